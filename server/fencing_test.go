package server

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// fencingSyncer runs a syncer holding one session x/s-x (generation 1) at
// Consul index 11.
func fencingSyncer(t *testing.T) (*fleet.Syncer, chan health.Observation) {
	return syncedReplicaWithFeed(t,
		health.Observation{Data: &health.TaskList{Index: 1, Tasks: []string{"work"}}},
		health.Observation{Data: &health.NonPassing{Index: 2}},
		health.Observation{
			Data: &health.Generations{
				Index: 3,
				Keys:  fleettest.Keys(map[string]uint64{"x": 1}),
			},
		},
		health.Observation{
			Data: &health.TaskMembers{
				Task:    "work",
				Index:   11,
				Members: []health.Member{member("work", "x", 9001, "1.0.0")},
			},
		},
	)
}

func checkX(t *testing.T, f *Fencing, min uint64,
	timeout time.Duration) *leaseholdv1.CheckSessionResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	r, err := f.CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s-x", MinConsulIndex: min})
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
	f := NewFencing(s, nowAt,
		FencingOptions{Refresh: func(context.Context, string, uint64) (uint64, error) {
			seq := uint64(refreshes.Add(1))
			go func() { // the watcher's fresh reads, then its marker
				obs <- health.Observation{Data: &health.Generations{Index: 40,
					Keys: fleettest.Keys(map[string]uint64{"x": 2})}}
				obs <- health.Observation{Data: &health.Refreshed{Seq: seq}}
			}()
			return seq, nil
		}},
	)
	if r := checkX(t, f, 0, time.Second); r.State != leaseholdv1.SessionState_CURRENT ||
		refreshes.Load() != 0 {
		t.Fatalf("without an index: %v (refreshes %d)", r, refreshes.Load())
	}
	if r := checkX(t, f, 2, time.Second); r.State != leaseholdv1.SessionState_CURRENT ||
		refreshes.Load() != 0 {
		t.Fatalf("at an index its checks and generation keys reached: %v (refreshes %d)",
			r, refreshes.Load())
	}
	r := checkX(t, f, 50, 2*time.Second)
	if r.State != leaseholdv1.SessionState_STALE || r.NewerGeneration != 2 ||
		refreshes.Load() != 1 {
		t.Fatalf("behind the index: %v (refreshes %d), want STALE from the fresh read",
			r, refreshes.Load())
	}
}

// When the fresh read does not come (Consul unreachable), the answer is
// UNKNOWN shortly before the caller's deadline, not an expired call.
func TestMinConsulIndexUnreachedIsUnknown(t *testing.T) {
	s, _ := fencingSyncer(t)
	f := NewFencing(s, nowAt,
		FencingOptions{
			Refresh: func(context.Context, string, uint64) (uint64, error) { return 1, nil },
		},
	)
	start := time.Now()
	r := checkX(t, f, 50, 500*time.Millisecond)
	if r.State != leaseholdv1.SessionState_UNKNOWN ||
		!strings.Contains(r.Detail, "min_consul_index 50") {
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
		obs <- health.Observation{Data: &health.NonPassing{Index: 60,
			Checks: []health.CheckState{
				{Node: "n1", CheckID: health.CheckID("x", "s-x", "work"),
					ServiceID: health.ServiceID("x", "work"), Status: health.StatusCritical,
					ModifyIndex: 60},
			}}}
		obs <- health.Observation{Data: &health.Generations{Index: 60,
			Keys: fleettest.Keys(map[string]uint64{"x": 1})}}
	}()
	if r := checkX(t, f, 60, 5*time.Second); r.State != leaseholdv1.SessionState_LAPSED ||
		r.ConsulIndex < 60 {
		t.Fatalf("%v, want LAPSED from the view at index 60", r)
	}
}

