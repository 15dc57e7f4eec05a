package main

import (
	"testing"
	"time"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
)

// Executors report utilization as their task ends, without that task: an
// idle peer reports 0, which grpc-go's weighted round robin ignores (it
// takes only reports with utilization and qps above 0), so the idle peers
// carry no weight of their own and get the mean of the weighted ones —
// the busy executor's. The busy one must still get clearly less.
func TestAttack16IdlePeersOutweighABusyExecutor(t *testing.T) {
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
	d.await(t, from, 10*time.Second, "calls over three seconds", func(cs []callResult) bool { return len(cs) > 0 && time.Since(from) > 3*time.Second })
	m := servedBy(d.since(from))
	t.Logf("busy %d, e2 %d, e3 %d", m["busy"], m["e2"], m["e3"])
	if 2*m["busy"] >= min(m["e2"], m["e3"]) {
		t.Fatalf("a busy executor (utilization 0.75) among idle peers got as much work as they: busy %d, e2 %d, e3 %d", m["busy"], m["e2"], m["e3"])
	}
}
