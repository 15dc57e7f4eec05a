package main

import (
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/server"
)

// A real grpc-go xds:/// dispatcher ACKs routes and clusters carrying a full
// dispatch policy set live through the rules in Consul KV (retries with
// backoff, a deadline, max_requests, outlier ejection, lrs_server self), and
// its calls keep reaching both executors: a NACK would leave it on the
// previous versions, a route it could not apply with no route at all.
func TestFullDispatchPolicyAckedByGRPCLive(t *testing.T) {
	a := consultest.Start(t)
	a.SettleSync()
	startExecutor(t, a, "e1", "1.0.0")
	startExecutor(t, a, "e2", "1.0.0")
	var log syncBuffer
	addrs := startServeTo(t, a, &log)
	start := time.Now()
	d := startDispatcher(t, addrs.xds, "dispatcher-policy", map[string]any{})
	bothServe := func(cs []callResult) bool {
		m := servedBy(cs)
		return m["e1"] > 0 && m["e2"] > 0
	}
	d.await(t, start, 20*time.Second, "calls to both executors (default policy)", bothServe)

	state := func(typeURL string) *server.TypeInfo {
		var ds struct {
			Dispatchers []server.StreamInfo `json:"dispatchers"`
		}
		getBody(t, "http://"+addrs.admin+"/debug/dispatchers", &ds)
		for _, s := range ds.Dispatchers {
			if s.NodeID == "dispatcher-policy" {
				return s.Types[typeURL]
			}
		}
		return nil
	}
	types := []string{resource.RouteType, resource.ClusterType}
	acked := func() map[string]string {
		t.Helper()
		out := map[string]string{}
		for _, typ := range types {
			ti := state(typ)
			if ti != nil && ti.LastNack != nil {
				t.Fatalf("grpc-go NACKed %s: %+v\nserve log:\n%s", typ, ti.LastNack, log.String())
			}
			if ti != nil && ti.LastSent != "" && ti.LastAcked == ti.LastSent {
				out[typ] = ti.LastAcked
			}
		}
		return out
	}
	var before map[string]string
	for deadline := time.Now().Add(15 * time.Second); len(before) < len(types); before = acked() {
		if time.Now().After(deadline) {
			t.Fatalf("the default policy's route and cluster were never ACKed: %v", before)
		}
		time.Sleep(50 * time.Millisecond)
	}

	const rules = `{"dispatch":{"default":{
		"retry":{"on":["UNAVAILABLE","RESOURCE_EXHAUSTED"],"num_retries":4,
			"backoff":{"base":"10ms","max":"100ms"}},
		"max_requests":64,"deadline":"20s",
		"outlier":{"failure_percentage":{"threshold":50,"minimum_hosts":2,"request_volume":10},
			"consecutive_failures":5,"interval":"1s","base_ejection_time":"5s",
			"max_ejection_percent":50}}}}`
	if _, err := a.Client().KV().Put(&api.KVPair{Key: consul.RulesKey, Value: []byte(rules)},
		nil); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(15 * time.Second); ; {
		now := acked()
		if now[resource.RouteType] != "" && now[resource.RouteType] != before[resource.RouteType] &&
			now[resource.ClusterType] != "" &&
			now[resource.ClusterType] != before[resource.ClusterType] {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the policy's route and cluster were not both ACKed within 15 s: %v "+
				"(before %v)\nserve log:\n%s", now, before, log.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	from := time.Now()
	d.await(t, from, 15*time.Second, "calls to both executors under the full policy", bothServe)
	for _, c := range d.since(from) {
		if c.Err != "" {
			t.Fatalf("a call failed under the full policy: %s", c.Err)
		}
	}
}
