package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/server"
)

// TestBadRegistrationsAreExcludedNotFatal: registrations that break the
// contract in every way Consul allows are excluded with a reason, and
// everyone else keeps being served.
func TestBadRegistrationsAreExcludedNotFatal(t *testing.T) {
	a := consultest.Start(t)
	startExecutor(t, a, "good", "1.0.0")
	c := a.Client()
	labels := map[string]string{} // 58 labels of the longest value Consul accepts, and nothing else
	for i := range 58 {
		labels[fmt.Sprintf("label_k%02d", i)] = strings.Repeat("v", 512)
	}
	bad := []map[string]string{
		{"instance_id": "b1", "session_id": "s", "generation": "1",
			"version": "not-semver", "capacity": "4", "state": "active"},
		{"instance_id": "b2", "session_id": "s", "generation": "1",
			"version": "1.0.0", "capacity": "abc", "state": "active"},
		{"instance_id": "b3", "session_id": "s", "generation": "1",
			"version": "1.0.0", "capacity": "-1", "state": "sleeping"},
		{"instance_id": strings.Repeat("i", 500), "session_id": "s", "generation": "1",
			"version": "1.0.0", "capacity": "4", "state": "active"},
		// No instance and no generation.
		{"session_id": "s", "version": "1.0.0", "capacity": "4", "state": "active"},
		labels, // no contract keys at all, 58 maximal labels
	}
	for i, meta := range bad {
		id := fmt.Sprintf("work:bad-%d", i)
		err := c.Agent().ServiceRegister(&api.AgentServiceRegistration{ID: id, Name: "work",
			Tags: []string{"leasehold"}, Address: "127.0.0.1", Port: 31000 + i, Meta: meta,
			Checks: api.AgentServiceChecks{{CheckID: "lease:bad:" + fmt.Sprint(i),
				TTL: "1h", Status: "passing"}}})
		if err != nil {
			t.Fatalf("Consul refused bad registration %d: %v", i, err)
		}
	}
	addrs := startServe(t, a)
	d := startDispatcher(t, addrs.xds, "dispatcher", map[string]any{})
	start := time.Now()
	d.await(t, start, 20*time.Second, "calls to the good executor", func(cs []callResult) bool {
		return servedBy(cs)["good"] > 20
	})
	for _, call := range d.since(start) {
		if call.Err != "" { // nothing listens behind the bad registrations
			t.Fatalf("a call failed (was a bad registration routed?): %s", call.Err)
		}
	}
	var ex server.ExplainExecutors
	getBody(t, "http://"+addrs.admin+"/debug/executors?task=work", &ex)
	reasons := map[string]int{}
	for _, e := range ex.Executors {
		reasons[e.Verdicts[0].Reason]++
		if e.Verdicts[0].Reason == string(health.ReasonBadMetadata) && e.MetadataError == "" {
			t.Errorf("%s excluded without the error", e.ServiceID)
		}
	}
	if reasons[string(health.ReasonBadMetadata)] != len(bad) || reasons[""] != 1 {
		t.Fatalf("verdicts %v, want %d bad-metadata and 1 eligible", reasons, len(bad))
	}
}
