package server

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/fleet"
	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// fencingSyncer runs a syncer holding one session x/s-x (generation 1) at
// Consul index 11.
func fencingSyncer(t *testing.T) (*fleet.Syncer, chan health.Observation) {
	return attack2Replica(t,
		health.Observation{Tasks: &health.TaskList{Index: 1, Tasks: []string{"work"}}},
		health.Observation{NonPassing: &health.NonPassing{Index: 2}},
		health.Observation{Generations: &health.Generations{Index: 3, Keys: fleettest.Keys(map[string]uint64{"x": 1})}},
		health.Observation{Members: &health.TaskMembers{Task: "work", Index: 11, Members: []health.Member{member("work", "x", 9001, "1.0.0")}}},
	)
}

func checkX(t *testing.T, f *Fencing, min uint64, timeout time.Duration) *leaseholdv1.CheckSessionResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	r, err := f.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s-x", MinConsulIndex: min})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// A replica behind the index a dispatcher already saw reads Consul afresh
// and answers from what that read shows: here a newer generation, so STALE,
// never the CURRENT its older view would say.
func TestMinConsulIndexReadsAfresh(t *testing.T) {
	s, obs := fencingSyncer(t)
	var refreshes atomic.Int64
	f := NewFencing(s, nowAt, FencingOptions{Refresh: func(context.Context, string, uint64) (uint64, error) {
		seq := uint64(refreshes.Add(1))
		go func() { // the watcher's fresh reads, then its marker
			obs <- health.Observation{Generations: &health.Generations{Index: 40, Keys: fleettest.Keys(map[string]uint64{"x": 2})}}
			obs <- health.Observation{Refreshed: &seq}
		}()
		return seq, nil
	}})
	if r := checkX(t, f, 0, time.Second); r.State != leaseholdv1.SessionState_CURRENT || refreshes.Load() != 0 {
		t.Fatalf("without an index: %v (refreshes %d)", r, refreshes.Load())
	}
	if r := checkX(t, f, 2, time.Second); r.State != leaseholdv1.SessionState_CURRENT || refreshes.Load() != 0 {
		t.Fatalf("at an index its checks and generation keys reached: %v (refreshes %d)", r, refreshes.Load())
	}
	r := checkX(t, f, 50, 2*time.Second)
	if r.State != leaseholdv1.SessionState_STALE || r.NewerGeneration != 2 || refreshes.Load() != 1 {
		t.Fatalf("behind the index: %v (refreshes %d), want STALE from the fresh read", r, refreshes.Load())
	}
}

// When the fresh read does not come (Consul unreachable), the answer is
// UNKNOWN shortly before the caller's deadline, not an expired call.
func TestMinConsulIndexUnreachedIsUnknown(t *testing.T) {
	s, _ := fencingSyncer(t)
	f := NewFencing(s, nowAt, FencingOptions{Refresh: func(context.Context, string, uint64) (uint64, error) { return 1, nil }})
	start := time.Now()
	r := checkX(t, f, 50, 500*time.Millisecond)
	if r.State != leaseholdv1.SessionState_UNKNOWN || !strings.Contains(r.Detail, "min_consul_index 50") {
		t.Fatalf("%v, want UNKNOWN naming min_consul_index", r)
	}
	if took := time.Since(start); took < 300*time.Millisecond || took >= 500*time.Millisecond {
		t.Fatalf("answered after %s: want shortly before the 500ms deadline", took)
	}
}

// Without Refresh, the request waits for the view's checks and generation
// keys to reach the index (its highest index alone is not enough: the
// membership at 11 says nothing of a lapse at 60).
func TestMinConsulIndexWaitsForTheView(t *testing.T) {
	s, obs := fencingSyncer(t)
	f := NewFencing(s, nowAt)
	go func() {
		time.Sleep(50 * time.Millisecond) // the change arrives while the request waits
		obs <- health.Observation{NonPassing: &health.NonPassing{Index: 60, Checks: []health.CheckState{
			{Node: "n1", CheckID: health.CheckID("x", "s-x", "work"), ServiceID: health.ServiceID("x", "work"), Status: health.StatusCritical, ModifyIndex: 60},
		}}}
		obs <- health.Observation{Generations: &health.Generations{Index: 60, Keys: fleettest.Keys(map[string]uint64{"x": 1})}}
	}()
	if r := checkX(t, f, 60, 5*time.Second); r.State != leaseholdv1.SessionState_LAPSED || r.ConsulIndex < 60 {
		t.Fatalf("%v, want LAPSED from the view at index 60", r)
	}
}

