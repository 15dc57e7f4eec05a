package fleet

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"reflect"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"
	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// leaseCheckOf is m's lease check (its service's check).
func leaseCheckOf(m health.Member) health.CheckState {
	for _, c := range m.Checks {
		if c.ServiceID != "" {
			return c
		}
	}
	return health.CheckState{}
}

// withLeaseCreated is m with its lease check created at index created.
func withLeaseCreated(m health.Member, created uint64) health.Member {
	checks := append([]health.CheckState(nil), m.Checks...)
	for i := range checks {
		if checks[i].ServiceID != "" {
			checks[i].CreateIndex = created
		}
	}
	m.Checks = checks
	return m
}

// TestRecreatedLeaseCheckIsAFinalLapse: s1's agent leaves (restarted with
// leave_on_terminate): its registration is gone, then re-synced with its lease
// check created anew, passing. The Registrar ends such a session
// (health.LeaseCheckRecreated); leasehold answers it LAPSED for ever and never
// routes it again — also when the check is re-created while the registration
// never left a read, and whatever the check says afterwards.
func TestRecreatedLeaseCheckIsAFinalLapse(t *testing.T) {
	h := startSyncer(t)
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	h.nonPassing()
	// Keeps the task type alive.
	y1 := withLeaseCreated(fleettest.Member("work", "y", "y1", 1, 9101, "1.0.0",
		health.StatusPassing, 3), 3)
	s1 := fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing, 4)
	z1 := fleettest.Member("work", "z", "z1", 1, 9201, "1.0.0", health.StatusPassing, 5)
	h.members("work", y1, withLeaseCreated(s1, 40), withLeaseCreated(z1, 41))
	if !h.routesHealthy("x", "s1") || !h.routesHealthy("z", "z1") {
		t.Fatal("s1 and z1 not routed at first")
	}
	h.members("work", y1, withLeaseCreated(z1, 41)) // x's agent left: s1's registration is gone
	h.settle()
	// Re-synced: s1's check created anew.
	h.members("work", y1, withLeaseCreated(s1, 90), withLeaseCreated(z1, 41))
	if st := h.settle().Sessions().Check("x", "s1"); st.State != health.SessionLapsed ||
		h.routesHealthy("x", "s1") {
		t.Fatalf("s1 back with its lease check re-created: %s (routed %v), want LAPSED, not routed",
			st.State, h.routesHealthy("x", "s1"))
	}
	if st := h.settle().Sessions().Check("z", "z1"); st.State != health.SessionCurrent ||
		!h.routesHealthy("z", "z1") {
		t.Fatalf("z1, its lease check the one first seen: %s (routed %v), want CURRENT and routed",
			st.State, h.routesHealthy("z", "z1"))
	}
	// z1's check re-created between two reads.
	h.members("work", y1, withLeaseCreated(s1, 90), withLeaseCreated(z1, 77))
	if st := h.settle().Sessions().Check("z", "z1"); st.State != health.SessionLapsed ||
		h.routesHealthy("z", "z1") {
		t.Fatalf("z1 with its lease check re-created: %s (routed %v), want LAPSED, not routed",
			st.State, h.routesHealthy("z", "z1"))
	}
	h.members("work", y1, withLeaseCreated(s1, 40)) // even the first check again: a lapse is final
	if st := h.settle().Sessions().Check("x", "s1"); st.State != health.SessionLapsed ||
		h.routesHealthy("x", "s1") {
		t.Fatalf("s1 later: %s (routed %v), want LAPSED, not routed", st.State,
			h.routesHealthy("x", "s1"))
	}
}

