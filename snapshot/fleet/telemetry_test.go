package fleet

import (
	"testing"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// leasehold.capacity counts the load of executors whose lease check output
// carried one in in_use, and the capacity of those whose did not in
// load_unreported, never as a load of 0; lapsed executors count in none.
func TestCapacityCountsAnUnreportedLoadApart(t *testing.T) {
	join := func(inst, output string, lease health.CheckStatus) health.Executor {
		m := fleettest.Member("work", inst, "s1", 1, 9000+len(inst), "1.0.0", lease, 3)
		for i := range m.Checks {
			if m.Checks[i].ServiceID != "" {
				m.Checks[i].Output = output
			}
		}
		return health.Join(m, health.NewNonPassingSet(health.NonPassing{}))
	}
	got := capacityByTask([]health.Executor{
		join("busy", "load=3", health.StatusPassing),
		join("new", "", health.StatusPassing),
		join("lapsed", "TTL expired", health.StatusCritical),
	})
	want := map[string]taskCapacity{"work": {total: 8, inUse: 3, unreported: 4}}
	if len(got) != 1 || got["work"] != want["work"] {
		t.Fatalf("capacity %+v, want %+v", got, want)
	}
	if got := capacityByTask([]health.Executor{
		join("lapsed", "load=2", health.StatusCritical)}); got["work"] != (taskCapacity{}) {
		t.Fatalf("only lapsed executors: %+v, want the series at 0", got)
	}
}
