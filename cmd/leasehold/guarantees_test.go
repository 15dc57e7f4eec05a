package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// catalogSession registers, straight into the catalog (no agent behind it,
// so nothing ever changes by itself), one session of instance on node with
// its lease check passing.
func catalogSession(
	t *testing.T, c *api.Client, node, instance, session string, generation uint64, port int,
) {
	t.Helper()
	reg := health.Registration{InstanceID: instance, SessionID: session, Generation: generation,
		Task: "work", Address: "127.0.0.1", Port: port, Version: "1.0.0", Capacity: 4,
		State: health.StateActive}
	_, err := c.Catalog().Register(&api.CatalogRegistration{
		Node: node, Address: "127.0.0.1", SkipNodeUpdate: true,
		Service: &api.AgentService{ID: health.ServiceID(instance, "work"), Service: "work",
			Tags: []string{"leasehold"}, Address: "127.0.0.1", Port: port, Meta: reg.Meta()},
		Check: &api.AgentCheck{Node: node, CheckID: health.CheckID(instance, session, "work"),
			Name: "lease", ServiceID: health.ServiceID(instance, "work"),
			Status: api.HealthPassing},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
}

// TestGenerationsOrderTheSameOnEveryReplica: generation 6 of an instance
// deregisters while generation 5 lingers on another node. A replica that saw
// 6, a replica started afterwards and a restarted replica all call 5 STALE
// and route none of it, because the order comes from Consul KV, not from
// what one replica happened to see. Deleting the generation key fences
// nothing for ever: 5 is then the newest session Consul knows.
func TestGenerationsOrderTheSameOnEveryReplica(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	if _, err := c.KV().Put(&api.KVPair{Key: health.GenerationKey("x"), Value: []byte("6")},
		nil); err != nil {
		t.Fatal(err)
	}
	catalogSession(t, c, "node-five", "x", "s5", 5, 9005)
	catalogSession(t, c, "node-six", "x", "s6", 6, 9006)
	catalogSession(t, c, "node-five", "y", "y1", 1, 9101) // keeps the task type alive

	first := startServe(t, a)
	fc := fencingClient(t, first.xds)
	awaitState(t, fc, "x", "s5", leaseholdv1.SessionState_STALE)
	awaitState(t, fc, "x", "s6", leaseholdv1.SessionState_CURRENT)

	if _, err := c.Catalog().Deregister(&api.CatalogDeregistration{Node: "node-six",
		ServiceID: health.ServiceID("x", "work")}, nil); err != nil {
		t.Fatal(err)
	}
	awaitGone := openEDS(t, first.xds)
	for eps := awaitGone(); eps.has("x", "s6"); eps = awaitGone() {
	}

	second := startServe(t, a) // a new replica, or the first one restarted
	for _, r := range []listening{first, second} {
		st := awaitState(t, fencingClient(t, r.xds), "x", "s5", leaseholdv1.SessionState_STALE)
		if st.NewerGeneration != 6 {
			t.Fatalf("replica %s: STALE answer %v, want newer generation 6", r.xds, st)
		}
		if eps := edsEndpoints(t, r.xds); eps.has("x", "s5") || !eps.has("y", "y1") {
			t.Fatalf("replica %s routes %v: want y1 and not the stale x/s5", r.xds, eps)
		}
	}

	// An operator deletes the generation keys: nothing stays fenced.
	if _, err := c.KV().DeleteTree(health.GenerationKeyPrefix, nil); err != nil {
		t.Fatal(err)
	}
	for _, r := range []listening{first, second} {
		awaitState(t, fencingClient(t, r.xds), "x", "s5", leaseholdv1.SessionState_CURRENT)
	}
}

// TestLiveExecutorSurvivesDeletedGenerationKeys: a real executor keeps being
// routed and CURRENT when its generation key is deleted, and so does its
// next session after a restart (the generation then starts again from the
// highest registered one).
func TestLiveExecutorSurvivesDeletedGenerationKeys(t *testing.T) {
	a := consultest.Start(t)
	e := startExecutor(t, a, "x", "1.0.0")
	addrs := startServe(t, a)
	fc := fencingClient(t, addrs.xds)
	s1 := e.reg.Session()
	awaitState(t, fc, "x", s1.ID, leaseholdv1.SessionState_CURRENT)
	if _, err := a.Client().KV().Delete(health.GenerationKey("x"), nil); err != nil {
		t.Fatal(err)
	}
	// Wait until leasehold has read the deletion (its view's index passes
	// the delete's), then it must still vouch for the session.
	_, meta, err := a.Client().KV().Get(health.GenerationKey("x"), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	r, err := fc.CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: s1.ID,
			MinConsulIndex: meta.LastIndex})
	if err != nil || r.State != leaseholdv1.SessionState_CURRENT {
		t.Fatalf("after the key was deleted: %v, %v", r, err)
	}
	if eps := edsEndpoints(t, addrs.xds); !eps.has("x", s1.ID) {
		t.Fatalf("routes %v without x", eps)
	}
	e.stop() // the process restarts: its next session must still be newer
	<-e.reg.Done()
	e2 := startExecutor(t, a, "x", "1.0.0")
	awaitState(t, fc, "x", e2.reg.Session().ID, leaseholdv1.SessionState_CURRENT)
	for next := openEDS(t, addrs.xds); ; {
		if eps := next(); eps.has("x", e2.reg.Session().ID) {
			break
		}
	}
}

// runRegistrar runs a Registrar through the agent client until the test
// ends and returns it with its first session.
func runRegistrar(
	t *testing.T, client *api.Client, cfg consul.Config,
) (*consul.Registrar, *consul.Session) {
	t.Helper()
	reg, err := consul.NewRegistrar(consul.NewAPIAgent(client), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go reg.Run(ctx)
	t.Cleanup(func() { cancel(); <-reg.Done() })
	wctx, wcancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer wcancel()
	s1, err := reg.WaitSession(wctx, nil)
	if err != nil {
		t.Fatalf("%s never registered: %v", cfg.InstanceID, err)
	}
	return reg, s1
}

// TestNodeFailureIsAFinalLapse: an executor's Consul agent is frozen until
// the servers declare its node failed, then resumed, shorter than the lease:
// the session's own check is still passing, but leasehold never routes it
// again and answers LAPSED; the executor's Registrar notices at its next
// fence check and comes back under a new session, which is routed.
func TestNodeFailureIsAFinalLapse(t *testing.T) {
	server := consultest.Start(t)
	node := consultest.Start(t, consultest.Options{NodeName: "frozen-node", JoinClientOf: server})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lis.Close() })
	reg, s1 := runRegistrar(t, node.Client(), consul.Config{
		InstanceID: "x", Tasks: []string{"work"}, Address: "127.0.0.1",
		Port: lis.Addr().(*net.TCPAddr).Port, Version: "1.0.0", Capacity: 2,
		// A lease far longer than the freeze: only the node failure ends it.
		Lease: health.Lease{TTL: 45 * time.Second,
			Heartbeat: time.Second, DeregisterAfter: time.Minute},
		FenceCheck: 500 * time.Millisecond,
		Load:       func() int { return 0 },
		Logger:     slog.New(slog.NewTextHandler(testWriter{t, "x"}, nil)),
	})
	addrs := startServe(t, server)
	fc := fencingClient(t, addrs.xds)
	awaitState(t, fc, "x", s1.ID, leaseholdv1.SessionState_CURRENT)
	next := openEDS(t, addrs.xds)
	for eps := next(); !eps.has("x", s1.ID); eps = next() {
	}

	node.Freeze()
	serf := func() string {
		checks, _, err := server.Client().Health().Node("frozen-node", nil)
		if err != nil {
			return ""
		}
		for _, c := range checks {
			if c.CheckID == health.SerfHealthCheckID {
				return c.Status
			}
		}
		return ""
	}
	consultest.WaitFor(t, 30*time.Second, "the frozen node declared failed", func() bool {
		return serf() == api.HealthCritical
	})
	lapsed := awaitState(t, fc, "x", s1.ID, leaseholdv1.SessionState_LAPSED)
	for eps := next(); eps.has("x", s1.ID); eps = next() {
	}
	node.Thaw()
	consultest.WaitFor(t, 30*time.Second, "the node alive again", func() bool {
		return serf() == api.HealthPassing
	})

	// From here on the old session must never be CURRENT or routed again,
	// whatever its check says; the Registrar takes a new session.
	wctx, wcancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer wcancel()
	s2, err := reg.WaitSession(wctx, s1)
	if err != nil {
		t.Fatalf("the Registrar did not come back under a new session: %v", err)
	}
	if s2.Generation <= s1.Generation {
		t.Fatalf("new session at generation %d, not above %d", s2.Generation, s1.Generation)
	}
	for eps := next(); !eps.has("x", s2.ID); eps = next() {
		if eps.has("x", s1.ID) {
			t.Fatalf("the lapsed session is routed again: %v", eps)
		}
	}
	if eps := edsEndpoints(t, addrs.xds); eps.has("x", s1.ID) {
		t.Fatalf("the lapsed session is routed again: %v", eps)
	}
	r, err := fc.CheckSession(context.Background(),
		&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: s1.ID})
	if err != nil || (r.State != leaseholdv1.SessionState_LAPSED &&
		r.State != leaseholdv1.SessionState_STALE) {
		t.Fatalf("old session answered %v (%v) after its node came back; was %v", r, err, lapsed)
	}
}

