package main

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/fleet"
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

// A lapse stays final when the pruner runs past the retention: x/s1's
// lapse was recorded 74 h (and more) ago, but its registration is still in
// the catalog, so its mark stays; a replica started afterwards, with x/s1's
// check passing again, neither routes it nor answers it CURRENT. Once the
// registration is gone for the retention, the mark goes.
func TestLapseStaysFinalWhenItsMarkIsPruned(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	catalogSession(t, c, "node-x", "x", "s1", 1, 9211)
	catalogSession(t, c, "node-y", "y", "y1", 1, 9212) // a bystander: routed throughout

	first, stop := startServeStoppable(t, a)
	fc := fencingClient(t, first.xds)
	awaitState(t, fc, "x", "s1", leaseholdv1.SessionState_CURRENT)
	setLeaseStatus(t, c, "node-x", "x", "s1", api.HealthCritical)
	awaitState(t, fc, "x", "s1", leaseholdv1.SessionState_LAPSED)
	key := health.LapseMarkKey("x", "s1")
	waitKey(t, c, key, 10*time.Second)
	stop()

	// A replica's pruner, its clock moved past the retention, three times.
	clock := clockwork.NewFakeClock()
	pruner := consul.NewLapseRecorder(c, consul.LapseRecorderConfig{Retention: fleet.DefaultHistoryRetention, Clock: clock})
	prune := func() {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := pruner.Prune(ctx); err != nil {
			t.Fatalf("prune: %v", err)
		}
	}
	for range 3 {
		prune()
		clock.Advance(fleet.DefaultHistoryRetention + time.Hour)
	}
	prune()
	if p, _, err := c.KV().Get(key, nil); err != nil || p == nil {
		t.Fatalf("x/s1's lapse mark pruned (%v) while x/s1 is registered", err)
	}

	setLeaseStatus(t, c, "node-x", "x", "s1", api.HealthPassing) // the old session heartbeats again
	l := startServe(t, a)
	fc = fencingClient(t, l.xds)
	awaitState(t, fc, "y", "y1", leaseholdv1.SessionState_CURRENT) // the fleet is read
	r := awaitState(t, fc, "x", "s1", leaseholdv1.SessionState_LAPSED)
	if eps := edsEndpoints(t, l.xds); eps.has("x", "s1") || !eps.has("y", "y1") {
		t.Fatalf("endpoints %v: x/s1 routed (or y/y1 not) after the pruner ran", eps)
	}
	t.Logf("a replica started after the prunes: x/s1 %s (%s)", r.State, r.Detail)

	if _, err := c.Catalog().Deregister(&api.CatalogDeregistration{Node: "node-x", ServiceID: health.ServiceID("x", "work")}, nil); err != nil {
		t.Fatal(err)
	}
	prune()
	clock.Advance(fleet.DefaultHistoryRetention)
	prune()
	if p, _, err := c.KV().Get(key, nil); err != nil || p != nil {
		t.Fatalf("x/s1's lapse mark %v (%v): want pruned, its registration gone for the retention", p, err)
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
