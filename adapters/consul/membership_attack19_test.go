package consul

import (
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// TestAttack19CheckAddedToAnUnchangedMemberIsNeverSeen (FAILS: regression):
// an operator puts node n1 in maintenance (`consul maint -enable` adds the
// critical node check _node_maintenance; no catalog entry changes) or a
// second service check is added to executor a. The non-passing set carries
// the new critical check at once, but Join only looks at the checks of a's
// membership read, and a is never re-read while its catalog entry is
// unchanged: a stays routed indefinitely. Before issue 19 any change in the
// task type (churn: another executor registering) re-read every member and
// picked the check up; now only the changed entry (b) is read.
func TestAttack19CheckAddedToAnUnchangedMemberIsNeverSeen(t *testing.T) {
	h := startWatcher(t, WatchConfig{MinInterval: time.Millisecond, SlowInterval: time.Hour})
	h.cat.call(t, "services")
	h.cat.push("services", scripted{index: 5, services: map[string][]string{"work": {"leasehold"}, "consul": nil}})
	h.cat.call(t, "nodes")
	var nodes []*api.CatalogService
	var entries []*api.ServiceEntry
	for i, inst := range []string{"a", "c", "d", "e"} {
		nodes = append(nodes, catalogEntry("n1", inst, "s1", uint64(7+i)))
		entries = append(entries, entry("work", "n1", inst, "s1", 1, "passing"))
	}
	h.cat.push("nodes/work", scripted{index: 10, nodes: nodes})
	h.cat.push("health/work", scripted{index: 10, entries: entries})
	for o := h.observe(); o.Members == nil; o = h.observe() {
	}
	// n1 goes into maintenance at 11
	maint := &api.HealthCheck{Node: "n1", CheckID: "_node_maintenance", Status: "critical", CreateIndex: 11, ModifyIndex: 11}
	h.cat.push("nonpassing", scripted{index: 11, checks: api.HealthChecks{maint}})
	var np *health.NonPassing
	for np == nil {
		np = h.observe().NonPassing
	}
	// churn: b registers at 12; Consul's health read now shows a with the
	// maintenance check too
	withMaint := func(e *api.ServiceEntry) *api.ServiceEntry {
		c := *e
		c.Checks = append(api.HealthChecks{maint}, e.Checks...)
		return &c
	}
	nodes2 := append(append([]*api.CatalogService{}, nodes...), catalogEntry("n1", "b", "s1", 12))
	var entries2 []*api.ServiceEntry
	for _, e := range append(append([]*api.ServiceEntry{}, entries...), entry("work", "n1", "b", "s1", 1, "passing")) {
		entries2 = append(entries2, withMaint(e))
	}
	h.advance(10 * time.Millisecond)
	h.cat.push("nodes/work", scripted{index: 12, nodes: nodes2})
	h.cat.push("health/work", scripted{index: 12, entries: entries2})
	var members []health.Member
	for members == nil {
		if o := h.observe(); o.Members != nil && len(o.Members.Members) == 5 {
			members = o.Members.Members
		}
	}
	set := health.NewNonPassingSet(*np)
	for _, m := range members {
		if e := health.Join(m, set); e.NodeChecks != health.StatusCritical {
			t.Errorf("%s on n1 (in maintenance since 11): node checks %q after the task type was re-read at 12 — routed", m.ServiceID, e.NodeChecks)
		}
	}
}
