package main

import (
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"
)

// The idle collector collects once a burst has ended (gcIdleQuiet samples
// allocating less than gcIdleAlloc after one that allocated more) and more
// than a third of the way from the live heap to the goal was allocated
// since the last collection; never inside a burst, never on less, never
// for a steady trickle with no burst, and not again for what a collection
// already took.
func TestTheIdleCollectorCollectsAfterABurstPastAThirdOfTheHeadroom(t *testing.T) {
	const mib = 1 << 20
	// A heap of 21 MiB live with a goal of 30: the headroom is 9 MiB, a
	// third of it 3 MiB. Two stops of the world a finished collection.
	at := func(allocated, cycles uint64) heapState {
		return heapState{allocated: allocated, cycles: cycles, pauses: 2 * cycles,
			live: 21 * mib, goal: 30 * mib}
	}
	type sample struct {
		s       heapState
		collect bool
	}
	trickle := []sample{{at(100*mib, 1), false}} // 60 KiB a sample: under gcIdleAlloc
	for i := range 80 {
		trickle = append(trickle, sample{at(100*mib+uint64(i+1)*60<<10, 1), false})
	}
	// A burst, the runtime's collection just after it, then a trickle that
	// adds up past a third: no burst since that collection.
	afterCollection := []sample{{at(100*mib, 1), false}, {at(104*mib, 1), false},
		{at(104*mib, 2), false}}
	for i := range 80 {
		afterCollection = append(afterCollection,
			sample{at(104*mib+uint64(i+1)*60<<10, 2), false})
	}
	collecting := at(104*mib, 1)
	collecting.pauses++ // a collection began and has not ended
	for _, tc := range []struct {
		name    string
		busy    bool
		samples []sample
	}{
		{"a burst past a third, then idle: collected on the second idle sample", false, []sample{
			{at(100*mib, 1), false}, // the first sample: the base
			{at(104*mib, 1), false}, // the burst: 4 MiB
			{at(104*mib, 1), false}, // idle once
			{at(104*mib+gcIdleAlloc-1, 1), true},
			{at(104*mib+gcIdleAlloc-1, 1), false}, // idle again, not collected again at once
			{at(104*mib+gcIdleAlloc-1, 1), false},
		}},
		{"a third exactly is not past it", false, []sample{
			{at(100*mib, 1), false},
			{at(103*mib, 1), false},
			{at(103*mib, 1), false},
			{at(103*mib, 1), false},
			{at(103*mib, 1), false},
		}},
		{"still allocating is no pause", false, []sample{
			{at(100*mib, 1), false},
			{at(106*mib, 1), false},
			{at(106*mib+gcIdleAlloc, 1), false},
			{at(106*mib+2*gcIdleAlloc, 1), false},
			{at(106*mib+3*gcIdleAlloc, 1), false},
		}},
		{"a steady trickle under gcIdleAlloc is no burst, whatever it adds up to", false, trickle},
		{"a trickle after the runtime collected is no burst", false, afterCollection},
		{"a burst that ended with a collection of its own", false, []sample{
			{at(100*mib, 1), false},
			{at(106*mib, 2), false}, // the runtime collected during the burst
			{at(106*mib, 2), false},
			{at(106*mib, 2), false},
		}},
		{"an idle pause after a burst under a third, then a second burst past it", false, []sample{
			{at(100*mib, 1), false},
			{at(102*mib, 1), false},
			{at(102*mib, 1), false},
			{at(102*mib, 1), false},
			{at(104*mib, 1), false}, // the second burst: 4 MiB since the collection
			{at(104*mib, 1), false},
			{at(104*mib, 1), true},
		}},
		{"a counter that restarts is a new base", false, []sample{
			{at(100*mib, 1), false},
			{at(106*mib, 1), false},
			{at(mib, 1), false},
			{at(mib, 1), false},
			{at(mib, 1), false},
		}},
		{"busy: the pacer's 100 is left to the runtime", true, []sample{
			{at(100*mib, 1), false},
			{at(104*mib, 1), false},
			{at(104*mib, 1), false},
			{at(104*mib, 1), false},
		}},
		{"a collection under way is not doubled", false, []sample{
			{at(100*mib, 1), false},
			{at(104*mib, 1), false},
			{collecting, false},
			{collecting, false},
			{at(104*mib, 1), true}, // it never finished (a test's liberty): now collect
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var p idlePace
			for i, s := range tc.samples {
				if got := p.step(s.s, tc.busy); got != s.collect {
					t.Fatalf("sample %d (%+v): collect %v, want %v", i, s.s, got, s.collect)
				}
			}
		})
	}
	// A headroom under gcIdleMinHeadroom (a memory limit near, or the goal at
	// the live heap) leaves nothing worth taking ahead of time.
	for _, headroom := range []uint64{0, gcIdleMinHeadroom - 1} {
		var p idlePace
		for i, allocated := range []uint64{100 * mib, 200 * mib, 200 * mib, 200 * mib} {
			if p.step(heapState{allocated: allocated, cycles: 1, pauses: 2, live: 30 * mib,
				goal: 30*mib + headroom}, false) {
				t.Fatalf("headroom %d, sample %d: collected", headroom, i)
			}
		}
	}
}

