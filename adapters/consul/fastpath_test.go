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
	if o.NonPassing.Index != 15 {
		t.Fatalf("set index %d, want the non-passing read's 15", o.NonPassing.Index)
	}
}
