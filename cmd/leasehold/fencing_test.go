package main

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"sync/atomic"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/server"
)

func startServe(t *testing.T, a *consultest.Agent) listening {
	t.Helper()
	return startServeTo(t, a, testWriter{t, "serve"})
}

// startServeTo runs leasehold serve in-process against a, logging to w,
// until the test ends.
func startServeTo(t *testing.T, a *consultest.Agent, w io.Writer,
	tune ...func(*serveConfig)) listening {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	bound := make(chan listening, 1)
	served := make(chan error, 1)
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
	go func() { served <- serve(ctx, cfg, slog.New(slog.NewTextHandler(w, nil)), bound) }()
	t.Cleanup(func() { cancel(); <-served })
	return <-bound
}

// readyzStatus is the status code of /readyz (0 when it does not answer).
func readyzStatus(admin string) int {
	resp, err := http.Get("http://" + admin + "/readyz")
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

func fencingClient(t *testing.T, addr string) leaseholdv1.FencingClient {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return leaseholdv1.NewFencingClient(conn)
}

// awaitState waits (WatchSession: no polling) until the session has state.
func awaitState(t *testing.T, fc leaseholdv1.FencingClient, instance, session string,
	want leaseholdv1.SessionState) *leaseholdv1.CheckSessionResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	w, err := fc.WatchSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: instance, SessionId: session})
	if err != nil {
		t.Fatal(err)
	}
	for {
		r, err := w.Recv()
		if err != nil {
			t.Fatalf("%s/%s never %s: %v", instance, session, want, err)
		}
		if r.State == want {
			return r
		}
	}
}

func getBody(t *testing.T, url string, v any) int {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if v != nil {
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatalf("%s: %v\n%s", url, err, b)
		}
	}
	return resp.StatusCode
}

