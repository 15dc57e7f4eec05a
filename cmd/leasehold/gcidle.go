package main

import (
	"context"
	"log/slog"
	"runtime"
	"runtime/metrics"
	"time"

	"github.com/jonboulle/clockwork"
)

// Collecting while idle. serve allocates in bursts: a lapse's reads, its
// decision and its fan-out allocate ~1 MB within a few milliseconds, then
// little until the next change. The heap's goal is therefore crossed inside
// a burst, and the collection runs beside that burst's fan-out on the same
// cores: at 1,000 executors and 1,000 streams serve ran 14 collections over
// 100 lapses, each begun inside one, and in an execution trace the bursts
// that ran beside the collector's marking (11–23 ms of it) were the longest
// (BENCHMARKS.md, "A floor of leasehold's shape, and collecting while
// idle"). The idle collector starts that collection soon after a burst
// instead, once serve has allocated next to nothing for two samples: the
// next bursts find the goal far ahead.
//
// It collects only after a burst (a sample allocating gcIdleAlloc or more
// since the last collection), when more than a third of the headroom (goal −
// live) has been allocated since the last collection. In the lapses
// measured that made 22 collections over 100 lapses instead of 14; a steady
// trickle of bursts could make up to about three times as many, each
// costing what the runtime's would. Not half: the runtime starts a
// collection well before the goal, and one burst allocates 1–3 MB, so with
// half of a 10 MiB headroom a burst still crossed the runtime's start in
// about one lapse in ten; with a third none of 100 lapses did. It leaves
// the collector to the runtime while the pacer counts serve busy (a fleet
// registering: the pacer's 100 saves the CPU that collecting at a third would
// spend again), while a collection is under way, and when the headroom is
// under gcIdleMinHeadroom (a memory limit near: the runtime collects often
// there already).
const (
	gcIdleEvery = 20 * time.Millisecond
	// gcIdleAlloc is what serve may allocate in gcIdleEvery and still count
	// as idle: the admin API's and the watches' background allocate a little.
	gcIdleAlloc = 64 << 10
	// gcIdleQuiet is how many idle samples in a row make serve idle: a burst
	// has ended, not paused.
	gcIdleQuiet = 2
	// gcIdleMinHeadroom is the least headroom (goal − live) worth collecting
	// ahead of: a burst's allocation.
	gcIdleMinHeadroom = 4 << 20
)

// heapState is what the idle collector reads of the runtime (runtime/metrics).
type heapState struct {
	allocated uint64 // bytes allocated since the process started
	cycles    uint64 // collections completed since the process started
	pauses    uint64 // the collector's stops of the world since the process started: two a cycle
	live      uint64 // bytes of heap objects live at the last collection
	goal      uint64 // the heap's goal: the next collection ends by it
}

// collecting reports whether a collection is under way: it has stopped the
// world once (its start) and not yet a second time (its end).
func (s heapState) collecting() bool { return s.pauses > 2*s.cycles }

// idlePace is the idle collector's state; step is its decision, a pure
// function of the samples.
type idlePace struct {
	last  heapState
	since uint64 // allocated when the last collection was first seen
	quiet int    // idle samples in a row
	burst bool   // a sample since the last collection allocated gcIdleAlloc or more
}

// step takes a sample, and whether the pacer counts serve busy, and says
// whether to collect now: serve has been idle for gcIdleQuiet samples after
// a burst, and what it allocated since the last collection is more than a
// third of the way from the live heap to the goal. (Bytes allocated, not
// the heap's objects: those include the dead ones the sweeper has not freed
// yet, just after a collection.)
func (p *idlePace) step(s heapState, busy bool) bool {
	first := p.last == heapState{}
	if first || s.cycles != p.last.cycles || s.allocated < p.since {
		// A collection since the last sample (or the first sample).
		p.since, p.burst = s.allocated, false
	}
	idle := !first && s.allocated >= p.last.allocated &&
		s.allocated-p.last.allocated < gcIdleAlloc
	p.last = s
	if !idle {
		p.quiet, p.burst = 0, !first
		return false
	}
	p.quiet++
	switch {
	case p.quiet < gcIdleQuiet, !p.burst, busy, s.collecting(),
		s.goal < s.live+gcIdleMinHeadroom, (s.allocated-p.since)*3 <= s.goal-s.live:
		return false
	}
	p.quiet, p.burst = 0, false
	return true
}

// gcIdle samples the heap every gcIdleEvery and collects when step says so,
// until ctx ends.
type gcIdle struct {
	busy    func() bool      // whether the pacer counts serve busy (nil: never)
	clock   clockwork.Clock  // default: the real clock
	read    func() heapState // default: a heapReader's
	collect func()           // default: runtime.GC
	log     *slog.Logger
}

func (g gcIdle) Run(ctx context.Context) error {
	if g.clock == nil {
		g.clock = clockwork.NewRealClock()
	}
	if g.read == nil {
		g.read = newHeapReader().read
	}
	if g.collect == nil {
		g.collect = runtime.GC
	}
	var p idlePace
	t := g.clock.NewTicker(gcIdleEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.Chan():
		}
		if s := g.read(); p.step(s, g.busy != nil && g.busy()) {
			g.collect()
			if g.log != nil {
				g.log.Debug("collected while idle", "allocated_bytes", s.allocated-p.since,
					"live_bytes", s.live, "goal_bytes", s.goal)
			}
		}
	}
}

var heapStateSamples = []string{"/gc/heap/allocs:bytes", "/gc/cycles/total:gc-cycles",
	"/sched/pauses/total/gc:seconds", "/gc/heap/live:bytes", "/gc/heap/goal:bytes"}

// heapReader reads heapState from runtime/metrics (no stop of the world)
// into the same samples each time: a histogram's read reuses their memory,
// so sampling 50 times a second allocates nothing.
type heapReader struct{ samples []metrics.Sample }

func newHeapReader() *heapReader {
	r := &heapReader{samples: make([]metrics.Sample, len(heapStateSamples))}
	for i, name := range heapStateSamples {
		r.samples[i].Name = name
	}
	return r
}

func (r *heapReader) read() heapState {
	s := r.samples
	metrics.Read(s)
	v := func(i int) uint64 {
		if s[i].Value.Kind() != metrics.KindUint64 {
			return 0
		}
		return s[i].Value.Uint64()
	}
	var pauses uint64
	if s[2].Value.Kind() == metrics.KindFloat64Histogram {
		for _, n := range s[2].Value.Float64Histogram().Counts {
			pauses += n
		}
	}
	return heapState{allocated: v(0), cycles: v(1), pauses: pauses, live: v(3), goal: v(4)}
}
