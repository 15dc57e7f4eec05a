package server

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// attackMember is one contract-conforming registration with its checks
// (serfHealth passing, the lease with the given status and ModifyIndex).
func attackMember(task, inst, sess string, gen uint64, node string, port int, lease health.CheckStatus, idx uint64) health.Member {
	reg := health.Registration{InstanceID: inst, SessionID: sess, Generation: gen, Task: task, Address: "127.0.0.1", Port: port, Version: "1.0.0", Capacity: 4, State: health.StateActive}
	return health.Member{
		Executor: health.Executor{Registration: reg, ServiceID: health.ServiceID(inst, task), Node: node, CreateIndex: idx},
		Checks: []health.CheckState{
			{Node: node, CheckID: "serfHealth", Status: health.StatusPassing, ModifyIndex: 1},
			{Node: node, CheckID: health.CheckID(inst, sess, task), ServiceID: health.ServiceID(inst, task), Status: lease, Output: "load=0", ModifyIndex: idx},
		},
	}
}

// attackReplica is one leasehold replica's Syncer, fed by the test with
// exactly the Consul answers that replica's watches have received so far.
func attackReplica(t *testing.T, obs ...health.Observation) *fleet.Syncer {
	t.Helper()
	s, _ := attack2Replica(t, obs...)
	return s
}

// attack2Replica is attackReplica that also hands back its observation
// channel, for the replica's later Consul answers. It returns once the
// replica has applied every observation (waiting on its views, no polling).
func attack2Replica(t *testing.T, obs ...health.Observation) (*fleet.Syncer, chan health.Observation) {
	t.Helper()
	ch := make(chan health.Observation, len(obs)+8)
	s := fleet.NewSyncer(fleet.SyncConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), AddDelay: time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx, ch); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	var want uint64
	for _, o := range obs {
		switch {
		case o.NonPassing != nil:
			want = max(want, o.NonPassing.Index)
		case o.Generations != nil:
			want = max(want, o.Generations.Index)
		case o.Members != nil:
			want = max(want, o.Members.Index)
		}
		ch <- o
	}
	deadline := time.After(5 * time.Second)
	for v := s.View(); !v.Synced || v.ConsulIndex != want; v = s.View() {
		select {
		case <-v.Changed():
		case <-deadline:
			t.Fatalf("replica never applied its observations: synced %v, index %d, want %d", v.Synced, v.ConsulIndex, want)
		}
	}
	return s, ch
}

// TestAttackMinConsulIndexIsTheMaxOfIndependentWatches: a view's Consul
// index is the highest index among its watches' answers, but the watches are
// independent blocking queries: one of them (the non-passing checks, which
// wakes on any check change in the cluster) can be far ahead while the ones
// that make a session STALE (the generation keys, the task's membership) have
// not answered yet. A replica whose view "reached" min_consul_index therefore
// does not include what the index stands for, and answers CURRENT for a
// session another replica answered STALE at that index.
//
// Consul's history (Raft order):
//
//	40  x/s1 (generation 1) registered on node-a, KV x=1, y/y1 registered
//	88  KV x=2: s2 takes generation 2
//	90  x/s2 registered on node-b
//	120 y1's lease turns warning (y is full) — any check change will do
//
// Replica A has read the generation keys at 88 and the task at 90: s1 is
// STALE at index 90. Replica B's non-passing query answered at 120 while its
// generation and task queries' answers for 88 and 90 are still in flight (or
// waiting out MinInterval): its view's index is 120 ≥ 90.
func TestAttackMinConsulIndexIsTheMaxOfIndependentWatches(t *testing.T) {
	tasks := health.Observation{Tasks: &health.TaskList{Index: 40, Tasks: []string{"work"}}}
	y1 := attackMember("work", "y", "y1", 1, "node-a", 9101, health.StatusPassing, 40)
	s1 := attackMember("work", "x", "s1", 1, "node-a", 9001, health.StatusPassing, 40)
	s2 := attackMember("work", "x", "s2", 2, "node-b", 9002, health.StatusPassing, 90)

	a := attackReplica(t, tasks,
		health.Observation{NonPassing: &health.NonPassing{Index: 85}},
		health.Observation{Generations: &health.Generations{Index: 88, Keys: fleettest.Keys(map[string]uint64{"x": 2, "y": 1})}},
		health.Observation{Members: &health.TaskMembers{Task: "work", Index: 90, Members: []health.Member{y1, s1, s2}}},
	)
	b := attackReplica(t, tasks,
		health.Observation{Generations: &health.Generations{Index: 40, Keys: fleettest.Keys(map[string]uint64{"x": 1, "y": 1})}},
		health.Observation{Members: &health.TaskMembers{Task: "work", Index: 40, Members: []health.Member{y1, s1}}},
		health.Observation{NonPassing: &health.NonPassing{Index: 120, Checks: []health.CheckState{
			{Node: "node-a", CheckID: health.CheckID("y", "y1", "work"), ServiceID: health.ServiceID("y", "work"), Status: health.StatusWarning, Output: "load=4", ModifyIndex: 120},
		}}},
	)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	ra, err := NewFencing(a, nowAt).CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1"})
	if err != nil || ra.State != leaseholdv1.SessionState_STALE {
		t.Fatalf("replica A: %v, %v; want STALE", ra, err)
	}
	rb, err := NewFencing(b, nowAt).CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1", MinConsulIndex: ra.ConsulIndex})
	if err != nil {
		t.Fatal(err)
	}
	if rb.State == leaseholdv1.SessionState_CURRENT {
		t.Fatalf("replica A answered STALE at consul_index %d; replica B, asked with min_consul_index %d, answered CURRENT at consul_index %d: "+
			"its view's index is the max over its watches (non-passing at 120) while its generation and task watches are at 40", ra.ConsulIndex, ra.ConsulIndex, rb.ConsulIndex)
	}
}

