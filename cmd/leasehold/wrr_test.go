package main

import (
	"fmt"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
)

// A real grpc-go xds:/// dispatcher under leasehold's default policy
// (weighted round robin from ORCA) sends an executor that reports 3× the
// utilization of its peers clearly fewer new tasks within seconds; one that
// turns full gets none (leasehold's gate, through Consul); once free it gets
// work again.
func TestWeightedRoundRobinFollowsORCALoad(t *testing.T) {
	a := consultest.Start(t)
	a.SettleSync()
	c := a.Client()
	busy := startExecutor(t, a, "busy", "1.0.0")
	e2 := startExecutor(t, a, "e2", "1.0.0")
	startExecutor(t, a, "e3", "1.0.0")
	busy.reported.Store(3) // 0.75 of capacity; the others report 0.25

	addrs := startServe(t, a)
	start := time.Now()
	d := startDispatcher(t, addrs.xds, "dispatcher-wrr", map[string]any{})
	d.await(t, start, 20*time.Second, "calls to every executor", func(cs []callResult) bool {
		m := servedBy(cs)
		return m["busy"] > 0 && m["e2"] > 0 && m["e3"] > 0
	})

	// Weights count after a 2 s blackout and are recomputed every second:
	// within a few seconds the busy executor's share falls well below its
	// peers' (equal weights would give each a third).
	share := func(cs []callResult) string {
		m := servedBy(cs)
		return fmt.Sprintf("busy %d, e2 %d, e3 %d", m["busy"], m["e2"], m["e3"])
	}
	var window []callResult
	deadline := time.Now().Add(20 * time.Second)
	for from := time.Now(); ; {
		to := from.Add(2 * time.Second)
		d.await(t, to, 10*time.Second, "calls over two seconds",
			func(cs []callResult) bool { return len(cs) > 0 })
		window = window[:0]
		for _, r := range d.since(from) {
			if r.At.Before(to) {
				window = append(window, r)
			}
		}
		m := servedBy(window)
		if m["e2"] > 50 && m["e3"] > 50 && 2*m["busy"] < min(m["e2"], m["e3"]) {
			t.Logf("weighted by ORCA load: %s", share(window))
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf(
				"the busy executor's share never fell below half of its peers' (last two seconds: "+
					"%s)",
				share(window))
		}
		from = to
	}

	// Full: leasehold's gate, whatever the weights.
	e2.load.Store(2)
	full := awaitCheck(t, c, "e2", api.HealthWarning)
	d.await(t, time.Now().Add(time.Second), 10*time.Second, "calls while e2 is full",
		func(cs []callResult) bool { return len(cs) > 50 })
	if n := servedBy(d.since(full.Add(300 * time.Millisecond)))["e2"]; n > 0 {
		t.Fatalf("%d calls reached e2 while full", n)
	}
	e2.load.Store(0)
	freed := awaitCheck(t, c, "e2", api.HealthPassing)
	d.await(t, freed, 10*time.Second, "calls to e2 again",
		func(cs []callResult) bool { return servedBy(cs)["e2"] > 0 })
}

// Executors report utilization as their task ends, without that task: an
// idle peer reports 0, which grpc-go's weighted round robin ignores (it
// takes only reports with utilization and qps above 0), so the idle peers
// carry no weight of their own and get the mean of the weighted ones —
// the busy executor's. The busy one must still get clearly less.
func TestIdlePeersOutweighABusyExecutor(t *testing.T) {
	a := consultest.Start(t)
	a.SettleSync()
	busy := startExecutor(t, a, "busy", "1.0.0")
	e2 := startExecutor(t, a, "e2", "1.0.0")
	e3 := startExecutor(t, a, "e3", "1.0.0")
	busy.reported.Store(3)
	e2.reported.Store(0)
	e3.reported.Store(0)
	addrs := startServe(t, a)
	start := time.Now()
	d := startDispatcher(t, addrs.xds, "dispatcher-idle", map[string]any{})
	d.await(t, start, 20*time.Second, "calls to every executor", func(cs []callResult) bool {
		m := servedBy(cs)
		return m["busy"] > 0 && m["e2"] > 0 && m["e3"] > 0
	})
	time.Sleep(4 * time.Second) // blackout 2 s, weights every second
	from := time.Now()
	d.await(t, from, 10*time.Second, "calls over three seconds",
		func(cs []callResult) bool { return len(cs) > 0 && time.Since(from) > 3*time.Second })
	m := servedBy(d.since(from))
	t.Logf("busy %d, e2 %d, e3 %d", m["busy"], m["e2"], m["e3"])
	if 2*m["busy"] >= min(m["e2"], m["e3"]) {
		t.Fatalf(
			"a busy executor (utilization 0.75) among idle peers got as much work as they: busy "+
				"%d, e2 %d, e3 %d",
			m["busy"], m["e2"], m["e3"])
	}
}
