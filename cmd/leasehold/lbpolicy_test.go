package main

import (
	"fmt"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/server"
)

// Every policy's cluster is accepted by a real grpc-go xds:/// dispatcher:
// the first from --lb-policy, every other switched to live through the
// rules in Consul KV. Each switch must reach the connected client (a new
// cluster version sent and ACKed, never NACKed), and calls keep reaching
// every executor under each policy.
func TestEveryLBPolicyAckedByGRPCLive(t *testing.T) {
	a := consultest.Start(t)
	a.SettleSync()
	startExecutor(t, a, "e1", "1.0.0")
	startExecutor(t, a, "e2", "1.0.0")
	var log syncBuffer
	addrs := startServeTo(t, a, &log, func(c *serveConfig) { c.lbPolicy = health.LBLeastRequest })
	start := time.Now()
	d := startDispatcher(t, addrs.xds, "dispatcher-lb", map[string]any{})
	d.await(t, start, 20*time.Second, "calls to both executors (least_request)",
		func(cs []callResult) bool {
			m := servedBy(cs)
			return m["e1"] > 0 && m["e2"] > 0
		},
	)

	clusterState := func() *server.TypeInfo {
		var ds struct {
			Dispatchers []server.StreamInfo `json:"dispatchers"`
		}
		getBody(t, "http://"+addrs.admin+"/debug/dispatchers", &ds)
		for _, s := range ds.Dispatchers {
			if s.NodeID == "dispatcher-lb" {
				if ti := s.Types[resource.ClusterType]; ti != nil {
					return ti
				}
			}
		}
		return nil
	}
	awaitAcked := func(policy string, not map[string]string) string {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for {
			ti := clusterState()
			if ti != nil && ti.LastNack != nil {
				t.Fatalf("%s: grpc-go NACKed the cluster: %+v\nserve log:\n%s",
					policy, ti.LastNack, log.String())
			}
			if ti != nil && ti.LastSent != "" && ti.LastAcked == ti.LastSent {
				if _, seen := not[ti.LastAcked]; !seen {
					return ti.LastAcked
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf(
					"%s: no new cluster version ACKed within 15 s (state %+v, versions before %v)",
					policy, ti, not)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	versions := map[string]string{} // version → policy
	versions[awaitAcked("least_request (flag)", versions)] = "least_request"

	for _, p := range []health.LBPolicy{health.LBRoundRobin, health.LBWeightedRoundRobin,
		health.LBLeastRequest} {
		rules := fmt.Sprintf(`{"load_balancing":{"default":%q}}`, p)
		if _, err := a.Client().KV().Put(&api.KVPair{Key: consul.RulesKey, Value: []byte(rules)},
			nil); err != nil {
			t.Fatal(err)
		}
		if p == health.LBLeastRequest {
			// The same content as the flag's: the version it had before.
			deadline := time.Now().Add(15 * time.Second)
			for {
				ti := clusterState()
				if ti != nil && ti.LastNack != nil {
					t.Fatalf("%s: NACK %+v", p, ti.LastNack)
				}
				if ti != nil && versions[ti.LastAcked] == "least_request" {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf(
						"back to least_request: state %+v, want the version it had under the flag "+
							"(%v)",
						ti, versions)
				}
				time.Sleep(50 * time.Millisecond)
			}
		} else {
			versions[awaitAcked(string(p), versions)] = string(p)
		}
		from := time.Now()
		d.await(t, from, 15*time.Second, "calls to both executors under "+string(p),
			func(cs []callResult) bool {
				m := servedBy(cs)
				return m["e1"] > 0 && m["e2"] > 0
			},
		)
	}

	// A rules change that leaves load_balancing alone sends no new clusters.
	before := clusterState()
	if _, err := a.Client().KV().Put(&api.KVPair{Key: consul.RulesKey,
		Value: []byte(`{"load_balancing":{"default":"least_request"},"safety_limit":0.9}`)},
		nil); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	if after := clusterState(); after.LastSent != before.LastSent ||
		!after.SentAt.Equal(before.SentAt) {
		t.Fatalf("an unrelated rules change resent the clusters: %+v → %+v", before, after)
	}
}
