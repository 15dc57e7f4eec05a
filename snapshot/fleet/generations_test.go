package fleet

import (
	"testing"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// keysAt sends a generation listing at index.
func (h *syncHarness) keysAt(index uint64, keys map[string]health.GenerationRecord) {
	h.index = max(h.index, index)
	h.obs <- health.Observation{Data: &health.Generations{Index: index, Keys: keys}}
}

// membersWithKeys sends a membership carrying the keys its watch read back.
func (h *syncHarness) membersWithKeys(task string, keys map[string]health.GenerationRecord,
	ms ...health.Member) {
	h.index++
	h.obs <- health.Observation{Data: &health.TaskMembers{Task: task, Index: h.index,
		Members: ms, Keys: keys}}
}

// sessionState is the settled view's answer for a session.
func (h *syncHarness) sessionState(inst, sess string) health.SessionStatus {
	h.t.Helper()
	return h.settle().Sessions().Check(inst, sess)
}

// TestKeyReadBackConfirmsANewSessionAtOnce: a new session's key comes with
// the membership that first shows it (read after it), before the generation
// listing has it: the session is confirmed, and its predecessor fenced, at
// once. A listing read before that key was written (a lower index) does not
// undo it; one at or after it takes over.
func TestKeyReadBackConfirmsANewSessionAtOnce(t *testing.T) {
	h := startSyncer(t)
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	h.nonPassing()
	k1 := health.GenerationRecord{Generation: 1, SessionID: "s1", ModifyIndex: 10}
	k2 := health.GenerationRecord{Generation: 2, SessionID: "s2", ModifyIndex: 20}
	h.keysAt(10, map[string]health.GenerationRecord{"a": k1})
	s1 := fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 11)
	h.members("work", s1)
	if st := h.sessionState("a", "s1"); st.State != health.SessionCurrent {
		t.Fatalf("a/s1 = %s (%s)", st.State, st.Detail)
	}

	s2 := fleettest.Member("work", "a", "s2", 2, 9002, "1.0.0", health.StatusPassing, 21)
	h.membersWithKeys("work", map[string]health.GenerationRecord{"a": k2}, s1, s2)
	expect := func(step string) {
		t.Helper()
		if st := h.sessionState("a", "s2"); st.State != health.SessionCurrent {
			t.Fatalf("%s: a/s2 = %s (%s), want CURRENT", step, st.State, st.Detail)
		}
		if st := h.sessionState("a", "s1"); st.State != health.SessionStale ||
			st.NewerSessionID != "s2" {
			t.Fatalf("%s: a/s1 = %s newer %s (%s), want STALE newer s2", step, st.State,
				st.NewerSessionID, st.Detail)
		}
		if !h.routesHealthy("a", "s2") || h.routesHealthy("a", "s1") {
			t.Fatalf("%s: s2 routed %v, s1 routed %v", step, h.routesHealthy("a", "s2"),
				h.routesHealthy("a", "s1"))
		}
	}
	expect("read back with the membership")
	// A listing read before s2 took the key.
	h.keysAt(15, map[string]health.GenerationRecord{"a": k1})
	expect("after a listing older than the read-back")
	h.keysAt(25, map[string]health.GenerationRecord{"a": k2})
	expect("after a listing holding the key")

	// Without a read-back (a registration the key does not name: forged),
	// the new registration is unconfirmed and changes nothing.
	s3 := fleettest.Member("work", "a", "s3", 3, 9003, "1.0.0", health.StatusPassing, 31)
	h.members("work", s1, s2, s3)
	if st := h.sessionState("a", "s3"); st.State != health.SessionUnknown {
		t.Fatalf("a/s3 = %s (%s), want UNKNOWN: no key names it", st.State, st.Detail)
	}
	expect("a forged registration above the key")
	if h.routesHealthy("a", "s3") {
		t.Fatal("a/s3 routed")
	}
	// The key deleted: no key, unprotected — the highest generation wins.
	h.keysAt(40, nil)
	if st := h.sessionState("a", "s3"); st.State != health.SessionCurrent {
		t.Fatalf("a/s3 after the key was deleted = %s (%s), want CURRENT (no key: ordered among "+
			"registrations)", st.State, st.Detail)
	}
}

