package consul

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

func serfCheck(node, status string, create, modify uint64) *api.HealthCheck {
	return &api.HealthCheck{
		Node:        node,
		CheckID:     health.SerfHealthCheckID,
		Status:      status,
		CreateIndex: create,
		ModifyIndex: modify,
	}
}

func serfIn(o health.Observation, node string) (health.CheckState, bool) {
	for _, c := range o.NonPassing().Checks {
		if c.Node == node && c.CheckID == health.SerfHealthCheckID {
			return c, true
		}
	}
	return health.CheckState{}, false
}

// TestFastPathCombinesSerfAndReadsANodeBack: the set carries every node's
// serfHealth from the paced listing; the non-passing entries win when newer;
// a serfHealth leaving the non-passing set (the node is back) is read by node
// at once, so the set never shows the node's pre-failure indexes.
func TestFastPathCombinesSerfAndReadsANodeBack(t *testing.T) {
	h := startWatcher(t, WatchConfig{MinInterval: time.Millisecond, SlowInterval: time.Hour})
	// the serf listing is read (a refresh makes the serf watch read it now,
	// whatever its first answer was): nothing is sent before the critical
	// checks are read too
	h.cat.push(
		"serf",
		scripted{
			index: 10,
			checks: api.HealthChecks{
				serfCheck("n1", "passing", 3, 3),
				serfCheck("n2", "passing", 4, 4),
			},
		},
	)
	if _, err := h.w.Refresh(context.Background(), everything); err != nil {
		t.Fatal(err)
	}
	select {
	case o := <-h.out:
		if o.NonPassing() != nil {
			t.Fatalf("a set was sent before the critical checks were read: %+v", o.NonPassing())
		}
	case <-time.After(50 * time.Millisecond): // absence check only
	}
	// n2 fails (the answer to the refresh's fresh read of the critical checks)
	h.cat.push(
		"nonpassing",
		scripted{index: 12, checks: api.HealthChecks{serfCheck("n2", "critical", 4, 12)}},
	)
	var o health.Observation
	for o = h.observe(); o.NonPassing() == nil || len(o.NonPassing().Checks) < 2; o = h.observe() {
	}
	if c, ok := serfIn(o, "n1"); !ok || c.Status != "passing" {
		t.Fatalf("n1's serfHealth missing: %+v", o.NonPassing().Checks)
	}
	if c, ok := serfIn(o, "n2"); !ok || c.Status != "critical" || c.ModifyIndex != 12 {
		t.Fatalf("n2's serfHealth %+v, want critical at 12 (newer than the listing)", c)
	}
	// n2 comes back at 15: read by node before the set is sent
	h.cat.push("nodeserf/n2", scripted{checks: api.HealthChecks{serfCheck("n2", "passing", 4, 15)}})
	h.cat.push("nonpassing", scripted{index: 15})
	// The watches pause between queries on the fake clock, each at its own
	// moment: advance until the node is read.
	for deadline := time.After(5 * time.Second); ; {
		h.clock.Advance(time.Millisecond)
		select {
		case c := <-h.cat.calls:
			if c.method != "nodeserf" {
				continue
			}
			if c.task != "n2" {
				t.Fatalf("read node %q, want n2", c.task)
			}
		case <-time.After(10 * time.Millisecond): // then advance again
			continue
		case <-deadline:
			t.Fatal("the node back was never read")
		}
		break
	}
	for o = h.observe(); o.NonPassing() == nil; o = h.observe() {
	}
	if c, ok := serfIn(o, "n2"); !ok || c.Status != "passing" || c.ModifyIndex != 15 {
		t.Fatalf("n2 back: serfHealth %+v, want passing at 15 (not the listing's 4)", c)
	}
	// n1's serfHealth is known from the listing (at 10, or later if the
	// listing answered again since): the set vouches for no index past it,
	// nor past the non-passing read's 15.
	if o.NonPassing().Index < 10 || o.NonPassing().Index > 15 {
		t.Fatalf(
			"set index %d, want the listing's (10 or later), at most the non-passing read's 15",
			o.NonPassing().Index,
		)
	}
}

