package server

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/snapshot/fleet"
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

// markingSyncer is fencingSyncer with the lapse marks read (AwaitLapses,
// their listing at 4) and this replica's lapses handed to onLapse (nil:
// none recorded).
func markingSyncer(t *testing.T, onLapse func(health.Executor)) (*fleet.Syncer, chan health.Observation) {
	t.Helper()
	ch := make(chan health.Observation, 16)
	s := fleet.NewSyncer(fleet.SyncConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), AddDelay: time.Millisecond, AwaitLapses: true, OnLapse: onLapse})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx, ch); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	for _, o := range []health.Observation{
		{Tasks: &health.TaskList{Index: 1, Tasks: []string{"work"}}},
		{NonPassing: &health.NonPassing{Index: 2}},
		{Generations: &health.Generations{Index: 3, Keys: fleettest.Keys(map[string]uint64{"x": 1})}},
		{Lapses: &health.LapseMarks{Index: 4}},
		{Members: &health.TaskMembers{Task: "work", Index: 11, Members: []health.Member{member("work", "x", 9001, "1.0.0")}}},
	} {
		ch <- o
	}
	waitView(t, s, "the fleet read", func(v *fleet.View) bool { return v.Synced && v.ConsulIndex == 11 })
	return s, ch
}

func waitView(t *testing.T, s *fleet.Syncer, what string, ok func(*fleet.View) bool) *fleet.View {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for v := s.View(); ; v = s.View() {
		if ok(v) {
			return v
		}
		select {
		case <-v.Changed():
		case <-deadline:
			t.Fatalf("no view with %s", what)
		}
	}
}

// A replica whose checks and generation keys are current at 200 but whose
// lapse marks were last read at 4 has not reached min_consul_index 150:
// another replica's LAPSED answer at 150 may rest on a mark written at 150.
// It reads afresh (the lapse marks), and answers LAPSED from the mark —
// not CURRENT from its checks, which say the lease passes again.
func TestMinConsulIndexHoldsTheLapseMarksToo(t *testing.T) {
	s, obs := markingSyncer(t, nil)
	obs <- health.Observation{Progress: &health.Progress{NonPassing: 200}}
	obs <- health.Observation{Progress: &health.Progress{Generations: 200}}
	deadline := time.After(5 * time.Second)
	for p := s.Progress(""); p.NonPassing < 200 || p.Generations < 200; p = s.Progress("") {
		select {
		case <-deadline:
			t.Fatalf("progress %+v never applied", p)
		case <-time.After(time.Millisecond): // progress publishes no view: polled
		}
	}
	var asked atomic.Uint64
	f := NewFencing(s, nowAt, FencingOptions{Refresh: func(_ context.Context, _ string, least uint64) (uint64, error) {
		asked.Store(least)
		seq := uint64(1)
		go func() { // the watcher's fresh read of the lapse marks, then its marker
			obs <- health.Observation{Lapses: &health.LapseMarks{Index: 150, Marks: []health.LapseMark{{InstanceID: "x", SessionID: "s-x", Generation: 1}}}}
			obs <- health.Observation{Refreshed: &seq}
		}()
		return seq, nil
	}})
	r := checkX(t, f, 150, 2*time.Second)
	if r.State != leaseholdv1.SessionState_LAPSED || asked.Load() != 150 || r.ConsulIndex < 150 {
		t.Fatalf("min_consul_index 150 with the lapse marks at 4: %v (refresh asked for %d), want LAPSED from a fresh read of the marks for 150", r, asked.Load())
	}
}

// A LAPSED answer this replica gives before it read back the lapse mark
// recording the lapse waits for it, and carries an index at or above the
// mark's: the index where the lapse became final for every replica, so a
// replica asked with it reads the mark first (it was answered at once, at
// the checks' index, below the mark's).
func TestLapsedAnswerCarriesItsMarksIndex(t *testing.T) {
	lapsed := make(chan health.Executor, 4)
	s, obs := markingSyncer(t, func(e health.Executor) { lapsed <- e })
	obs <- health.Observation{NonPassing: &health.NonPassing{Index: 60, Checks: []health.CheckState{
		{Node: "n1", CheckID: health.CheckID("x", "s-x", "work"), ServiceID: health.ServiceID("x", "work"), Status: health.StatusCritical, ModifyIndex: 60},
	}}}
	select {
	case <-lapsed:
	case <-time.After(5 * time.Second):
		t.Fatal("the lapse was never recorded")
	}
	waitView(t, s, "x/s-x lapsed", func(v *fleet.View) bool {
		return v.Sessions().Check("x", "s-x").State == health.SessionLapsed
	})
	f := NewFencing(s, nowAt)
	answer := make(chan *leaseholdv1.CheckSessionResponse, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		r, err := f.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s-x"})
		if err != nil {
			r = &leaseholdv1.CheckSessionResponse{Detail: err.Error()}
		}
		answer <- r
	}()
	select {
	case r := <-answer:
		t.Fatalf("answered %v before the lapse mark was read back (consul_index %d: below the mark's, to come)", r.State, r.ConsulIndex)
	case <-time.After(50 * time.Millisecond): // absence check only
	}
	obs <- health.Observation{Lapses: &health.LapseMarks{Index: 70, Marks: []health.LapseMark{{InstanceID: "x", SessionID: "s-x", Generation: 1}}}}
	select {
	case r := <-answer:
		if r.State != leaseholdv1.SessionState_LAPSED || r.ConsulIndex < 70 {
			t.Fatalf("%v, want LAPSED at consul_index ≥ 70 (the mark's listing)", r)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no answer after the mark was read back")
	}
}

// When the mark does not come (Consul refuses the write), the LAPSED answer
// comes anyway shortly before the caller's deadline, saying so.
func TestLapsedAnswerWithoutItsMarkComesBeforeTheDeadline(t *testing.T) {
	s, obs := markingSyncer(t, func(health.Executor) {})
	obs <- health.Observation{NonPassing: &health.NonPassing{Index: 60, Checks: []health.CheckState{
		{Node: "n1", CheckID: health.CheckID("x", "s-x", "work"), ServiceID: health.ServiceID("x", "work"), Status: health.StatusCritical, ModifyIndex: 60},
	}}}
	waitView(t, s, "x/s-x lapsed", func(v *fleet.View) bool {
		return v.Sessions().Check("x", "s-x").State == health.SessionLapsed
	})
	start := time.Now()
	r := checkX(t, NewFencing(s, nowAt), 0, 500*time.Millisecond)
	if took := time.Since(start); r.State != leaseholdv1.SessionState_LAPSED || !strings.Contains(r.Detail, "not recorded") || took >= 500*time.Millisecond {
		t.Fatalf("%v after %s, want LAPSED saying its mark is not recorded, before the 500ms deadline", r, took)
	}
}
