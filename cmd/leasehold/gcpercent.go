package main

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"runtime/debug"
	"runtime/metrics"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jonboulle/clockwork"
)

// The collector's target percentage (runtime/debug.SetGCPercent), which
// --gc-percent sets. The runtime's default, 100, lets the heap grow by as
// much as is live (and the goroutines' stacks) before it collects, and the
// process's resident set follows that goal, not the live heap. leasehold's
// heap is nearly all state that lives as long as the fleet does, and a
// change allocates little beside it: at 10,000 executors a lapse allocated
// ~2 MB against a live heap of ~40 MB. Collecting at a quarter of that
// growth costs a collection per ~13 MB allocated instead of per ~53 MB, and
// kept the resident set after a run of lapses at 101 MB instead of 128 MB
// (BENCHMARKS.md, "The collector's target"). While serve allocates fast the
// pacer below lets it go to 100.
const defaultGCPercent = 25

// gcPercent is --gc-percent decided: the percentage (-1: off, as GOGC=off
// may set it), where it came from, for the log, and whether the pacer
// (gcPacer) moves it with what serve allocates: only leasehold's default
// is paced, a percentage asked for is kept.
type gcPercent struct {
	percent int
	source  string
	paced   bool
}

// parseGCPercent reads --gc-percent: auto (0) or a percentage from 1 to
// 10,000 (off is not offered: without a memory limit the heap would grow
// without bound; GOGC=off stays the runtime's to take).
func parseGCPercent(s string) (int, error) {
	if s == "auto" {
		return 0, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 10000 {
		return 0, fmt.Errorf("%q: want a percentage from 1 to 10000, or auto", s)
	}
	return n, nil
}

// decideGCPercent is the percentage serve runs with: the flag's, or (auto:
// 0) GOGC's when set (the runtime applied it already), else
// defaultGCPercent.
func decideGCPercent(flagPercent int, getenv func(string) string) gcPercent {
	switch {
	case flagPercent > 0:
		return gcPercent{percent: flagPercent, source: "--gc-percent"}
	case getenv("GOGC") != "":
		// What the runtime made of GOGC (100 for a value it could not read).
		s := []metrics.Sample{{Name: "/gc/gogc:percent"}}
		metrics.Read(s)
		p := -1 // off
		if s[0].Value.Kind() == metrics.KindUint64 && s[0].Value.Uint64() <= math.MaxInt32 {
			p = int(s[0].Value.Uint64())
		}
		return gcPercent{percent: p, source: "GOGC"}
	}
	return gcPercent{percent: defaultGCPercent, source: "leasehold's default", paced: true}
}

// apply sets the collector's percentage; GOGC's, already applied by the
// runtime, is left as it is.
func (g gcPercent) apply() {
	if g.source != "GOGC" {
		debug.SetGCPercent(g.percent)
	}
}

// The pacer: --gc-percent's default holds the collector at
// defaultGCPercent while serve allocates little (a fleet at rest, lapses,
// their fan-outs), or higher on a small heap (gcHeadroom), and lets it go
// to the runtime's 100 while serve allocates a lot (a fleet registering or
// restarting: every change re-reads a task type's listing). The
// collector's share of the CPU grows with what is allocated over the
// percentage, whatever the heap's size: at 25 a fleet
// of 10,000 registering cost leasehold 15–16 s of CPU against 10 s at 100
// (BENCHMARKS.md, "The collector's target"), CPU the Consul servers on the
// same cores then lack. Past gcBusyRate the pacer trades the memory back
// for it until the allocation has stayed below it for gcCalmFor.
const (
	gcBusyPercent = 100
	// gcBusyRate is the allocation rate, in bytes a second over
	// gcWindow, from which serve counts as busy: at 25 the collector then
	// marks the live heap for every quarter of it allocated, ~3% of a core
	// at this rate. Over a window, so that a burst (a fan-out to 1,000
	// streams allocates ~10 MB at once) does not count: a churn allocates
	// at this rate for minutes.
	gcBusyRate  = 8 << 20
	gcWindow    = 10 * time.Second
	gcPaceEvery = time.Second
	gcCalmFor   = 10 * time.Second
	// gcHeadroom is the least the heap's goal is set past its live part
	// while calm: the percentage is of what is retained (the live heap, the
	// goroutines' stacks and the globals: the goal is live + retained ×
	// percentage / 100), and the collector starts somewhat before the goal.
	// It is about what a fan-out to 1,000 streams allocates at once. A
	// quarter of a small heap is less than that, and the collector then ran
	// inside every fan-out: at 1,000 executors and 1,000 streams (21–25 MB
	// retained) 25 cost 12–15 µs of CPU per stream and update against 5 µs
	// at 100, and 9 µs with this headroom (43–50%; BENCHMARKS.md, "The
	// collector's headroom").
	// The percentage stays at 25 from 40 MiB retained on (10,000 executors
	// and 1,000 streams retain ~45 MB).
	gcHeadroom = 10 << 20
	// gcQuietStep is how far the calm percentage must fall before it is
	// lowered (to the quiet one at once): what is retained moves a little
	// with every change. It is raised at once: less would leave less than
	// gcHeadroom.
	gcQuietStep = 5
)

// gcPace is the pacer's state; step is its decision, a pure function of
// the samples.
type gcPace struct {
	quiet     int        // the least percentage while calm
	current   int        // the percentage set (0: quiet, as serve starts)
	busy      bool       // at gcBusyPercent
	calmSince time.Time  // since when the rate stayed below gcBusyRate while busy (zero: not)
	samples   []gcSample // the last gcWindow's, oldest first
}

type gcSample struct {
	at        time.Time
	allocated uint64 // bytes allocated since the process started
}

// step takes a sample (the bytes allocated since the process started, and
// those retained, at now) and returns the percentage to set, or 0 to leave
// it. The rate is over the samples of the last gcWindow (at least two); a
// sample that goes back in time or counts less than the last restarts
// them. While calm the percentage is the quiet one, or more when that would
// leave less than gcHeadroom (quietFor).
func (p *gcPace) step(now time.Time, allocated, retained uint64) int {
	if p.current == 0 {
		p.current = p.quiet
	}
	if n := len(p.samples); n > 0 &&
		(!now.After(p.samples[n-1].at) || allocated < p.samples[n-1].allocated) {
		p.samples = p.samples[:0]
	}
	p.samples = append(p.samples, gcSample{now, allocated})
	drop := 0
	for drop < len(p.samples)-2 && now.Sub(p.samples[drop+1].at) >= gcWindow {
		drop++ // the next one still spans the window
	}
	p.samples = append(p.samples[:0], p.samples[drop:]...)
	quiet := p.quietFor(retained)
	if len(p.samples) < 2 {
		if p.busy { // the samples restarted: busy until shown calm
			return 0
		}
		return p.calm(quiet, false)
	}
	first := p.samples[0]
	rate := float64(allocated-first.allocated) / now.Sub(first.at).Seconds()
	switch {
	case rate >= gcBusyRate:
		p.calmSince = time.Time{}
		if !p.busy {
			p.busy, p.current = true, gcBusyPercent
			return gcBusyPercent
		}
	case p.busy:
		if p.calmSince.IsZero() {
			p.calmSince = now
		}
		if now.Sub(p.calmSince) >= gcCalmFor {
			p.busy, p.calmSince = false, time.Time{}
			return p.calm(quiet, true)
		}
	default:
		return p.calm(quiet, false)
	}
	return 0
}

// quietFor is the calm percentage when retained bytes are retained: the
// quiet one, or the one that sets the goal gcHeadroom past the live heap,
// up to gcBusyPercent (retained 0: not known, the quiet one).
func (p *gcPace) quietFor(retained uint64) int {
	if retained == 0 {
		return p.quiet
	}
	pct := int((uint64(gcHeadroom)*100 + retained - 1) / retained)
	return min(max(pct, p.quiet), gcBusyPercent)
}

// calm returns quiet to set, or 0 to leave the one set: it is set when the
// pacer just left busy, when it is above the one set (less headroom would
// be left), when it is the least (the quiet percentage) and when it is
// gcQuietStep or more below the one set.
func (p *gcPace) calm(quiet int, leaving bool) int {
	if quiet == p.current && !leaving {
		return 0
	}
	if leaving || quiet > p.current || quiet == p.quiet || p.current-quiet >= gcQuietStep {
		p.current = quiet
		return quiet
	}
	return 0
}

// gcPacer samples the bytes allocated every gcPaceEvery and sets the
// percentage step decides, from the first view of the whole fleet on: the
// first read of a fleet is done at the quiet percentage (once), so that
// its allocation does not hold the collector at 100 while serve's first
// streams and changes come in.
type gcPacer struct {
	quiet    int
	ready    func(context.Context) error // waits for the first view of the whole fleet (nil: none)
	clock    clockwork.Clock             // default: the real clock
	allocs   func() uint64               // default: runtime/metrics' /gc/heap/allocs:bytes
	retained func() uint64               // default: heapRetained
	set      func(int) int               // default: debug.SetGCPercent
	// busy, when set, says after each sample whether the pacer counts serve
	// busy (the idle collector leaves the collector alone then).
	busy *atomic.Bool
	log  *slog.Logger
}

// Run paces until ctx ends, leaving the calm percentage set; it returns
// ctx's error.
func (g gcPacer) Run(ctx context.Context) error {
	if g.ready != nil {
		if err := g.ready(ctx); err != nil {
			return err
		}
	}
	if g.clock == nil {
		g.clock = clockwork.NewRealClock()
	}
	if g.allocs == nil {
		g.allocs = heapAllocated
	}
	if g.set == nil {
		g.set = debug.SetGCPercent
	}
	retained := g.retained
	if retained == nil {
		retained = heapRetained
	}
	p := gcPace{quiet: g.quiet}
	step := func() {
		r := retained()
		pct := p.step(g.clock.Now(), g.allocs(), r)
		if g.busy != nil {
			g.busy.Store(p.busy)
		}
		if pct != 0 {
			g.set(pct)
			if g.log != nil {
				g.log.Debug("collector", "gc_percent", pct, "busy", p.busy, "retained_bytes", r)
			}
		}
	}
	step()
	t := g.clock.NewTicker(gcPaceEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			if p.busy {
				g.set(p.quietFor(retained()))
			}
			return ctx.Err()
		case <-t.Chan():
		}
		step()
	}
}

// heapRetained is what the collector's percentage is of: the heap live at
// the last collection, the goroutines' stacks and the globals it scans
// (runtime/metrics).
func heapRetained() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}, {Name: "/gc/scan/stack:bytes"},
		{Name: "/gc/scan/globals:bytes"}}
	metrics.Read(s)
	var sum uint64
	for _, v := range s {
		if v.Value.Kind() == metrics.KindUint64 {
			sum += v.Value.Uint64()
		}
	}
	return sum
}

// heapAllocated is the bytes allocated on the heap since the process
// started (runtime/metrics; no stop of the world, unlike ReadMemStats).
func heapAllocated() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return s[0].Value.Uint64()
}
