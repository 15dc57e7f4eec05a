package server

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// Attack 17: the fencing API with several datacenters (--datacenters
// dc1,dc2). Each datacenter's Consul has its own Raft log, so its indexes
// are its own: here dc1's are around 90000, dc2's around 5000 (two clusters
// of different ages).

// a17Member is a contract-conforming registration of task work in a
// datacenter: serfHealth passing since long before (ModifyIndex 10), the
// lease passing since the registration (create).
func a17Member(inst, sess string, gen uint64, node string, port int, create uint64) health.Member {
	reg := health.Registration{InstanceID: inst, SessionID: sess, Generation: gen, Task: "work", Address: "127.0.0.1", Port: port, Version: "1.0.0", Capacity: 4, State: health.StateActive}
	return health.Member{
		Executor: health.Executor{Registration: reg, ServiceID: health.ServiceID(inst, "work"), Node: node, CreateIndex: create},
		Checks: []health.CheckState{
			{Node: node, CheckID: health.SerfHealthCheckID, Status: health.StatusPassing, CreateIndex: 1, ModifyIndex: 10},
			{Node: node, CheckID: health.CheckID(inst, sess, "work"), ServiceID: health.ServiceID(inst, "work"), Status: health.StatusPassing, Output: "load=0", CreateIndex: create, ModifyIndex: create},
		},
	}
}

// a17Read is one datacenter's whole read: task list, non-passing checks
// (its nodes' serfHealth, passing), generation keys, members of work, at
// the indexes given.
type a17Read struct {
	dc                        string
	tasks, np, gen, membersAt uint64
	nodes                     []string
	floor                     map[string]uint64
	members                   []health.Member
}

func (r a17Read) observations() []health.Observation {
	var serf []health.CheckState
	for _, n := range r.nodes {
		serf = append(serf, health.CheckState{Node: n, CheckID: health.SerfHealthCheckID, Status: health.StatusPassing, CreateIndex: 1, ModifyIndex: 10})
	}
	return []health.Observation{
		{Datacenter: r.dc, Tasks: &health.TaskList{Index: r.tasks, Tasks: []string{"work"}}},
		{Datacenter: r.dc, NonPassing: &health.NonPassing{Index: r.np, Checks: serf}},
		{Datacenter: r.dc, Generations: &health.Generations{Index: r.gen, Keys: fleettest.Keys(r.floor)}},
		{Datacenter: r.dc, Members: &health.TaskMembers{Task: "work", Index: r.membersAt, Members: r.members}},
	}
}

// a17Replica is one leasehold replica watching dc1 (its own) and dc2, fed
// the reads given; it returns once both are applied and the fleet synced.
func a17Replica(t *testing.T, reads ...a17Read) (*fleet.Syncer, chan health.Observation) {
	t.Helper()
	ch := make(chan health.Observation, 64)
	s := fleet.NewSyncer(fleet.SyncConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), AddDelay: time.Millisecond,
		Datacenters: []string{"dc1", "dc2"}})
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
	a17WaitView(t, s, "the reads applied", func(v *fleet.View) bool {
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

func a17WaitView(t *testing.T, s *fleet.Syncer, what string, ok func(v *fleet.View) bool) *fleet.View {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		v := s.View()
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

func a17Check(t *testing.T, f *Fencing, inst, sess string, min uint64, timeout time.Duration) *leaseholdv1.CheckSessionResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	r, err := f.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: inst, SessionId: sess, MinConsulIndex: min})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// a17Stream is a WatchSession stream that records what is sent.
type a17Stream struct {
	grpc.ServerStream
	ctx  context.Context
	mu   sync.Mutex
	sent []*leaseholdv1.CheckSessionResponse
	got  chan struct{}
}

func (s *a17Stream) Context() context.Context     { return s.ctx }
func (s *a17Stream) SetHeader(metadata.MD) error  { return nil }
func (s *a17Stream) SendHeader(metadata.MD) error { return nil }
func (s *a17Stream) SetTrailer(metadata.MD)       {}
func (s *a17Stream) Send(r *leaseholdv1.CheckSessionResponse) error {
	s.mu.Lock()
	s.sent = append(s.sent, r)
	s.mu.Unlock()
	select {
	case s.got <- struct{}{}:
	default:
	}
	return nil
}

func (s *a17Stream) answers() []*leaseholdv1.CheckSessionResponse {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*leaseholdv1.CheckSessionResponse(nil), s.sent...)
}