// TestFastPathVouchesForSerfHealthOnlyUpToItsListing: n1 fails and comes
// back (101, 102) between two answers of the critical checks, so neither
// sees it, while the paced serf listing (made at 100) waits; then another
// executor's lease lapses (103). The lapse goes out at once, but neither the
// set nor any progress may vouch for an index past the listing's unless the
// set shows that n1 failed: fencing would answer session s1 (lease check
// created at 40, on n1) CURRENT at min_consul_index 102, where Join, given
// n1's serfHealth as Consul holds it, says its node failed since.
func TestFastPathVouchesForSerfHealthOnlyUpToItsListing(t *testing.T) {
	serf := &api.HealthCheck{
		Node:        "n1",
		CheckID:     health.SerfHealthCheckID,
		Status:      "passing",
		CreateIndex: 5,
		ModifyIndex: 5,
	}
	world := newWorld(99, serf)
	world.set(leaseCheck("passing")) // 100
	_, out := runWorld(
		t,
		world,
		WatchConfig{MinInterval: time.Millisecond, SlowInterval: time.Hour},
	)
	last := nextObs(t, out, "a set with n1's serfHealth", func(o health.Observation) bool {
		if o.NonPassing() == nil {
			return false
		}
		_, ok := checkIn(o.NonPassing(), "n1", health.SerfHealthCheckID)
		return ok
	}).NonPassing()
	failed, back := *serf, *serf
	failed.Status = "critical"
	world.set(&failed, &back) // 101 critical, 102 passing again: no critical read sees it
	lapse := &api.HealthCheck{
		Node:      "n2",
		CheckID:   health.CheckID("b", "s1", "work"),
		ServiceID: health.ServiceID("b", "work"),
		Status:    "critical",
	}
	world.set(lapse) // 103
	vouched := last.Index
	for deadline := time.After(5 * time.Second); ; {
		var o health.Observation
		select {
		case o = <-out:
		case <-deadline:
			t.Fatal("the lapse at 103 never went out")
		}
		if o.Progress() != nil {
			vouched = max(vouched, o.Progress().NonPassing)
		}
		if o.NonPassing() == nil {
			continue
		}
		last, vouched = o.NonPassing(), max(vouched, o.NonPassing().Index)
		if _, ok := checkIn(last, "n2", lapse.CheckID); ok {
			break
		}
	}
	if e := health.Join(memberA(), health.NewNonPassingSet(*last)); vouched >= 101 &&
		!e.NodeFailed {
		c, _ := checkIn(last, "n1", health.SerfHealthCheckID)
		t.Fatalf(
			"the fast path vouched for index %d with n1's serfHealth %+v from the listing at "+
				"100: n1 failed at 101, yet session s1 is answered CURRENT there",
			vouched,
			c,
		)
	}
	if last.Index > 100 {
		t.Fatalf("the lapse went out at index %d, past the serf listing's 100", last.Index)
	}
}

