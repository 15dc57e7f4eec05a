package fleet

import (
	"strconv"
	"testing"
	"time"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// onNode is fleettest.Member on another node, its serfHealth check with the given
// status and ModifyIndex.
func attackOnNode(m health.Member, node string, serf health.CheckStatus, serfIdx uint64) health.Member {
	m.Node = node
	checks := make([]health.CheckState, len(m.Checks))
	copy(checks, m.Checks)
	for i := range checks {
		checks[i].Node = node
		if checks[i].CheckID == health.SerfHealthCheckID {
			checks[i].Status, checks[i].ModifyIndex = serf, serfIdx
		}
	}
	m.Checks = checks
	return m
}

// attackSettle waits until Run has applied every observation sent so far.
func (h *syncHarness) attackSettle() *View {
	h.t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		v := h.s.View()
		if v.ConsulIndex >= h.index {
			return v
		}
		select {
		case <-v.Changed():
		case <-h.pubs:
		case <-deadline:
			h.t.Fatalf("the view never reached index %d", h.index)
		}
	}
}

func (h *syncHarness) attackRoutes(inst, sess string) bool {
	h.t.Helper()
	v := h.attackSettle()
	d := dispatcher(h.t, "")
	for i, vd := range v.DecideAll(d) {
		if e := v.Executors()[i]; e.InstanceID == inst && e.SessionID == sess && vd.Route == health.RouteHealthy {
			return true
		}
	}
	return false
}

// lapseByNodeFailureThenVanish: x/s1 runs on node-x, y/y1 on node-y keeps the
// task type alive. node-x fails (serfHealth critical): s1 is LAPSED. Then
// node-x leaves the catalog (an operator's force-leave, or Consul reaping a
// node failed for longer than reconnect_timeout): s1's registration is gone.
func lapseByNodeFailureThenVanish(t *testing.T) (*syncHarness, health.Member) {
	h := startSyncer(t)
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	h.nonPassing()
	y1 := attackOnNode(fleettest.Member("work", "y", "y1", 1, 9101, "1.0.0", health.StatusPassing, 3), "node-y", health.StatusPassing, 1)
	s1 := attackOnNode(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing, 4), "node-x", health.StatusPassing, 1)
	h.members("work", y1, s1)
	if !h.attackRoutes("x", "s1") {
		t.Fatal("s1 not routed at first")
	}
	h.nonPassing(health.CheckState{Node: "node-x", CheckID: health.SerfHealthCheckID, Status: health.StatusCritical, Output: "Agent not live or unreachable"})
	if st := h.attackSettle().Sessions().Check("x", "s1"); st.State != health.SessionLapsed || h.attackRoutes("x", "s1") {
		t.Fatalf("node failed: s1 %s (routed %v), want LAPSED and not routed", st.State, h.attackRoutes("x", "s1"))
	}
	h.members("work", y1) // node-x force-left / reaped: its registrations are gone
	h.nonPassing()        // and so is its serfHealth check
	if st := h.attackSettle().Sessions().Check("x", "s1"); st.State != health.SessionLapsed {
		t.Fatalf("gone: s1 %s, want LAPSED (remembered)", st.State)
	}
	return h, y1
}

// TestAttackLapseForgottenAfterHistoryRetention: README promises a session
// seen lapsed or on a failed node "is never routed again, even if its check
// turns passing or its node comes back, also when its registration
// disappears and is re-synced". The memory of that lapse lives only in the
// history, which forgets instances absent for HistoryRetention (1 h). A node
// that failed is reaped by Consul only after reconnect_timeout (72 h by
// default, 8 h at least), so a node that comes back after being reaped (a
// suspended VM, a long partition) always finds its lapse forgotten: its
// agent re-syncs the same session with its lease check passing (the agent's
// TTL timer and the executor's monotonic clock did not run while suspended),
// serfHealth is passing again, the generation key still holds the session's
// generation — and s1 is routed and answered CURRENT, although its tasks were
// re-dispatched when it lapsed.
func TestAttackLapseForgottenAfterHistoryRetention(t *testing.T) {
	h, y1 := lapseByNodeFailureThenVanish(t)
	h.clock.Advance(2 * time.Hour) // gone longer than HistoryRetention
	h.nonPassing()                 // any change: the history is pruned
	h.attackSettle()               // (not coalesced with the re-sync below)
	// node-x is back, its agent re-syncs s1 (lease passing, serfHealth passing).
	s1 := attackOnNode(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing, h.index+2), "node-x", health.StatusPassing, h.index+1)
	h.members("work", y1, s1)
	st := h.attackSettle().Sessions().Check("x", "s1")
	if routed := h.attackRoutes("x", "s1"); routed || st.State == health.SessionCurrent {
		t.Fatalf("a session seen on a failed node came back after %v: state %s, routed %v — a lapse must be final", 2*time.Hour, st.State, routed)
	}
}

