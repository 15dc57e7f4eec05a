package fleet

import (
	"strconv"
	"testing"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// TestAttack2LapseOfALowGenerationSessionIsNeverRemembered: the history
// keeps 8 sessions per instance, the 8 highest generations (remember sorts
// by generation and truncates). 6ffb2c5 keeps the history when Consul's
// index goes back (a lapse must stay final whatever Consul forgot) — but
// after Consul lost its state the generations start again low: the KV key
// is gone and, once the instance's old registrations are gone too, the next
// session takes generation 1 (README: "Deleting the keys fences nothing for
// ever" — the same without any index going back when an operator deletes
// the key while the instance is down). The history of the instance still
// holds 8 older sessions with higher generations, so the new session is cut
// off the history on every recompute: its lapse lives only in s.lapsed,
// which forgets it the moment its registration is gone. Then it is answered
// UNKNOWN ("never seen") instead of LAPSED, and when its registration comes
// back (its failed node was force-left and rejoins, its agent re-syncs the
// same session with the lease passing) it is routed and answered CURRENT.
func TestAttack2LapseOfALowGenerationSessionIsNeverRemembered(t *testing.T) {
	h := startSyncer(t)
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	h.nonPassing()
	y1 := attackOnNode(fleettest.Member("work", "y", "y1", 1, 9101, "1.0.0", health.StatusPassing, 3), "node-y", health.StatusPassing, 1)
	// Before: instance x restarted 8 times (generations 10..17), each
	// session replaced by the next.
	for g := uint64(10); g <= 17; g++ {
		h.generations(map[string]uint64{"x": g, "y": 1})
		s := attackOnNode(fleettest.Member("work", "x", "old"+strconv.FormatUint(g, 10), g, 9001, "1.0.0", health.StatusPassing, h.index+1), "node-x", health.StatusPassing, 1)
		h.members("work", y1, s)
		h.attackSettle()
	}
	h.members("work", y1) // x stopped
	h.attackSettle()

	// Consul loses its state (or the key is deleted): x starts again at generation 1.
	h.obs <- health.Observation{Contact: &health.Contact{OK: true, IndexWentBack: true}}
	h.generations(map[string]uint64{"x": 1, "y": 1})
	s1 := attackOnNode(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing, h.index+1), "node-x", health.StatusPassing, 1)
	h.members("work", y1, s1)
	if !h.attackRoutes("x", "s1") {
		t.Fatal("premise: s1 is routed")
	}
	// node-x fails: s1 is LAPSED, for ever.
	h.nonPassing(health.CheckState{Node: "node-x", CheckID: health.SerfHealthCheckID, Status: health.StatusCritical, Output: "Agent not live or unreachable"})
	if st := h.attackSettle().Sessions().Check("x", "s1"); st.State != health.SessionLapsed {
		t.Fatalf("premise: s1 %s, want LAPSED", st.State)
	}
	// node-x is force-left: its registrations are gone.
	h.members("work", y1)
	h.nonPassing()
	gone := h.attackSettle().Sessions().Check("x", "s1")
	// node-x rejoins, its agent re-syncs s1 (lease passing, serfHealth passing).
	back := attackOnNode(fleettest.Member("work", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing, h.index+2), "node-x", health.StatusPassing, h.index+1)
	h.members("work", y1, back)
	st := h.attackSettle().Sessions().Check("x", "s1")
	routed := h.attackRoutes("x", "s1")
	if gone.State != health.SessionLapsed || st.State == health.SessionCurrent || routed {
		t.Fatalf("s1 (generation 1) was seen LAPSED; with its registration gone it is answered %s (%s); back again it is %s and routed %v — "+
			"the history held 8 sessions with higher generations from before, so s1 was never in it", gone.State, gone.Detail, st.State, routed)
	}
}
