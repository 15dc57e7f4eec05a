package main

import (
	"context"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// attackCatalogSerf sets a catalog-only node's serfHealth check, as the Consul
// leader does for a real agent (the node is created when missing).
func attackCatalogSerf(t *testing.T, c *api.Client, node, status string) {
	t.Helper()
	_, err := c.Catalog().Register(&api.CatalogRegistration{
		Node: node, Address: "127.0.0.1",
		Check: &api.AgentCheck{Node: node, CheckID: health.SerfHealthCheckID, Name: "Serf Health Status", Status: status},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
}

// TestAttackNodeFailureSeenByLeaseholdButNotByTheRegistrar: leasehold and
// the Registrar define "this session's node failed" differently. leasehold:
// serfHealth was ever seen critical while the session was registered, and it
// remembers that across the registration going away and coming back
// (lapsedBefore). The Registrar (APIAgent.Sessions, used by its fence check):
// serfHealth is critical now, or its ModifyIndex is above the lease check's
// CreateIndex. When a failed node leaves the catalog (an operator's
// `consul force-leave`, which is the usual cleanup of a failed node) and then
// rejoins, the leader re-creates serfHealth (passing) on the member-join
// event at once, and the agent re-syncs its services after its stagger delay
// (up to 3 s × cluster factor after a server "joins"): the lease check is
// created after serfHealth. The Registrar then sees nothing wrong and keeps
// heartbeating its session for ever, while leasehold answers LAPSED for it
// and never routes it again: a live executor is out of service until someone
// restarts it.
//
// The catalog history below is exactly that sequence, written through the
// catalog API (catalog-only nodes never change by themselves; Consul's
// leader would reap them at its next reconcile, 60 s away).
func TestAttackNodeFailureSeenByLeaseholdButNotByTheRegistrar(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	if _, err := c.KV().Put(&api.KVPair{Key: health.GenerationKey("x"), Value: []byte("1")}, nil); err != nil {
		t.Fatal(err)
	}
	attackCatalogSerf(t, c, "node-x", api.HealthPassing)
	catalogSession(t, c, "node-x", "x", "s1", 1, 9001)
	catalogSession(t, c, "node-y", "y", "y1", 1, 9101) // keeps the task type alive

	addrs := startServe(t, a)
	fc := fencingClient(t, addrs.xds)
	awaitState(t, fc, "x", "s1", leaseholdv1.SessionState_CURRENT)
	before := func() uint64 { // the lease check's CreateIndex as the Registrar first saw it
		ss, err := consul.NewAPIAgent(c).Sessions(context.Background(), "work", "x")
		if err != nil || len(ss) != 1 {
			t.Fatalf("sessions %v, %v", ss, err)
		}
		return ss[0].LeaseCreateIndex
	}()

	attackCatalogSerf(t, c, "node-x", api.HealthCritical) // node-x failed
	awaitState(t, fc, "x", "s1", leaseholdv1.SessionState_LAPSED)

	// `consul force-leave node-x`: the node and its registrations leave the catalog.
	if _, err := c.Catalog().Deregister(&api.CatalogDeregistration{Node: "node-x"}, nil); err != nil {
		t.Fatal(err)
	}
	awaitGone := openEDS(t, addrs.xds)
	for eps := awaitGone(); eps.has("x", "s1"); eps = awaitGone() {
	}
	// node-x rejoins: the leader registers it with serfHealth passing, then
	// its agent's anti-entropy re-syncs the same session (lease passing).
	attackCatalogSerf(t, c, "node-x", api.HealthPassing)
	catalogSession(t, c, "node-x", "x", "s1", 1, 9001)

	// What the executor's Registrar sees at its fence check.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var registrarSees *consul.RemoteSession
	for registrarSees == nil {
		ss, err := consul.NewAPIAgent(c).Sessions(ctx, "work", "x")
		if err != nil {
			t.Fatal(err)
		}
		for i := range ss {
			if ss[i].SessionID == "s1" {
				registrarSees = &ss[i]
			}
		}
	}
	// What leasehold answers, once it has read the re-sync.
	_, meta, err := c.Catalog().Service("work", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err := fc.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1", MinConsulIndex: meta.LastIndex})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("leasehold: %s (%s); the Registrar's fence check: status %s, node failed %v", r.State, r.Detail, registrarSees.Status, registrarSees.NodeFailed)
	if r.State == leaseholdv1.SessionState_LAPSED && !registrarSees.NodeFailed && registrarSees.Status != health.StatusCritical && registrarSees.LeaseCreateIndex == before {
		t.Fatalf("leasehold answers LAPSED for x/s1 for ever, but the Registrar's fence check sees its session passing on a healthy node: " +
			"the live executor keeps heartbeating a session that is never routed again and never takes a new one")
	}
}

// TestAttackNodeFailureLapseIsMemoryNotConsul: a session on a node that
// failed is LAPSED "for ever" — but only in the memory of the replicas that
// happened to see serfHealth critical. A replica started (or restarted)
// after the node came back, or one whose non-passing watch was between
// answers (reconnecting after an error, waiting out its back-off) while the
// node was failed, reads a passing serfHealth and a passing lease and answers
// CURRENT, with a consul_index above the one the first replica answered
// LAPSED at — and routes the session. A dispatcher of the first replica
// re-dispatched that session's tasks; the late results are confirmed at the
// second. What Consul still shows is enough to tell: serfHealth's
// ModifyIndex is above the lease check's CreateIndex (the Registrar's own
// rule, APIAgent.Sessions).
func TestAttackNodeFailureLapseIsMemoryNotConsul(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	if _, err := c.KV().Put(&api.KVPair{Key: health.GenerationKey("x"), Value: []byte("1")}, nil); err != nil {
		t.Fatal(err)
	}
	attackCatalogSerf(t, c, "node-x", api.HealthPassing)
	catalogSession(t, c, "node-x", "x", "s1", 1, 9001)
	catalogSession(t, c, "node-y", "y", "y1", 1, 9101)

	first := startServe(t, a)
	fc1 := fencingClient(t, first.xds)
	awaitState(t, fc1, "x", "s1", leaseholdv1.SessionState_CURRENT)
	attackCatalogSerf(t, c, "node-x", api.HealthCritical) // node-x fails ...
	lapsed := awaitState(t, fc1, "x", "s1", leaseholdv1.SessionState_LAPSED)
	attackCatalogSerf(t, c, "node-x", api.HealthPassing) // ... and comes back a few seconds later

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ss, err := consul.NewAPIAgent(c).Sessions(ctx, "work", "x")
	if err != nil || len(ss) != 1 || !ss[0].NodeFailed {
		t.Fatalf("premise: Consul itself still shows the failure (the Registrar's rule): %+v, %v", ss, err)
	}

	second := startServe(t, a) // a replica started now, or the first one restarted
	fc2 := fencingClient(t, second.xds)
	r, err := fc2.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1", MinConsulIndex: lapsed.ConsulIndex})
	for err == nil && r.State == leaseholdv1.SessionState_UNKNOWN && ctx.Err() == nil { // not read yet
		time.Sleep(50 * time.Millisecond)
		r, err = fc2.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1", MinConsulIndex: lapsed.ConsulIndex})
	}
	if err != nil {
		t.Fatal(err)
	}
	routed := edsEndpoints(t, second.xds).has("x", "s1")
	if r.State == leaseholdv1.SessionState_CURRENT || routed {
		t.Fatalf("replica 1 answered LAPSED at consul_index %d; replica 2 answers %s at consul_index %d (min_consul_index %d) and routes s1: %v",
			lapsed.ConsulIndex, r.State, r.ConsulIndex, lapsed.ConsulIndex, routed)
	}
}
