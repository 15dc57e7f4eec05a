package consul

import (
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// TestAttack19GenerationRaiseWaitsForAnotherTaskTypesDebt (FAILS: design
// consequence): the generation keys share the read budget with the task
// listings. One task type's listing (40 MiB of JSON, a large fleet's churn)
// puts the budget 8 s in debt at the default 4 MiB/s; a new session's
// generation raised meanwhile (a few bytes) is not read until the debt is
// paid, so the replaced session stays unfenced — routed by xDS, answered
// CURRENT by fencing without min_consul_index — for those 8 s; only a
// Refresh ends the wait. Before issue 19 the generations watch was never
// paced.
func TestAttack19GenerationRaiseWaitsForAnotherTaskTypesDebt(t *testing.T) {
	h := startWatcher(t, WatchConfig{MinInterval: time.Millisecond, SlowInterval: time.Hour})
	h.cat.push("generations", scripted{index: 3, kv: api.KVPairs{{Key: health.GenerationKeyPrefix + "a", Value: []byte("1")}}})
	for o := h.observe(); o.Generations == nil; o = h.observe() {
	}
	// a big task type's listing, read while the generations watch pauses
	h.cat.call(t, "services")
	h.cat.push("services", scripted{index: 5, services: map[string][]string{"work": {"leasehold"}, "consul": nil}})
	h.cat.call(t, "nodes")
	h.cat.push("nodes/work", scripted{index: 8, nodes: []*api.CatalogService{catalogEntry("n1", "b", "s1", 7)}, bytes: 40 << 20})
	h.cat.push("health/work", scripted{index: 8, entries: []*api.ServiceEntry{entry("work", "n1", "b", "s1", 1, "passing")}})
	for o := h.observe(); o.Members == nil; o = h.observe() {
	}
	for deadline := time.Now().Add(5 * time.Second); h.w.budget.delay() < 7*time.Second; {
		if time.Now().After(deadline) {
			t.Fatalf("debt %s", h.w.budget.delay())
		}
		time.Sleep(time.Millisecond) // polling a counter the task watch sets
	}
	// instance a restarts: generation 2 is raised before its new session registers
	h.cat.push("generations", scripted{index: 9, kv: api.KVPairs{{Key: health.GenerationKeyPrefix + "a", Value: []byte("2")}}})
	for step := 0; step < 100; step++ { // 1 s of fake time in 10 ms steps
		h.clock.Advance(10 * time.Millisecond)
		select {
		case o := <-h.out:
			if o.Generations != nil && o.Generations.Keys["a"].Generation == 2 {
				return
			}
		case <-time.After(5 * time.Millisecond):
		}
	}
	t.Fatalf("a's generation 2 (a replaced session fenced) not read after 1 s: the generations watch waits for the %s debt of another task type's listing", h.w.budget.delay().Round(time.Second))
}