// A view older than the bound is not vouched for; fresh again, it is.
func TestStaleViewIsUnknown(t *testing.T) {
	s, _ := fencingSyncer(t)
	var fresh atomic.Int64
	fresh.Store(time.Now().Add(-40 * time.Second).UnixNano())
	f := NewFencing(s, func(string) time.Time { return time.Unix(0, fresh.Load()) },
		FencingOptions{StaleAfter: 35 * time.Second})
	r := checkX(t, f, 0, time.Second)
	if r.State != leaseholdv1.SessionState_UNKNOWN || !strings.Contains(r.Detail, "stale") ||
		!strings.Contains(r.Detail, "CURRENT") ||
		r.ViewAge.AsDuration() < 40*time.Second {
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
	s := syncedReplica(t,
		health.Observation{Data: &health.TaskList{Index: 1, Tasks: []string{"work"}}},
		health.Observation{Data: &health.NonPassing{Index: 2}},
		health.Observation{Data: &health.Generations{Index: 3}},
		health.Observation{
			Data: &health.TaskMembers{
				Task:    "work",
				Index:   11,
				Members: []health.Member{x, member("work", "y", 9002, "1.0.0")},
			},
		},
	)
	return s
}

// A session declaring a 6 s lease (lease_ttl) turns UNKNOWN once Consul has
// been silent for longer than that, though --fencing-stale-after is 35 s;
// one declaring none keeps the 35 s bound.
func TestFencingVouchesOnlyWithinTheSessionsLease(t *testing.T) {
	s := leaseSyncer(t)
	fc := newFreshClock()
	f := NewFencing(s, fc.freshAsOf, FencingOptions{Clock: fc.clock})
	check := func(inst string) *leaseholdv1.CheckSessionResponse {
		t.Helper()
		r, err := f.CheckSession(context.Background(),
			&leaseholdv1.CheckSessionRequest{InstanceId: inst, SessionId: "s-" + inst})
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
	if r := check("x"); r.State != leaseholdv1.SessionState_UNKNOWN ||
		!strings.Contains(r.Detail, "lease_ttl") {
		t.Fatalf("x after 7 s of silence: %v, want UNKNOWN naming its lease_ttl", r)
	}
	if r := check("y"); r.State != leaseholdv1.SessionState_CURRENT {
		t.Fatalf("y after 7 s of silence: %v, want CURRENT (no lease_ttl: the 35 s bound)", r)
	}
	fc.silentFor(36 * time.Second)
	if r := check("y"); r.State != leaseholdv1.SessionState_UNKNOWN ||
		!strings.Contains(r.Detail, "--fencing-stale-after") {
		t.Fatalf("y after 36 s of silence: %v, want UNKNOWN naming --fencing-stale-after", r)
	}
}

// markingSyncer is fencingSyncer with the lapse marks read (AwaitLapses,
// their listing at 4) and this replica's lapses handed to onLapse (nil:
// none recorded).
func markingSyncer(t *testing.T,
	onLapse func(health.Executor)) (*fleet.Syncer, chan health.Observation) {
	t.Helper()
	ch := make(chan health.Observation, 16)
	s := fleet.NewSyncer(
		fleet.SyncConfig{
			Logger:      slog.New(slog.NewTextHandler(io.Discard, nil)),
			AddDelay:    time.Millisecond,
			AwaitLapses: true,
			OnLapse:     onLapse,
		},
	)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx, ch); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	for _, o := range []health.Observation{
		{Data: &health.TaskList{Index: 1, Tasks: []string{"work"}}},
		{Data: &health.NonPassing{Index: 2}},
		{Data: &health.Generations{Index: 3,
			Keys: fleettest.Keys(map[string]uint64{"x": 1})}},
		{Data: &health.LapseMarks{Index: 4}},
		{Data: &health.TaskMembers{Task: "work", Index: 11,
			Members: []health.Member{member("work", "x", 9001, "1.0.0")}}},
	} {
		ch <- o
	}
	waitView(t, s, "the fleet read",
		func(v *fleet.View) bool { return v.Synced && v.ConsulIndex == 11 })
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
	obs <- health.Observation{Data: &health.Progress{NonPassing: 200}}
	obs <- health.Observation{Data: &health.Progress{Generations: 200}}
	deadline := time.After(5 * time.Second)
	for p := s.Progress(""); p.NonPassing < 200 || p.Generations < 200; p = s.Progress("") {
		select {
		case <-deadline:
			t.Fatalf("progress %+v never applied", p)
		case <-time.After(time.Millisecond): // progress publishes no view: polled
		}
	}
	var asked atomic.Uint64
	f := NewFencing(s, nowAt,
		FencingOptions{Refresh: func(_ context.Context, _ string, least uint64) (uint64, error) {
			asked.Store(least)
			seq := uint64(1)
			go func() { // the watcher's fresh read of the lapse marks, then its marker
				obs <- health.Observation{Data: &health.LapseMarks{Index: 150,
					Marks: []health.LapseMark{{InstanceID: "x", SessionID: "s-x", Generation: 1}}}}
				obs <- health.Observation{Data: &health.Refreshed{Seq: seq}}
			}()
			return seq, nil
		}},
	)
	r := checkX(t, f, 150, 2*time.Second)
	if r.State != leaseholdv1.SessionState_LAPSED || asked.Load() != 150 || r.ConsulIndex < 150 {
		t.Fatalf(
			"min_consul_index 150 with the lapse marks at 4: %v (refresh asked for %d), want "+
				"LAPSED from a fresh read of the marks for 150",
			r, asked.Load())
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
	obs <- health.Observation{Data: &health.NonPassing{Index: 60, Checks: []health.CheckState{
		{Node: "n1", CheckID: health.CheckID("x", "s-x", "work"),
			ServiceID: health.ServiceID("x", "work"), Status: health.StatusCritical,
			ModifyIndex: 60},
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
		r, err := f.CheckSession(ctx,
			&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s-x"})
		if err != nil {
			r = &leaseholdv1.CheckSessionResponse{Detail: err.Error()}
		}
		answer <- r
	}()
	select {
	case r := <-answer:
		t.Fatalf(
			"answered %v before the lapse mark was read back (consul_index %d: below the mark's, "+
				"to come)",
			r.State, r.ConsulIndex)
	case <-time.After(50 * time.Millisecond): // absence check only
	}
	obs <- health.Observation{Data: &health.LapseMarks{Index: 70,
		Marks: []health.LapseMark{{InstanceID: "x", SessionID: "s-x", Generation: 1}}}}
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
	obs <- health.Observation{Data: &health.NonPassing{Index: 60, Checks: []health.CheckState{
		{Node: "n1", CheckID: health.CheckID("x", "s-x", "work"),
			ServiceID: health.ServiceID("x", "work"), Status: health.StatusCritical,
			ModifyIndex: 60},
	}}}
	waitView(t, s, "x/s-x lapsed", func(v *fleet.View) bool {
		return v.Sessions().Check("x", "s-x").State == health.SessionLapsed
	})
	start := time.Now()
	r := checkX(t, NewFencing(s, nowAt), 0, 500*time.Millisecond)
	if took := time.Since(start); r.State != leaseholdv1.SessionState_LAPSED ||
		!strings.Contains(r.Detail, "not recorded") ||
		took >= 500*time.Millisecond {
		t.Fatalf(
			"%v after %s, want LAPSED saying its mark is not recorded, before the 500ms deadline",
			r, took)
	}
}

// sessionMember is one contract-conforming registration of session
// inst/sess of task with its checks: serfHealth passing, the lease with the
// given status, and ModifyIndex idx.
func sessionMember(task, inst, sess string, gen uint64, node string, port int,
	lease health.CheckStatus, idx uint64) health.Member {
	reg := health.Registration{
		InstanceID: inst,
		SessionID:  sess,
		Generation: gen,
		Task:       task,
		Address:    "127.0.0.1",
		Port:       port,
		Version:    "1.0.0",
		Capacity:   4,
		State:      health.StateActive,
	}
	return health.Member{
		Observed: health.Observed{
			Registration: reg,
			ServiceID:    health.ServiceID(inst, task),
			Node:         node,
			CreateIndex:  idx,
		},
		Checks: []health.CheckState{
			{Node: node, CheckID: "serfHealth", Status: health.StatusPassing, ModifyIndex: 1},
			{
				Node:        node,
				CheckID:     health.CheckID(inst, sess, task),
				ServiceID:   health.ServiceID(inst, task),
				Status:      lease,
				Output:      "load=0",
				ModifyIndex: idx,
			},
		},
	}
}

// syncedReplica is one leasehold replica's Syncer, fed by the test with
// exactly the Consul answers that replica's watches have received so far.
func syncedReplica(t *testing.T, obs ...health.Observation) *fleet.Syncer {
	t.Helper()
	s, _ := syncedReplicaWithFeed(t, obs...)
	return s
}

// syncedReplicaWithFeed is syncedReplica that also hands back its
// observation channel, for the replica's later Consul answers. It returns
// once the replica has applied every observation (waiting on its views, no
// polling).
func syncedReplicaWithFeed(t *testing.T,
	obs ...health.Observation) (*fleet.Syncer, chan health.Observation) {
	t.Helper()
	ch := make(chan health.Observation, len(obs)+8)
	s := fleet.NewSyncer(
		fleet.SyncConfig{
			Logger:   slog.New(slog.NewTextHandler(io.Discard, nil)),
			AddDelay: time.Millisecond,
		},
	)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx, ch); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	var want uint64
	for _, o := range obs {
		switch {
		case o.NonPassing() != nil:
			want = max(want, o.NonPassing().Index)
		case o.Generations() != nil:
			want = max(want, o.Generations().Index)
		case o.Members() != nil:
			want = max(want, o.Members().Index)
		}
		ch <- o
	}
	deadline := time.After(5 * time.Second)
	for v := s.View(); !v.Synced || v.ConsulIndex != want; v = s.View() {
		select {
		case <-v.Changed():
		case <-deadline:
			t.Fatalf("replica never applied its observations: synced %v, index %d, want %d",
				v.Synced, v.ConsulIndex, want)
		}
	}
	return s, ch
}

// A view's Consul index is the highest among its watches' answers, but the
// watches are independent blocking queries: one of them (the non-passing
// checks, which wake on any check change in the cluster) can be far ahead
// while those that make a session STALE (the generation keys, the task's
// membership) have not answered yet. A replica is caught up with
// min_consul_index only when every one of them has reached it, so it never
// answers CURRENT for a session another replica answered STALE at that
// index.
//
// Consul's history (Raft order):
//
//	40  x/s1 (generation 1) registered on node-a, KV x=1, y/y1 registered
//	88  KV x=2: s2 takes generation 2
//	90  x/s2 registered on node-b
//	120 y1's lease turns warning (y is full): any check change will do
//
// Replica A has read the generation keys at 88 and the task at 90: s1 is
// STALE at index 90. Replica B's non-passing query answered at 120 while its
// generation and task queries' answers for 88 and 90 are still in flight (or
// waiting out MinInterval): its view's index is 120 ≥ 90.
func TestMinConsulIndexIsReachedByEveryWatchNotTheFurthest(t *testing.T) {
	tasks := health.Observation{Data: &health.TaskList{Index: 40, Tasks: []string{"work"}}}
	y1 := sessionMember("work", "y", "y1", 1, "node-a", 9101, health.StatusPassing, 40)
	s1 := sessionMember("work", "x", "s1", 1, "node-a", 9001, health.StatusPassing, 40)
	s2 := sessionMember("work", "x", "s2", 2, "node-b", 9002, health.StatusPassing, 90)

	a := syncedReplica(t, tasks, health.Observation{Data: &health.NonPassing{Index: 85}},
		health.Observation{
			Data: &health.Generations{
				Index: 88,
				Keys:  fleettest.Keys(map[string]uint64{"x": 2, "y": 1}),
			},
		},
		health.Observation{
			Data: &health.TaskMembers{
				Task:    "work",
				Index:   90,
				Members: []health.Member{y1, s1, s2},
			},
		},
	)
	b := syncedReplica(t, tasks,
		health.Observation{
			Data: &health.Generations{
				Index: 40,
				Keys:  fleettest.Keys(map[string]uint64{"x": 1, "y": 1}),
			},
		},
		health.Observation{
			Data: &health.TaskMembers{Task: "work", Index: 40, Members: []health.Member{y1, s1}},
		},
		health.Observation{Data: &health.NonPassing{Index: 120, Checks: []health.CheckState{
			{
				Node:        "node-a",
				CheckID:     health.CheckID("y", "y1", "work"),
				ServiceID:   health.ServiceID("y", "work"),
				Status:      health.StatusWarning,
				Output:      "load=4",
				ModifyIndex: 120,
			},
		}}},
	)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	ra, err := NewFencing(a, nowAt).CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1"},
	)
	if err != nil || ra.State != leaseholdv1.SessionState_STALE {
		t.Fatalf("replica A: %v, %v; want STALE", ra, err)
	}
	rb, err := NewFencing(b, nowAt).CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{
			InstanceId:     "x",
			SessionId:      "s1",
			MinConsulIndex: ra.ConsulIndex,
		},
	)
	if err != nil {
		t.Fatal(err)
	}
	if rb.State == leaseholdv1.SessionState_CURRENT {
		t.Fatalf(
			"replica A answered STALE at consul_index %d; replica B, asked with min_consul_index "+
				"%d, answered CURRENT at consul_index %d: "+
				"its view's index is the max over its watches (non-passing at 120) while its "+
				"generation and task watches are at 40",
			ra.ConsulIndex, ra.ConsulIndex, rb.ConsulIndex)
	}
}

// The same holds for LAPSED. Replica A saw x/s1's lease critical at 100
// (non-passing). Replica B's non-passing query has not answered since 95,
// but another task's membership answered at 130: B's view index is 130, yet
// it must not answer CURRENT for min_consul_index 100.
func TestLapsedAtAnIndexIsNotCurrentWhereTheChecksAreBehindIt(t *testing.T) {
	tasks := health.Observation{
		Data: &health.TaskList{Index: 40, Tasks: []string{"other", "work"}},
	}
	gens := health.Observation{
		Data: &health.Generations{
			Index: 40,
			Keys:  fleettest.Keys(map[string]uint64{"x": 1, "o": 1}),
		},
	}
	s1 := sessionMember("work", "x", "s1", 1, "node-a", 9001, health.StatusPassing, 40)
	o1 := sessionMember("other", "o", "o1", 1, "node-c", 9201, health.StatusPassing, 40)
	o1b := sessionMember("other", "o", "o1", 1, "node-c", 9201, health.StatusPassing, 40)
	o1b.State = health.StateDraining // o1 starts draining at 130

	a := syncedReplica(t, tasks, gens,
		health.Observation{
			Data: &health.TaskMembers{Task: "work", Index: 40, Members: []health.Member{s1}},
		},
		health.Observation{
			Data: &health.TaskMembers{Task: "other", Index: 40, Members: []health.Member{o1}},
		},
		health.Observation{Data: &health.NonPassing{Index: 100, Checks: []health.CheckState{
			{
				Node:        "node-a",
				CheckID:     health.CheckID("x", "s1", "work"),
				ServiceID:   health.ServiceID("x", "work"),
				Status:      health.StatusCritical,
				Output:      "TTL expired",
				ModifyIndex: 100,
			},
		}}},
	)
	b := syncedReplica(t, tasks, gens,
		health.Observation{
			Data: &health.TaskMembers{Task: "work", Index: 40, Members: []health.Member{s1}},
		},
		health.Observation{Data: &health.NonPassing{Index: 95}},
		health.Observation{
			Data: &health.TaskMembers{Task: "other", Index: 130, Members: []health.Member{o1b}},
		},
	)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	ra, err := NewFencing(a, nowAt).CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1"},
	)
	if err != nil || ra.State != leaseholdv1.SessionState_LAPSED {
		t.Fatalf("replica A: %v, %v; want LAPSED", ra, err)
	}
	rb, err := NewFencing(b, nowAt).CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{
			InstanceId:     "x",
			SessionId:      "s1",
			MinConsulIndex: ra.ConsulIndex,
		},
	)
	if err != nil {
		t.Fatal(err)
	}
	if rb.State == leaseholdv1.SessionState_CURRENT {
		t.Fatalf(
			"replica A answered LAPSED at consul_index %d; replica B, asked with that "+
				"min_consul_index, answered CURRENT at consul_index %d (its non-passing watch is "+
				"at 95)",
			ra.ConsulIndex, rb.ConsulIndex)
	}
}

