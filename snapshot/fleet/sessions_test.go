package fleet

import (
	"testing"

	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// TestSessionNamedAsReplacedStaysStaleWhenItsNamerGoes: a leasehold started
// after x was replaced answers x STALE because y's registration names it.
// When y then drains and deregisters, x stays STALE: the history remembers
// what y named along with y, so an answer this leasehold gave (STALE: discard
// the results) is not taken back, and a dispatcher holding x's results that
// asks again is not told "never seen".
func TestSessionNamedAsReplacedStaysStaleWhenItsNamerGoes(t *testing.T) {
	a := newDirectSyncer(t, clockwork.NewFakeClock(), false, []health.Dispatcher{{}})
	y := fleettest.Member("a", "i", "y", 3, 9001, "1.0.0", health.StatusPassing, 20)
	y.Replaces = []string{"x"}
	a.batch(health.Observation{Data: &health.TaskList{Index: 10, Tasks: []string{"a"}}},
		health.Observation{Data: &health.Generations{Index: 11}},
		health.Observation{Data: &health.NonPassing{Index: 12}},
		health.Observation{Data: &health.TaskMembers{Task: "a", Index: 20,
			Members: []health.Member{y}}})
	if st := a.s.View().Sessions().Check("i", "x"); st.State != health.SessionStale {
		t.Fatalf("premise: i/x %s (%s), want STALE", st.State, st.Detail)
	}
	// y drains: its registration goes, nothing replaces it.
	a.batch(health.Observation{Data: &health.TaskMembers{Task: "a", Index: 30,
		Members: []health.Member{}}})
	if st := a.s.View().Sessions().Check("i", "y"); st.State != health.SessionUnknown {
		t.Fatalf("premise: i/y %s, want UNKNOWN (deregistered)", st.State)
	}
	st := a.s.View().Sessions().Check("i", "x")
	if st.State != health.SessionStale {
		t.Fatalf("i/x answered STALE while y named it, %s (%s) once y deregistered: what a "+
			"remembered session named is forgotten", st.State, st.Detail)
	}
}

// TestReplacesOnlyChangeIsIndexedAgain: a registration whose replaces meta
// alone changes (same session, re-registered) is indexed again, in the
// incremental syncer as in the full one.
func TestReplacesOnlyChangeIsIndexedAgain(t *testing.T) {
	for _, full := range []bool{false, true} {
		a := newDirectSyncer(t, clockwork.NewFakeClock(), full, []health.Dispatcher{{}})
		y := fleettest.Member("a", "i", "y", 3, 9001, "1.0.0", health.StatusPassing, 20)
		a.batch(health.Observation{Data: &health.TaskList{Index: 10, Tasks: []string{"a"}}},
			health.Observation{Data: &health.Generations{Index: 11}},
			health.Observation{Data: &health.NonPassing{Index: 12}},
			health.Observation{Data: &health.TaskMembers{Task: "a", Index: 20,
				Members: []health.Member{y}}})
		if st := a.s.View().Sessions().Check("i", "x"); st.State != health.SessionUnknown {
			t.Fatalf("premise: i/x %s", st.State)
		}
		y2 := y
		y2.Replaces = []string{"x"}
		a.batch(health.Observation{Data: &health.TaskMembers{Task: "a", Index: 21,
			Members: []health.Member{y2}}})
		if st := a.s.View().Sessions().Check("i", "x"); st.State != health.SessionStale ||
			st.NewerSessionID != "y" {
			t.Fatalf("full=%v: i/x %s newer %q after y named it", full, st.State, st.NewerSessionID)
		}
		y3 := y
		y3.Replaces = []string{"w"}
		a.batch(health.Observation{Data: &health.TaskMembers{Task: "a", Index: 22,
			Members: []health.Member{y3}}})
		if st := a.s.View().Sessions().Check("i", "w"); st.State != health.SessionStale {
			t.Fatalf("full=%v: i/w %s after y named it", full, st.State)
		}
	}
}
