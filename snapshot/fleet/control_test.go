package fleet

import (
	"slices"
	"testing"
	"time"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// TestCordonLimitDoesNotCountALostDatacenter: the cordon safety limit (at
// most half of a task's live executors cordoned at once, by default) does not
// count the executors of a lost datacenter as live: they are routed nowhere.
// With dc2 lost, a cordon of every 1.x executor must leave one of dc1's two
// taking new work; counting "4 live" would let it take both (DRAINING), and
// the limit that exists to keep half of a task serving would keep none.
func TestCordonLimitDoesNotCountALostDatacenter(t *testing.T) {
	h := mdcStart(t)
	h.readAll("dc1")
	h.readAll("dc2")
	local := mdcDispatcher(t, "")
	h.subscribe(local)
	h.waitLoad(local, mdcBothFromDC1)
	h.tickUntil(mdcLost+2*mdcTick, []string{"dc1"}, nil)
	h.waitReach("dc2", health.Lost)
	h.waitLoad(local, mdcOnlyDC1)

	cordon := `{"id":"c1","version_constraint":">=1.0.0, <2.0.0","reason":"bad build",` +
		`"by":"ops","at":"2026-01-01T00:00:00Z"}`
	raw := map[string][]byte{"c1": []byte(cordon)}
	h.send("", health.Observation{Data: &health.CordonSet{Index: 1, Raw: raw}})
	routed := 0
	for _, x := range h.ofDC("dc1") {
		if h.verdict(local, x.inst, x.sess).Route == health.RouteHealthy {
			routed++
		}
	}
	if routed == 0 {
		t.Fatalf("the cordon took every executor that takes new work (served %q); the safety "+
			"limit counted dc2's lost executors as live", h.load(local))
	}
}

// TestCordonHeldForEveryConstraintSetInUse: the safety limit counts each
// connected dispatcher's constraint set. With a <2.0.0 dispatcher connected,
// a cordon of its only executor is held (it keeps being served, HEALTHY);
// when the set's last stream goes the cordon applies, and when a stream of
// the set connects again it is held again before that stream is served —
// the new group's first snapshot routes the executor. Counting per task
// type alone (4 live, 2 may go) cordoned it and left the dispatcher with no
// executor at all.
func TestCordonHeldForEveryConstraintSetInUse(t *testing.T) {
	h := startSyncer(t)
	old := dispatcher(t, "<2.0.0")
	h.s.Subscribe(old)
	h.tasks("work")
	h.nonPassing()
	h.members("work",
		fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 5),
		fleettest.Member("work", "b", "s1", 1, 9002, "2.0.0", health.StatusPassing, 6),
		fleettest.Member("work", "c", "s1", 1, 9003, "2.0.0", health.StatusPassing, 7),
		fleettest.Member("work", "d", "s1", 1, 9004, "2.0.0", health.StatusPassing, 8))
	if got := endpointsOf(t, h.publish().snap, "work"); len(got) != 1 || got[0] != "a:HEALTHY" {
		t.Fatalf("the <2.0.0 set before the cordon: %v", got)
	}
	status := func(what string, ok func(health.CordonStatus) bool) health.CordonStatus {
		t.Helper()
		deadline := time.After(5 * time.Second)
		for {
			v := h.s.View()
			if cs := v.Control.Cordons; len(cs) == 1 && ok(cs[0]) {
				return cs[0]
			}
			select {
			case <-v.Changed():
			case <-deadline:
				t.Fatalf("%s: cordons %+v", what, v.Control.Cordons)
			}
		}
	}
	cordon := `{"id":"c1","instance_id":"a","reason":"disk","by":"ops",` +
		`"at":"2026-01-01T00:00:00Z"}`
	h.obs <- health.Observation{Data: &health.CordonSet{Index: 1,
		Raw: map[string][]byte{"c1": []byte(cordon)}}}
	st := status("held while the <2.0.0 set is in use", func(st health.CordonStatus) bool {
		return st.Held == 1 || st.Applied == 1
	})
	want := []health.PoolLimit{{ConstraintSet: "v=<2.0.0", Task: "work", Live: 1}}
	if st.Applied != 0 || !slices.Equal(st.HeldBy, want) {
		t.Fatalf("the cordon left the <2.0.0 dispatcher no executor: %+v", st)
	}
	h.s.Unsubscribe(old)
	status("applied once the set is unused", func(st health.CordonStatus) bool {
		return st.Applied == 1 && st.Held == 0
	})
	for len(h.pubs) > 0 {
		<-h.pubs
	}
	h.s.Subscribe(old)
	p := h.publish()
	if got := endpointsOf(t, p.snap, "work"); p.group != old.Key() || len(got) != 1 ||
		got[0] != "a:HEALTHY" {
		t.Fatalf("the set's first snapshot when it connects again (%s): %v", p.group, got)
	}
	status("held again", func(st health.CordonStatus) bool { return st.Held == 1 })
}