// withIndexes sets the CreateIndex of m's lease check and its serfHealth's
// CreateIndex/ModifyIndex, as a health/service read of Consul returns them.
func withIndexes(m health.Member, leaseCreated, serfCreated, serfModified uint64) health.Member {
	checks := append([]health.CheckState(nil), m.Checks...)
	for i := range checks {
		switch checks[i].CheckID {
		case health.SerfHealthCheckID:
			checks[i].CreateIndex, checks[i].ModifyIndex = serfCreated, serfModified
		default:
			checks[i].CreateIndex = leaseCreated
		}
	}
	m.Checks = checks
	return m
}

// A node failure that healed is still told by Consul's indexes: serfHealth
// rewritten (its ModifyIndex) after the lease check was created (its
// CreateIndex). A running replica re-reads a task's membership only when its
// catalog entries change, and a node that fails and comes back changes none
// of them (their service indexes, meta and address), while Refresh re-reads
// only the non-passing checks and the generation keys. So the
// fresh non-passing read carries every node's serfHealth with its indexes,
// and a replica that reads afresh for min_consul_index sees the failure
// there.
//
// Replica B's non-passing watch missed the failure (it was in its error
// back-off, up to 10 s, or between answers, while node-a was critical:
// 50..60). Replica C started at 70 and read the membership afresh:
// serfHealth rewritten at 60 after the lease was created at 40, so LAPSED. A
// dispatcher that acted on C's answer asks B with min_consul_index = C's
// consul_index: B is behind, reads afresh, and must not answer CURRENT.
func TestRefreshSeesAHealedNodeFailureInSerfHealthsIndexes(t *testing.T) {
	tasks := health.Observation{Data: &health.TaskList{Index: 40, Tasks: []string{"work"}}}
	gens := health.Observation{
		Data: &health.Generations{
			Index: 39,
			Keys:  fleettest.Keys(map[string]uint64{"x": 1}),
		},
	}
	before := withIndexes(
		sessionMember("work", "x", "s1", 1, "node-a", 9001, health.StatusPassing, 40), 40, 5, 5)
	after := withIndexes(
		sessionMember("work", "x", "s1", 1, "node-a", 9001, health.StatusPassing, 40), 40, 5, 60)

	c := syncedReplica(t, tasks, gens,
		health.Observation{Data: &health.NonPassing{Index: 70}},
		health.Observation{
			Data: &health.TaskMembers{Task: "work", Index: 70, Members: []health.Member{after}},
		},
	)
	b, bObs := syncedReplicaWithFeed(t, tasks, gens,
		health.Observation{
			Data: &health.TaskMembers{Task: "work", Index: 40, Members: []health.Member{before}},
		},
		health.Observation{Data: &health.NonPassing{Index: 45}},
	)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	rc, err := NewFencing(c, nowAt).CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1"},
	)
	if err != nil || rc.State != leaseholdv1.SessionState_LAPSED {
		t.Fatalf(
			"replica C: %v, %v; want LAPSED (serfHealth rewritten after the lease check was "+
				"created)",
			rc, err)
	}

	// B's Refresh, as the Watcher does it: fresh non-passing checks (nothing
	// critical any more) and generation keys (unchanged), then the marker.
	var refreshes atomic.Int64
	fb := NewFencing(b, nowAt,
		FencingOptions{Refresh: func(context.Context, string, uint64) (uint64, error) {
			seq := uint64(refreshes.Add(1))
			go func() {
				// The fast path carries every node's serfHealth with its indexes.
				bObs <- health.Observation{Data: &health.NonPassing{Index: 80,
					Checks: []health.CheckState{
						{Node: "node-a", CheckID: health.SerfHealthCheckID,
							Status: health.StatusPassing, CreateIndex: 5, ModifyIndex: 60},
					}}}
				bObs <- health.Observation{Data: &health.Generations{Index: 39,
					Keys: fleettest.Keys(map[string]uint64{"x": 1})}}
				bObs <- health.Observation{Data: &health.Refreshed{Seq: seq}}
			}()
			return seq, nil
		}},
	)
	rb, err := fb.CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{
			InstanceId:     "x",
			SessionId:      "s1",
			MinConsulIndex: rc.ConsulIndex,
		},
	)
	if err != nil {
		t.Fatal(err)
	}
	if rb.State == leaseholdv1.SessionState_CURRENT {
		t.Fatalf(
			"replica C answered LAPSED at consul_index %d; replica B, asked with that "+
				"min_consul_index, read Consul afresh (%d refreshes) and answered CURRENT at "+
				"consul_index %d: "+
				"the failure is only in a membership read, which Refresh does not make",
			rc.ConsulIndex, refreshes.Load(), rb.ConsulIndex)
	}
}