// TestAttackMinConsulIndexLapsedThenCurrent: the same with LAPSED. Replica A
// saw x/s1's lease critical at 100 (non-passing). Replica B's non-passing
// query has not answered since 95, but another task's membership answered at
// 130: B's view index is 130 and it answers CURRENT for min_consul_index 100.
func TestAttackMinConsulIndexLapsedThenCurrent(t *testing.T) {
	tasks := health.Observation{Tasks: &health.TaskList{Index: 40, Tasks: []string{"other", "work"}}}
	gens := health.Observation{Generations: &health.Generations{Index: 40, Keys: fleettest.Keys(map[string]uint64{"x": 1, "o": 1})}}
	s1 := attackMember("work", "x", "s1", 1, "node-a", 9001, health.StatusPassing, 40)
	o1 := attackMember("other", "o", "o1", 1, "node-c", 9201, health.StatusPassing, 40)
	o1b := attackMember("other", "o", "o1", 1, "node-c", 9201, health.StatusPassing, 40)
	o1b.State = health.StateDraining // o1 starts draining at 130

	a := attackReplica(t, tasks, gens,
		health.Observation{Members: &health.TaskMembers{Task: "work", Index: 40, Members: []health.Member{s1}}},
		health.Observation{Members: &health.TaskMembers{Task: "other", Index: 40, Members: []health.Member{o1}}},
		health.Observation{NonPassing: &health.NonPassing{Index: 100, Checks: []health.CheckState{
			{Node: "node-a", CheckID: health.CheckID("x", "s1", "work"), ServiceID: health.ServiceID("x", "work"), Status: health.StatusCritical, Output: "TTL expired", ModifyIndex: 100},
		}}},
	)
	b := attackReplica(t, tasks, gens,
		health.Observation{Members: &health.TaskMembers{Task: "work", Index: 40, Members: []health.Member{s1}}},
		health.Observation{NonPassing: &health.NonPassing{Index: 95}},
		health.Observation{Members: &health.TaskMembers{Task: "other", Index: 130, Members: []health.Member{o1b}}},
	)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	ra, err := NewFencing(a, nowAt).CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1"})
	if err != nil || ra.State != leaseholdv1.SessionState_LAPSED {
		t.Fatalf("replica A: %v, %v; want LAPSED", ra, err)
	}
	rb, err := NewFencing(b, nowAt).CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1", MinConsulIndex: ra.ConsulIndex})
	if err != nil {
		t.Fatal(err)
	}
	if rb.State == leaseholdv1.SessionState_CURRENT {
		t.Fatalf("replica A answered LAPSED at consul_index %d; replica B, asked with that min_consul_index, answered CURRENT at consul_index %d (its non-passing watch is at 95)", ra.ConsulIndex, rb.ConsulIndex)
	}
}
