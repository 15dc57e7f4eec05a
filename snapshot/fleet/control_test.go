package fleet

import (
	"testing"

	"github.com/leasehold/leasehold/health"
)

// TestCordonLimitDoesNotCountALostDatacenter: the cordon safety limit (at
// most half of a task's live executors cordoned at once, by default) does not
// count the executors of a lost datacenter as live: they are routed nowhere.
// With dc2 lost, a cordon of every 1.x executor must leave one of dc1's two
// taking new work; counting "4 live" would let it take both (DRAINING), and
// the limit that exists to keep half of a task serving would keep none.
func TestCordonLimitDoesNotCountALostDatacenter(t *testing.T) {
	h := mdcStart(t)
	h.readAll("dc1")
	h.readAll("dc2")
	local := mdcDispatcher(t, "")
	h.subscribe(local)
	h.waitLoad(local, mdcBothFromDC1)
	h.tickUntil(mdcLost+2*mdcTick, []string{"dc1"}, nil)
	h.waitReach("dc2", health.Lost)
	h.waitLoad(local, mdcOnlyDC1)

	cordon := `{"id":"c1","version_constraint":">=1.0.0, <2.0.0","reason":"bad build",` +
		`"by":"ops","at":"2026-01-01T00:00:00Z"}`
	raw := map[string][]byte{"c1": []byte(cordon)}
	h.send("", health.Observation{Data: &health.CordonSet{Index: 1, Raw: raw}})
	routed := 0
	for _, x := range h.ofDC("dc1") {
		if h.verdict(local, x.inst, x.sess).Route == health.RouteHealthy {
			routed++
		}
	}
	if routed == 0 {
		t.Fatalf("the cordon took every executor that takes new work (served %q); the safety "+
			"limit counted dc2's lost executors as live", h.load(local))
	}
}
