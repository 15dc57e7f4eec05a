package main

import (
	"context"
	"testing"
	"time"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// The memory of the first read is returned once the whole fleet has been
// read — not before (the read still holds it), and not again.
func TestStartupMemoryIsReturnedOnceTheFleetIsRead(t *testing.T) {
	s := fleet.NewSyncer(fleet.SyncConfig{})
	obs := make(chan health.Observation, 8)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.Run(ctx, obs)
	freed := make(chan struct{}, 4)
	done := make(chan error, 1)
	go func() {
		done <- startupMemory{view: s.View, free: func() { freed <- struct{}{} }}.Run(ctx)
	}()
	select {
	case <-freed:
		t.Fatal("freed before the fleet was read")
	case <-time.After(50 * time.Millisecond): // absence check only
	}
	obs <- health.Observation{Data: &health.TaskList{Index: 1, Tasks: []string{"work"}}}
	obs <- health.Observation{Data: &health.NonPassing{Index: 2}}
	obs <- health.Observation{Data: &health.Generations{Index: 3}}
	obs <- health.Observation{Data: &health.TaskMembers{Task: "work", Index: 4}}
	select {
	case <-freed:
	case <-time.After(5 * time.Second):
		t.Fatal("the fleet was read and nothing was freed")
	}
	obs <- health.Observation{Data: &health.NonPassing{Index: 5}}
	select {
	case <-freed:
		t.Fatal("freed twice")
	case <-time.After(50 * time.Millisecond): // absence check only
	}
	cancel()
	if err := <-done; err != context.Canceled {
		t.Fatalf("Run returned %v, want the context's error", err)
	}
}
