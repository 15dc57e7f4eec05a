package fleet

import (
	"testing"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

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
	y1 := withLeaseCreated(fleettest.Member("work", "y", "y1", 1, 9101, "1.0.0", health.StatusPassing, 3), 3) // keeps the task type alive
	s1 := fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing, 4)
	z1 := fleettest.Member("work", "z", "z1", 1, 9201, "1.0.0", health.StatusPassing, 5)
	h.members("work", y1, withLeaseCreated(s1, 40), withLeaseCreated(z1, 41))
	if !h.attackRoutes("x", "s1") || !h.attackRoutes("z", "z1") {
		t.Fatal("s1 and z1 not routed at first")
	}
	h.members("work", y1, withLeaseCreated(z1, 41)) // x's agent left: s1's registration is gone
	h.attackSettle()
	h.members("work", y1, withLeaseCreated(s1, 90), withLeaseCreated(z1, 41)) // re-synced: s1's check created anew
	if st := h.attackSettle().Sessions().Check("x", "s1"); st.State != health.SessionLapsed || h.attackRoutes("x", "s1") {
		t.Fatalf("s1 back with its lease check re-created: %s (routed %v), want LAPSED, not routed", st.State, h.attackRoutes("x", "s1"))
	}
	if st := h.attackSettle().Sessions().Check("z", "z1"); st.State != health.SessionCurrent || !h.attackRoutes("z", "z1") {
		t.Fatalf("z1, its lease check the one first seen: %s (routed %v), want CURRENT and routed", st.State, h.attackRoutes("z", "z1"))
	}
	h.members("work", y1, withLeaseCreated(s1, 90), withLeaseCreated(z1, 77)) // z1's check re-created between two reads
	if st := h.attackSettle().Sessions().Check("z", "z1"); st.State != health.SessionLapsed || h.attackRoutes("z", "z1") {
		t.Fatalf("z1 with its lease check re-created: %s (routed %v), want LAPSED, not routed", st.State, h.attackRoutes("z", "z1"))
	}
	h.members("work", y1, withLeaseCreated(s1, 40)) // even the first check again: a lapse is final
	if st := h.attackSettle().Sessions().Check("x", "s1"); st.State != health.SessionLapsed || h.attackRoutes("x", "s1") {
		t.Fatalf("s1 later: %s (routed %v), want LAPSED, not routed", st.State, h.attackRoutes("x", "s1"))
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
	s1 := withLeaseCreated(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing, 4), 40)
	h.members("work", s1)
	noLease := s1
	noLease.Checks = s1.Checks[:1]
	h.members("work", noLease)
	h.attackSettle()
	warm := s1
	warm.Checks = append([]health.CheckState(nil), s1.Checks...)
	warm.Checks[1].ModifyIndex = 60 // heartbeats change the check, not its CreateIndex
	h.members("work", warm)
	if st := h.attackSettle().Sessions().Check("x", "s1"); st.State != health.SessionCurrent || !h.attackRoutes("x", "s1") {
		t.Fatalf("s1 with its first lease check: %s (routed %v), want CURRENT and routed", st.State, h.attackRoutes("x", "s1"))
	}
}