// onNode is m registered on node (its checks too).
func onNode(m health.Member, node string) health.Member {
	m.Node = node
	m.Checks = append([]health.CheckState(nil), m.Checks...)
	for i := range m.Checks {
		m.Checks[i].Node = node
	}
	return m
}

// TestACopyOfASessionUnderALowerGenerationLapsesNothing: another instance's
// token registers, on its own node, a copy of the live session's id under a
// lower generation and lets its lease check go critical. The copy is not
// the session: the session stays CURRENT and routed, and is not lapsed
// (which would be final, and recorded for every replica).
func TestACopyOfASessionUnderALowerGenerationLapsesNothing(t *testing.T) {
	h := startSyncer(t)
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	h.nonPassing()
	h.keysAt(10,
		map[string]health.GenerationRecord{"a": {Generation: 5, SessionID: "s-real",
			ModifyIndex: 10}})
	real := fleettest.Member("work", "a", "s-real", 5, 9001, "1.0.0", health.StatusPassing, 11)
	h.members("work", real)
	if st := h.sessionState("a", "s-real"); st.State != health.SessionCurrent {
		t.Fatalf("a/s-real = %s (%s)", st.State, st.Detail)
	}
	copied := onNode(fleettest.Member("work", "a", "s-real", 3, 9002, "1.0.0",
		health.StatusCritical, 12), "evil")
	h.members("work", real, copied)
	h.nonPassing(health.CheckState{Node: "evil", CheckID: health.CheckID("a", "s-real", "work"),
		ServiceID: "work:a", Status: health.StatusCritical})
	if st := h.sessionState("a", "s-real"); st.State != health.SessionCurrent {
		t.Fatalf("a/s-real with a critical copy under generation 3 on another node = %s (%s), "+
			"want CURRENT", st.State, st.Detail)
	}
	if !h.routesHealthy("a", "s-real") {
		t.Fatal("a/s-real is not routed: a copy of its id on another node unrouted it")
	}
	// The copy gone, nothing of it stays.
	h.members("work", real)
	if st := h.sessionState("a", "s-real"); st.State != health.SessionCurrent ||
		!h.routesHealthy("a", "s-real") {
		t.Fatalf("a/s-real after the copy went = %s (%s), routed %v", st.State, st.Detail,
			h.routesHealthy("a", "s-real"))
	}
}

// TestAKeyReadBackBeforeConsulsIndexWentBackDoesNotOutliveIt: a key read
// back at index 1000 (a new session's, not yet in a listing) when Consul is
// restored from a snapshot (its index goes back): the restored KV and the
// sessions started since are at lower indexes than that read, which must
// not override them — the new session the restored listing names is
// confirmed, not held unconfirmed until Consul's index passes 1000 again.
func TestAKeyReadBackBeforeConsulsIndexWentBackDoesNotOutliveIt(t *testing.T) {
	h := startSyncer(t)
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	h.nonPassing()
	h.keysAt(900,
		map[string]health.GenerationRecord{"a": {Generation: 1, SessionID: "s1", ModifyIndex: 900}})
	s2 := fleettest.Member("work", "a", "s2", 2, 9002, "1.0.0", health.StatusPassing, 1001)
	h.membersWithKeys("work",
		map[string]health.GenerationRecord{"a": {Generation: 2, SessionID: "s2",
			ModifyIndex: 1000}}, s2)
	if st := h.sessionState("a", "s2"); st.State != health.SessionCurrent {
		t.Fatalf("a/s2 = %s (%s)", st.State, st.Detail)
	}
	// Consul restored: its index goes back; s2 found its key gone and s3
	// took generation 3 (at index 45).
	h.obs <- health.Observation{Data: &health.Contact{OK: true, IndexWentBack: true}}
	h.index = 0
	h.keysAt(50,
		map[string]health.GenerationRecord{"a": {Generation: 3, SessionID: "s3", ModifyIndex: 45}})
	h.index = max(h.index, 1001) // the view's index stays at its highest (settle waits for it)
	s3 := fleettest.Member("work", "a", "s3", 3, 9003, "1.0.0", health.StatusPassing, 46)
	h.members("work", s3)
	if st := h.sessionState("a", "s3"); st.State != health.SessionCurrent {
		t.Fatalf("a/s3 after Consul's index went back = %s (%s), want CURRENT: a read-back from "+
			"before the restore overrides the restored key", st.State, st.Detail)
	}
}
