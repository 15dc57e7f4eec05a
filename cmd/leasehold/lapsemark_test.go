package main

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// setLeaseStatus rewrites a catalogSession's lease check status.
func setLeaseStatus(t *testing.T, c *api.Client, node, instance, session, status string) {
	t.Helper()
	_, err := c.Catalog().Register(&api.CatalogRegistration{
		Node: node, Address: "127.0.0.1", SkipNodeUpdate: true,
		Check: &api.AgentCheck{Node: node, CheckID: health.CheckID(instance, session, "work"), Name: "lease",
			ServiceID: health.ServiceID(instance, "work"), Status: status},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
}

// A lapse is final across restarts and replicas: leasehold sees x/s1's
// lease lapse, is stopped, the check turns passing again (a process that
// resumed heartbeating its old session), and neither leasehold started
// again nor a replica that never saw the lapse routes x/s1 or answers it
// CURRENT — they read the lapse mark the first one wrote in Consul KV.
func TestLapseIsFinalAcrossRestartsAndReplicas(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	catalogSession(t, c, "node-x", "x", "s1", 1, 9201)
	catalogSession(t, c, "node-y", "y", "y1", 1, 9202) // a bystander: routed throughout

	first, stop := startServeStoppable(t, a)
	fc := fencingClient(t, first.xds)
	awaitState(t, fc, "x", "s1", leaseholdv1.SessionState_CURRENT)
	setLeaseStatus(t, c, "node-x", "x", "s1", api.HealthCritical)
	awaitState(t, fc, "x", "s1", leaseholdv1.SessionState_LAPSED)
	waitKey(t, c, health.LapseMarkKey("x", "s1"), 10*time.Second)
	stop()

	setLeaseStatus(t, c, "node-x", "x", "s1", api.HealthPassing) // the old session heartbeats again

	for _, name := range []string{"restarted", "a replica started later"} {
		l := startServe(t, a)
		fc := fencingClient(t, l.xds)
		awaitState(t, fc, "y", "y1", leaseholdv1.SessionState_CURRENT) // the fleet is read
		r := awaitState(t, fc, "x", "s1", leaseholdv1.SessionState_LAPSED)
		if eps := edsEndpoints(t, l.xds); eps.has("x", "s1") || !eps.has("y", "y1") {
			t.Fatalf("%s: endpoints %v: x/s1 routed (or y/y1 not) although its lapse was recorded", name, eps)
		}
		t.Logf("%s: x/s1 %s (%s)", name, r.State, r.Detail)
	}
}

// startServeStoppable is startServe with a stop the test calls itself.
func startServeStoppable(t *testing.T, a *consultest.Agent) (listening, func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	bound, served := make(chan listening, 1), make(chan error, 1)
	cfg := &serveConfig{consulAddr: a.HTTPAddr(), xdsAddr: "127.0.0.1:0", adminAddr: "127.0.0.1:0", tag: "leasehold", consulMaxConns: 8}
	go func() { served <- serve(ctx, cfg, slog.New(slog.NewTextHandler(testWriter{t, "serve"}, nil)), bound) }()
	var l listening
	select {
	case l = <-bound:
	case err := <-served:
		t.Fatalf("serve: %v", err)
	}
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			cancel()
			if err := <-served; err != nil {
				t.Errorf("serve: %v", err)
			}
		}
	}
	t.Cleanup(stop)
	return l, stop
}

// waitKey waits (blocking queries) until key exists.
func waitKey(t *testing.T, c *api.Client, key string, timeout time.Duration) *api.KVPair {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var index uint64
	for {
		p, meta, err := c.KV().Get(key, (&api.QueryOptions{WaitIndex: index, WaitTime: timeout}).WithContext(ctx))
		if err != nil {
			t.Fatalf("%s never written: %v", key, err)
		}
		if p != nil {
			return p
		}
		index = meta.LastIndex
	}
}
