package main

import (
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// Two datacenters federated over WAN on loopback, a client agent in each,
// two executors in each; leasehold watches both through dc1's client agent;
// real grpc-go dispatchers in dc1 and in dc2 (bootstraps from `leasehold
// bootstrap --datacenter`).
//
//   - each dispatcher uses its own datacenter's executors only;
//   - every dc1 executor lapses: dc1's dispatcher fails over to dc2's within
//     the lapse → stop budget, and comes back when dc1's executors register
//     new sessions;
//   - dc2's only server freezes (a partition): after the staleness bound
//     dc2's executors leave the assignments (dc2's dispatcher fails over to
//     dc1), their sessions answer UNKNOWN, and dc1's dispatcher is not
//     disturbed: no failed call, dc1's sessions CURRENT.
func TestTwoDatacentersFailover(t *testing.T) {
	consultest.RequireBinary(t)
	dc1 := consultest.Start(t, consultest.Options{Datacenter: "dc1"})
	dc2 := consultest.Start(t, consultest.Options{Datacenter: "dc2", FederateWith: dc1})
	c1 := consultest.Start(t, consultest.Options{NodeName: "dc1-client", JoinClientOf: dc1})
	c2 := consultest.Start(t, consultest.Options{NodeName: "dc2-client", JoinClientOf: dc2})
	c1.SettleSync()
	c2.SettleSync()
	a1, a2 := startExecutor(t, c1, "a1", "1.0.0"), startExecutor(t, c1, "a2", "1.0.0")
	b1, b2 := startExecutor(t, c2, "b1", "1.0.0"), startExecutor(t, c2, "b2", "1.0.0")

	const staleAfter = 6 * time.Second // --fencing-stale-after
	// The executors' 2 s lease (lease_ttl) is shorter: a silent datacenter is
	// lost after it — but never under health.MinStaleBound — and its watches
	// wait a third of it.
	lostBound := min(staleAfter, health.DatacenterLeaseBound(2*time.Second))
	const fastWait = 2 * time.Second / 3
	l := startServeTo(t, c1, testWriter{t, "serve"}, func(c *serveConfig) {
		c.datacenters = []string{"dc1", "dc2"}
		c.staleAfter = staleAfter
	})
	fc := fencingClient(t, l.xds)
	awaitState(t, fc, "b1", b1.reg.Session().ID, leaseholdv1.SessionState_CURRENT)

	start := time.Now()
	d1 := startDispatcher(t, l.xds, "dispatcher-dc1", map[string]any{"datacenter": "dc1"})
	d2 := startDispatcher(t, l.xds, "dispatcher-dc2", map[string]any{"datacenter": "dc2"})
	only := func(want ...string) func([]callResult) bool {
		return func(cs []callResult) bool {
			m := servedBy(cs)
			for _, w := range want {
				if m[w] < 5 {
					return false
				}
			}
			return true
		}
	}
	d1.await(t, start, 20*time.Second, "dc1's dispatcher on a1 and a2", only("a1", "a2"))
	d2.await(t, start, 20*time.Second, "dc2's dispatcher on b1 and b2", only("b1", "b2"))
	settled := time.Now()
	d1.await(t, settled, 10*time.Second, "200 more calls", func(cs []callResult) bool {
		return len(cs) >= 200
	})
	for _, c := range d1.since(settled) {
		if c.Err != "" || strings.HasPrefix(c.Instance, "b") {
			t.Fatalf("dc1's dispatcher, dc1 healthy: call %+v (want a1 or a2 only)", c)
		}
	}
	for _, c := range d2.since(settled) {
		if c.Err != "" || strings.HasPrefix(c.Instance, "a") {
			t.Fatalf("dc2's dispatcher, dc2 healthy: call %+v (want b1 or b2 only)", c)
		}
	}

	// Failover: every dc1 executor lapses.
	a1.silent.Store(true)
	a2.silent.Store(true)
	lapsed := awaitCheck(t, c1.Client(), "a1", api.HealthCritical)
	if t2 := awaitCheck(t, c1.Client(), "a2", api.HealthCritical); t2.After(lapsed) {
		lapsed = t2
	}
	margin := lapsed.Add(300 * time.Millisecond)
	d1.await(t, margin, 10*time.Second, "dc1's dispatcher on b1 and b2", only("b1", "b2"))
	for _, c := range d1.since(margin) {
		if strings.HasPrefix(c.Instance, "a") {
			t.Fatalf("a call reached %s more than 300ms after the last dc1 lease lapsed: "+
				"call %+v, lapsed %s margin %s", c.Instance, c,
				lapsed.Format("15:04:05.000"), margin.Format("15:04:05.000"))
		}
	}
	failedOver := time.Now()
	d1.await(t, failedOver, 10*time.Second, "100 calls after failover", func(cs []callResult) bool {
		return len(cs) >= 100
	})
	for _, c := range d1.since(failedOver) {
		if c.Err != "" {
			t.Fatalf("dc1's dispatcher failed a call after failing over: %s", c.Err)
		}
	}
	t.Logf("failover: first call to dc2 %v after dc1's last lapse",
		firstCallAfter(d1, lapsed, "b").Sub(lapsed).Round(time.Millisecond))

	// Back: dc1's executors register new sessions.
	a1b, a2b := startExecutor(t, c1, "a1", "1.0.0"), startExecutor(t, c1, "a2", "1.0.0")
	back := time.Now()
	d1.await(t, back, 15*time.Second, "dc1's dispatcher back on a1 and a2", only("a1", "a2"))
	returned := time.Now()
	d1.await(t, returned, 10*time.Second, "100 calls after return", func(cs []callResult) bool {
		return len(cs) >= 100
	})
	for _, c := range d1.since(returned.Add(100 * time.Millisecond)) {
		if c.Err != "" || strings.HasPrefix(c.Instance, "b") {
			t.Fatalf("dc1's dispatcher after dc1's return: call %+v (want a1 or a2 only)", c)
		}
	}

	// Partition: dc2's only server freezes.
	if err := dc2.Freeze(); err != nil {
		t.Fatal(err)
	}
	frozen := time.Now()
	t.Cleanup(func() { dc2.Thaw() })
	awaitState(t, fc, "b1", b1.reg.Session().ID, leaseholdv1.SessionState_UNKNOWN)
	unknownAfter := time.Since(frozen)
	d2.await(t, frozen, staleAfter+20*time.Second,
		"dc2's dispatcher failed over to a1 and a2", only("a1", "a2"))
	lostAfter := time.Since(frozen)
	// dc2 is heard from as much as its least recent always-answering watch:
	// up to one watch wait (plus Consul's jitter of 1/16 and the pacing)
	// before the freeze.
	if early := lostBound - fastWait - fastWait/8 - 500*time.Millisecond; lostAfter < early {
		t.Fatalf("dc2's executors left the assignment %v after the freeze: before the bound %v "+
			"counted from dc2's last answer", lostAfter, lostBound)
	}
	t.Logf("partition: dc2's sessions UNKNOWN after %v, its executors unrouted after ≤ %v",
		unknownAfter.Round(time.Millisecond), lostAfter.Round(time.Millisecond))
	for _, c := range d1.since(frozen) {
		if c.Err != "" || strings.HasPrefix(c.Instance, "b") {
			t.Fatalf("dc1's dispatcher disturbed by dc2's partition: call %+v", c)
		}
	}
	for _, e := range []*e2eExecutor{a1b, a2b} {
		awaitState(t, fc, e.instance, e.reg.Session().ID, leaseholdv1.SessionState_CURRENT)
	}
	if code := readyzStatus(l.admin); code != 200 {
		t.Errorf("/readyz %d while dc1 answers", code)
	}
	_ = b2
}

// firstCallAfter is when d's first call at or after t reached an instance
// whose name starts with prefix.
func firstCallAfter(d *dispatcher, t time.Time, prefix string) time.Time {
	for _, c := range d.since(t) {
		if strings.HasPrefix(c.Instance, prefix) {
			return c.At
		}
	}
	return time.Time{}
}