// TestAttackLapseForgottenAfterIndexWentBack: any watch whose index goes
// backwards makes the Syncer clear the whole session history at once. For
// the generation keys' watch (a KV prefix listing) that is ordinary Consul
// behaviour, not a state loss: a deleted key leaves a tombstone whose index
// the listing reports, and once Consul reaps the tombstone (15 min later by
// default) the listing's index falls back to the highest remaining key's.
// Any holder of an executor token (write on leasehold/generation/) can
// create and delete a key to trigger it. Every lapse of a session whose
// registration is momentarily gone is then forgotten.
func TestAttackLapseForgottenAfterIndexWentBack(t *testing.T) {
	h, y1 := lapseByNodeFailureThenVanish(t)
	h.obs <- health.Observation{Contact: &health.Contact{OK: true, IndexWentBack: true}}
	s1 := attackOnNode(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing, h.index+2), "node-x", health.StatusPassing, h.index+1)
	h.members("work", y1, s1)
	st := h.attackSettle().Sessions().Check("x", "s1")
	if routed := h.attackRoutes("x", "s1"); routed || st.State == health.SessionCurrent {
		t.Fatalf("after an index reset, a session seen on a failed node came back: state %s, routed %v — a lapse must be final", st.State, routed)
	}
}

// TestAttackLapseRememberedWithinRetention is the regression guard for the
// case that holds: back within the retention, the session stays LAPSED and
// unrouted.
func TestAttackLapseRememberedWithinRetention(t *testing.T) {
	h, y1 := lapseByNodeFailureThenVanish(t)
	h.clock.Advance(30 * time.Minute)
	h.nonPassing()
	h.attackSettle()
	s1 := attackOnNode(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing, h.index+2), "node-x", health.StatusPassing, h.index+1)
	h.members("work", y1, s1)
	st := h.attackSettle().Sessions().Check("x", "s1")
	if routed := h.attackRoutes("x", "s1"); routed || st.State != health.SessionLapsed {
		t.Fatalf("back within the retention: state %s, routed %v", st.State, routed)
	}
}

// TestAttackLapseFlushedByChurn: the history keeps at most 10,000 absent
// instances, dropping those gone longest first, whatever the retention. Any
// holder of a token that may register the task's service (every executor)
// registers and deregisters 10,001 throw-away instance ids: the lapse of a
// session whose registration is momentarily gone (its node was force-left)
// is forgotten at once, and when the node comes back the session is routed
// and answered CURRENT.
func TestAttackLapseFlushedByChurn(t *testing.T) {
	h, y1 := lapseByNodeFailureThenVanish(t)
	h.clock.Advance(time.Second)
	churn := []health.Member{y1}
	for i := range historyInstances + 1 {
		churn = append(churn, fleettest.Member("work", "junk-"+strconv.Itoa(i), "j", 1, 20000+i%40000, "1.0.0", health.StatusPassing, h.index+1))
	}
	h.members("work", churn...)
	h.attackSettle()
	h.clock.Advance(time.Second)
	h.members("work", y1)
	h.attackSettle()
	s1 := attackOnNode(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing, h.index+2), "node-x", health.StatusPassing, h.index+1)
	h.members("work", y1, s1)
	st := h.attackSettle().Sessions().Check("x", "s1")
	if routed := h.attackRoutes("x", "s1"); routed || st.State == health.SessionCurrent {
		t.Fatalf("after %d other instances came and went, a session seen on a failed node came back: state %s, routed %v", historyInstances+1, st.State, routed)
	}
}

// TestMissingLeaseIsNotAFinalLapse: a registration whose lease check is
// missing is not routed and not vouched for, but answered UNKNOWN, not
// LAPSED: LAPSED is final, and a missing check is no proof that the lease
// ended (the same session's check may appear again).
func TestMissingLeaseIsNotAFinalLapse(t *testing.T) {
	h := startSyncer(t)
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	h.nonPassing()
	s1 := fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing, 3)
	noLease := s1
	noLease.Checks = s1.Checks[:1] // serfHealth only: the lease check was deregistered
	h.members("work", noLease)
	if st := h.attackSettle().Sessions().Check("x", "s1"); st.State != health.SessionUnknown || h.attackRoutes("x", "s1") {
		t.Fatalf("without its lease check s1 is %s, routed %v: want UNKNOWN, not routed", st.State, h.attackRoutes("x", "s1"))
	}
	h.members("work", s1) // the same session's check is back, passing
	if st := h.attackSettle().Sessions().Check("x", "s1"); st.State != health.SessionCurrent || !h.attackRoutes("x", "s1") {
		t.Fatalf("with its check back s1 is %s, routed %v", st.State, h.attackRoutes("x", "s1"))
	}
}