// Run samples every gcIdleEvery and collects when the pace says so, until
// its context ends.
func TestTheIdleCollectorRunsOnItsClock(t *testing.T) {
	fc := clockwork.NewFakeClock()
	// Unbuffered: a sample is taken only when a tick reads it, so the next
	// tick is set after the last was consumed (a fake ticker drops a tick
	// its reader has not taken, and a sample would then wait for no tick).
	samples := make(chan heapState)
	collected := make(chan struct{}, 8)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		done <- gcIdle{clock: fc, read: func() heapState { return <-samples },
			collect: func() { collected <- struct{}{} }}.Run(ctx)
	}()
	const mib = 1 << 20
	tick := func(allocated uint64) {
		t.Helper()
		if err := fc.BlockUntilContext(ctx, 1); err != nil { // the ticker is set
			t.Fatal(err)
		}
		fc.Advance(gcIdleEvery)
		select { // the tick asks for a sample
		case samples <- heapState{allocated: allocated, cycles: 3, pauses: 6, live: 20 * mib,
			goal: 30 * mib}:
		case <-time.After(5 * time.Second):
			t.Fatalf("no sample read %s after the last", gcIdleEvery)
		}
	}
	for _, allocated := range []uint64{100 * mib, 108 * mib, 108 * mib, 108 * mib} {
		tick(allocated)
	}
	select {
	case <-collected:
	case <-time.After(5 * time.Second):
		t.Fatal("not collected after a burst of 8 MiB and two idle samples")
	}
	select {
	case <-collected:
		t.Fatal("collected twice")
	default:
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v", err)
	}
}

// A heapReader reads the runtime's own figures: the bytes allocated grow
// with an allocation, a collection counts, and the goal is past the live
// heap. Its reads allocate nothing: sampled 50 times a second, they would
// otherwise be garbage of their own.
func TestHeapStateIsTheRuntimes(t *testing.T) {
	r := newHeapReader()
	before := r.read()
	sink = make([]byte, 4<<20)
	runtime.GC()
	after := r.read()
	if n := testing.AllocsPerRun(100, func() { r.read() }); n != 0 {
		t.Fatalf("a read allocates %.0f times, want none", n)
	}
	if after.allocated < before.allocated+4<<20 {
		t.Fatalf("allocated %d → %d, want 4 MiB more", before.allocated, after.allocated)
	}
	if after.cycles <= before.cycles {
		t.Fatalf("cycles %d → %d across a collection", before.cycles, after.cycles)
	}
	if after.live == 0 || after.goal <= after.live {
		t.Fatalf("live %d, goal %d: want a goal past a live heap", after.live, after.goal)
	}
	// Two stops of the world a collection, none under way once it returned:
	// what collecting reads.
	if after.pauses != 2*after.cycles || after.collecting() {
		t.Fatalf("%d collector pauses over %d cycles after runtime.GC: want two a cycle",
			after.pauses, after.cycles)
	}
	sink = nil
}

var sink []byte