func TestFencingAndExplain(t *testing.T) {
	a := consultest.Start(t)
	e1 := startExecutor(t, a, "e1", "1.0.0")
	e2 := startExecutor(t, a, "e2", "2.0.0")
	e3 := startExecutor(t, a, "e3", "1.0.0")
	addrs := startServe(t, a)
	fc := fencingClient(t, addrs.xds)
	ctx := context.Background()
	s1 := e1.reg.Session()

	// CURRENT, with what leasehold knows of the session
	r := awaitState(t, fc, "e1", s1.ID, leaseholdv1.SessionState_CURRENT)
	if len(r.Tasks) != 1 || r.Tasks[0] != "work" || r.Version != "1.0.0" ||
		r.Generation != s1.Generation ||
		r.ConsulIndex == 0 ||
		r.ViewAge == nil {
		t.Fatalf("current answer %v", r)
	}
	// UNKNOWN
	if r, err := fc.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "e1",
		SessionId: "nope"}); err != nil ||
		r.State != leaseholdv1.SessionState_UNKNOWN {
		t.Fatalf("unknown session: %v %v", r, err)
	}
	// bad input names the field
	for _, bad := range []struct{ inst, sess, field string }{
		{"", "x", "instance_id"}, {"e1", "", "session_id"},
		{strings.Repeat("x", 300), "s", "instance_id"}, {"e1", "a b", "session_id"},
	} {
		_, err := fc.CheckSession(ctx,
			&leaseholdv1.CheckSessionRequest{InstanceId: bad.inst, SessionId: bad.sess})
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), bad.field) {
			t.Errorf("%+v: %v", bad, err)
		}
	}
	// the same over HTTP
	var hr map[string]any
	if code := getBody(t, "http://"+addrs.admin+"/v1/session?instance_id=e1&session_id="+s1.ID,
		&hr); code != 200 ||
		hr["state"] != "CURRENT" {
		t.Fatalf("HTTP answer %d %v", code, hr)
	}
	if code := getBody(t, "http://"+addrs.admin+"/v1/session?instance_id=e1", &hr); code != 400 ||
		!strings.Contains(hr["error"].(string), "session_id") {
		t.Fatalf("HTTP bad input %d %v", code, hr)
	}

	// WatchSession notifies a lapse, and the answer agrees with xDS
	wctx, wcancel := context.WithTimeout(ctx, 15*time.Second)
	defer wcancel()
	watch, err := fc.WatchSession(wctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: "e1", SessionId: s1.ID})
	if err != nil {
		t.Fatal(err)
	}
	if first, err := watch.Recv(); err != nil || first.State != leaseholdv1.SessionState_CURRENT {
		t.Fatalf("watch first %v %v", first, err)
	}
	eds := openEDS(t, addrs.xds)
	if got, want := eds(), endpointSet(e1.endpoint(), e2.endpoint(), e3.endpoint()); !got.equal(
		want) {
		t.Fatalf("xDS before the lapse: %v, want %v", got, want)
	}
	e1.silent.Store(true)
	next, err := watch.Recv()
	if err != nil || next.State != leaseholdv1.SessionState_LAPSED {
		t.Fatalf("watch after the lapse: %v %v", next, err)
	}
	// the removal was pushed before the answer changed: it is the next update
	if got, want := eds(), endpointSet(e2.endpoint(), e3.endpoint()); !got.equal(want) {
		t.Fatalf("after e1's lapse xDS serves %v, want %v", got, want)
	}

	// a newer session of e2's instance: the old one is STALE and gone from xDS
	old2 := e2.reg.Session()
	e2b := startExecutor(t, a, "e2", "2.0.0")
	stale := awaitState(t, fc, "e2", old2.ID, leaseholdv1.SessionState_STALE)
	if stale.NewerSessionId == "" || stale.NewerSessionId == old2.ID ||
		stale.NewerGeneration <= old2.Generation {
		t.Fatalf("stale answer %v", stale)
	}
	// The old session is STALE from the moment the new one took its
	// generation in KV, a moment before it registers: never served again,
	// and the new one follows.
	for next, want := openEDS(t, addrs.xds), endpointSet(e2b.endpoint(), e3.endpoint()); ; {
		got := next()
		if got.has("e2", old2.ID) {
			t.Fatalf("after e2's restart xDS serves the STALE session: %v", got)
		}
		if got.equal(want) {
			break
		}
	}

	// draining
	e3.load.Store(1)
	drained := make(chan error, 1)
	go func() { drained <- e3.reg.Drain(context.Background()) }()
	awaitState(t, fc, "e3", e3.reg.Session().ID, leaseholdv1.SessionState_DRAINING)
	e3.load.Store(0)
	if err := <-drained; err != nil {
		t.Fatal(err)
	}

	// a constrained dispatcher and a NACKing one show up in /debug
	strict := startDispatcher(t, addrs.xds, "strict",
		map[string]any{"version_constraint": "<2.0.0"})
	_ = strict
	nacker := nackingClient(t, addrs.xds)
	var ex server.ExplainExecutors
	deadline := time.Now().Add(15 * time.Second)
	for {
		getBody(t, "http://"+addrs.admin+"/debug/executors?task=work", &ex)
		if len(ex.ConstraintSets) == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("constraint sets %v", ex.ConstraintSets)
		}
		<-time.After(50 * time.Millisecond) // /debug has no watch API
	}
	found := false
	for _, e := range ex.Executors {
		if e.InstanceID == "e2" && e.SessionID == e2b.reg.Session().ID {
			for i, v := range e.Verdicts {
				if ex.ConstraintSets[i].VersionConstraint == "<2.0.0" &&
					v.Reason == "version-incompatible" {
					found = true
				}
			}
		}
	}
	if !found {
		t.Fatalf("no version-incompatible verdict for e2 under <2.0.0: %+v", ex)
	}
	var ds struct {
		Dispatchers []server.StreamInfo `json:"dispatchers"`
	}
	getBody(t, "http://"+addrs.admin+"/debug/dispatchers", &ds)
	sawNack := false
	for _, d := range ds.Dispatchers {
		if d.NodeID == nacker {
			if n := d.Types[resource.EndpointType].LastNack; n != nil &&
				strings.Contains(n.Detail, "refused on purpose") {
				sawNack = true
			}
		}
	}
	if !sawNack {
		t.Fatalf("NACK not shown: %+v", ds.Dispatchers)
	}
	var snap map[string]any
	if code := getBody(t, "http://"+addrs.admin+"/debug/snapshot?node="+nacker,
		&snap); code != 200 ||
		snap["constraint_set"] == nil {
		t.Fatalf("/debug/snapshot %d %v", code, snap)
	}
	// Its load assignment lists its endpoints, held encoded in the server
	// (translator.Expand): a dump without them would say nothing is routed.
	var dump struct {
		Resources map[string]struct {
			Resources []struct {
				Endpoints []struct {
					LbEndpoints []struct {
						Endpoint struct{ Hostname string }
					}
				}
			}
		}
	}
	getBody(t, "http://"+addrs.admin+"/debug/snapshot?node="+nacker, &dump)
	var hosts []string
	for _, r := range dump.Resources[resource.EndpointType].Resources {
		for _, l := range r.Endpoints {
			for _, lb := range l.LbEndpoints {
				hosts = append(hosts, lb.Endpoint.Hostname)
			}
		}
	}
	if len(hosts) == 0 || slices.Contains(hosts, "") {
		t.Fatalf("/debug/snapshot lists endpoints %q", hosts)
	}
	// the explain CLI against the live server
	var out strings.Builder
	if code := runExplain(ctx, []string{"--admin-addr", addrs.admin, "--dispatcher", "strict"},
		&out, &out); code != 0 {
		t.Fatalf("explain: %d\n%s", code, out.String())
	}
	if !strings.Contains(out.String(), "version-incompatible") ||
		!strings.Contains(out.String(), "no: lapsed") ||
		!strings.Contains(out.String(), "dispatcher strict (sotw xDS): version <2.0.0") {
		t.Fatalf("explain output (%d bytes):\n%s", out.Len(), out.String())
	}
}