// The fencing API with several datacenters (--datacenters dc1,dc2): each
// datacenter's Consul has its own Raft log, so its indexes are its own. In
// the tests below dc1's are around 90000 and dc2's around 5000 (two clusters
// of different ages), unless a test says otherwise.

// dcMember is a contract-conforming registration of task work in a
// datacenter: serfHealth passing since long before (ModifyIndex 10), the
// lease passing since the registration (create).
func dcMember(inst, sess string, gen uint64, node string, port int, create uint64) health.Member {
	reg := health.Registration{
		InstanceID: inst,
		SessionID:  sess,
		Generation: gen,
		Task:       "work",
		Address:    "127.0.0.1",
		Port:       port,
		Version:    "1.0.0",
		Capacity:   4,
		State:      health.StateActive,
	}
	return health.Member{
		Observed: health.Observed{
			Registration: reg,
			ServiceID:    health.ServiceID(inst, "work"),
			Node:         node,
			CreateIndex:  create,
		},
		Checks: []health.CheckState{
			{
				Node:        node,
				CheckID:     health.SerfHealthCheckID,
				Status:      health.StatusPassing,
				CreateIndex: 1,
				ModifyIndex: 10,
			},
			{
				Node:        node,
				CheckID:     health.CheckID(inst, sess, "work"),
				ServiceID:   health.ServiceID(inst, "work"),
				Status:      health.StatusPassing,
				Output:      "load=0",
				CreateIndex: create,
				ModifyIndex: create,
			},
		},
	}
}