// A view older than the bound is not vouched for; fresh again, it is.
func TestStaleViewIsUnknown(t *testing.T) {
	s, _ := fencingSyncer(t)
	var fresh atomic.Int64
	fresh.Store(time.Now().Add(-40 * time.Second).UnixNano())
	f := NewFencing(s, func(string) time.Time { return time.Unix(0, fresh.Load()) }, FencingOptions{StaleAfter: 35 * time.Second})
	r := checkX(t, f, 0, time.Second)
	if r.State != leaseholdv1.SessionState_UNKNOWN || !strings.Contains(r.Detail, "stale") || !strings.Contains(r.Detail, "CURRENT") || r.ViewAge.AsDuration() < 40*time.Second {
		t.Fatalf("%v, want UNKNOWN saying the view is stale and what it last said", r)
	}
	fresh.Store(time.Now().UnixNano())
	if r := checkX(t, f, 0, time.Second); r.State != leaseholdv1.SessionState_CURRENT {
		t.Fatalf("fresh again: %v", r)
	}
}

// nowAt is a freshAsOf for tests: every datacenter's view is current now.
func nowAt(string) time.Time { return time.Now() }

// freshClock is a view freshness set by a test, read with a fake clock.
type freshClock struct {
	clock *clockwork.FakeClock
	at    atomic.Pointer[time.Time]
}

func newFreshClock() *freshClock {
	f := &freshClock{clock: clockwork.NewFakeClock()}
	f.silentFor(0)
	return f
}

// silentFor: Consul last answered d ago.
func (f *freshClock) silentFor(d time.Duration) {
	t := f.clock.Now().Add(-d)
	f.at.Store(&t)
}

func (f *freshClock) freshAsOf(string) time.Time { return *f.at.Load() }

// leaseSyncer runs a syncer holding x/s-x with a 6 s lease_ttl and y/s-y
// declaring none.
func leaseSyncer(t *testing.T) *fleet.Syncer {
	x := member("work", "x", 9001, "1.0.0")
	x.LeaseTTL = 6 * time.Second
	s, _ := attack2Replica(t,
		health.Observation{Tasks: &health.TaskList{Index: 1, Tasks: []string{"work"}}},
		health.Observation{NonPassing: &health.NonPassing{Index: 2}},
		health.Observation{Generations: &health.Generations{Index: 3}},
		health.Observation{Members: &health.TaskMembers{Task: "work", Index: 11, Members: []health.Member{x, member("work", "y", 9002, "1.0.0")}}},
	)
	return s
}

// TestFencingVouchesOnlyWithinTheSessionsLease: a session declaring a 6 s
// lease (lease_ttl) turns UNKNOWN once Consul has been silent for longer
// than that, though --fencing-stale-after is 35 s; one declaring none keeps
// the 35 s bound.
func TestFencingVouchesOnlyWithinTheSessionsLease(t *testing.T) {
	s := leaseSyncer(t)
	fc := newFreshClock()
	f := NewFencing(s, fc.freshAsOf, FencingOptions{Clock: fc.clock})
	check := func(inst string) *leaseholdv1.CheckSessionResponse {
		t.Helper()
		r, err := f.CheckSession(context.Background(), &leaseholdv1.CheckSessionRequest{InstanceId: inst, SessionId: "s-" + inst})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	fc.silentFor(5 * time.Second)
	if r := check("x"); r.State != leaseholdv1.SessionState_CURRENT {
		t.Fatalf("x after 5 s of silence: %v, want CURRENT (inside its 6 s lease)", r)
	}
	fc.silentFor(7 * time.Second)
	if r := check("x"); r.State != leaseholdv1.SessionState_UNKNOWN || !strings.Contains(r.Detail, "lease_ttl") {
		t.Fatalf("x after 7 s of silence: %v, want UNKNOWN naming its lease_ttl", r)
	}
	if r := check("y"); r.State != leaseholdv1.SessionState_CURRENT {
		t.Fatalf("y after 7 s of silence: %v, want CURRENT (no lease_ttl: the 35 s bound)", r)
	}
	fc.silentFor(36 * time.Second)
	if r := check("y"); r.State != leaseholdv1.SessionState_UNKNOWN || !strings.Contains(r.Detail, "--fencing-stale-after") {
		t.Fatalf("y after 36 s of silence: %v, want UNKNOWN naming --fencing-stale-after", r)
	}
}