// TestLeaseCheckSeenAgainIsNoLapse: the same lease check (same CreateIndex)
// in every read, also after a read that lacked it (a missing check is no
// proof: TestMissingLeaseIsNotAFinalLapse), keeps the session CURRENT.
func TestLeaseCheckSeenAgainIsNoLapse(t *testing.T) {
	h := startSyncer(t)
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	h.nonPassing()
	s1 := withLeaseCreated(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0",
		health.StatusPassing, 4), 40)
	h.members("work", s1)
	noLease := s1
	noLease.Checks = s1.Checks[:1]
	h.members("work", noLease)
	h.settle()
	warm := s1
	warm.Checks = append([]health.CheckState(nil), s1.Checks...)
	warm.Checks[1].ModifyIndex = 60 // heartbeats change the check, not its CreateIndex
	h.members("work", warm)
	if st := h.settle().Sessions().Check("x", "s1"); st.State != health.SessionCurrent ||
		!h.routesHealthy("x", "s1") {
		t.Fatalf("s1 with its first lease check: %s (routed %v), want CURRENT and routed", st.State,
			h.routesHealthy("x", "s1"))
	}
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
	y1 := onNodeWithSerf(fleettest.Member("work", "y", "y1", 1, 9101, "1.0.0", health.StatusPassing,
		3), "node-y", health.StatusPassing, 1)
	s1 := onNodeWithSerf(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing,
		4), "node-x", health.StatusPassing, 1)
	h.members("work", y1, s1)
	if !h.routesHealthy("x", "s1") {
		t.Fatal("s1 not routed at first")
	}
	h.nonPassing(health.CheckState{Node: "node-x", CheckID: health.SerfHealthCheckID,
		Status: health.StatusCritical, Output: "Agent not live or unreachable"})
	if st := h.settle().Sessions().Check("x", "s1"); st.State != health.SessionLapsed ||
		h.routesHealthy("x", "s1") {
		t.Fatalf("node failed: s1 %s (routed %v), want LAPSED and not routed", st.State,
			h.routesHealthy("x", "s1"))
	}
	h.members("work", y1) // node-x force-left / reaped: its registrations are gone
	h.nonPassing()        // and so is its serfHealth check
	if st := h.settle().Sessions().Check("x", "s1"); st.State != health.SessionLapsed {
		t.Fatalf("gone: s1 %s, want LAPSED (remembered)", st.State)
	}
	return h, y1
}

// TestLapseOfANodeBackAfterHoursIsFinal: docs/failure-semantics.md promises a session seen
// lapsed or on a failed node "is never routed again, even if its check turns
// passing or its node comes back, also when its registration disappears and
// is re-synced". The memory of that lapse lives in the history once the
// registration is gone, and the history keeps an absent instance for
// HistoryRetention (DefaultHistoryRetention outlasts Consul's default
// reconnect_timeout of 72 h). A node that comes back hours after it was reaped
// (a suspended VM, a long partition) has its agent re-sync the same session
// with its lease check passing (the agent's TTL timer and the executor's
// monotonic clock did not run while suspended), serfHealth passing again and
// the generation key still holding the session's generation: s1 stays LAPSED
// and unrouted, as its tasks were re-dispatched when it lapsed.
func TestLapseOfANodeBackAfterHoursIsFinal(t *testing.T) {
	h, y1 := lapseByNodeFailureThenVanish(t)
	h.clock.Advance(2 * time.Hour) // hours away, within HistoryRetention
	h.nonPassing()                 // any change: the history is pruned
	h.settle()                     // (not coalesced with the re-sync below)
	// node-x is back, its agent re-syncs s1 (lease passing, serfHealth passing).
	s1 := onNodeWithSerf(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing,
		h.index+2), "node-x", health.StatusPassing, h.index+1)
	h.members("work", y1, s1)
	st := h.settle().Sessions().Check("x", "s1")
	if routed := h.routesHealthy("x", "s1"); routed || st.State == health.SessionCurrent {
		t.Fatalf("a session seen on a failed node came back after %v: state %s, routed %v — a "+
			"lapse must be final", 2*time.Hour, st.State, routed)
	}
}

// TestLapseSurvivesConsulsIndexGoingBack: a watch whose index goes backwards
// does not clear the session history. For the generation keys' watch (a KV
// prefix listing) that is ordinary Consul behaviour, not a state loss: a
// deleted key leaves a tombstone whose index the listing reports, and once
// Consul reaps the tombstone (15 min later by default) the listing's index
// falls back to the highest remaining key's. Any holder of an executor token
// (write on leasehold/generation/) can create and delete a key to cause it;
// the lapse of a session whose registration is momentarily gone stays final.
func TestLapseSurvivesConsulsIndexGoingBack(t *testing.T) {
	h, y1 := lapseByNodeFailureThenVanish(t)
	h.obs <- health.Observation{Data: &health.Contact{OK: true, IndexWentBack: true}}
	s1 := onNodeWithSerf(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing,
		h.index+2), "node-x", health.StatusPassing, h.index+1)
	h.members("work", y1, s1)
	st := h.settle().Sessions().Check("x", "s1")
	if routed := h.routesHealthy("x", "s1"); routed || st.State == health.SessionCurrent {
		t.Fatalf("after an index reset, a session seen on a failed node came back: state %s, "+
			"routed %v — a lapse must be final", st.State, routed)
	}
}

