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
// allocating less than gcIdleAlloc) and more than a third of the way from
// the live heap to the goal was allocated since the last collection; never
// inside a burst, never on less, and not again for what a collection
// already took.
func TestTheIdleCollectorCollectsAfterABurstPastAThirdOfTheHeadroom(t *testing.T) {
	const mib = 1 << 20
	// A heap of 21 MiB live with a goal of 30: the headroom is 9 MiB, a
	// third of it 3 MiB.
	at := func(allocated, cycles uint64) heapState {
		return heapState{allocated: allocated, cycles: cycles, live: 21 * mib, goal: 30 * mib}
	}
	type sample struct {
		s       heapState
		collect bool
	}
	for _, tc := range []struct {
		name    string
		samples []sample
	}{
		{"a burst past a third, then idle: collected on the second idle sample", []sample{
			{at(100*mib, 1), false}, // the first sample: the base
			{at(104*mib, 1), false}, // the burst: 4 MiB
			{at(104*mib, 1), false}, // idle once
			{at(104*mib+gcIdleAlloc-1, 1), true},
			{at(104*mib+gcIdleAlloc-1, 1), false}, // idle again, not collected again at once
		}},
		{"a third exactly is not past it", []sample{
			{at(100*mib, 1), false},
			{at(103*mib, 1), false},
			{at(103*mib, 1), false},
			{at(103*mib, 1), false},
			{at(103*mib, 1), false},
		}},
		{"still allocating is no pause", []sample{
			{at(100*mib, 1), false},
			{at(106*mib, 1), false},
			{at(106*mib+gcIdleAlloc, 1), false},
			{at(106*mib+2*gcIdleAlloc, 1), false},
			{at(106*mib+3*gcIdleAlloc, 1), false},
		}},
		{"a burst that ended with a collection of its own", []sample{
			{at(100*mib, 1), false},
			{at(106*mib, 2), false}, // the runtime collected during the burst
			{at(106*mib, 2), false},
			{at(106*mib, 2), false},
		}},
		{"an idle pause after a burst under a third, then a second burst past it", []sample{
			{at(100*mib, 1), false},
			{at(102*mib, 1), false},
			{at(102*mib, 1), false},
			{at(102*mib, 1), false},
			{at(104*mib, 1), false}, // the second burst: 4 MiB since the collection
			{at(104*mib, 1), false},
			{at(104*mib, 1), true},
		}},
		{"a counter that restarts is a new base", []sample{
			{at(100*mib, 1), false},
			{at(106*mib, 1), false},
			{at(mib, 1), false},
			{at(mib, 1), false},
			{at(mib, 1), false},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var p idlePace
			for i, s := range tc.samples {
				if got := p.step(s.s); got != s.collect {
					t.Fatalf("sample %d (%+v): collect %v, want %v", i, s.s, got, s.collect)
				}
			}
		})
	}
	// A goal at or under the live heap (the runtime's limit reached) leaves
	// nothing to take ahead of time.
	var p idlePace
	for i, allocated := range []uint64{100 * mib, 200 * mib, 200 * mib, 200 * mib} {
		if p.step(heapState{allocated: allocated, cycles: 1, live: 30 * mib, goal: 30 * mib}) {
			t.Fatalf("sample %d: collected with the goal at the live heap", i)
		}
	}
}

// Run samples every gcIdleEvery and collects when the pace says so, until
// its context ends.
func TestTheIdleCollectorRunsOnItsClock(t *testing.T) {
	fc := clockwork.NewFakeClock()
	samples := make(chan heapState, 1)
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
		samples <- heapState{allocated: allocated, cycles: 3, live: 20 * mib, goal: 30 * mib}
		fc.Advance(gcIdleEvery)
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

// readHeapState reads the runtime's own figures: the bytes allocated grow
// with an allocation, a collection counts, and the goal is past the live heap.
func TestHeapStateIsTheRuntimes(t *testing.T) {
	before := readHeapState()
	sink = make([]byte, 4<<20)
	runtime.GC()
	after := readHeapState()
	if after.allocated < before.allocated+4<<20 {
		t.Fatalf("allocated %d → %d, want 4 MiB more", before.allocated, after.allocated)
	}
	if after.cycles <= before.cycles {
		t.Fatalf("cycles %d → %d across a collection", before.cycles, after.cycles)
	}
	if after.live == 0 || after.goal <= after.live {
		t.Fatalf("live %d, goal %d: want a goal past a live heap", after.live, after.goal)
	}
	sink = nil
}

var sink []byte
