package main

import (
	"testing"
	"time"

	"github.com/leasehold/leasehold/health"
)

// The probe keeps the first answer that had a lease critical, per instance,
// whatever else the entries carry.
func TestProbeSplitsConsulsPart(t *testing.T) {
	f := newFleet(nil, 3, taskNames(1), 0, nil)
	p := &taskProbe{critical: map[string]time.Time{}}
	entry := func(inst, status string) probeEntry {
		var e probeEntry
		e.Checks = append(e.Checks,
			struct{ CheckID, Status string }{"serfHealth", "passing"},
			struct{ CheckID, Status string }{health.CheckID(inst, "s", task), status})
		return e
	}
	t0 := time.Now()
	p.seen([]probeEntry{entry(f.ids[0], "warning"), entry(f.ids[1], "critical")}, t0.Add(10*time.Millisecond))
	p.seen([]probeEntry{entry(f.ids[0], "critical"), entry(f.ids[1], "critical")}, t0.Add(30*time.Millisecond))
	got := p.consulPart(f, []int{0, 1, 2}, []time.Time{t0, t0, t0})
	if len(got) != 2 || got[0] != 30*time.Millisecond || got[1] != 10*time.Millisecond {
		t.Fatalf("consul part = %v, want [30ms 10ms] (executor 2 never seen)", got)
	}
	var none *taskProbe
	if none.consulPart(f, []int{0}, []time.Time{t0}) != nil {
		t.Fatal("no probe: want nothing")
	}
}
