package main

import (
	"context"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// setLeaseStatus rewrites a catalogSession's lease check status.
func setLeaseStatus(t *testing.T, c *api.Client, node, instance, session, status string) {
	t.Helper()
	_, err := c.Catalog().Register(&api.CatalogRegistration{
		Node: node, Address: "127.0.0.1", SkipNodeUpdate: true,
		Check: &api.AgentCheck{
			Node:      node,
			CheckID:   health.CheckID(instance, session, "work"),
			Name:      "lease",
			ServiceID: health.ServiceID(instance, "work"),
			Status:    status,
		},
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
			t.Fatalf("%s: endpoints %v: x/s1 routed (or y/y1 not) although its lapse was recorded",
				name, eps)
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
	pruner := consul.NewLapseRecorder(c,
		consul.LapseRecorderConfig{Retention: fleet.DefaultHistoryRetention, Clock: clock})
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

	if _, err := c.Catalog().Deregister(&api.CatalogDeregistration{Node: "node-x",
		ServiceID: health.ServiceID("x", "work")}, nil); err != nil {
		t.Fatal(err)
	}
	prune()
	clock.Advance(fleet.DefaultHistoryRetention)
	prune()
	if p, _, err := c.KV().Get(key, nil); err != nil || p != nil {
		t.Fatalf("x/s1's lapse mark %v (%v): want pruned, its registration gone for the retention",
			p, err)
	}
}

// startServeStoppable is startServe with a stop the test calls itself.
func startServeStoppable(t *testing.T, a *consultest.Agent) (listening, func()) {
	t.Helper()
	return startServeStoppableAs(t, a, "serve")
}

// startServeStoppableAs is startServeStoppable logging as name, with the
// configuration tuned by tune (another --xds-addr, say).
func startServeStoppableAs(t *testing.T, a *consultest.Agent, name string,
	tune ...func(*serveConfig)) (listening, func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	bound, served := make(chan listening, 1), make(chan error, 1)
	cfg := &serveConfig{
		consulAddr:     a.HTTPAddr(),
		xdsAddr:        "127.0.0.1:0",
		adminAddr:      "127.0.0.1:0",
		tag:            "leasehold",
		consulMaxConns: 8,
	}
	for _, f := range tune {
		f(cfg)
	}
	go func() {
		served <- serve(ctx, cfg,
			slog.New(slog.NewTextHandler(testWriter{t, name}, nil)), bound)
	}()
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
		p, meta, err := c.KV().Get(key,
			(&api.QueryOptions{WaitIndex: index, WaitTime: timeout}).WithContext(ctx))
		if err != nil {
			t.Fatalf("%s never written: %v", key, err)
		}
		if p != nil {
			return p
		}
		index = meta.LastIndex
	}
}

// holdingConsul is a reverse proxy in front of a Consul agent that holds
// the blocking queries (index > 0) it is told to — every one, or the lapse
// marks' — until told otherwise or the client gives up, and forwards them
// then: a replica on a slow link, hearing of Consul's changes late. Reads
// without an index (a refresh's) always pass.
type holdingConsul struct {
	srv *httptest.Server

	mu          sync.Mutex
	all, marks  bool
	changed     chan struct{}  // closed and replaced when what is held changes
	held        map[string]int // by path: the blocking queries waiting now
	heldChanged chan struct{}
}

func holdConsul(t *testing.T, a *consultest.Agent) *holdingConsul {
	t.Helper()
	u, _ := url.Parse("http://" + a.HTTPAddr())
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.ErrorLog = log.New(io.Discard, "", 0) // a query its client gave up on
	h := &holdingConsul{
		changed:     make(chan struct{}),
		held:        map[string]int{},
		heldChanged: make(chan struct{}),
	}
	h.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if idx := r.URL.Query().Get("index"); r.Method == http.MethodGet && idx != "" &&
			idx != "0" &&
			!h.wait(r) {
			return // the client gave up
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(h.srv.Close)
	return h
}

func (h *holdingConsul) URL() string { return h.srv.URL }

func (h *holdingConsul) holds(r *http.Request) bool {
	return h.all || (h.marks && strings.HasPrefix(r.URL.Path, "/v1/kv/"+health.LapseMarkPrefix))
}

// wait holds r while it is to be held; false when its client gave up.
func (h *holdingConsul) wait(r *http.Request) bool {
	h.mu.Lock()
	counted := false
	defer func() {
		if counted {
			h.held[r.URL.Path]--
			close(h.heldChanged)
			h.heldChanged = make(chan struct{})
		}
		h.mu.Unlock()
	}()
	for h.holds(r) {
		if !counted {
			counted = true
			h.held[r.URL.Path]++
			close(h.heldChanged)
			h.heldChanged = make(chan struct{})
		}
		changed := h.changed
		h.mu.Unlock()
		select {
		case <-r.Context().Done():
			h.mu.Lock()
			return false
		case <-changed:
		}
		h.mu.Lock()
	}
	return true
}

// hold sets what is held: every blocking query, the lapse marks' ones.
func (h *holdingConsul) hold(all, marks bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.all, h.marks = all, marks
	close(h.changed)
	h.changed = make(chan struct{})
}

// awaitHeld waits until a blocking query of each path is held (the queries
// in flight when the hold began have answered: the replica hears nothing
// more of those watches).
func (h *holdingConsul) awaitHeld(t *testing.T, paths ...string) {
	t.Helper()
	deadline := time.After(15 * time.Second)
	for {
		h.mu.Lock()
		missing := slices.DeleteFunc(slices.Clone(paths),
			func(p string) bool { return h.held[p] > 0 })
		ch := h.heldChanged
		h.mu.Unlock()
		if len(missing) == 0 {
			return
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("no blocking query of %v held", missing)
		}
	}
}

// Two replicas on one agent. Replica A sees x/s1's lease lapse and records
// the lapse mark; replica B is on a slow link: its blocking queries wait in
// a proxy meanwhile, so it never sees the lease critical (it passes again
// before B hears anything), and its watch of the lapse marks stays slow.
// A's LAPSED answer carries a consul_index at or above the mark's (where the
// lapse became final for every replica); asked with it, B reads the lapse
// marks afresh and answers LAPSED — never CURRENT, which its checks alone
// say. (A answered at the checks' index, below the mark's, and B, whose
// checks and generation keys had passed it, answered CURRENT.)
func TestLapsedAnswerIndexHoldsAReplicaThatHasNotReadTheMark(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	catalogSession(t, c, "node-x", "x", "s1", 1, 9201)
	catalogSession(t, c, "node-y", "y", "y1", 1, 9202) // a bystander
	slow := holdConsul(t, a)
	la := startServeTo(t, a, testWriter{t, "serve A"})
	lb := startServeTo(t, a, testWriter{t, "serve B"}, func(c *serveConfig) {
		c.consulAddr = slow.URL()
		// its fast watches answer every 2 s: held a few seconds, its view stays fresh
		c.staleAfter = 8 * time.Second
	})
	fa, fb := fencingClient(t, la.xds), fencingClient(t, lb.xds)
	awaitState(t, fa, "x", "s1", leaseholdv1.SessionState_CURRENT)
	awaitState(t, fb, "x", "s1", leaseholdv1.SessionState_CURRENT)

	slow.hold(true, true)
	slow.awaitHeld(t, "/v1/health/state/critical", "/v1/kv/"+health.LapseMarkPrefix)
	setLeaseStatus(t, c, "node-x", "x", "s1", api.HealthCritical)
	ra := awaitState(t, fa, "x", "s1", leaseholdv1.SessionState_LAPSED)
	mark := waitKey(t, c, health.LapseMarkKey("x", "s1"), 10*time.Second)
	setLeaseStatus(t, c, "node-x", "x", "s1", api.HealthPassing) // the old session heartbeats again
	if ra.ConsulIndex < mark.ModifyIndex {
		t.Errorf("replica A answered LAPSED at consul_index %d, below its lapse mark's %d",
			ra.ConsulIndex, mark.ModifyIndex)
	}

	slow.hold(false, true) // B hears of everything again but the lapse marks
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if r, err := fb.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "x",
		SessionId: "s1"}); err != nil ||
		r.State != leaseholdv1.SessionState_CURRENT {
		t.Fatalf("the drill did not hold B back: without min_consul_index it answers %v (%v)",
			r, err)
	}
	rb, err := fb.CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{
			InstanceId:     "x",
			SessionId:      "s1",
			MinConsulIndex: ra.ConsulIndex,
		},
	)
	if err != nil {
		t.Fatal(err)
	}
	if rb.State == leaseholdv1.SessionState_CURRENT {
		t.Fatalf(
			"replica B answered CURRENT at min_consul_index %d (replica A's LAPSED answer; the "+
				"mark at %d): %v",
			ra.ConsulIndex, mark.ModifyIndex, rb)
	}
	if rb.State != leaseholdv1.SessionState_LAPSED {
		t.Errorf("replica B: %v, want LAPSED (the lapse marks read afresh)", rb)
	}
	t.Logf("A: LAPSED at %d (mark at %d); B with min_consul_index %d: %s at %d (%s)",
		ra.ConsulIndex, mark.ModifyIndex, ra.ConsulIndex, rb.State, rb.ConsulIndex, rb.Detail)
}

