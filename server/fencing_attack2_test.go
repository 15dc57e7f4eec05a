package server

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

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

// TestAttack2NodeFailureFromIndexesIsNotInWhatRefreshReads: 6ffb2c5 derives
// a healed node failure from Consul's indexes, but only from a membership
// read (health/service: the lease check's CreateIndex, serfHealth's
// ModifyIndex), and a running replica re-reads a task's membership only
// when its catalog entries change — a node failing and coming back changes
// none of them (membershipKey: service indexes, meta, address). Refresh
// (4b9b57a) re-reads only the non-passing checks and the generation keys.
//
// Replica B's non-passing watch missed the failure (it was in its error
// back-off, up to 10 s, or between answers, when node-a was critical:
// 50..60). Replica C started at 70 and read the membership afresh: serfHealth
// rewritten at 60 after the lease was created at 40: LAPSED. A dispatcher
// that acted on C's answer asks B with min_consul_index = C's consul_index:
// B is behind, reads afresh as promised — and answers CURRENT from a view
// "at least as new as the request".
func TestAttack2NodeFailureFromIndexesIsNotInWhatRefreshReads(t *testing.T) {
	tasks := health.Observation{Tasks: &health.TaskList{Index: 40, Tasks: []string{"work"}}}
	gens := health.Observation{Generations: &health.Generations{Index: 39, Keys: fleettest.Keys(map[string]uint64{"x": 1})}}
	before := withIndexes(attackMember("work", "x", "s1", 1, "node-a", 9001, health.StatusPassing, 40), 40, 5, 5)
	after := withIndexes(attackMember("work", "x", "s1", 1, "node-a", 9001, health.StatusPassing, 40), 40, 5, 60)

	c := attackReplica(t, tasks, gens,
		health.Observation{NonPassing: &health.NonPassing{Index: 70}},
		health.Observation{Members: &health.TaskMembers{Task: "work", Index: 70, Members: []health.Member{after}}},
	)
	b, bObs := attack2Replica(t, tasks, gens,
		health.Observation{Members: &health.TaskMembers{Task: "work", Index: 40, Members: []health.Member{before}}},
		health.Observation{NonPassing: &health.NonPassing{Index: 45}},
	)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	rc, err := NewFencing(c, nowAt).CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1"})
	if err != nil || rc.State != leaseholdv1.SessionState_LAPSED {
		t.Fatalf("replica C: %v, %v; want LAPSED (serfHealth rewritten after the lease check was created)", rc, err)
	}

	// B's Refresh, as the Watcher does it: fresh non-passing checks (nothing
	// critical any more) and generation keys (unchanged), then the marker.
	var refreshes atomic.Int64
	fb := NewFencing(b, nowAt, FencingOptions{Refresh: func(context.Context, string, uint64) (uint64, error) {
		seq := uint64(refreshes.Add(1))
		go func() {
			// The fast path carries every node's serfHealth with its indexes.
			bObs <- health.Observation{NonPassing: &health.NonPassing{Index: 80, Checks: []health.CheckState{
				{Node: "node-a", CheckID: health.SerfHealthCheckID, Status: health.StatusPassing, CreateIndex: 5, ModifyIndex: 60},
			}}}
			bObs <- health.Observation{Generations: &health.Generations{Index: 39, Keys: fleettest.Keys(map[string]uint64{"x": 1})}}
			bObs <- health.Observation{Refreshed: &seq}
		}()
		return seq, nil
	}})
	rb, err := fb.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1", MinConsulIndex: rc.ConsulIndex})
	if err != nil {
		t.Fatal(err)
	}
	if rb.State == leaseholdv1.SessionState_CURRENT {
		t.Fatalf("replica C answered LAPSED at consul_index %d; replica B, asked with that min_consul_index, read Consul afresh (%d refreshes) and answered CURRENT at consul_index %d: "+
			"the failure is only in a membership read, which Refresh does not make", rc.ConsulIndex, refreshes.Load(), rb.ConsulIndex)
	}
}