// TestRecreatedLeaseCheckEndsTheSession: an executor's client agent is
// restarted with leave_on_terminate (the default of a client agent): it
// leaves, the catalog drops the node and its registrations, and when it is
// back it re-syncs them from its data dir, the lease check created anew and
// passing. The Registrar's fence check is kept blind meanwhile (as it is
// between its checks, once a lease by default); leasehold answers the
// session LAPSED at once and stops routing it (health.LeaseCheckRecreated).
// Then the fence check sees the same and ends the session (node-failed),
// the new session is routed. A replica started after the restart, which
// never saw the first check, answers the old session LAPSED too (from the
// lapse mark the first one recorded).
func TestRecreatedLeaseCheckEndsTheSession(t *testing.T) {
	server := consultest.Start(t)
	node := consultest.Start(t,
		consultest.Options{NodeName: "lh-recreated-client", JoinClientOf: server})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lis.Close() })
	proxy := newPartitionProxy(t, node)
	pc, err := api.NewClient(&api.Config{Address: proxy.srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	lost := make(chan consul.LeaseLoss, 4)
	reg, s1 := runRegistrar(t, pc, consul.Config{
		InstanceID: "x", Tasks: []string{"work"}, Address: "127.0.0.1",
		Port: lis.Addr().(*net.TCPAddr).Port, Version: "1.0.0", Capacity: 2,
		// A lease far longer than the restart: only the re-created check ends it.
		Lease: health.Lease{TTL: 45 * time.Second,
			Heartbeat: time.Second, DeregisterAfter: time.Minute},
		FenceCheck:  200 * time.Millisecond,
		Load:        func() int { return 0 },
		OnLeaseLost: func(l consul.LeaseLoss) { lost <- l },
		Logger:      slog.New(slog.NewTextHandler(testWriter{t, "x"}, nil)),
	})
	addrs := startServe(t, server)
	fc := fencingClient(t, addrs.xds)
	awaitState(t, fc, "x", s1.ID, leaseholdv1.SessionState_CURRENT)
	next := openEDS(t, addrs.xds)
	for eps := next(); !eps.has("x", s1.ID); eps = next() {
	}
	// Two fence checks after leasehold saw the check (the second began after
	// the first ended): the Registrar knows the check too.
	seen := proxy.healthReads.Load()
	consultest.WaitFor(t, 10*time.Second, "two fence checks", func() bool {
		return proxy.healthReads.Load() >= seen+2
	})

	proxy.cut.Store(true) // the fence check cannot tell until it is restored
	lease := func() uint64 {
		checks, _, err := server.Client().Health().Node(node.Node, nil)
		if err != nil {
			return 0
		}
		for _, c := range checks {
			if _, id, _, ok := health.ParseCheckID(c.CheckID); ok && id == s1.ID {
				return c.CreateIndex
			}
		}
		return 0
	}
	first := lease()
	node.RestartKeepingState()
	consultest.WaitFor(t, 30*time.Second, "the lease check re-synced", func() bool {
		l := lease()
		return l != 0 && l != first
	})
	awaitState(t, fc, "x", s1.ID, leaseholdv1.SessionState_LAPSED)
	for eps := next(); eps.has("x", s1.ID); eps = next() {
	}
	// A replica started now never saw the first check: the lapse mark the
	// first one recorded tells it.
	later := startServe(t, server)
	awaitState(t, fencingClient(t, later.xds), "x", s1.ID, leaseholdv1.SessionState_LAPSED)
	select {
	case l := <-lost:
		t.Fatalf("the Registrar ended the session while its fence check was blind: %+v", l)
	default:
	}

	proxy.cut.Store(false)
	select {
	case l := <-lost:
		if l.SessionID != s1.ID || l.Reason != consul.LossNodeFailed {
			t.Fatalf("loss %+v, want %s of %s", l, consul.LossNodeFailed, s1.ID)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the Registrar kept the session whose lease check was re-created: " +
			"leasehold answers it LAPSED for ever")
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer wcancel()
	s2, err := reg.WaitSession(wctx, s1)
	if err != nil {
		t.Fatalf("the Registrar did not come back under a new session: %v", err)
	}
	for eps := next(); !eps.has("x", s2.ID); eps = next() {
		if eps.has("x", s1.ID) {
			t.Fatalf("the session whose lease check was re-created is routed again: %v", eps)
		}
	}
	if r, err := fc.CheckSession(context.Background(),
		&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: s1.ID}); err != nil ||
		(r.State != leaseholdv1.SessionState_LAPSED && r.State != leaseholdv1.SessionState_STALE) {
		t.Fatalf("old session answered %v (%v), want LAPSED (or STALE: replaced by %s)",
			r, err, s2.ID)
	}
}

// TestFencingUnknownWhileConsulIsSilent: with Consul frozen, leasehold keeps
// routing the last known snapshot (fail static) but stops vouching for
// sessions once its view is older than --fencing-stale-after; it answers as
// before once Consul answers again; /readyz is 503 consul_silent meanwhile.
// A request whose min_consul_index is
// beyond the view is answered from a fresh read of Consul, or UNKNOWN when
// none can be made before its deadline.
func TestFencingUnknownWhileConsulIsSilent(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	catalogSession(t, c, "node-a", "x", "s1", 1, 9001)
	addrs := startServeTo(t, a, testWriter{t, "serve"}, func(cfg *serveConfig) {
		cfg.staleAfter = 3 * time.Second
	})
	fc := fencingClient(t, addrs.xds)
	current := awaitState(t, fc, "x", "s1", leaseholdv1.SessionState_CURRENT)

	// Monotonic reads: an index beyond the view makes leasehold read Consul
	// afresh and answer from that read.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r, err := fc.CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1",
			MinConsulIndex: current.ConsulIndex + 1_000_000})
	if err != nil || r.State != leaseholdv1.SessionState_CURRENT {
		t.Fatalf("beyond the view: %v, %v", r, err)
	}
	r, err = fc.CheckSession(context.Background(),
		&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1",
			MinConsulIndex: current.ConsulIndex})
	if err != nil || r.State != leaseholdv1.SessionState_CURRENT {
		t.Fatalf("at the view's own index: %v, %v", r, err)
	}

	a.Freeze()
	frozen := time.Now()
	unknown := awaitState(t, fc, "x", "s1", leaseholdv1.SessionState_UNKNOWN)
	if !strings.Contains(unknown.Detail, "stale") || unknown.ViewAge.AsDuration() < 3*time.Second {
		t.Fatalf("UNKNOWN answer %v: want a stale-view detail and an age ≥ 3s", unknown)
	}
	if since := time.Since(frozen); since > 15*time.Second {
		t.Fatalf("UNKNOWN only %s after Consul froze", since)
	}
	if eps := edsEndpoints(t, addrs.xds); !eps.has("x", "s1") {
		t.Fatalf("fail static: routes %v while Consul is silent, want x/s1", eps)
	}
	// Consul hung past the staleness bound: no query failed, none answered;
	// leasehold is not ready, and says how long Consul has been silent.
	if code, body := readyzBody(t, addrs.admin); code != 503 || body["reason"] != "consul_silent" ||
		!strings.Contains(body["detail"].(string), "has not answered for") {
		t.Fatalf("/readyz while Consul is frozen: %d %v, want 503 consul_silent", code, body)
	}
	var body map[string]any
	getBody(t, "http://"+addrs.admin+"/v1/session?instance_id=x&session_id=s1", &body)
	if body["state"] != "UNKNOWN" {
		t.Fatalf("/v1/session while stale: %v", body)
	}
	if code := getBody(t,
		"http://"+addrs.admin+"/v1/session?instance_id=x&session_id=s1&min_consul_index=-1",
		&body); code != 400 || !strings.Contains(body["error"].(string), "min_consul_index") {
		t.Fatalf("bad min_consul_index: %d %v", code, body)
	}
	// Consul silent: the fresh read cannot happen; UNKNOWN before the deadline.
	ctx2, cancel2 := context.WithTimeout(context.Background(), time.Second)
	defer cancel2()
	r, err = fc.CheckSession(ctx2,
		&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1",
			MinConsulIndex: current.ConsulIndex + 1_000_000})
	if err != nil || r.State != leaseholdv1.SessionState_UNKNOWN {
		t.Fatalf("beyond the view with Consul silent: %v, %v", r, err)
	}
	a.Thaw()
	awaitState(t, fc, "x", "s1", leaseholdv1.SessionState_CURRENT)
	consultest.WaitFor(t, 10*time.Second, "/readyz 200 once Consul answers again", func() bool {
		return readyzStatus(addrs.admin) == 200
	})
	answers := scrape(t, addrs.admin)
	if f := answers["leasehold_fencing_answers_total"]; f == nil || sum(f) == 0 {
		t.Fatalf("no leasehold_fencing_answers_total in /metrics")
	}
	if f := answers["leasehold_fencing_view_age_seconds"]; f == nil {
		t.Fatalf("no leasehold_fencing_view_age_seconds in /metrics")
	}
}