// The fleet of the dc-switch tests: a/s-a in dc1; x/s-x registers in dc2 at
// index 5090 and lapses there at 5150. Replica A saw the lapse (LAPSED,
// consul_index 5150 — dc2's, the session's datacenter); replica B's dc2
// view is behind: its non-passing checks are at 5002, its member list of
// work does not have x yet.
var (
	a17DC1 = a17Read{dc: "dc1", tasks: 90001, np: 90002, gen: 90003, membersAt: 90004, nodes: []string{"n1"},
		floor: map[string]uint64{"a": 1}, members: []health.Member{a17Member("a", "s-a", 1, "n1", 9001, 90000)}}
	a17DC2Behind = a17Read{dc: "dc2", tasks: 5001, np: 5002, gen: 5003, membersAt: 5004, nodes: []string{"m1"}, floor: map[string]uint64{}}
	// x/s-x as B's members watch reads it next (at 5100: registered, passing).
	a17XRegistered = health.Observation{Datacenter: "dc2", Members: &health.TaskMembers{Task: "work", Index: 5100,
		Members: []health.Member{a17Member("x", "s-x", 1, "m1", 9002, 5090)}}}
	// x/s-x's lease critical at 5150 (what replica A saw).
	a17XLapsed = health.Observation{Datacenter: "dc2", NonPassing: &health.NonPassing{Index: 5150, Checks: []health.CheckState{
		{Node: "m1", CheckID: health.SerfHealthCheckID, Status: health.StatusPassing, CreateIndex: 1, ModifyIndex: 10},
		{Node: "m1", CheckID: health.CheckID("x", "s-x", "work"), ServiceID: health.ServiceID("x", "work"), Status: health.StatusCritical, CreateIndex: 5090, ModifyIndex: 5150},
	}}}
)

