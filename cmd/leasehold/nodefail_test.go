package main

import (
	"context"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// setCatalogSerfHealth sets a catalog-only node's serfHealth check, as the Consul
// leader does for a real agent (the node is created when missing).
func setCatalogSerfHealth(t *testing.T, c *api.Client, node, status string) {
	t.Helper()
	_, err := c.Catalog().Register(&api.CatalogRegistration{
		Node: node, Address: "127.0.0.1",
		Check: &api.AgentCheck{
			Node:    node,
			CheckID: health.SerfHealthCheckID,
			Name:    "Serf Health Status",
			Status:  status,
		},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
}

// leasehold and the Registrar agree on whether a session's node failed, even
// though they tell it differently. leasehold remembers that serfHealth was
// seen critical while the session was registered, across the registration
// going away and coming back (lapsedBefore). The Registrar (APIAgent.Sessions,
// used by its fence check) sees serfHealth critical now, or its ModifyIndex
// above the lease check's CreateIndex. When a failed node leaves the catalog
// (an operator's `consul force-leave`, the usual cleanup of a failed node)
// and then rejoins, the leader re-creates serfHealth (passing) on the
// member-join event at once, and the agent re-syncs its services after its
// stagger delay (up to 3 s × cluster factor after a server "joins"): the
// lease check is created after serfHealth. Were the Registrar then to see
// nothing wrong, it would keep heartbeating its session for ever while
// leasehold answered LAPSED for it and never routed it again: a live
// executor out of service until someone restarts it.
//
// The catalog history below is exactly that sequence, written through the
// catalog API (catalog-only nodes never change by themselves; Consul's
// leader would reap them at its next reconcile, 60 s away).
func TestNodeRejoinAfterForceLeaveLeaseholdAndRegistrarAgree(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	if _, err := c.KV().Put(&api.KVPair{Key: health.GenerationKey("x"), Value: []byte("1")},
		nil); err != nil {
		t.Fatal(err)
	}
	setCatalogSerfHealth(t, c, "node-x", api.HealthPassing)
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

	setCatalogSerfHealth(t, c, "node-x", api.HealthCritical) // node-x failed
	awaitState(t, fc, "x", "s1", leaseholdv1.SessionState_LAPSED)

	// `consul force-leave node-x`: the node and its registrations leave the catalog.
	if _, err := c.Catalog().Deregister(&api.CatalogDeregistration{Node: "node-x"},
		nil); err != nil {
		t.Fatal(err)
	}
	awaitGone := openEDS(t, addrs.xds)
	for eps := awaitGone(); eps.has("x", "s1"); eps = awaitGone() {
	}
	// node-x rejoins: the leader registers it with serfHealth passing, then
	// its agent's anti-entropy re-syncs the same session (lease passing).
	setCatalogSerfHealth(t, c, "node-x", api.HealthPassing)
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
	r, err := fc.CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{
			InstanceId:     "x",
			SessionId:      "s1",
			MinConsulIndex: meta.LastIndex,
		},
	)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("leasehold: %s (%s); the Registrar's fence check: status %s, node failed %v",
		r.State, r.Detail, registrarSees.Status, registrarSees.NodeFailed)
	if r.State == leaseholdv1.SessionState_LAPSED && !registrarSees.NodeFailed &&
		registrarSees.Status != health.StatusCritical &&
		registrarSees.LeaseCreateIndex == before {
		t.Fatalf(
			"leasehold answers LAPSED for x/s1 for ever, but the Registrar's fence check sees " +
				"its " +
				"session passing on a healthy node: " +
				"the live executor keeps heartbeating a session that is never routed again and " +
				"never takes a new one",
		)
	}
}

// A session on a node that failed is LAPSED for ever, and not only in the
// memory of the replicas that happened to see serfHealth critical. A replica
// started (or restarted) after the node came back, or one whose non-passing
// watch was between answers (reconnecting after an error, waiting out its
// back-off) while the node was failed, reads a passing serfHealth and a
// passing lease; it must still not answer CURRENT, with a consul_index above
// the one the first replica answered LAPSED at, nor route the session: a
// dispatcher of the first replica re-dispatched that session's tasks, and
// their late results would be confirmed at the second. What Consul still
// shows is enough to tell: serfHealth's ModifyIndex is above the lease
// check's CreateIndex (the Registrar's own rule, APIAgent.Sessions).
func TestNodeFailureLapseHoldsAtAReplicaStartedAfterTheNodeCameBack(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	if _, err := c.KV().Put(&api.KVPair{Key: health.GenerationKey("x"), Value: []byte("1")},
		nil); err != nil {
		t.Fatal(err)
	}
	setCatalogSerfHealth(t, c, "node-x", api.HealthPassing)
	catalogSession(t, c, "node-x", "x", "s1", 1, 9001)
	catalogSession(t, c, "node-y", "y", "y1", 1, 9101)

	first := startServe(t, a)
	fc1 := fencingClient(t, first.xds)
	awaitState(t, fc1, "x", "s1", leaseholdv1.SessionState_CURRENT)
	setCatalogSerfHealth(t, c, "node-x", api.HealthCritical) // node-x fails ...
	lapsed := awaitState(t, fc1, "x", "s1", leaseholdv1.SessionState_LAPSED)
	setCatalogSerfHealth(t, c, "node-x",
		api.HealthPassing) // ... and comes back a few seconds later

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ss, err := consul.NewAPIAgent(c).Sessions(ctx, "work", "x")
	if err != nil || len(ss) != 1 || !ss[0].NodeFailed {
		t.Fatalf("premise: Consul itself still shows the failure (the Registrar's rule): %+v, %v",
			ss, err)
	}

	second := startServe(t, a) // a replica started now, or the first one restarted
	fc2 := fencingClient(t, second.xds)
	r, err := fc2.CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{
			InstanceId:     "x",
			SessionId:      "s1",
			MinConsulIndex: lapsed.ConsulIndex,
		},
	)
	// not read yet
	for err == nil && r.State == leaseholdv1.SessionState_UNKNOWN && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
		r, err = fc2.CheckSession(ctx,
			&leaseholdv1.CheckSessionRequest{
				InstanceId:     "x",
				SessionId:      "s1",
				MinConsulIndex: lapsed.ConsulIndex,
			},
		)
	}
	if err != nil {
		t.Fatal(err)
	}
	routed := edsEndpoints(t, second.xds).has("x", "s1")
	if r.State == leaseholdv1.SessionState_CURRENT || routed {
		t.Fatalf(
			"replica 1 answered LAPSED at consul_index %d; replica 2 answers %s at consul_index "+
				"%d (min_consul_index %d) and routes s1: %v",
			lapsed.ConsulIndex, r.State, r.ConsulIndex, lapsed.ConsulIndex, routed)
	}
}