// TestFencingVouchesOnlyWithinTheLease: an executor on a 2 s lease
// declares it (lease_ttl, filled by the Registrar); with Consul frozen its
// session turns UNKNOWN once Consul has been silent for longer than that
// lease, not after --fencing-stale-after's 35 s. Meanwhile the watches that
// always answer wait a third of the lease, so a quiet Consul never reads as
// a silent one.
func TestFencingVouchesOnlyWithinTheLease(t *testing.T) {
	a := consultest.Start(t)
	e := startExecutor(t, a, "x", "1.0.0")
	s := e.reg.Session()
	addrs := startServe(t, a)
	fc := fencingClient(t, addrs.xds)
	awaitState(t, fc, "x", s.ID, leaseholdv1.SessionState_CURRENT)
	// Quiet but answering: several leases long, the session stays CURRENT.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	w, err := fc.WatchSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: s.ID})
	if err != nil {
		t.Fatal(err)
	}
	for {
		r, err := w.Recv()
		// The watch ends at the deadline as DeadlineExceeded, whichever side
		// saw it first: the server says why it ends a watch.
		if status.Code(err) == codes.DeadlineExceeded {
			break
		}
		if err != nil || r.State != leaseholdv1.SessionState_CURRENT {
			t.Fatalf("an answering Consul read as silent: %v, %v", r, err)
		}
	}

	a.Freeze()
	frozen := time.Now()
	unknown := awaitState(t, fc, "x", s.ID, leaseholdv1.SessionState_UNKNOWN)
	if !strings.Contains(unknown.Detail, "lease_ttl") {
		t.Fatalf("UNKNOWN answer %v: want the session's lease_ttl named as the bound", unknown)
	}
	if since := time.Since(frozen); since > 10*time.Second {
		t.Fatalf("UNKNOWN only %s after Consul froze: the 2 s lease did not bound it", since)
	}
	a.Thaw()
}

