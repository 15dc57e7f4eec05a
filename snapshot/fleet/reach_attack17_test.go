package fleet

import (
	"testing"

	"github.com/leasehold/leasehold/health"
)

// Attack 17: datacenter reach (mdcHarness: dc1 leasehold's own, dc2; fake
// clock).

// TestAttack17CommonSilenceIsNoPartition (fixed; failed before, MEDIUM, wrong but
// safe): every datacenter is watched through leasehold's one local agent.
// When that agent is away for longer than a lease (restarted, upgraded, its
// host overloaded), no datacenter answers — fail static, as documented. When
// it is back, whichever datacenter's watches answer first (the local one:
// no WAN round trip; its back-offs ran out first) makes every other
// datacenter Lost at once, since their silence, which began with its own,
// already exceeds the lease — though nothing shows a partition. Every dc2
// executor leaves every assignment until dc2 answers again (for a failed
// watch: once every one of its per-task watches has answered, after its
// back-off), and dispatchers in dc2 are failed over to dc1 across the WAN
// meanwhile. A datacenter should be Lost only after being silent for the
// bound WHILE another answers.
func TestAttack17CommonSilenceIsNoPartition(t *testing.T) {
	h := mdcStart(t)
	h.readAll("dc1")
	h.readAll("dc2")
	local, inDC2 := mdcDispatcher(t, ""), mdcDispatcher(t, "dc2")
	h.subscribe(local, inDC2)
	h.tickUntil(2*mdcTick, []string{"dc1", "dc2"}, nil)
	h.waitLoad(local, mdcBothFromDC1)
	h.waitLoad(inDC2, mdcBothFromDC2)

	// The local agent is away: nobody answers for longer than a lease.
	h.clock.Advance(mdcLost + 2*mdcTick)
	h.nudge()
	h.waitReach("dc1", health.Unanswered)
	h.waitReach("dc2", health.Unanswered)
	h.expectLoad(local, mdcBothFromDC1) // fail static
	h.expectLoad(inDC2, mdcBothFromDC2)

	// The agent is back; dc1's watches answer first.
	h.send("dc1", h.heartbeat("dc1")...)
	h.waitReach("dc1", health.Reached)
	if r := h.reach("dc2"); r == health.Lost {
		t.Errorf("dc2 is %s the moment dc1 answered after a silence both shared (it was never silent while another answered)", r)
	}
	if got := h.load(inDC2); got != mdcBothFromDC2 {
		t.Errorf("the dispatcher in dc2 is served %q (its own datacenter's executors gone) after a common silence, want %q", got, mdcBothFromDC2)
	}
}

// A session registered in two datacenters (one executor process registered
// with two agents, or two task types through two agents) is answered from
// the worst of its registrations: dc2 unanswered → UNKNOWN; a lapse seen
// in dc2 → LAPSED, and its dc1 registration leaves the assignments too.
// (Holds.)
func TestAttack17SessionInTwoDatacenters(t *testing.T) {
	x1 := mdcExec{"dc1", "x", "s1", 1, "n1"}
	x2 := mdcExec{"dc2", "x", "s1", 1, "n1"}
	h := mdcStart(t, x1, x2)
	h.readAll("dc1")
	h.readAll("dc2")
	local := mdcDispatcher(t, "")
	h.subscribe(local)
	h.tickUntil(mdcTick, []string{"dc1", "dc2"}, nil)
	h.expectSession("x", "s1", health.SessionCurrent)

	// dc2 goes quiet: the session is not vouched for.
	h.tickUntil(mdcTick+mdcQuiet+mdcTick, []string{"dc1"}, nil)
	h.waitReach("dc2", health.Unanswered)
	h.expectSession("x", "s1", health.SessionUnknown)

	// dc2 answers with the lease critical: LAPSED, both registrations out.
	lease := health.CheckState{Node: "n1", CheckID: mdcLeaseOf(x2), ServiceID: health.ServiceID("x", mdcTask), Status: health.StatusCritical, CreateIndex: 1}
	h.send("dc2", h.nonPassing("dc2", lease), health.Observation{Progress: &health.Progress{Generations: h.next("dc2")}}, h.tasks("dc2"))
	h.waitReach("dc2", health.Reached)
	h.expectSession("x", "s1", health.SessionLapsed)
	h.expectVerdict(local, "x", "s1", health.RouteNone, health.ReasonLapsed)
	for _, e := range h.s.View().Executors() {
		if v := h.s.View().Decide(e, local); v.Route != health.RouteNone {
			t.Fatalf("%s/%s in %s routed (%s) after its session lapsed in dc2", e.InstanceID, e.SessionID, e.Datacenter, v.Route)
		}
	}
}