// dcRead is one datacenter's whole read: task list, non-passing checks
// (its nodes' serfHealth, passing), generation keys, members of work, at
// the indexes given.
type dcRead struct {
	dc                        string
	tasks, np, gen, membersAt uint64
	nodes                     []string
	floor                     map[string]uint64
	members                   []health.Member
}

func (r dcRead) observations() []health.Observation {
	var serf []health.CheckState
	for _, n := range r.nodes {
		serf = append(serf,
			health.CheckState{
				Node:        n,
				CheckID:     health.SerfHealthCheckID,
				Status:      health.StatusPassing,
				CreateIndex: 1,
				ModifyIndex: 10,
			},
		)
	}
	return []health.Observation{
		{Datacenter: r.dc, Data: &health.TaskList{Index: r.tasks, Tasks: []string{"work"}}},
		{Datacenter: r.dc, Data: &health.NonPassing{Index: r.np, Checks: serf}},
		{
			Datacenter: r.dc,
			Data:       &health.Generations{Index: r.gen, Keys: fleettest.Keys(r.floor)},
		},
		{
			Datacenter: r.dc,
			Data:       &health.TaskMembers{Task: "work", Index: r.membersAt, Members: r.members},
		},
	}
}

// twoDCReplica is one leasehold replica watching dc1 (its own) and dc2, fed
// the reads given; it returns once both are applied and the fleet synced.
func twoDCReplica(t *testing.T, reads ...dcRead) (*fleet.Syncer, chan health.Observation) {
	t.Helper()
	ch := make(chan health.Observation, 64)
	s := fleet.NewSyncer(
		fleet.SyncConfig{
			Logger:      slog.New(slog.NewTextHandler(io.Discard, nil)),
			AddDelay:    time.Millisecond,
			Datacenters: []string{"dc1", "dc2"},
		},
	)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx, ch); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	want := map[string]uint64{}
	for _, r := range reads {
		for _, o := range r.observations() {
			ch <- o
		}
		want[r.dc] = max(r.tasks, r.np, r.gen, r.membersAt)
	}
	waitView(t, s, "the reads applied", func(v *fleet.View) bool {
		if !v.Synced {
			return false
		}
		for dc, w := range want {
			if i, _ := v.Datacenter(dc); i.ConsulIndex < w {
				return false
			}
		}
		return true
	})
	return s, ch
}