// TestAShortLeaseJoiningAQuietFleetKeepsLeaseholdReady: the fleet declares
// no lease_ttl (an executor registered by hand), so the watches that always
// answer wait their full 10 s on a quiet Consul. Then an executor on a 2 s
// lease registers: leasehold's bounds shorten at once (its session's
// fencing bound, the datacenter's readiness bound), and the watches already
// waiting must not outlast them — Consul is quiet, not silent: /readyz stays
// ready and the new session never turns UNKNOWN.
func TestAShortLeaseJoiningAQuietFleetKeepsLeaseholdReady(t *testing.T) {
	a := consultest.Start(t)
	catalogSession(t, a.Client(), "hand-node", "by-hand", "s-hand", 1, 9301)
	addrs := startServe(t, a)
	consultest.WaitFor(t, 15*time.Second, "leasehold ready", func() bool {
		return readyzStatus(addrs.admin) == 200
	})
	// Past the first reads' 1 s waits: the fast watches wait 10 s now.
	quiet := time.Now()
	consultest.WaitFor(t, 5*time.Second, "2 s of a quiet, ready leasehold", func() bool {
		return readyzStatus(addrs.admin) == 200 && time.Since(quiet) > 2*time.Second
	})

	e := startExecutor(t, a, "x", "1.0.0")
	s := e.reg.Session()
	fc := fencingClient(t, addrs.xds)
	awaitState(t, fc, "x", s.ID, leaseholdv1.SessionState_CURRENT)
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Second)
	defer cancel()
	w, err := fc.WatchSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: s.ID})
	if err != nil {
		t.Fatal(err)
	}
	notReady := make(chan string, 1)
	go func() {
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				if code, body := readyzBody(t, addrs.admin); code != 200 {
					select {
					case notReady <- fmt.Sprintf("%d %v", code, body):
					default:
					}
					return
				}
			}
		}
	}()
	for {
		r, err := w.Recv()
		// The watch ends at its deadline (the server may end it first: EOF).
		if status.Code(err) == codes.DeadlineExceeded || errors.Is(err, io.EOF) {
			break
		}
		if err != nil || r.State != leaseholdv1.SessionState_CURRENT {
			t.Fatalf("x/%s on a quiet Consul: %v, %v — want CURRENT throughout", s.ID, r, err)
		}
	}
	select {
	case why := <-notReady:
		t.Fatalf("/readyz on a quiet Consul after a 2 s lease registered: %s", why)
	default:
	}
}