// TestAttack17WatchSessionCatchUpFollowsTheDatacenterSwitch (fixed; failed before):
// WatchSession decides whether the view reached min_consul_index in the
// datacenter of the session as the FIRST view saw it — leasehold's own (dc1)
// for a session it does not know yet — and keeps that verdict (caughtUp)
// for the life of the stream. dc1's indexes (~90000) are far above dc2's
// 5150, so the stream counts as caught up at once; when replica B's members
// watch then reads x/s-x in dc2 (at 5100, passing) while its non-passing
// checks of dc2 are still at 5002 — below the 5150 the dispatcher asked for,
// where x/s-x's lease is critical — the stream answers CURRENT. A dispatcher
// that had been told LAPSED by replica A (consul_index 5150) is told CURRENT
// by replica B with min_consul_index 5150: a lapsed session confirmed
// CURRENT, the monotonic read min_consul_index promises broken. (With one
// datacenter the stream stays UNKNOWN until B's checks reach 5150.)
func TestAttack17WatchSessionCatchUpFollowsTheDatacenterSwitch(t *testing.T) {
	b, obs := a17Replica(t, a17DC1, a17DC2Behind)
	f := NewFencing(b, nowAt)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream := &a17Stream{ctx: ctx, got: make(chan struct{}, 1)}
	done := make(chan error, 1)
	go func() {
		done <- f.WatchSession(&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s-x", MinConsulIndex: 5150}, stream)
	}()
	select { // the first answer (x/s-x is not known to B) — or the stream still catching up in dc2
	case <-stream.got:
	case <-time.After(200 * time.Millisecond):
	}
	obs <- a17XRegistered
	a17WaitView(t, b, "x/s-x read in dc2", func(v *fleet.View) bool {
		return v.Sessions().Check("x", "s-x").Datacenter == "dc2"
	})
	deadline := time.After(500 * time.Millisecond)
	for {
		for _, r := range stream.answers() {
			if r.GetState() == leaseholdv1.SessionState_CURRENT {
				i, _ := b.View().Datacenter("dc2")
				t.Fatalf("x/s-x answered CURRENT for min_consul_index 5150 while replica B's dc2 checks are at %d (generation keys %d): %v",
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

// TestAttack17CheckSessionRefreshOfTheWrongDatacenter (fixed; failed before):
// CheckSession picks the datacenter to catch up in (dcOf) from the view
// before catching up; for a session B does not know yet that is
// leasehold's own, dc1 (here the younger cluster, its indexes ~1000). B
// reads dc1 afresh (the only refresh it asks for)
// and, once that refresh is in a view, answers from that view — which by
// then holds x/s-x in dc2, read at 5100 and passing — as caught up, though
// its dc2 checks (5002) never reached the 5150 asked for, nor was dc2 read
// afresh. A session replica A answered LAPSED at dc2's 5150 is answered
// CURRENT. The right answer is LAPSED (dc2 read afresh) or UNKNOWN.
func TestAttack17CheckSessionRefreshOfTheWrongDatacenter(t *testing.T) {
	// Here dc1 is the younger cluster (indexes ~1000): its view is below
	// 5150 too, so B asks for a refresh — of dc1.
	young := a17Read{dc: "dc1", tasks: 1001, np: 1002, gen: 1003, membersAt: 1004, nodes: []string{"n1"},
		floor: map[string]uint64{"a": 1}, members: []health.Member{a17Member("a", "s-a", 1, "n1", 9001, 1000)}}
	b, obs := a17Replica(t, young, a17DC2Behind)
	var mu sync.Mutex
	var asked []string
	var seq uint64
	f := NewFencing(b, nowAt, FencingOptions{Refresh: func(_ context.Context, dc string, atLeast uint64) (uint64, error) {
		mu.Lock()
		defer mu.Unlock()
		asked = append(asked, dc)
		seq++
		s := seq
		switch dc {
		case "dc1": // dc1 read afresh: nothing new there; meanwhile B's dc2 members watch answers
			obs <- a17XRegistered
		case "dc2": // dc2 read afresh: the lapse
			obs <- a17XRegistered
			obs <- a17XLapsed
		}
		obs <- health.Observation{Datacenter: dc, Refreshed: &s, RefreshedAtLeast: atLeast}
		return s, nil
	}})
	r := a17Check(t, f, "x", "s-x", 5150, 2*time.Second)
	mu.Lock()
	defer mu.Unlock()
	if r.GetState() == leaseholdv1.SessionState_CURRENT {
		i, _ := b.View().Datacenter("dc2")
		t.Fatalf("x/s-x answered CURRENT for min_consul_index 5150 (refreshed: %v; dc2's checks at %d): %v", asked, i.NonPassingIndex, r)
	}
}

// TestAttack17StaleFromAnotherDatacenterIsNotMonotonic (fixed; failed before): an
// instance's sessions are fenced across datacenters (README: "the newest
// session wins wherever it registered"; an instance that moves keeps
// counting its generation), but the answer's consul_index — the
// min_consul_index a dispatcher sends to any replica next — is only the
// session's own datacenter's. x/s1 (generation 1, dc1) is replaced by x/s2
// (generation 2) in dc2. Replica A has read dc2: x/s1 is STALE, consul_index
// 90004 (dc1's). Replica B's dc1 view is past 90004, its dc2 view a few
// seconds behind (x/s2 and its generation key not read yet): asked with
// min_consul_index 90004 it is caught up, reads nothing afresh, and answers
// CURRENT. A replaced session is confirmed CURRENT after another replica
// called it STALE, at an index the dispatcher passed on as the contract
// says.
func TestAttack17StaleFromAnotherDatacenterIsNotMonotonic(t *testing.T) {
	dc1 := a17Read{dc: "dc1", tasks: 90001, np: 90002, gen: 90003, membersAt: 90004, nodes: []string{"n1"},
		floor: map[string]uint64{"x": 1}, members: []health.Member{a17Member("x", "s1", 1, "n1", 9001, 90000)}}
	dc2Ahead := a17Read{dc: "dc2", tasks: 5001, np: 5002, gen: 5010, membersAt: 5012, nodes: []string{"m1"},
		floor: map[string]uint64{"x": 2}, members: []health.Member{a17Member("x", "s2", 2, "m1", 9002, 5008)}}
	dc2Behind := a17Read{dc: "dc2", tasks: 5001, np: 5002, gen: 5003, membersAt: 5004, nodes: []string{"m1"}, floor: map[string]uint64{}}

	a, _ := a17Replica(t, dc1, dc2Ahead)
	ra := a17Check(t, NewFencing(a, nowAt), "x", "s1", 0, time.Second)
	if ra.GetState() != leaseholdv1.SessionState_STALE {
		t.Fatalf("replica A: x/s1 %v, want STALE (x/s2 in dc2 is newer)", ra)
	}
	// B's dc1 watches answered a little later than A's (nothing changed
	// there): its dc1 view is at least as new as A's.
	dc1B := dc1
	dc1B.np, dc1B.gen = 90005, 90006
	b, _ := a17Replica(t, dc1B, dc2Behind)
	var refreshed []string
	fb := NewFencing(b, nowAt, FencingOptions{Refresh: func(_ context.Context, dc string, _ uint64) (uint64, error) {
		refreshed = append(refreshed, dc)
		return 0, fmt.Errorf("not in this test")
	}})
	rb := a17Check(t, fb, "x", "s1", ra.GetConsulIndex(), time.Second)
	if rb.GetState() == leaseholdv1.SessionState_CURRENT {
		t.Fatalf("replica B: x/s1 CURRENT with min_consul_index %d from replica A's STALE answer (refreshes asked: %v): %v",
			ra.GetConsulIndex(), refreshed, rb)
	}
}
