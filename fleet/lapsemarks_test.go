package fleet

import (
	"testing"

	"github.com/leasehold/leasehold/health"
)

// A lapse mark (another replica's, or this one's before a restart) makes a
// session lapsed although its check passes: not routed, answered LAPSED,
// and lapsed for good (a later read without the mark does not bring it
// back); a mark for a session this replica never saw answers LAPSED too, in
// the datacenter it was read from only for the registrations it names.
func TestLapseMarksAreFinal(t *testing.T) {
	h := mdcStart(t)
	h.readAll("dc1")
	h.readAll("dc2")
	local := mdcDispatcher(t, "")
	h.subscribe(local)
	h.expectSession("a1", "s1", health.SessionCurrent)

	marks := &health.LapseMarks{Index: h.next("dc1"), Marks: []health.LapseMark{
		{InstanceID: "a1", SessionID: "s1", Generation: 1},
		{InstanceID: "a2", SessionID: "s0", Generation: 1}, // a2's earlier session, gone before this replica started
	}}
	h.send("dc1", health.Observation{Lapses: marks})
	h.expectSession("a1", "s1", health.SessionLapsed)
	h.expectVerdict(local, "a1", "s1", health.RouteNone, health.ReasonLapsed)
	h.expectSession("a2", "s0", health.SessionLapsed)
	h.expectSession("a2", "s1", health.SessionCurrent) // its live session is not touched
	h.expectVerdict(local, "a2", "s1", health.RouteHealthy, health.ReasonNone)
	h.expectSession("b1", "s1", health.SessionCurrent) // nor another datacenter's

	// The mark pruned: still lapsed (a lapse is final while the session is present).
	h.send("dc1", health.Observation{Lapses: &health.LapseMarks{Index: h.next("dc1")}})
	h.expectSession("a1", "s1", health.SessionLapsed)
	h.expectVerdict(local, "a1", "s1", health.RouteNone, health.ReasonLapsed)
}
