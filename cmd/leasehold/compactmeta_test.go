package main

import (
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
)

// Real grpc-go dispatchers asking for compact endpoint metadata (session, or
// none) accept those load assignments: their calls spread over the
// executors, and a lapsed executor gets no more of them.
func TestGRPCDispatchersWithCompactEndpointMetadata(t *testing.T) {
	a := consultest.Start(t)
	a.SettleSync()
	c := a.Client()
	e1 := startExecutor(t, a, "e1", "1.0.0")
	startExecutor(t, a, "e2", "1.0.0")
	addrs := startServe(t, a)
	start := time.Now()
	both := func(cs []callResult) bool {
		m := servedBy(cs)
		return m["e1"] > 0 && m["e2"] > 0
	}
	var ds []*dispatcher
	for _, form := range []string{"session", "none"} {
		d := startDispatcher(t, addrs.xds, "dispatcher-"+form,
			map[string]any{"endpoint_metadata": form})
		d.await(t, start, 20*time.Second, form+": calls spread over e1 and e2", both)
		ds = append(ds, d)
	}
	var debug struct {
		Dispatchers []struct {
			NodeID           string `json:"node_id"`
			EndpointMetadata string `json:"endpoint_metadata"`
		} `json:"dispatchers"`
	}
	getBody(t, "http://"+addrs.admin+"/debug/dispatchers", &debug)
	forms := map[string]string{}
	for _, d := range debug.Dispatchers {
		forms[d.NodeID] = d.EndpointMetadata
	}
	if forms["dispatcher-session"] != "session" || forms["dispatcher-none"] != "none" {
		t.Fatalf("streams' endpoint metadata %v", forms)
	}
	e1.silent.Store(true)
	lapsed := awaitCheck(t, c, "e1", api.HealthCritical)
	margin := lapsed.Add(300 * time.Millisecond)
	for _, d := range ds {
		d.await(t, time.Now().Add(time.Second), 10*time.Second, "calls after the lapse",
			func(cs []callResult) bool { return len(cs) > 50 })
		if n := servedBy(d.since(margin))["e1"]; n > 0 {
			t.Fatalf("%d calls reached e1 more than 300ms after its lease lapsed", n)
		}
	}
}
