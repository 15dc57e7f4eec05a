package main

import (
	"context"
	"runtime/debug"

	"github.com/leasehold/leasehold/snapshot/fleet"
)

// startupMemory returns to the operating system, once, the memory the first
// read of the fleet used and no longer holds. Reading 10,000 registrations
// decodes megabytes of catalog listings that are garbage a moment later; the
// Go runtime gives freed memory back only gradually, so serve's resident set
// stayed near twice its live heap long after it was ready (measured:
// BENCHMARKS.md, "Fleet scale"). One forced return at that point costs one
// collection; afterwards the runtime's own pacing (and GOMEMLIMIT, when
// set) applies.
type startupMemory struct {
	view func() *fleet.View // the syncer's latest view
	free func()             // default: debug.FreeOSMemory
}

// Run waits for the first view of the whole fleet, frees, and waits for the
// end; it returns ctx's error.
func (m startupMemory) Run(ctx context.Context) error {
	if m.free == nil {
		m.free = debug.FreeOSMemory
	}
	if err := awaitWholeFleet(ctx, m.view); err != nil {
		return err
	}
	m.free()
	<-ctx.Done()
	return ctx.Err()
}

// awaitWholeFleet waits for the first view of the whole fleet (Synced).
func awaitWholeFleet(ctx context.Context, view func() *fleet.View) error {
	for v := view(); !v.Synced; v = view() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-v.Changed():
		}
	}
	return nil
}