// TestLapseRememberedWithinTheRetention: back within the retention, the
// session stays LAPSED and unrouted.
func TestLapseRememberedWithinTheRetention(t *testing.T) {
	h, y1 := lapseByNodeFailureThenVanish(t)
	h.clock.Advance(30 * time.Minute)
	h.nonPassing()
	h.settle()
	s1 := onNodeWithSerf(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing,
		h.index+2), "node-x", health.StatusPassing, h.index+1)
	h.members("work", y1, s1)
	st := h.settle().Sessions().Check("x", "s1")
	if routed := h.routesHealthy("x", "s1"); routed || st.State != health.SessionLapsed {
		t.Fatalf("back within the retention: state %s, routed %v", st.State, routed)
	}
}

// TestLapseSurvivesChurnOfOtherInstances: the history keeps at most 10,000
// absent instances, whatever the retention, and drops those holding a lapsed
// session last. Any holder of a token that may register the task's service
// (every executor) can register and deregister 10,001 throw-away instance
// ids: the lapse of a session whose registration is momentarily gone (its
// node was force-left) stays, and when the node comes back the session is
// neither routed nor answered CURRENT.
func TestLapseSurvivesChurnOfOtherInstances(t *testing.T) {
	h, y1 := lapseByNodeFailureThenVanish(t)
	h.clock.Advance(time.Second)
	churn := []health.Member{y1}
	for i := range historyInstances + 1 {
		churn = append(churn,
			fleettest.Member("work", "junk-"+strconv.Itoa(i), "j", 1, 20000+i%40000, "1.0.0",
				health.StatusPassing, h.index+1))
	}
	h.members("work", churn...)
	h.settle()
	h.clock.Advance(time.Second)
	h.members("work", y1)
	h.settle()
	s1 := onNodeWithSerf(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing,
		h.index+2), "node-x", health.StatusPassing, h.index+1)
	h.members("work", y1, s1)
	st := h.settle().Sessions().Check("x", "s1")
	if routed := h.routesHealthy("x", "s1"); routed || st.State == health.SessionCurrent {
		t.Fatalf("after %d other instances came and went, a session seen on a failed node came "+
			"back: state %s, routed %v", historyInstances+1, st.State, routed)
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
	if st := h.settle().Sessions().Check("x", "s1"); st.State != health.SessionUnknown ||
		h.routesHealthy("x", "s1") {
		t.Fatalf("without its lease check s1 is %s, routed %v: want UNKNOWN, not routed", st.State,
			h.routesHealthy("x", "s1"))
	}
	h.members("work", s1) // the same session's check is back, passing
	if st := h.settle().Sessions().Check("x", "s1"); st.State != health.SessionCurrent ||
		!h.routesHealthy("x", "s1") {
		t.Fatalf("with its check back s1 is %s, routed %v", st.State, h.routesHealthy("x", "s1"))
	}
}

