package consul

import (
	"context"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

func serfCheck(node, status string, create, modify uint64) *api.HealthCheck {
	return &api.HealthCheck{Node: node, CheckID: health.SerfHealthCheckID, Status: status, CreateIndex: create, ModifyIndex: modify}
}

func serfIn(o health.Observation, node string) (health.CheckState, bool) {
	for _, c := range o.NonPassing.Checks {
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
	h.cat.push("serf", scripted{index: 10, checks: api.HealthChecks{serfCheck("n1", "passing", 3, 3), serfCheck("n2", "passing", 4, 4)}})
	if _, err := h.w.Refresh(context.Background(), everything); err != nil {
		t.Fatal(err)
	}
	select {
	case o := <-h.out:
		if o.NonPassing != nil {
			t.Fatalf("a set was sent before the critical checks were read: %+v", o.NonPassing)
		}
	case <-time.After(50 * time.Millisecond): // absence check only
	}
	// n2 fails (the answer to the refresh's fresh read of the critical checks)
	h.cat.push("nonpassing", scripted{index: 12, checks: api.HealthChecks{serfCheck("n2", "critical", 4, 12)}})
	var o health.Observation
	for o = h.observe(); o.NonPassing == nil || len(o.NonPassing.Checks) < 2; o = h.observe() {
	}
	if c, ok := serfIn(o, "n1"); !ok || c.Status != "passing" {
		t.Fatalf("n1's serfHealth missing: %+v", o.NonPassing.Checks)
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
	for o = h.observe(); o.NonPassing == nil; o = h.observe() {
	}
	if c, ok := serfIn(o, "n2"); !ok || c.Status != "passing" || c.ModifyIndex != 15 {
		t.Fatalf("n2 back: serfHealth %+v, want passing at 15 (not the listing's 4)", c)
	}
	// n1's serfHealth is known from the listing (at 10, or later if the
	// listing answered again since): the set vouches for no index past it,
	// nor past the non-passing read's 15.
	if o.NonPassing.Index < 10 || o.NonPassing.Index > 15 {
		t.Fatalf("set index %d, want the listing's (10 or later), at most the non-passing read's 15", o.NonPassing.Index)
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
	serf := &api.HealthCheck{Node: "n1", CheckID: health.SerfHealthCheckID, Status: "passing", CreateIndex: 5, ModifyIndex: 5}
	world := newWorld(99, serf)
	world.set(leaseCheck("passing")) // 100
	_, out := runWorld(t, world, WatchConfig{MinInterval: time.Millisecond, SlowInterval: time.Hour})
	last := nextObs(t, out, "a set with n1's serfHealth", func(o health.Observation) bool {
		if o.NonPassing == nil {
			return false
		}
		_, ok := checkIn(o.NonPassing, "n1", health.SerfHealthCheckID)
		return ok
	}).NonPassing
	failed, back := *serf, *serf
	failed.Status = "critical"
	world.set(&failed, &back) // 101 critical, 102 passing again: no critical read sees it
	lapse := &api.HealthCheck{Node: "n2", CheckID: health.CheckID("b", "s1", "work"), ServiceID: health.ServiceID("b", "work"), Status: "critical"}
	world.set(lapse) // 103
	vouched := last.Index
	for deadline := time.After(5 * time.Second); ; {
		var o health.Observation
		select {
		case o = <-out:
		case <-deadline:
			t.Fatal("the lapse at 103 never went out")
		}
		if o.Progress != nil {
			vouched = max(vouched, o.Progress.NonPassing)
		}
		if o.NonPassing == nil {
			continue
		}
		last, vouched = o.NonPassing, max(vouched, o.NonPassing.Index)
		if _, ok := checkIn(last, "n2", lapse.CheckID); ok {
			break
		}
	}
	if e := health.Join(attackMember(), health.NewNonPassingSet(*last)); vouched >= 101 && !e.NodeFailed {
		c, _ := checkIn(last, "n1", health.SerfHealthCheckID)
		t.Fatalf("the fast path vouched for index %d with n1's serfHealth %+v from the listing at 100: n1 failed at 101, yet session s1 is answered CURRENT there", vouched, c)
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
	serf := &api.HealthCheck{Node: "n1", CheckID: health.SerfHealthCheckID, Status: "passing", CreateIndex: 5, ModifyIndex: 5}
	world := newWorld(99, serf)
	world.set(leaseCheck("passing")) // 100
	out := make(chan health.Observation) // read by nobody until the set was decided
	w := newWatcher(world, WatchConfig{MinInterval: time.Millisecond, SlowInterval: time.Hour, Out: out})
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
			t.Fatal("the fast path's lock stayed held while its first set waited for the observation channel")
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
			sawSet = sawSet || o.NonPassing != nil
			if o.Refreshed != nil && *o.Refreshed >= r.seq {
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