// An instance that moved from dc1 to dc2 (README: it keeps counting its
// generation): its old session in dc1 stays STALE and unrouted however dc2's
// reach goes — quiet, lost, back — as long as its new registration or its
// generation key in dc2 was read. (Holds.)
func TestAttack17MovedInstanceStaysFencedThroughReach(t *testing.T) {
	old := mdcExec{"dc1", "x", "s1", 3, "n1"}
	moved := mdcExec{"dc2", "x", "s2", 4, "n1"}
	h := mdcStart(t, old, moved)
	h.send("dc1", h.tasks("dc1"), h.nonPassing("dc1"), h.generations("dc1", map[string]uint64{"x": 3}), h.members("dc1"))
	h.send("dc2", h.tasks("dc2"), h.nonPassing("dc2"), h.generations("dc2", map[string]uint64{"x": 4}), h.members("dc2"))
	local := mdcDispatcher(t, "")
	h.subscribe(local)
	check := func(step string) {
		t.Helper()
		if st := h.session("x", "s1"); st.State != health.SessionStale {
			t.Fatalf("%s: x/s1 %s (%s), want STALE", step, st.State, st.Detail)
		}
		h.expectVerdict(local, "x", "s1", health.RouteNone, health.ReasonFenced)
	}
	check("read")
	h.tickUntil(mdcQuiet+mdcTick, []string{"dc1"}, func() { check("dc2 quiet") })
	h.waitReach("dc2", health.Unanswered)
	h.tickUntil(mdcLost+2*mdcTick, []string{"dc1"}, func() { check("dc2 going") })
	h.waitReach("dc2", health.Lost)
	check("dc2 lost")
	if st := h.session("x", "s2"); st.State == health.SessionCurrent {
		t.Fatalf("x/s2 in a lost datacenter answered CURRENT")
	}
	h.send("dc2", h.heartbeat("dc2")...)
	h.waitReach("dc2", health.Reached)
	check("dc2 back")
	h.expectSession("x", "s2", health.SessionCurrent)
}

// TestAttack17CordonLimitCountsALostDatacenter (fixed; failed before, MEDIUM, wrong but
// safe): the cordon safety limit (at most half of a task's live executors
// cordoned at once, by default) counts the executors of a lost datacenter as
// live (health.isLive ignores Reach), though they are routed nowhere. With
// dc2 lost, a cordon of every 1.x executor takes both of dc1's — the limit
// allows 2 of the "4 live" — and the task is left with no endpoint taking
// new work (both DRAINING): the limit that exists to keep half of a task
// serving keeps none.
func TestAttack17CordonLimitCountsALostDatacenter(t *testing.T) {
	h := mdcStart(t)
	h.readAll("dc1")
	h.readAll("dc2")
	local := mdcDispatcher(t, "")
	h.subscribe(local)
	h.waitLoad(local, mdcBothFromDC1)
	h.tickUntil(mdcLost+2*mdcTick, []string{"dc1"}, nil)
	h.waitReach("dc2", health.Lost)
	h.waitLoad(local, mdcOnlyDC1)

	raw := map[string][]byte{"c1": []byte(`{"id":"c1","version_constraint":">=1.0.0, <2.0.0","reason":"bad build","by":"ops","at":"2026-01-01T00:00:00Z"}`)}
	h.send("", health.Observation{Cordons: &health.CordonSet{Index: 1, Raw: raw}})
	routed := 0
	for _, x := range h.ofDC("dc1") {
		if h.verdict(local, x.inst, x.sess).Route == health.RouteHealthy {
			routed++
		}
	}
	if routed == 0 {
		t.Fatalf("the cordon took every executor that takes new work (served %q); the safety limit counted dc2's lost executors as live", h.load(local))
	}
}