// TestLapseOfALowGenerationSessionIsRemembered: the history keeps 8 sessions
// per instance, the newest seen first whatever their generation, and it is
// kept when Consul's index goes back (a lapse must stay final whatever Consul
// forgot). After Consul lost its state the generations start again low: the
// KV key is gone and, once the instance's old registrations are gone too, the
// next session takes generation 1 (docs/contract.md: "Deleting the keys fences nothing
// for ever"; the same without any index going back when an operator deletes
// the key while the instance is down). The instance's history still holds 8
// older sessions with higher generations; the new session must not be cut
// off it, or its lapse would be forgotten the moment its registration goes:
// answered UNKNOWN ("never seen") instead of LAPSED, and routed and answered
// CURRENT when its registration comes back (its failed node was force-left
// and rejoins, its agent re-syncs the same session with the lease passing).
func TestLapseOfALowGenerationSessionIsRemembered(t *testing.T) {
	h := startSyncer(t)
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	h.nonPassing()
	y1 := onNodeWithSerf(fleettest.Member("work", "y", "y1", 1, 9101, "1.0.0", health.StatusPassing,
		3), "node-y", health.StatusPassing, 1)
	// Instance x restarted 8 times (generations 10..17), each
	// session replaced by the next.
	for g := uint64(10); g <= 17; g++ {
		h.generations(map[string]uint64{"x": g, "y": 1})
		s := onNodeWithSerf(fleettest.Member("work", "x", "old"+strconv.FormatUint(g, 10), g, 9001,
			"1.0.0", health.StatusPassing, h.index+1), "node-x", health.StatusPassing, 1)
		h.members("work", y1, s)
		h.settle()
	}
	h.members("work", y1) // x stopped
	h.settle()

	// Consul loses its state (or the key is deleted): x starts again at generation 1.
	h.obs <- health.Observation{Data: &health.Contact{OK: true, IndexWentBack: true}}
	h.generations(map[string]uint64{"x": 1, "y": 1})
	s1 := onNodeWithSerf(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing,
		h.index+1), "node-x", health.StatusPassing, 1)
	h.members("work", y1, s1)
	if !h.routesHealthy("x", "s1") {
		t.Fatal("premise: s1 is routed")
	}
	// node-x fails: s1 is LAPSED, for ever.
	h.nonPassing(health.CheckState{Node: "node-x", CheckID: health.SerfHealthCheckID,
		Status: health.StatusCritical, Output: "Agent not live or unreachable"})
	if st := h.settle().Sessions().Check("x", "s1"); st.State != health.SessionLapsed {
		t.Fatalf("premise: s1 %s, want LAPSED", st.State)
	}
	// node-x is force-left: its registrations are gone.
	h.members("work", y1)
	h.nonPassing()
	gone := h.settle().Sessions().Check("x", "s1")
	// node-x rejoins, its agent re-syncs s1 (lease passing, serfHealth passing).
	back := onNodeWithSerf(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0",
		health.StatusPassing, h.index+2), "node-x", health.StatusPassing, h.index+1)
	h.members("work", y1, back)
	st := h.settle().Sessions().Check("x", "s1")
	routed := h.routesHealthy("x", "s1")
	if gone.State != health.SessionLapsed || st.State == health.SessionCurrent || routed {
		t.Fatalf("s1 (generation 1) was seen LAPSED; with its registration gone it is answered "+
			"%s (%s); back again it is %s and routed %v: the history held 8 sessions with "+
			"higher generations from before, so s1 was never in it",
			gone.State, gone.Detail, st.State, routed)
	}
}