// nackingClient opens an ADS stream that rejects the endpoints it gets.
func nackingClient(t *testing.T, addr string) string {
	t.Helper()
	s := dialADS(t, addr, &corev3.Node{Id: "nacker", Metadata: &structpb.Struct{}})
	s.Subscribe(resource.EndpointType, "work")
	s.NACK(s.Next(), "refused on purpose by the test", "work")
	return "nacker"
}

// consulCounter is a reverse proxy in front of a Consul agent that counts
// the non-blocking reads (no index, or index 0) of the non-passing checks
// and of the generation keys: the reads Watcher.Refresh makes.
type consulCounter struct {
	srv               *httptest.Server
	freshNP, freshGen atomic.Int64
}

func countConsul(t *testing.T, a *consultest.Agent) *consulCounter {
	t.Helper()
	u, _ := url.Parse("http://" + a.HTTPAddr())
	rp := httputil.NewSingleHostReverseProxy(u)
	c := &consulCounter{}
	c.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		idx := r.URL.Query().Get("index")
		if idx == "" || idx == "0" {
			switch {
			case strings.HasPrefix(r.URL.Path, "/v1/health/state/"):
				c.freshNP.Add(1)
			case strings.HasPrefix(r.URL.Path, "/v1/kv/"+health.GenerationKeyPrefix):
				c.freshGen.Add(1)
			}
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(c.srv.Close)
	return c
}

// examples/dispatcher passes the highest consul_index it acted on as
// min_consul_index on every fencing call. consul_index is the view's highest
// index (the task's membership included), while "reached" asks that the
// non-passing checks and the generation keys be at that index, and each is
// at the index of its last change: the generation keys at the KV write that
// preceded the last registration, so below the registration's own index,
// for ever on an idle fleet. A fresh read that finds nothing new does not
// move them either (identical bodies are not sent). Were that all, the
// replica that produced consul_index X would be behind X for itself, and
// every fencing call would interrupt both blocking queries, read the whole
// non-passing set (a server-side filter over every check of the cluster)
// and the whole generation prefix afresh, and recompute the fleet: Consul's
// load would scale with the dispatchers' result rate (bounded only by
// MinInterval: ~200+50 reads/s per replica), and every call would wait for
// two Consul round trips. The fresh reads are bounded by Consul's changes
// instead.
func TestMinConsulIndexOfItsOwnAnswerDoesNotReadConsulEveryCall(t *testing.T) {
	a := consultest.Start(t)
	counter := countConsul(t, a)
	e := startExecutor(t, a, "e1", "1.0.0")
	sess := e.reg.Session().ID
	addrs := startServeTo(t, a, testWriter{t, "serve"},
		func(c *serveConfig) { c.consulAddr = counter.srv.URL })
	fc := fencingClient(t, addrs.xds)
	first := awaitState(t, fc, "e1", sess, leaseholdv1.SessionState_CURRENT)
	time.Sleep(time.Second) // idle fleet: every watch settles in its blocking query

	const calls = 40
	np0, gen0 := counter.freshNP.Load(), counter.freshGen.Load()
	seen := first.ConsulIndex
	start := time.Now()
	for i := 0; i < calls; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		r, err := fc.CheckSession(ctx,
			&leaseholdv1.CheckSessionRequest{
				InstanceId:     "e1",
				SessionId:      sess,
				MinConsulIndex: seen,
			},
		)
		cancel()
		if err != nil || r.State != leaseholdv1.SessionState_CURRENT {
			t.Fatalf("call %d: %v %v", i, r, err)
		}
		seen = max(seen, r.ConsulIndex)
	}
	took := time.Since(start)
	np, gen := counter.freshNP.Load()-np0, counter.freshGen.Load()-gen0
	t.Logf(
		"%d fencing calls, each with the consul_index this same replica answered (%d): %d fresh "+
			"non-passing reads, %d fresh generation-key reads, %s",
		calls, seen, np, gen, took.Round(time.Millisecond))
	// One refresh reads the critical and warning checks and every node's
	// serfHealth afresh (and a change in one state the other), plus the
	// generation keys: two refreshes' worth at most, not one per call.
	if np+gen > 10 {
		t.Fatalf(
			"an idle fleet, one replica, min_consul_index = its own last consul_index: %d fencing "+
				"calls cost %d fresh non-passing reads and %d fresh generation-key reads of "+
				"Consul "+
				"(one of each per call): the cost of min_consul_index is not bounded by Consul's "+
				"changes but by the dispatchers' result rate",
			calls, np, gen)
	}
}
