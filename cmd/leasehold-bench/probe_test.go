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
			probeCheck{"serfHealth", "passing"}, probeCheck{health.CheckID(inst, "s", task), status})
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

// Both answers the probe follows decode to the checks it reads: a health
// state answer (the critical checks, each with its service's fields) and a
// service answer (entries, each with its checks).
func TestProbeReadsBothAnswers(t *testing.T) {
	f := newFleet(nil, 2, taskNames(1), 0, nil)
	lease := health.CheckID(f.ids[0], "s", task)
	state := `[{"Node":"n1","CheckID":"` + lease + `","Name":"lease","Status":"critical",` +
		`"Output":"TTL expired","ServiceID":"` + task + `:` + f.ids[0] + `","ServiceName":"` +
		task + `","ServiceTags":[],"Type":"ttl","CreateIndex":7,"ModifyIndex":9},` +
		`{"Node":"n1","CheckID":"other","Status":"critical","ServiceID":"","ServiceName":""}]`
	service := `[{"Node":{"Node":"n1"},"Service":{"ID":"x"},"Checks":[` +
		`{"CheckID":"serfHealth","Status":"passing"},` +
		`{"CheckID":"` + health.CheckID(f.ids[1], "s", task) + `","Status":"critical"}]}]`
	t0 := time.Now()
	for _, c := range []struct {
		body   string
		decode func([]byte) ([]probeEntry, error)
		at     time.Duration
	}{{state, decodeChecks, 10 * time.Millisecond}, {service, decodeServiceEntries, 20 * time.Millisecond}} {
		entries, err := c.decode([]byte(c.body))
		if err != nil {
			t.Fatal(err)
		}
		p := &taskProbe{critical: map[string]time.Time{}}
		p.seen(entries, t0.Add(c.at))
		if got := p.consulPart(f, []int{0, 1}, []time.Time{t0, t0}); len(got) != 1 || got[0] != c.at {
			t.Fatalf("consul part from %.20s… = %v, want [%v] (one lease critical)", c.body, got, c.at)
		}
	}
	if _, err := decodeChecks([]byte(`{"not":"a list"}`)); err == nil {
		t.Fatal("decodeChecks accepted an object")
	}
}

// goneAt is a hostWatcher whose dispatchers all dropped each host at a set
// instant.
type goneAt map[string]time.Time

func (g goneAt) awaitAll(func(string, map[string]bool) bool, time.Duration) error { return nil }
func (g goneAt) goneFromAll(host string) time.Time                                { return g[host] }

// leasehold's part on the harness's clock runs from the probe seeing a lease
// critical to the last dispatcher without it, for the victims both saw; a
// watch that beat the probe gives a negative part, kept as it is.
func TestAfterConsulIsProbeToLastStream(t *testing.T) {
	f := newFleet(nil, 4, taskNames(1), 0, nil)
	t0 := time.Now()
	p := &taskProbe{critical: map[string]time.Time{
		f.ids[0]: t0, f.ids[1]: t0, f.ids[3]: t0.Add(5 * time.Millisecond),
	}}
	w := goneAt{f.ids[0]: t0.Add(12 * time.Millisecond), f.ids[2]: t0, f.ids[3]: t0.Add(2 * time.Millisecond)}
	got := p.afterConsul(f, w, []int{0, 1, 2, 3})
	want := []time.Duration{12 * time.Millisecond, -3 * time.Millisecond}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("afterConsul = %v, want %v (1 never dropped, 2 never seen critical)", got, want)
	}
	var none *taskProbe
	if none.afterConsul(f, w, []int{0}) != nil {
		t.Fatal("no probe: want nothing")
	}
}
