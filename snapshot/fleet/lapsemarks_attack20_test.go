package fleet

import (
	"testing"
	"time"

	"github.com/leasehold/leasehold/health"
)

// TestAttack20RestartServesLapsedSessionBeforeMarksRead: a restarted
// leasehold (a fresh Syncer) whose datacenters hold a lapse mark for a1/s1
// (its check passing again, the drill's situation) must not route a1/s1.
//
// (fixed; failed before: SyncConfig.AwaitLapses, which serve sets.) It
// failed because allRead did not wait for the lapses watch's first answer
// (it checks tasks, members, non-passing and generations only), so the
// fleet is served — a1/s1 HEALTHY in the load assignment, its session
// CURRENT — until the marks arrive. With a token that cannot read
// leasehold/lapsed/ (the watch fails for ever), that window never closes.
func TestAttack20RestartServesLapsedSessionBeforeMarksRead(t *testing.T) {
	h := mdcStartTuned(t, func(c *SyncConfig) { c.AwaitLapses = true })
	d := mdcDispatcher(t, "")
	h.subscribe(d)
	h.readAll("dc1")
	h.readAll("dc2")
	// The marks (written before the restart) are in KV but not read yet.
	if got := h.load(d); got != "(none)" {
		h.clock.Advance(100 * time.Millisecond)
		h.settle()
		if st := h.session("a1", "s1"); st.State == health.SessionCurrent {
			t.Errorf("session a1/s1 answered CURRENT before the lapse marks were read (it lapsed before the restart)")
		}
		t.Fatalf("served %q before the lapse marks were read: a1/s1 (lapsed before the restart) may be routed", h.load(d))
	}
	marks := &health.LapseMarks{Index: h.next("dc1"), Marks: []health.LapseMark{{InstanceID: "a1", SessionID: "s1", Generation: 1}}}
	h.send("dc1", health.Observation{Lapses: marks})
	h.expectVerdict(d, "a1", "s1", health.RouteNone, health.ReasonLapsed)
}