// TestPresentLapsedSessionStaysInTheHistory: the history keeps 8 sessions per
// instance, dropping the one seen longest ago (a lapsed one last), but never a
// session whose registration is still present. Its lapse would otherwise live
// only in the syncer's lapsed set, which forgets it the moment its
// registrations go: once gone it would be answered UNKNOWN instead of LAPSED,
// and when its registration came back (its failed node rejoins, its agent
// re-syncs the session with the lease passing) routed and answered CURRENT.
// The incremental syncer remembers only what a batch touched, so a present
// session dropped from the history would also stay out of it where the full
// syncer put it back at the next batch, and the two would disagree.
//
// X (generation 10) lapses on node-a; 8 older sessions of the same instance
// (generations 1..8, re-synced registrations of earlier processes) appear on
// node-b, all lapsed: X, seen first, stays in the history while registered.
func TestPresentLapsedSessionStaysInTheHistory(t *testing.T) {
	groups := []health.Dispatcher{{}}
	clock := clockwork.NewFakeClock()
	inc, full := newDirectSyncer(t, clock, false, groups), newDirectSyncer(t, clock, true, groups)
	index := uint64(10)
	next := func() uint64 { index++; return index }
	both := func(obs ...health.Observation) {
		inc.batch(obs...)
		full.batch(obs...)
	}
	on := func(m health.Member, node string) health.Member {
		return onNodeWithSerf(m, node, health.StatusPassing, 1)
	}
	y1 := on(fleettest.Member("a", "y", "y1", 1, 9101, "1.0.0", health.StatusPassing, 3), "node-y")
	xCreate := next()
	x := on(fleettest.Member("a", "x", "X", 10, 9001, "1.0.0", health.StatusPassing, xCreate),
		"node-a")
	both(health.Observation{Data: &health.TaskList{Index: next(), Tasks: []string{"a", "b"}}},
		health.Observation{Data: &health.Generations{Index: next()}},
		health.Observation{Data: &health.NonPassing{Index: next()}},
		health.Observation{Data: &health.TaskMembers{Task: "a", Index: next(),
			Members: []health.Member{y1, x}}},
		health.Observation{Data: &health.TaskMembers{Task: "b", Index: next(), Gone: true}})
	if st := inc.s.View().Sessions().Check("x", "X"); st.State != health.SessionCurrent {
		t.Fatalf("premise: X %s", st.State)
	}
	// X's lease lapses.
	lapse := x.Checks[1]
	lapse.Status, lapse.ModifyIndex = health.StatusCritical, next()
	both(health.Observation{Data: &health.NonPassing{Index: index,
		Checks: []health.CheckState{lapse}}})
	if st := inc.s.View().Sessions().Check("x", "X"); st.State != health.SessionLapsed {
		t.Fatalf("premise: X %s, want LAPSED", st.State)
	}
	// 8 older sessions of x on node-b, lapsed.
	var olds []health.Member
	for g := uint64(1); g <= 8; g++ {
		olds = append(olds,
			on(fleettest.Member("b", "x", fmt.Sprint("o", g), g, 9001+int(g), "1.0.0",
				health.StatusCritical, next()), "node-b"))
	}
	both(health.Observation{Data: &health.TaskMembers{Task: "b", Index: next(), Members: olds}})
	// Anything else: a batch that does not concern x.
	both(health.Observation{Data: &health.NonPassing{Index: next(),
		Checks: []health.CheckState{lapse}}})
	// node-a is reaped: X's registration is gone; so are the old ones.
	both(health.Observation{Data: &health.TaskMembers{Task: "a", Index: next(),
		Members: []health.Member{y1}}},
		health.Observation{Data: &health.TaskMembers{Task: "b", Index: next(), Gone: true}})
	gone := inc.s.View().Sessions().Check("x", "X")
	// node-a rejoins (a new serfHealth), its agent re-syncs X, lease passing.
	back := onNodeWithSerf(fleettest.Member("a", "x", "X", 10, 9001, "1.0.0", health.StatusPassing,
		next()), "node-a", health.StatusPassing, next())
	back.Checks[0].CreateIndex = index
	both(health.Observation{Data: &health.NonPassing{Index: next()}},
		health.Observation{Data: &health.TaskMembers{Task: "a", Index: next(),
			Members: []health.Member{y1, back}}})
	routed := func(a *directSyncer) bool {
		v := a.s.View()
		for i, vd := range v.DecideAll(health.Dispatcher{}) {
			if e := v.Executors()[i]; e.InstanceID == "x" && e.SessionID == "X" &&
				vd.Route != health.RouteNone {
				return true
			}
		}
		return false
	}
	si, sf := inc.s.View().Sessions().Check("x", "X"), full.s.View().Sessions().Check("x", "X")
	if gone.State != health.SessionLapsed || si.State != health.SessionLapsed || routed(inc) {
		t.Fatalf("X was seen LAPSED while registered; gone it is answered %s (%s), back %s, "+
			"routed %v (the full syncer: %s, routed %v)",
			gone.State, gone.Detail, si.State, routed(inc), sf.State, routed(full))
	}
	if err := sameState(inc, full, groups); err != nil {
		t.Fatal(err)
	}
}

