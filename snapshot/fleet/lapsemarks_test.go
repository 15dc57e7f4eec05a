package fleet

import (
	"testing"
	"time"

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
		// a2's earlier session, gone before this replica started.
		{InstanceID: "a2", SessionID: "s0", Generation: 1},
	}}
	h.send("dc1", health.Observation{Data: marks})
	h.expectSession("a1", "s1", health.SessionLapsed)
	h.expectVerdict(local, "a1", "s1", health.RouteNone, health.ReasonLapsed)
	h.expectSession("a2", "s0", health.SessionLapsed)
	h.expectSession("a2", "s1", health.SessionCurrent) // its live session is not touched
	h.expectVerdict(local, "a2", "s1", health.RouteHealthy, health.ReasonNone)
	h.expectSession("b1", "s1", health.SessionCurrent) // nor another datacenter's

	// The mark pruned: still lapsed (a lapse is final while the session is present).
	h.send("dc1", health.Observation{Data: &health.LapseMarks{Index: h.next("dc1")}})
	h.expectSession("a1", "s1", health.SessionLapsed)
	h.expectVerdict(local, "a1", "s1", health.RouteNone, health.ReasonLapsed)
}

// The lapse marks' listing is one of the answers that can make a session
// LAPSED: its index is in the view (LapsesIndex, and ConsulIndex: a LAPSED
// answer carries an index at or above its mark's) and in Progress, which
// counts it (ReadsLapses) when the syncer reads the marks (AwaitLapses).
func TestLapseMarksIndexIsInTheViewAndProgress(t *testing.T) {
	h := mdcStartTuned(t, func(c *SyncConfig) { c.AwaitLapses = true })
	h.readAll("dc1")
	h.readAll("dc2")
	if p := h.s.Progress("dc1"); !p.ReadsLapses || p.Lapses != 0 || p.Current() != 0 {
		t.Fatalf("before the marks were read: Progress %+v, want them counted and at 0", p)
	}
	at := h.next("dc1") + 50 // the marks' listing, above every other answer of dc1
	h.index["dc1"] = at
	h.send("dc1",
		health.Observation{Data: &health.LapseMarks{Index: at,
			Marks: []health.LapseMark{{InstanceID: "a2", SessionID: "s0", Generation: 1}}}})
	i, _ := h.s.View().Datacenter("dc1")
	if i.LapsesIndex != at || i.ConsulIndex != at {
		t.Fatalf("dc1's indexes %+v after the lapse marks' listing at %d: want it as LapsesIndex "+
			"and ConsulIndex", i, at)
	}
	p := h.s.Progress("dc1")
	if p.Lapses != at || p.Current() != min(p.NonPassing, p.Generations) {
		t.Fatalf("Progress %+v after the marks at %d", p, at)
	}
	h.send("dc1", health.Observation{Data: &health.Progress{Lapses: at + 7}})
	if p := h.s.Progress("dc1"); p.Lapses != at+7 {
		t.Fatalf("Progress %+v after the marks' progress to %d", p, at+7)
	}
	if p := h.s.Progress("dc2"); p.Lapses != 0 || p.Current() != 0 {
		t.Fatalf("dc2's Progress %+v: its marks were never read", p)
	}
	h2 := mdcStart(t)
	h2.readAll("dc1")
	if p := h2.s.Progress("dc1"); p.ReadsLapses || p.Current() == 0 {
		t.Fatalf("a syncer that does not read the marks: Progress %+v, want them not counted", p)
	}
}

// A lapse this replica saw is recorded (OnLapse) and, until its mark is read
// back, the view says so (LapseUnrecorded): the fencing API's LAPSED answer
// waits for it, so the answer's index is at or above the mark's.
func TestLapseSeenAwaitsItsMarkInTheView(t *testing.T) {
	var recorded []health.Executor
	h := mdcStartTuned(t, func(c *SyncConfig) {
		c.AwaitLapses = true
		c.OnLapse = func(e health.Executor) { recorded = append(recorded, e) }
	})
	h.readAll("dc1")
	h.readAll("dc2")
	h.send("dc1", health.Observation{Data: &health.LapseMarks{Index: h.next("dc1")}})
	h.send("dc2", health.Observation{Data: &health.LapseMarks{Index: h.next("dc2")}})
	a1 := h.execs[0]
	h.send("dc1",
		h.nonPassing("dc1",
			health.CheckState{Node: a1.node, CheckID: mdcLeaseOf(a1),
				ServiceID: health.ServiceID(a1.inst, mdcTask), Status: health.StatusCritical}))
	h.expectSession("a1", "s1", health.SessionLapsed)
	if len(recorded) != 1 || !h.s.View().LapseUnrecorded("a1", "s1") {
		t.Fatalf("a1/s1 lapsed: recorded %d, unrecorded in the view %v; want its mark awaited",
			len(recorded), h.s.View().LapseUnrecorded("a1", "s1"))
	}
	if h.s.View().LapseUnrecorded("a2", "s1") {
		t.Fatal("a2/s1 never lapsed")
	}
	h.send("dc1",
		health.Observation{Data: &health.LapseMarks{Index: h.next("dc1"),
			Marks: []health.LapseMark{{InstanceID: "a1", SessionID: "s1", Generation: 1}}}})
	if v := h.s.View(); v.LapseUnrecorded("a1", "s1") {
		t.Fatal("a1/s1's mark was read back; the view still awaits it")
	}
}

// TestNothingIsServedBeforeTheLapseMarksAreRead: a restarted leasehold (a
// fresh Syncer) whose datacenters hold a lapse mark for a1/s1 (its check
// passing again, the lapse drill's situation) must not route a1/s1. With
// SyncConfig.AwaitLapses (which serve sets) the first read waits for every
// datacenter's lapse marks too, so nothing is served meanwhile: otherwise
// a1/s1 would be HEALTHY in the load assignment and its session CURRENT until
// the marks arrive, and for ever with a token that cannot read
// leasehold/lapsed/.
func TestNothingIsServedBeforeTheLapseMarksAreRead(t *testing.T) {
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
			t.Errorf("session a1/s1 answered CURRENT before the lapse marks were read (it lapsed " +
				"before the restart)")
		}
		t.Fatalf("served %q before the lapse marks were read: a1/s1 (lapsed before the restart) "+
			"may be routed", h.load(d))
	}
	marks := &health.LapseMarks{Index: h.next("dc1"),
		Marks: []health.LapseMark{{InstanceID: "a1", SessionID: "s1", Generation: 1}}}
	h.send("dc1", health.Observation{Data: marks})
	h.expectVerdict(d, "a1", "s1", health.RouteNone, health.ReasonLapsed)
}