// The order of a node's first catalog writes is a race in Consul. When a
// node joins, its agent's anti-entropy registers the node, its services and
// their checks as soon as it learns a server, while the leader creates
// serfHealth when the member-join reaches it (gossip, then its reconcile
// queue). When the executor's registration wins, serfHealth's CreateIndex is
// above the lease check's, and the index rule (serfHealth created before the
// lease check, rewritten after it) does not apply to that session. A later
// failure of the node that heals must still be told by leasehold
// (health.Join) and by the Registrar (APIAgent.Sessions) alike: otherwise
// the replica that saw serfHealth critical would answer LAPSED for ever, a
// replica started afterwards would answer CURRENT for min_consul_index of
// that LAPSED answer and route the session, and the Registrar would keep
// heartbeating it.
//
// The catalog history is written through the catalog API: node-x's
// registration first, then its serfHealth (passing), then a failure.
func TestNodeFailureToldWhenSerfHealthWasCreatedAfterTheLease(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	if _, err := c.KV().Put(&api.KVPair{Key: health.GenerationKey("x"), Value: []byte("1")},
		nil); err != nil {
		t.Fatal(err)
	}
	catalogSession(t, c, "node-x", "x", "s1", 1, 9001)      // the agent's sync wins the race
	setCatalogSerfHealth(t, c, "node-x", api.HealthPassing) // the leader's handleAliveMember
	setCatalogSerfHealth(t, c, "node-y", api.HealthPassing)
	catalogSession(t, c, "node-y", "y", "y1", 1, 9101)

	first := startServe(t, a)
	fc1 := fencingClient(t, first.xds)
	awaitState(t, fc1, "x", "s1", leaseholdv1.SessionState_CURRENT)
	setCatalogSerfHealth(t, c, "node-x", api.HealthCritical) // node-x fails ...
	lapsed := awaitState(t, fc1, "x", "s1", leaseholdv1.SessionState_LAPSED)
	setCatalogSerfHealth(t, c, "node-x", api.HealthPassing) // ... and is back a few seconds later

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ss, err := consul.NewAPIAgent(c).Sessions(ctx, "work", "x")
	if err != nil || len(ss) != 1 {
		t.Fatalf("sessions %+v, %v", ss, err)
	}
	registrar := ss[0]

	second := startServe(t, a)
	fc2 := fencingClient(t, second.xds)
	req := &leaseholdv1.CheckSessionRequest{
		InstanceId:     "x",
		SessionId:      "s1",
		MinConsulIndex: lapsed.ConsulIndex,
	}
	r, err := fc2.CheckSession(ctx, req)
	// not read yet
	for err == nil && r.State == leaseholdv1.SessionState_UNKNOWN && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
		r, err = fc2.CheckSession(ctx, req)
	}
	if err != nil {
		t.Fatal(err)
	}
	routed := edsEndpoints(t, second.xds).has("x", "s1")
	t.Logf(
		"replica 1: LAPSED at %d; replica 2: %s at %d (routed %v); the Registrar's fence check "+
			"sees status %s, node failed %v",
		lapsed.ConsulIndex, r.State, r.ConsulIndex, routed, registrar.Status, registrar.NodeFailed)
	if r.State == leaseholdv1.SessionState_CURRENT || routed ||
		(!registrar.NodeFailed && registrar.Status != health.StatusCritical) {
		t.Fatalf(
			"node-x failed and came back after s1 registered (serfHealth created after s1's lease "+
				"check): replica 1 answers LAPSED for ever; "+
				"replica 2 answers %s with min_consul_index %d and routes s1: %v; the Registrar's "+
				"fence check sees node failed %v, status %s, so it keeps s1",
			r.State, lapsed.ConsulIndex, routed, registrar.NodeFailed, registrar.Status)
	}
}

