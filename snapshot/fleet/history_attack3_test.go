package fleet

import (
	"fmt"
	"testing"

	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// TestAttack3PresentLapsedSessionEvictedFromHistory: the history kept 8
// sessions per instance, dropping the one seen longest ago (a lapsed one
// last) — also a session whose registration was still present. Such a
// session's lapse then lived only in s.lapsed, which forgets it the moment
// its registrations go: once gone it was answered UNKNOWN instead of LAPSED,
// and when its registration came back (its failed node rejoins, its agent
// re-syncs the session with the lease passing) it was routed and answered
// CURRENT. The incremental syncer made it worse (it remembers only what a
// batch touched, so a present session dropped from the history stayed out
// of it, where the full syncer put it back at the next batch, and the two
// disagreed about later answers: TestAttack3IncrementalEqualsFullWide, seed
// 7); the full one lost it too here, rotating the 9 sessions through the 8
// places on every batch.
//
// X (generation 10) lapses on node-a; 8 older sessions of the same instance
// (generations 1..8, re-synced registrations of earlier processes) appear
// on node-b, all lapsed: X, seen first, was dropped from the history
// although it was still registered.
func TestAttack3PresentLapsedSessionEvictedFromHistory(t *testing.T) {
	groups := []health.Dispatcher{{}}
	clock := clockwork.NewFakeClock()
	inc, full := a3New(t, clock, false, groups), a3New(t, clock, true, groups)
	index := uint64(10)
	next := func() uint64 { index++; return index }
	both := func(obs ...health.Observation) {
		inc.batch(obs...)
		full.batch(obs...)
	}
	on := func(m health.Member, node string) health.Member {
		return attackOnNode(m, node, health.StatusPassing, 1)
	}
	y1 := on(fleettest.Member("a", "y", "y1", 1, 9101, "1.0.0", health.StatusPassing, 3), "node-y")
	xCreate := next()
	x := on(fleettest.Member("a", "x", "X", 10, 9001, "1.0.0", health.StatusPassing, xCreate), "node-a")
	both(health.Observation{Tasks: &health.TaskList{Index: next(), Tasks: []string{"a", "b"}}},
		health.Observation{Generations: &health.Generations{Index: next()}},
		health.Observation{NonPassing: &health.NonPassing{Index: next()}},
		health.Observation{Members: &health.TaskMembers{Task: "a", Index: next(), Members: []health.Member{y1, x}}},
		health.Observation{Members: &health.TaskMembers{Task: "b", Index: next(), Gone: true}})
	if st := inc.s.View().Sessions().Check("x", "X"); st.State != health.SessionCurrent {
		t.Fatalf("premise: X %s", st.State)
	}
	// X's lease lapses.
	lapse := x.Checks[1]
	lapse.Status, lapse.ModifyIndex = health.StatusCritical, next()
	both(health.Observation{NonPassing: &health.NonPassing{Index: index, Checks: []health.CheckState{lapse}}})
	if st := inc.s.View().Sessions().Check("x", "X"); st.State != health.SessionLapsed {
		t.Fatalf("premise: X %s, want LAPSED", st.State)
	}
	// 8 older sessions of x on node-b, lapsed.
	var olds []health.Member
	for g := uint64(1); g <= 8; g++ {
		olds = append(olds, on(fleettest.Member("b", "x", fmt.Sprint("o", g), g, 9001+int(g), "1.0.0", health.StatusCritical, next()), "node-b"))
	}
	both(health.Observation{Members: &health.TaskMembers{Task: "b", Index: next(), Members: olds}})
	// Anything else: a batch that does not concern x.
	both(health.Observation{NonPassing: &health.NonPassing{Index: next(), Checks: []health.CheckState{lapse}}})
	// node-a is reaped: X's registration is gone; so are the old ones.
	both(health.Observation{Members: &health.TaskMembers{Task: "a", Index: next(), Members: []health.Member{y1}}},
		health.Observation{Members: &health.TaskMembers{Task: "b", Index: next(), Gone: true}})
	gone := inc.s.View().Sessions().Check("x", "X")
	// node-a rejoins (a new serfHealth), its agent re-syncs X, lease passing.
	back := attackOnNode(fleettest.Member("a", "x", "X", 10, 9001, "1.0.0", health.StatusPassing, next()), "node-a", health.StatusPassing, next())
	back.Checks[0].CreateIndex = index
	both(health.Observation{NonPassing: &health.NonPassing{Index: next()}},
		health.Observation{Members: &health.TaskMembers{Task: "a", Index: next(), Members: []health.Member{y1, back}}})
	routed := func(a *a3Syncer) bool {
		v := a.s.View()
		for i, vd := range v.DecideAll(health.Dispatcher{}) {
			if e := v.Executors()[i]; e.InstanceID == "x" && e.SessionID == "X" && vd.Route != health.RouteNone {
				return true
			}
		}
		return false
	}
	si, sf := inc.s.View().Sessions().Check("x", "X"), full.s.View().Sessions().Check("x", "X")
	if gone.State != health.SessionLapsed || si.State != health.SessionLapsed || routed(inc) {
		t.Fatalf("X was seen LAPSED while registered; gone it is answered %s (%s), back %s, routed %v (the full syncer: %s, routed %v)",
			gone.State, gone.Detail, si.State, routed(inc), sf.State, routed(full))
	}
	if err := a3Compare(inc, full, groups); err != nil {
		t.Fatal(err)
	}
}