// / Another replica (or this one before a restart) recorded x/s1's lapse in
// Consul KV, and x/s1's check is passing again. leasehold runs with a token
// that reads everything it needs except leasehold/lapsed/. The lapse marks
// are the only memory of the lapse, so x/s1 must not be routed: leasehold
// may stay unready, but must not serve a session it cannot tell is lapsed.
//
// serve sets SyncConfig.AwaitLapses, so the Syncer waits for the lapse marks
// as it does for the tasks, members, non-passing checks, generations and
// controls before it serves the fleet. Without that it would serve x/s1 in
// the load assignment and answer it CURRENT while /readyz says 503 acl
// (key_prefix "leasehold/lapsed/"), and the same window would open on every
// restart with a healthy token until the lapses watch's first answer
// arrives; the fleet package's tests hold that case.
func TestUnreadableLapseMarksServeNothing(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t,
		consultest.Options{ACLManagementToken: "7c1b0c1e-0000-4000-8000-0000000000a2"})
	root := a.Client()
	rules := `
service_prefix "" { policy = "read" }
node_prefix "" { policy = "read" }
key_prefix "leasehold/generation/" { policy = "read" }
key_prefix "leasehold/control/" { policy = "read" }
`
	p, _, err := root.ACL().PolicyCreate(&api.ACLPolicy{Name: "no-lapsed", Rules: rules}, nil)
	if err != nil {
		t.Fatal(err)
	}
	tok, _, err := root.ACL().TokenCreate(
		&api.ACLToken{Policies: []*api.ACLTokenPolicyLink{{ID: p.ID}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	catalogSession(t, root, "node-x", "x", "s1", 1, 9301)
	catalogSession(t, root, "node-y", "y", "y1", 1, 9302)
	mark := health.LapseMark{
		InstanceID: "x",
		SessionID:  "s1",
		Generation: 1,
		At:         time.Now().UTC().Truncate(time.Second),
		Tasks:      []string{"work"},
	}
	if _, err := root.KV().Put(&api.KVPair{Key: health.LapseMarkKey("x", "s1"),
		Value: mark.Value()}, nil); err != nil {
		t.Fatal(err)
	}

	t.Setenv("CONSUL_HTTP_TOKEN", tok.SecretID)
	t.Setenv("CONSUL_HTTP_TOKEN_FILE", "")
	var log syncBuffer
	l := startServeLogged(t, a, &log)
	fc := fencingClient(t, l.xds)
	consultest.WaitFor(t, 15*time.Second, "/readyz naming leasehold/lapsed/", func() bool {
		code, body := readyzBody(t, l.admin)
		detail, _ := body["detail"].(string)
		return code == 503 && strings.Contains(detail, "leasehold/lapsed/")
	})
	// Give the syncer time to serve whatever it will serve.
	time.Sleep(2 * time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if r, err := fc.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "x",
		SessionId: "s1"}); err == nil &&
		r.State == leaseholdv1.SessionState_CURRENT {
		t.Errorf(
			"x/s1 (lapse recorded in KV) answered CURRENT while its lapse marks cannot be read "+
				"(%s)",
			r.Detail)
	}
	// Nothing is served while the marks cannot be read: no snapshot (an
	// xDS client would wait), and the fleet is never announced as read.
	if strings.Contains(log.String(), "fleet read: serving") {
		t.Errorf("the fleet was served although its lapse marks cannot be read:\n%s", log.String())
	}
}