// partitionProxy stands between a Registrar and its agent. While cut, every
// request that the agent would forward to the servers fails (as during a
// partition of the node: "No known Consul servers" / rpc error), while the
// agent-local ones (heartbeats, local service reads) still work.
type partitionProxy struct {
	srv *httptest.Server
	cut atomic.Bool
	// healthReads counts the health reads (the fence check's catalog look)
	// answered through the proxy.
	healthReads atomic.Int64
}

func newPartitionProxy(t *testing.T, a *consultest.Agent) *partitionProxy {
	u, _ := url.Parse("http://" + a.HTTPAddr())
	rp := httputil.NewSingleHostReverseProxy(u)
	p := &partitionProxy{}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if p.cut.Load() && !strings.HasPrefix(r.URL.Path, "/v1/agent/") {
			http.Error(w, "rpc error making call: No known Consul servers",
				http.StatusInternalServerError)
			return
		}
		rp.ServeHTTP(w, r)
		if strings.HasPrefix(r.URL.Path, "/v1/health/") {
			p.healthReads.Add(1)
		}
	}))
	t.Cleanup(p.srv.Close)
	return p
}

// The same with a real Registrar on a real agent: its node's serfHealth is
// (re-)created after the session registered, as when the agent's sync wins
// the join race. The node is then cut off for a few seconds (its agent still
// takes heartbeats, but cannot reach the servers, so the fence check cannot
// tell), the servers hold it failed meanwhile, and it comes back. leasehold
// answers LAPSED for ever, so the Registrar must not keep the session: the
// executor would never be routed again and never re-register.
func TestRegistrarDropsASessionLeaseholdAnswersLapsed(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	node, _, err := c.Catalog().Node(a.Node, nil)
	if err != nil || node == nil {
		t.Fatalf("node %s: %v", a.Node, err)
	}
	setSerf := func(status string) {
		t.Helper()
		if _, err := c.Catalog().Register(&api.CatalogRegistration{Node: a.Node,
			Address: node.Node.Address, SkipNodeUpdate: true,
			Check: &api.AgentCheck{Node: a.Node, CheckID: health.SerfHealthCheckID,
				Name: "Serf Health Status", Status: status}}, nil); err != nil {
			t.Fatal(err)
		}
	}
	// The node's serfHealth does not exist yet when the executor registers.
	if _, err := c.Catalog().Deregister(&api.CatalogDeregistration{Node: a.Node,
		CheckID: health.SerfHealthCheckID}, nil); err != nil {
		t.Fatal(err)
	}
	proxy := newPartitionProxy(t, a)
	pc, err := api.NewClient(&api.Config{Address: proxy.srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	const fenceEvery = 500 * time.Millisecond
	reg, s1 := runRegistrar(t, pc, consul.Config{
		InstanceID: "x", Tasks: []string{"work"}, Address: "127.0.0.1", Port: 9001,
		Version: "1.0.0", Capacity: 2,
		Lease: health.Lease{
			TTL:             2 * time.Second,
			Heartbeat:       500 * time.Millisecond,
			DeregisterAfter: time.Minute,
		},
		FenceCheck: fenceEvery, Load: func() int { return 0 },
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	setSerf(api.HealthPassing) // the leader registers the node's serfHealth

	addrs := startServe(t, a)
	fc := fencingClient(t, addrs.xds)
	awaitState(t, fc, "x", s1.ID, leaseholdv1.SessionState_CURRENT)

	proxy.cut.Store(true)       // the node is cut off ...
	setSerf(api.HealthCritical) // ... the servers hold it failed ...
	awaitState(t, fc, "x", s1.ID, leaseholdv1.SessionState_LAPSED)
	time.Sleep(300 * time.Millisecond)
	setSerf(api.HealthPassing) // ... it is back
	proxy.cut.Store(false)

	time.Sleep(6 * fenceEvery) // several fence checks, on a healed node
	r, err := fc.CheckSession(context.Background(),
		&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: s1.ID})
	if err != nil {
		t.Fatal(err)
	}
	if cur := reg.Session(); cur == s1 && s1.Err() == nil &&
		r.State == leaseholdv1.SessionState_LAPSED {
		t.Fatalf(
			"leasehold answers LAPSED for session %s (for ever: its node failed), but %s after "+
				"the node came back the Registrar still holds it: "+
				"the executor heartbeats a session that is never routed again and never takes a "+
				"new one",
			s1.ID, 6*fenceEvery)
	}
}

// The same without any catalog writing: a real client agent, a real
// Registrar, a real node failure. A graceful restart of the client agent
// (leave_on_terminate is on by default for clients) deregisters the node;
// the agent re-syncs its registrations at once; the Registrar sees its lease
// check re-created, ends the session (LossNodeFailed) and registers a new
// one right away, while the leader has not yet re-created the node's
// serfHealth (it does so on the member-join, seconds later here). The new
// session's lease check is then older than serfHealth, the blind spot of the
// index rule. The agent then hangs for a while (SIGSTOP: a long GC pause of
// the VM, a partition): the servers hold the node failed, and leasehold
// answers the session LAPSED for ever. The agent comes back: serfHealth
// passing, heartbeats accepted. The Registrar must not keep the session,
// or the replica that saw the failure would never route the executor again.
func TestRegistrarDropsASessionLapsedAfterAnAgentRestart(t *testing.T) {
	srv := consultest.Start(t)
	cl := consultest.Start(t,
		consultest.Options{JoinClientOf: srv, NodeName: "lh-restarted-client"})
	sc := srv.Client()
	// The Registrar's fence check runs every 200 ms here, to see the restart
	// quickly; by default it runs once a lease (35 s), so it usually misses a
	// failure of a few seconds. The proxy models that: the fence check cannot
	// see Consul from the node's failure until it is back.
	proxy := newPartitionProxy(t, cl)
	pc, err := api.NewClient(&api.Config{Address: proxy.srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	reg, _ := runRegistrar(t, pc, consul.Config{
		InstanceID: "x", Tasks: []string{"work"}, Address: "127.0.0.1", Port: 9001,
		Version: "1.0.0", Capacity: 2,
		Lease: health.Lease{
			TTL:             40 * time.Second,
			Heartbeat:       time.Second,
			DeregisterAfter: 10 * time.Minute,
		},
		FenceCheck: 200 * time.Millisecond, Load: func() int { return 0 },
		Logger: slog.New(slog.NewTextHandler(testWriter{t, "registrar"}, nil)),
	})
	// indexes is (lease check CreateIndex of the current session, serfHealth CreateIndex).
	indexes := func(sess string) (uint64, uint64) {
		checks, _, err := sc.Health().Node(cl.Node, nil)
		if err != nil {
			return 0, 0
		}
		var l, s uint64
		for _, c := range checks {
			if _, id, _, ok := health.ParseCheckID(c.CheckID); ok && id == sess {
				l = c.CreateIndex
			}
			if c.CheckID == health.SerfHealthCheckID {
				s = c.CreateIndex
			}
		}
		return l, s
	}
	var sess *consul.Session
	for i := 0; i < 8 && sess == nil; i++ {
		before := reg.Session()
		cl.RestartKeepingState()
		deadline := time.Now().Add(8 * time.Second)
		for time.Now().Before(deadline) {
			cur := reg.Session()
			if l, s := indexes(cur.ID); cur != before && l != 0 && s != 0 {
				t.Logf("restart %d: new session %s, lease check created %d, serfHealth created %d",
					i+1, cur.ID, l, s)
				if l < s {
					sess = cur
				}
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	if sess == nil {
		t.Skip(
			"the Registrar's new session never registered before the leader re-created " +
				"serfHealth " +
				"in 8 agent restarts")
	}
	addrs := startServe(t, srv)
	fc := fencingClient(t, addrs.xds)
	awaitState(t, fc, "x", sess.ID, leaseholdv1.SessionState_CURRENT)

	proxy.cut.Store(true)
	cl.Freeze() // the node hangs: the servers declare it failed
	lapsed := awaitState(t, fc, "x", sess.ID, leaseholdv1.SessionState_LAPSED)
	cl.Thaw()
	consultest.WaitFor(t, 30*time.Second, "node alive again", func() bool {
		checks, _, err := sc.Health().Node(cl.Node, nil)
		if err != nil {
			return false
		}
		for _, c := range checks {
			if c.CheckID == health.SerfHealthCheckID {
				return c.Status == api.HealthPassing
			}
		}
		return false
	})
	proxy.cut.Store(false)
	time.Sleep(5 * time.Second) // 25 fence checks on a healed node

	second := startServe(t, srv)
	fc2 := fencingClient(t, second.xds)
	qctx, qcancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer qcancel()
	req := &leaseholdv1.CheckSessionRequest{
		InstanceId:     "x",
		SessionId:      sess.ID,
		MinConsulIndex: lapsed.ConsulIndex,
	}
	r2, err := fc2.CheckSession(qctx, req)
	// not read yet
	for i := 0; i < 100 && err == nil && r2.State == leaseholdv1.SessionState_UNKNOWN; i++ {
		time.Sleep(50 * time.Millisecond)
		r2, err = fc2.CheckSession(qctx, req)
	}
	t.Logf("replica 2: %v %v", r2, err)
	r1, err := fc.CheckSession(context.Background(),
		&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: sess.ID})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("replica 1: %v", r1)
	if cur := reg.Session(); cur == sess && sess.Err() == nil &&
		r1.State == leaseholdv1.SessionState_LAPSED {
		t.Fatalf(
			"after a real node failure (agent frozen, declared failed, back): replica 1 answers "+
				"LAPSED for ever, a replica started now answers %s (min_consul_index %d), "+
				"and the Registrar still holds session %s and heartbeats it: the executor is "+
				"never routed by replica 1 again",
			r2.State, lapsed.ConsulIndex, sess.ID)
	}
}