// checkSession asks f for inst/sess with min_consul_index min, within
// timeout.
func checkSession(t *testing.T, f *Fencing, inst, sess string, min uint64,
	timeout time.Duration) *leaseholdv1.CheckSessionResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	r, err := f.CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: inst, SessionId: sess, MinConsulIndex: min})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// recordingStream is a WatchSession stream that records what is sent.
type recordingStream struct {
	grpc.ServerStream
	ctx  context.Context
	mu   sync.Mutex
	sent []*leaseholdv1.CheckSessionResponse
	got  chan struct{}
}

func (s *recordingStream) Context() context.Context     { return s.ctx }
func (s *recordingStream) SetHeader(metadata.MD) error  { return nil }
func (s *recordingStream) SendHeader(metadata.MD) error { return nil }
func (s *recordingStream) SetTrailer(metadata.MD)       {}
func (s *recordingStream) Send(r *leaseholdv1.CheckSessionResponse) error {
	s.mu.Lock()
	s.sent = append(s.sent, r)
	s.mu.Unlock()
	select {
	case s.got <- struct{}{}:
	default:
	}
	return nil
}

func (s *recordingStream) answers() []*leaseholdv1.CheckSessionResponse {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*leaseholdv1.CheckSessionResponse(nil), s.sent...)
}