// TestChurnDoesNotGrowMemory: 20,000 sessions come and go (some lapse, some
// carry bad metadata); once they are gone for longer than the history
// retention, every per-session and per-registration map is back to the size
// of the fleet that is left, and so is the heap.
func TestChurnDoesNotGrowMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("churns 20,000 sessions")
	}
	// 20,000 sessions' logs would dwarf the test.
	h := startSyncer(t, slog.New(slog.NewTextHandler(io.Discard, nil)))
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	h.nonPassing()
	steady := fleettest.Member("work", "steady", "s0", 1, 9000, "1.0.0", health.StatusPassing, 1)
	h.members("work", steady)
	h.publish()
	settle := func() { // until Run has applied the last observation (none coalesced away)
		t.Helper()
		deadline := time.After(10 * time.Second)
		for v := h.s.View(); v.ConsulIndex < h.index; v = h.s.View() {
			select {
			case <-v.Changed():
			case <-h.pubs: // OnPublish must never block Run
			case <-deadline:
				t.Fatalf("the view never reached index %d", h.index)
			}
		}
	}
	sizes := func() (history, lastSeen, lapsed, bad, prints int) {
		t.Helper()
		settle()
		h.s.Subscribe(dispatcher(t, ">=9.9.9")) // a round trip through Run: its writes are visible
		h.s.Unsubscribe(dispatcher(t, ">=9.9.9"))
		bad, prints = 0, 0
		for _, ts := range h.s.fleet {
			bad += len(ts.bad)
			prints += len(ts.prints)
		}
		return h.s.history.len(), len(h.s.lastSeen), len(h.s.lapsed), bad, prints
	}
	heap := func() uint64 {
		var m runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	sizes()
	before := heap()

	const batches, perBatch = 200, 100
	for b := range batches {
		ms := []health.Member{steady}
		for i := range perBatch {
			n := b*perBatch + i
			lease := health.StatusPassing
			if n%10 == 0 {
				lease = health.StatusCritical
			}
			m := fleettest.Member("work", fmt.Sprintf("inst-%d", n), fmt.Sprintf("s-%d", n), 1,
				10000+i, "1.0.0", lease, h.index+1)
			if n%7 == 0 {
				m.Err = errors.New("capacity: not an integer")
			}
			ms = append(ms, m)
		}
		h.members("work", ms...)
		settle()
		h.clock.Advance(time.Second)
	}
	h.members("work", steady) // every churned session is gone
	history, _, _, _, _ := sizes()
	// 17,142 instances went, the 10,000 gone last are kept.
	if want := 1 + historyInstances; history != want {
		t.Fatalf("history holds %d instances right after the churn, want %d: gone sessions must "+
			"still be answered for a while", history, want)
	}
	if st := h.s.View().Sessions().Check("inst-19990",
		"s-19990"); st.State != health.SessionLapsed {
		t.Fatalf("a lapsed session gone a moment ago answers %s, want LAPSED", st.State)
	}
	if history <= 1 {
		t.Fatalf("history holds %d instances right after the churn: gone sessions must still be "+
			"answered for a while", history)
	}
	h.clock.Advance(h.s.cfg.HistoryRetention + time.Minute)
	h.members("work", steady)
	history, lastSeen, lapsed, bad, prints := sizes()
	if history > 1 || lastSeen > 1 || lapsed > 0 || bad > 0 || prints > 1 {
		t.Fatalf("after the retention: history %d, lastSeen %d, lapsed %d, bad %d, registrations "+
			"%d; want the one steady executor at most", history, lastSeen, lapsed, bad, prints)
	}
	if after := heap(); after > before+4<<20 {
		t.Fatalf("heap %d KiB after the churn, %d KiB before", after>>10, before>>10)
	}
	if st := h.s.View().Sessions().Check("inst-5", "s-5"); st.State != health.SessionUnknown {
		t.Fatalf("a session gone past the retention answers %s", st.State)
	}
}

// TestAViewsAnswersDoNotChangeWithTheHistory: the session indexes share the
// history's lists (a list is never written once set), so a view taken while
// a session was answered from the history alone still answers as it did
// when it was taken after that session comes back and lapses, while the
// next view answers LAPSED.
func TestAViewsAnswersDoNotChangeWithTheHistory(t *testing.T) {
	h := startSyncer(t)
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	h.nonPassing()
	s1 := fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing, 4)
	y1 := fleettest.Member("work", "y", "y1", 1, 9101, "1.0.0", health.StatusPassing, 5)
	h.members("work", s1, y1)
	h.settle()
	h.members("work", y1) // s1's registration gone: answered from the history
	gone := h.settle()
	was := gone.Sessions().Check("x", "s1")
	if was.State == health.SessionLapsed || was.State == health.SessionCurrent {
		t.Fatalf("s1 gone without a lapse: %s", was.State)
	}
	lease := leaseCheckOf(s1)
	lease.Status = health.StatusCritical
	h.nonPassing(lease)
	h.members("work", s1, y1) // back, its lease critical
	if st := h.settle().Sessions().Check("x", "s1"); st.State != health.SessionLapsed {
		t.Fatalf("s1 back with its lease critical: %s, want LAPSED", st.State)
	}
	if st := gone.Sessions().Check("x", "s1"); !reflect.DeepEqual(st, was) {
		t.Fatalf("the view taken while s1 was gone answered %s (%s), now %s (%s)", was.State,
			was.Detail, st.State, st.Detail)
	}
}