// TestFastPathSetWaitingForTheChannelHoldsNoLock: a set decided while nobody
// reads the observation channel waits for the channel without holding the
// fast path's lock, the fencing API's calls into the Watcher (Refresh,
// FreshAsOf) return all the same, and once the channel is read the set goes
// out before the refresh's marker.
func TestFastPathSetWaitingForTheChannelHoldsNoLock(t *testing.T) {
	serf := &api.HealthCheck{
		Node:        "n1",
		CheckID:     health.SerfHealthCheckID,
		Status:      "passing",
		CreateIndex: 5,
		ModifyIndex: 5,
	}
	world := newWorld(99, serf)
	world.set(leaseCheck("passing"))     // 100
	out := make(chan health.Observation) // read by nobody until the set was decided
	w := newWatcher(
		world,
		WatchConfig{MinInterval: time.Millisecond, SlowInterval: time.Hour, Out: out},
	)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()

	f := &w.fast
	for deadline := time.Now().Add(5 * time.Second); ; {
		if f.mu.TryLock() {
			decided := f.sent
			f.mu.Unlock()
			if decided {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal(
				"the fast path's lock stayed held while its first set waited for the observation " +
					"channel",
			)
		}
		time.Sleep(time.Millisecond) // polling a lock: nothing signals that it is free
	}

	type refreshed struct {
		seq uint64
		err error
	}
	called := make(chan refreshed, 1)
	go func() {
		seq, err := w.Refresh(ctx, everything)
		w.FreshAsOf()
		called <- refreshed{seq, err}
	}()
	var r refreshed
	select {
	case r = <-called:
		if r.err != nil {
			t.Fatal(r.err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Refresh did not return while nobody read the observation channel")
	}

	sawSet := false
	for deadline := time.After(5 * time.Second); ; {
		select {
		case o := <-out:
			sawSet = sawSet || o.NonPassing() != nil
			if o.Refreshed() != nil && o.Refreshed().Seq >= r.seq {
				if !sawSet {
					t.Fatal("the refresh's marker went out before the set decided before it")
				}
				return
			}
		case <-deadline:
			t.Fatal("no Refreshed marker once the channel was read")
		}
	}
}

// TestStaleCriticalAnswerNeverUndoesALapse: the critical watch's blocking
// answer is read at index 61 (another executor's lease lapses) and arrives
// late; meanwhile the full executor a (lease in state warning) hangs and its
// lease goes critical at 62. The warning watch sees a leave the warning state,
// reads the critical checks afresh and publishes a's lapse at 62. The late
// critical answer (61, without a) must not replace that fresher read: no set
// after the lapse goes back in index or has a in neither state (Join would
// read a's lease as passing, and a Syncer taking both sets in one batch would
// route a).
func TestStaleCriticalAnswerNeverUndoesALapse(t *testing.T) {
	other := &api.HealthCheck{
		Node:        "n2",
		CheckID:     health.CheckID("b", "s1", "work"),
		ServiceID:   health.ServiceID("b", "work"),
		ServiceTags: []string{"leasehold"},
		Status:      "passing",
	}
	world := newWorld(
		59,
		&api.HealthCheck{
			Node:        "n1",
			CheckID:     health.SerfHealthCheckID,
			Status:      "passing",
			CreateIndex: 5,
			ModifyIndex: 5,
		},
		&api.HealthCheck{
			Node:        "n2",
			CheckID:     health.SerfHealthCheckID,
			Status:      "passing",
			CreateIndex: 6,
			ModifyIndex: 6,
		},
		other,
	)
	world.set(leaseCheck("warning")) // index 60
	_, out := runWorld(t, world, WatchConfig{MinInterval: time.Millisecond})
	nextObs(t, out, "first set with a warning", func(o health.Observation) bool {
		if o.NonPassing() == nil {
			return false
		}
		c, ok := checkIn(o.NonPassing(), "n1", health.CheckID("a", "s1", "work"))
		return ok && c.Status == health.StatusWarning
	})

	held, release := world.holdNextCritical()
	lapsedB := *other
	lapsedB.Status = "critical"
	world.set(&lapsedB) // 61: the critical watch reads {b} at 61 and is held
	select {
	case <-held:
	case <-time.After(5 * time.Second):
		t.Fatal("the critical watch never answered at 61")
	}
	world.set(leaseCheck("critical")) // 62: a lapses
	lapse := nextObs(t, out, "a's lapse at 62", func(o health.Observation) bool {
		if o.NonPassing() == nil {
			return false
		}
		c, ok := checkIn(o.NonPassing(), "n1", health.CheckID("a", "s1", "work"))
		return ok && c.Status == health.StatusCritical
	})
	t.Logf("lapse published at index %d", lapse.NonPassing().Index)
	close(release)

	for quiet := time.After(300 * time.Millisecond); ; {
		select {
		case o := <-out:
			if o.NonPassing() == nil {
				continue
			}
			np := o.NonPassing()
			e := health.Join(memberA(), health.NewNonPassingSet(*np))
			if np.Index < lapse.NonPassing().Index || e.LeaseStatus != health.StatusCritical {
				t.Fatalf(
					"after the lapse went out at index %d, a set at index %d says a's lease is "+
						"%q (checks %+v): a stale critical answer replaced a fresher read",
					lapse.NonPassing().Index,
					np.Index,
					e.LeaseStatus,
					np.Checks,
				)
			}
		case <-quiet:
			return
		}
	}
}

// TestRefreshNeverVouchesForAStaleSerfHealth: node n1 fails and comes back
// (serfHealth critical at 101, passing at 102) between two reads of the
// critical checks (a back-off after an error, a slow re-read under the fast
// path's lock, two changes coalesced into one wake-up), so neither fast watch
// sees serfHealth in its state, and the serf listing is paced at 1 s. A
// Refresh at min_consul_index 102 must not vouch for a set that still carries
// n1's serfHealth from before the failure (modified at 5): once the view is
// vouched current at 102, Join sees that n1 failed after session s1's lease
// check was created (40), and fencing does not answer CURRENT for it.
func TestRefreshNeverVouchesForAStaleSerfHealth(t *testing.T) {
	serf := &api.HealthCheck{
		Node:        "n1",
		CheckID:     health.SerfHealthCheckID,
		Status:      "passing",
		CreateIndex: 5,
		ModifyIndex: 5,
	}
	world := newWorld(99, serf)
	world.set(leaseCheck("passing")) // 100
	// Default SlowInterval: 1 s.
	w, out := runWorld(t, world, WatchConfig{MinInterval: time.Millisecond})
	first := nextObs(t, out, "a set with n1's serfHealth", func(o health.Observation) bool {
		if o.NonPassing() == nil {
			return false
		}
		_, ok := checkIn(o.NonPassing(), "n1", health.SerfHealthCheckID)
		return ok
	})
	start := time.Now()
	failed, back := *serf, *serf
	failed.Status = "critical"
	world.set(&failed, &back) // 101 critical, 102 passing again

	last := first.NonPassing()
	var progress uint64
	seq, err := w.Refresh(context.Background(), 102)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.After(5 * time.Second); ; {
		var o health.Observation
		select {
		case o = <-out:
		case <-deadline:
			t.Fatal("no Refreshed marker")
		}
		switch {
		case o.NonPassing() != nil:
			last = o.NonPassing()
			progress = max(progress, o.NonPassing().Index)
		case o.Progress() != nil:
			progress = max(progress, o.Progress().NonPassing)
		case o.Refreshed() != nil && o.Refreshed().Seq >= seq:
			progress = max(progress, o.Refreshed().AtLeast)
		}
		if o.Refreshed() != nil && o.Refreshed().Seq >= seq {
			break
		}
	}
	if progress < 102 {
		t.Fatalf("progress %d after the refresh, want ≥ 102", progress)
	}
	e := health.Join(memberA(), health.NewNonPassingSet(*last))
	c, _ := checkIn(last, "n1", health.SerfHealthCheckID)
	if !e.NodeFailed {
		t.Fatalf(
			"%s after n1 failed at 101: the view is vouched current at %d (Refreshed), but its "+
				"set (index %d) has n1's serfHealth %+v from before the failure: NodeFailed "+
				"false, session s1 (lease check created at 40) is answered CURRENT",
			time.Since(start).Round(time.Millisecond),
			progress,
			last.Index,
			c,
		)
	}
}

// TestNodeBackSeenByTheWarningWatchIsReadByNode: n1 fails (serfHealth critical
// at 101) and the set says so; n1 comes back at 102. The critical watch's
// answer at 102 is slow to arrive; a warning change at 103 (executor a full)
// makes the warning watch read the critical checks afresh, which replaces the
// critical state. The node back is read by node then too, so no set carries
// n1's serfHealth from the listing made before the failure (passing, modified
// at 5): Join keeps seeing that n1 failed after session s1's lease check (40),
// and s1 is not routed or answered CURRENT until the paced serf listing
// answers.
func TestNodeBackSeenByTheWarningWatchIsReadByNode(t *testing.T) {
	serf := &api.HealthCheck{
		Node:        "n1",
		CheckID:     health.SerfHealthCheckID,
		Status:      "passing",
		CreateIndex: 5,
		ModifyIndex: 5,
	}
	world := newWorld(99, serf)
	world.set(leaseCheck("passing")) // 100
	_, out := runWorld(t, world, WatchConfig{MinInterval: time.Millisecond})
	nextObs(t, out, "a set with n1's serfHealth", func(o health.Observation) bool {
		if o.NonPassing() == nil {
			return false
		}
		_, ok := checkIn(o.NonPassing(), "n1", health.SerfHealthCheckID)
		return ok
	})
	failed := *serf
	failed.Status = "critical"
	world.set(&failed) // 101
	nextObs(t, out, "n1 failed", func(o health.Observation) bool {
		if o.NonPassing() == nil {
			return false
		}
		c, _ := checkIn(o.NonPassing(), "n1", health.SerfHealthCheckID)
		return c.Status == health.StatusCritical
	})
	held, release := world.holdNextCritical()
	world.set(serf) // 102: n1 back
	select {
	case <-held:
	case <-time.After(5 * time.Second):
		t.Fatal("the critical watch never answered at 102")
	}
	world.set(leaseCheck("warning")) // 103: a is full
	defer close(release)
	for quiet := time.After(300 * time.Millisecond); ; {
		select {
		case o := <-out:
			if o.NonPassing() == nil {
				continue
			}
			c, _ := checkIn(o.NonPassing(), "n1", health.SerfHealthCheckID)
			if e := health.Join(memberA(), health.NewNonPassingSet(*o.NonPassing())); !e.NodeFailed {
				t.Fatalf(
					"n1 failed at 101 and came back at 102; the set at index %d carries its "+
						"serfHealth %+v (the listing from before the failure): NodeFailed false "+
						"for session s1, whose lease check was created at 40",
					o.NonPassing().Index,
					c,
				)
			}
		case <-quiet:
			return
		}
	}
}

// TestFailedCrossReadIsRetried: executor a is full (lease warning at 60). The
// critical watch's next blocking answer is slow to arrive (read at 61, when b
// lapses). a's lease goes critical at 62: the warning watch sees a leave the
// warning state, stores that, and reads the critical checks afresh, and that
// read fails (one 500). Its next answer, though its own state is unchanged,
// reads the critical checks again, and until then what left the warning state
// is carried as it was: no set has a in neither state (Join would read a's
// lease as passing and route a full executor whose lease lapsed).
func TestFailedCrossReadIsRetried(t *testing.T) {
	other := &api.HealthCheck{
		Node:        "n2",
		CheckID:     health.CheckID("b", "s1", "work"),
		ServiceID:   health.ServiceID("b", "work"),
		ServiceTags: []string{"leasehold"},
		Status:      "passing",
	}
	world := newWorld(
		59,
		&api.HealthCheck{
			Node:        "n1",
			CheckID:     health.SerfHealthCheckID,
			Status:      "passing",
			CreateIndex: 5,
			ModifyIndex: 5,
		},
		&api.HealthCheck{
			Node:        "n2",
			CheckID:     health.SerfHealthCheckID,
			Status:      "passing",
			CreateIndex: 6,
			ModifyIndex: 6,
		},
		other,
	)
	world.set(leaseCheck("warning")) // 60
	fw := newFaulty(world)
	_, out := runWorld(
		t,
		fw,
		WatchConfig{MinInterval: time.Millisecond, MaxBackoff: 200 * time.Millisecond},
	)
	nextObs(t, out, "first set with a warning", func(o health.Observation) bool {
		if o.NonPassing() == nil {
			return false
		}
		c, ok := checkIn(o.NonPassing(), "n1", health.CheckID("a", "s1", "work"))
		return ok && c.Status == health.StatusWarning
	})
	time.Sleep(50 * time.Millisecond) // both watches back in their blocking queries

	held, release := world.holdNextCritical()
	defer close(release)
	lapsedB := *other
	lapsedB.Status = "critical"
	world.set(&lapsedB) // 61: the critical watch reads {b} and is held
	select {
	case <-held:
	case <-time.After(5 * time.Second):
		t.Fatal("the critical watch never answered at 61")
	}
	fw.mu.Lock()
	fw.failFresh[api.HealthCritical] = 1 // the warning watch's cross read fails once
	fw.mu.Unlock()
	world.set(leaseCheck("critical")) // 62: a lapses

	for quiet := time.After(1500 * time.Millisecond); ; {
		select {
		case o := <-out:
			if o.NonPassing() == nil {
				continue
			}
			e := health.Join(memberA(), health.NewNonPassingSet(*o.NonPassing()))
			if e.LeaseStatus == health.StatusPassing {
				t.Fatalf(
					"a lapsed at 62 (it was full, lease warning, before); a set at index %d "+
						"(checks %+v) has a in neither state: Join reads its lease as passing "+
						"and a is routed",
					o.NonPassing().Index,
					o.NonPassing().Checks,
				)
			}
		case <-quiet:
			return
		}
	}
}

// TestWarningWatchFailureDoesNotWithholdALapse: the warning watch's queries
// fail (a 429 or 500 that hits it alone, or its back-off after an outage
// outlasting the critical watch's). The critical watch keeps answering and
// sees a's lease go critical; the lapse goes out within a few back-offs
// although the gap holds the set's index, so routing stops sending work to the
// lapsed session and fencing does not answer from a held view until
// StaleAfter. TestFailedCrossReadIsRetried must keep this passing.
func TestWarningWatchFailureDoesNotWithholdALapse(t *testing.T) {
	world := newWorld(
		99,
		&api.HealthCheck{
			Node:        "n1",
			CheckID:     health.SerfHealthCheckID,
			Status:      "passing",
			CreateIndex: 5,
			ModifyIndex: 5,
		},
	)
	world.set(leaseCheck("passing")) // 100
	fw := newFaulty(world)
	_, out := runWorld(t, fw, WatchConfig{MinInterval: time.Millisecond})
	nextObs(t, out, "first set", func(o health.Observation) bool { return o.NonPassing() != nil })
	time.Sleep(50 * time.Millisecond)
	fw.mu.Lock()
	fw.failAll[api.HealthWarning] = true
	fw.mu.Unlock()
	// 101: wakes the warning watch, which fails from now on.
	world.set(&api.HealthCheck{Node: "n9", CheckID: "x", Status: "warning"})
	time.Sleep(100 * time.Millisecond)
	start := time.Now()
	world.set(leaseCheck("critical")) // 102: a lapses
	for deadline := time.After(3 * time.Second); ; {
		select {
		case o := <-out:
			if o.NonPassing() == nil {
				continue
			}
			if c, ok := checkIn(o.NonPassing(), "n1", health.CheckID("a", "s1", "work")); ok &&
				c.Status == health.StatusCritical {
				t.Logf("lapse published after %v", time.Since(start))
				return
			}
		case <-deadline:
			t.Fatalf(
				"a lapsed at 102 and the critical watch read it; while the warning watch fails "+
					"the lapse is withheld (%v and counting): a is routed",
				time.Since(start).Round(time.Millisecond),
			)
		}
	}
}

// TestNodesBackDoNotDelayALapse: 50 nodes fail and come back together (a
// partition heals). The watch that sees their serfHealth leave the critical
// state does not read each by node under the fast path's lock (20 ms a read: a
// remote Consul) but lists them once, so a's lease lapsing meanwhile goes out
// within 300 ms, not behind every node read.
func TestNodesBackDoNotDelayALapse(t *testing.T) {
	const nodes = 50
	var serfs []*api.HealthCheck
	for i := 0; i < nodes; i++ {
		serfs = append(
			serfs,
			&api.HealthCheck{
				Node:    "m" + string(rune('A'+i/26)) + string(rune('a'+i%26)),
				CheckID: health.SerfHealthCheckID,
				Status:  "passing",
			},
		)
	}
	world := newWorld(
		99,
		&api.HealthCheck{
			Node:        "n1",
			CheckID:     health.SerfHealthCheckID,
			Status:      "passing",
			CreateIndex: 5,
			ModifyIndex: 5,
		},
	)
	world.set(serfs...)
	world.set(leaseCheck("passing"))
	fw := newFaulty(world)
	_, out := runWorld(t, fw, WatchConfig{MinInterval: time.Millisecond})
	nextObs(t, out, "first set", func(o health.Observation) bool { return o.NonPassing() != nil })
	var failed []*api.HealthCheck
	for _, s := range serfs {
		c := *s
		c.Status = "critical"
		failed = append(failed, &c)
	}
	world.set(failed...)
	nextObs(t, out, "the nodes failed", func(o health.Observation) bool {
		if o.NonPassing() == nil {
			return false
		}
		c, _ := checkIn(o.NonPassing(), failed[0].Node, health.SerfHealthCheckID)
		return c.Status == health.StatusCritical
	})
	time.Sleep(50 * time.Millisecond)
	fw.mu.Lock()
	fw.nodeDelay = 20 * time.Millisecond
	fw.mu.Unlock()
	world.set(serfs...) // the partition heals
	time.Sleep(30 * time.Millisecond)
	start := time.Now()
	world.set(leaseCheck("critical")) // a lapses
	o := nextObs(t, out, "a's lapse", func(o health.Observation) bool {
		if o.NonPassing() == nil {
			return false
		}
		c, ok := checkIn(o.NonPassing(), "n1", health.CheckID("a", "s1", "work"))
		return ok && c.Status == health.StatusCritical
	})
	took := time.Since(start)
	t.Logf("lapse out after %v (%d node reads)", took, fw.nodeCalls.Load())
	if took > 300*time.Millisecond {
		t.Fatalf(
			"a's lapse (read at once by the critical watch) went out after %v, behind %d serial "+
				"by-node reads under the fast path's lock (set index %d)",
			took.Round(time.Millisecond),
			fw.nodeCalls.Load(),
			o.NonPassing().Index,
		)
	}
}

// gapCatalog is fakeCatalog whose fresh serfHealth listings can be made to fail.
type gapCatalog struct {
	*fakeCatalog
	failListing atomic.Bool
}

func (g *gapCatalog) SerfHealth(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (api.HealthChecks, uint64, error) {
	if index == 0 && g.failListing.Load() {
		return nil, 0, errors.New("listing refused")
	}
	return g.fakeCatalog.SerfHealth(ctx, index, wait)
}

// TestFastPathGapStillCarriesLapses: after a failed query of the critical
// checks the set vouches for nothing newer than what it said before, until
// every serfHealth is listed again — but a lapse seen meanwhile goes out at
// once (at the old index); once the listing answers, the index moves on.
func TestFastPathGapStillCarriesLapses(t *testing.T) {
	cat := &gapCatalog{fakeCatalog: newFakeCatalog()}
	h := &watchHarness{t: t, cat: cat.fakeCatalog, out: make(chan health.Observation, 100)}
	w := newWatcher(cat, WatchConfig{MinInterval: time.Millisecond, Out: h.out})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	nonPassing := func(what string) *health.NonPassing {
		t.Helper()
		deadline := time.After(5 * time.Second)
		for {
			select {
			case o := <-h.out:
				if o.NonPassing() != nil {
					return o.NonPassing()
				}
			case <-deadline:
				t.Fatalf("no set: %s", what)
			}
		}
	}
	cat.push("nonpassing", scripted{index: 10})
	// the first set goes out at 10, or, when the serf listing is taken after
	// it (at 1, then again once the checks passed it), at 0 with progress to
	// 10 after
	for vouched, deadline := uint64(0), time.After(5*time.Second); vouched < 10; {
		select {
		case o := <-h.out:
			switch {
			case o.NonPassing() != nil:
				vouched = o.NonPassing().Index
			case o.Progress() != nil:
				vouched = max(vouched, o.Progress().NonPassing)
			}
			if vouched > 10 {
				t.Fatalf("the first set vouches for %d, want 10", vouched)
			}
		case <-deadline:
			t.Fatal("the first set never reached 10")
		}
	}
	cat.failListing.Store(true)
	cat.push("nonpassing", scripted{err: errors.New("connection reset")})
	lapse := &api.HealthCheck{
		Node:        "n1",
		CheckID:     health.CheckID("a", "s1", "work"),
		ServiceID:   health.ServiceID("a", "work"),
		Status:      "critical",
		ModifyIndex: 20,
	}
	cat.push("nonpassing", scripted{index: 20, checks: api.HealthChecks{lapse}})
	// Another watch may publish the set, still without the lapse, first:
	// such a set vouches for nothing newer either.
	np := nonPassing("the lapse during the gap")
	for len(np.Checks) == 0 {
		if np.Index > 10 {
			t.Fatalf("set during the gap at %d: it vouches for more than the index before the gap (10)", np.Index)
		}
		np = nonPassing("the lapse during the gap")
	}
	if len(np.Checks) != 1 || np.Checks[0].CheckID != lapse.CheckID {
		t.Fatalf("set during the gap %+v: the lapse did not go out", np.Checks)
	}
	if np.Index != 10 {
		t.Fatalf(
			"set during the gap at %d: it vouches for more than the index before the gap (10)",
			np.Index,
		)
	}
	// the listing answers again: the next answer moves the index on
	cat.failListing.Store(false)
	cat.push("nonpassing", scripted{index: 21, checks: api.HealthChecks{lapse}})
	deadline := time.After(5 * time.Second)
	for {
		select {
		case o := <-h.out:
			if o.Progress() != nil && o.Progress().NonPassing >= 21 ||
				o.NonPassing() != nil && o.NonPassing().Index >= 21 {
				return
			}
		case <-deadline:
			t.Fatal("the index never moved on after the listing answered")
		}
	}
}

// TestALapseGoesOutBeforeTheCrossRead: a check entering the critical state
// leaves nothing missing from both states, so the set carrying it goes out
// before the warning checks are read afresh — with Consul slow to answer
// that read (busy serving a large listing: 3 s here), the lapse is not held
// behind it. The cross read still happens and its answer follows.
func TestALapseGoesOutBeforeTheCrossRead(t *testing.T) {
	world := newWorld(99, serfCheck("n1", "passing", 5, 5))
	world.set(leaseCheck("passing")) // 100
	fw := newFaulty(world)
	_, out := runWorld(t, fw, WatchConfig{MinInterval: time.Millisecond})
	nextObs(t, out, "first set", func(o health.Observation) bool { return o.NonPassing() != nil })
	fw.mu.Lock()
	fw.freshDelay[api.HealthWarning] = 3 * time.Second
	fw.mu.Unlock()
	fresh := fw.freshCalls.Load()
	start := time.Now()
	world.set(leaseCheck("critical")) // 101: a lapses
	nextObs(t, out, "the lapse", func(o health.Observation) bool {
		np := o.NonPassing()
		if np == nil {
			return false
		}
		c, ok := checkIn(np, "n1", health.CheckID("a", "s1", "work"))
		return ok && c.Status == health.StatusCritical
	})
	if d := time.Since(start); d >= 2*time.Second {
		t.Fatalf("the lapse went out after %v: held behind the warning checks' fresh read", d)
	}
	for deadline := time.After(5 * time.Second); fw.freshCalls.Load() == fresh; {
		select {
		case <-deadline:
			t.Fatal("the warning checks were never read afresh after the lapse")
		case <-time.After(10 * time.Millisecond):
		}
	}
}