// The fleet of the datacenter-switch tests: a/s-a in dc1; x/s-x registers in dc2 at
// index 5090 and lapses there at 5150. Replica A saw the lapse (LAPSED,
// consul_index 5150 — dc2's, the session's datacenter); replica B's dc2
// view is behind: its non-passing checks are at 5002, its member list of
// work does not have x yet.
var (
	dc1Fleet = dcRead{
		dc:        "dc1",
		tasks:     90001,
		np:        90002,
		gen:       90003,
		membersAt: 90004,
		nodes:     []string{"n1"},
		floor: map[string]uint64{
			"a": 1,
		},
		members: []health.Member{dcMember("a", "s-a", 1, "n1", 9001, 90000)},
	}
	dc2Behind = dcRead{
		dc:        "dc2",
		tasks:     5001,
		np:        5002,
		gen:       5003,
		membersAt: 5004,
		nodes:     []string{"m1"},
		floor:     map[string]uint64{},
	}
	// x/s-x as B's members watch reads it next (at 5100: registered, passing).
	xRegisteredInDC2 = health.Observation{
		Datacenter: "dc2",
		Data: &health.TaskMembers{Task: "work", Index: 5100,
			Members: []health.Member{dcMember("x", "s-x", 1, "m1", 9002, 5090)}},
	}
	// x/s-x's lease critical at 5150 (what replica A saw).
	xLapsedInDC2 = health.Observation{
		Datacenter: "dc2",
		Data: &health.NonPassing{Index: 5150, Checks: []health.CheckState{
			{
				Node:        "m1",
				CheckID:     health.SerfHealthCheckID,
				Status:      health.StatusPassing,
				CreateIndex: 1,
				ModifyIndex: 10,
			},
			{
				Node:        "m1",
				CheckID:     health.CheckID("x", "s-x", "work"),
				ServiceID:   health.ServiceID("x", "work"),
				Status:      health.StatusCritical,
				CreateIndex: 5090,
				ModifyIndex: 5150,
			},
		}},
	}
)

// WatchSession holds every datacenter that answers to min_consul_index, not
// only the one its first view places the session in. A session leasehold
// does not know yet would be placed in leasehold's own datacenter (dc1),
// whose indexes (~90000) are far above dc2's 5150, and the stream would
// count as caught up for good. When replica B's members watch then reads
// x/s-x in dc2 (at 5100, passing) while B's non-passing checks of dc2 are
// still at 5002, below the 5150 asked for, where x/s-x's lease is critical,
// the stream would answer CURRENT: a dispatcher told LAPSED by replica A
// (consul_index 5150) would be told CURRENT by replica B with
// min_consul_index 5150, breaking the monotonic read min_consul_index
// promises. With one datacenter the stream likewise stays UNKNOWN until B's
// checks reach 5150.
func TestWatchSessionHoldsEveryDatacenterToMinConsulIndex(t *testing.T) {
	b, obs := twoDCReplica(t, dc1Fleet, dc2Behind)
	f := NewFencing(b, nowAt)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream := &recordingStream{ctx: ctx, got: make(chan struct{}, 1)}
	done := make(chan error, 1)
	go func() {
		done <- f.WatchSession(&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s-x",
			MinConsulIndex: 5150}, stream)
	}()
	select { // the first answer (x/s-x is not known to B) — or the stream still catching up in dc2
	case <-stream.got:
	case <-time.After(200 * time.Millisecond):
	}
	obs <- xRegisteredInDC2
	waitView(t, b, "x/s-x read in dc2", func(v *fleet.View) bool {
		return v.Sessions().Check("x", "s-x").Datacenter == "dc2"
	})
	deadline := time.After(500 * time.Millisecond)
	for {
		for _, r := range stream.answers() {
			if r.GetState() == leaseholdv1.SessionState_CURRENT {
				i, _ := b.View().Datacenter("dc2")
				t.Fatalf(
					"x/s-x answered CURRENT for min_consul_index 5150 while replica B's dc2 "+
						"checks are at %d (generation keys %d): %v",
					i.NonPassingIndex, i.GenerationsIndex, r)
			}
		}
		select {
		case <-stream.got:
		case <-deadline:
			cancel()
			<-done
			return
		}
	}
}

// CheckSession reads afresh every datacenter that has not reached
// min_consul_index, not only the one its view before catching up places the
// session in. For a session B does not know yet that is leasehold's own,
// dc1 (here the younger cluster, its indexes ~1000). Had B read only dc1
// afresh and answered from the view holding that refresh, which by then
// holds x/s-x in dc2 (read at 5100, passing), its dc2 checks (5002) would
// never have reached the 5150 asked for: a session replica A answered
// LAPSED at dc2's 5150 would be answered CURRENT. The answer is LAPSED (dc2
// read afresh) or UNKNOWN.
func TestCheckSessionReadsAfreshEveryDatacenterBehind(t *testing.T) {
	// Here dc1 is the younger cluster (indexes ~1000): its view is below
	// 5150 too, so B asks for a refresh — of dc1.
	young := dcRead{
		dc:        "dc1",
		tasks:     1001,
		np:        1002,
		gen:       1003,
		membersAt: 1004,
		nodes:     []string{"n1"},
		floor: map[string]uint64{
			"a": 1,
		},
		members: []health.Member{dcMember("a", "s-a", 1, "n1", 9001, 1000)},
	}
	b, obs := twoDCReplica(t, young, dc2Behind)
	var mu sync.Mutex
	var asked []string
	var seq uint64
	f := NewFencing(b, nowAt,
		FencingOptions{Refresh: func(_ context.Context, dc string, atLeast uint64) (uint64, error) {
			mu.Lock()
			defer mu.Unlock()
			asked = append(asked, dc)
			seq++
			s := seq
			switch dc {
			// dc1 read afresh: nothing new there; meanwhile B's dc2 members watch answers
			case "dc1":
				obs <- xRegisteredInDC2
			case "dc2": // dc2 read afresh: the lapse
				obs <- xRegisteredInDC2
				obs <- xLapsedInDC2
			}
			obs <- health.Observation{Datacenter: dc, Data: &health.Refreshed{Seq: s, AtLeast: atLeast}}
			return s, nil
		}},
	)
	r := checkSession(t, f, "x", "s-x", 5150, 2*time.Second)
	mu.Lock()
	defer mu.Unlock()
	if r.GetState() == leaseholdv1.SessionState_CURRENT {
		i, _ := b.View().Datacenter("dc2")
		t.Fatalf(
			"x/s-x answered CURRENT for min_consul_index 5150 (refreshed: %v; dc2's checks at "+
				"%d): %v",
			asked, i.NonPassingIndex, r)
	}
}

// An instance's sessions are fenced across datacenters (docs/failure-semantics.md: "the newest
// session wins wherever it registered"; an instance that moves keeps
// counting its generation), while an answer's consul_index (the
// min_consul_index a dispatcher sends to any replica next) is only the
// session's own datacenter's. x/s1 (generation 1, dc1) is replaced by x/s2
// (generation 2) in dc2. Replica A has read dc2: x/s1 is STALE,
// consul_index 90004 (dc1's). Replica B's dc1 view is past 90004, its dc2
// view a few seconds behind (x/s2 and its generation key not read yet).
// Asked with min_consul_index 90004, B holds dc2 to it as well (the index
// does not say whose it is) and does not answer CURRENT: a replaced session
// would be confirmed CURRENT after another replica called it STALE, at an
// index the dispatcher passed on as the contract says.
func TestStaleFromAnotherDatacenterStaysStaleAtItsIndex(t *testing.T) {
	dc1 := dcRead{
		dc:        "dc1",
		tasks:     90001,
		np:        90002,
		gen:       90003,
		membersAt: 90004,
		nodes:     []string{"n1"},
		floor: map[string]uint64{
			"x": 1,
		},
		members: []health.Member{dcMember("x", "s1", 1, "n1", 9001, 90000)},
	}
	dc2Ahead := dcRead{
		dc:        "dc2",
		tasks:     5001,
		np:        5002,
		gen:       5010,
		membersAt: 5012,
		nodes:     []string{"m1"},
		floor: map[string]uint64{
			"x": 2,
		},
		members: []health.Member{dcMember("x", "s2", 2, "m1", 9002, 5008)},
	}
	dc2Behind := dcRead{
		dc:        "dc2",
		tasks:     5001,
		np:        5002,
		gen:       5003,
		membersAt: 5004,
		nodes:     []string{"m1"},
		floor:     map[string]uint64{},
	}

	a, _ := twoDCReplica(t, dc1, dc2Ahead)
	ra := checkSession(t, NewFencing(a, nowAt), "x", "s1", 0, time.Second)
	if ra.GetState() != leaseholdv1.SessionState_STALE {
		t.Fatalf("replica A: x/s1 %v, want STALE (x/s2 in dc2 is newer)", ra)
	}
	// B's dc1 watches answered a little later than A's (nothing changed
	// there): its dc1 view is at least as new as A's.
	dc1B := dc1
	dc1B.np, dc1B.gen = 90005, 90006
	b, _ := twoDCReplica(t, dc1B, dc2Behind)
	var refreshed []string
	fb := NewFencing(b, nowAt,
		FencingOptions{Refresh: func(_ context.Context, dc string, _ uint64) (uint64, error) {
			refreshed = append(refreshed, dc)
			return 0, fmt.Errorf("not in this test")
		}},
	)
	rb := checkSession(t, fb, "x", "s1", ra.GetConsulIndex(), time.Second)
	if rb.GetState() == leaseholdv1.SessionState_CURRENT {
		t.Fatalf(
			"replica B: x/s1 CURRENT with min_consul_index %d from replica A's STALE answer "+
				"(refreshes asked: %v): %v",
			ra.GetConsulIndex(), refreshed, rb)
	}
}

// A watch the caller gave a deadline ends with DeadlineExceeded, not a
// clean end of stream: a clean end says the server closed a watch it still
// owed, and a client whose own deadline had not fired yet could not tell.
func TestWatchSessionEndsWithTheCallersDeadline(t *testing.T) {
	s, _ := fencingSyncer(t)
	f := NewFencing(s, nowAt)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	stream := &recordingStream{ctx: ctx, got: make(chan struct{}, 1)}
	err := f.WatchSession(&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s-x"},
		stream)
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("WatchSession past the caller's deadline returned %v, want DeadlineExceeded", err)
	}
	if len(stream.answers()) == 0 {
		t.Fatalf("the watch ended without its first answer")
	}
}
