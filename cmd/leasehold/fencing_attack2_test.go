package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

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

// TestAttack2MinConsulIndexOfItsOwnAnswerReadsConsulEveryTime: examples/
// dispatcher passes the highest consul_index it acted on as
// min_consul_index on every fencing call. consul_index is the view's
// highest index (the task's membership included), but "reached" asks that
// the non-passing checks AND the generation keys be at that index, and each
// is at the index of its last *change*: the generation keys at the KV write
// that preceded the last registration, so below the registration's own
// index, for ever on an idle fleet. A fresh read that finds nothing new does
// not move them either (identical bodies are not sent). So the replica that
// produced consul_index X is behind X for itself, and every single fencing
// call interrupts both blocking queries and reads the whole non-passing set
// (a server-side filter over every check of the cluster) and the whole
// generation prefix afresh, then recomputes the fleet: Consul load scales
// with the dispatchers' result rate (bounded only by MinInterval: ~200+50
// reads/s per replica), and every call waits for two Consul round trips.
func TestAttack2MinConsulIndexOfItsOwnAnswerReadsConsulEveryTime(t *testing.T) {
	a := consultest.Start(t)
	counter := countConsul(t, a)
	e := startExecutor(t, a, "e1", "1.0.0")
	sess := e.reg.Session().ID
	addrs := startServeTo(t, a, testWriter{t, "serve"}, func(c *serveConfig) { c.consulAddr = counter.srv.URL })
	fc := fencingClient(t, addrs.xds)
	first := awaitState(t, fc, "e1", sess, leaseholdv1.SessionState_CURRENT)
	time.Sleep(time.Second) // idle fleet: every watch settles in its blocking query

	const calls = 40
	np0, gen0 := counter.freshNP.Load(), counter.freshGen.Load()
	seen := first.ConsulIndex
	start := time.Now()
	for i := 0; i < calls; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		r, err := fc.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "e1", SessionId: sess, MinConsulIndex: seen})
		cancel()
		if err != nil || r.State != leaseholdv1.SessionState_CURRENT {
			t.Fatalf("call %d: %v %v", i, r, err)
		}
		seen = max(seen, r.ConsulIndex)
	}
	took := time.Since(start)
	np, gen := counter.freshNP.Load()-np0, counter.freshGen.Load()-gen0
	t.Logf("%d fencing calls, each with the consul_index this same replica answered (%d): %d fresh non-passing reads, %d fresh generation-key reads, %s",
		calls, seen, np, gen, took.Round(time.Millisecond))
	// One refresh reads the critical and warning checks and every node's
	// serfHealth afresh (and a change in one state the other), plus the
	// generation keys: two refreshes' worth at most, not one per call.
	if np+gen > 10 {
		t.Fatalf("an idle fleet, one replica, min_consul_index = its own last consul_index: %d fencing calls cost %d fresh non-passing reads and %d fresh generation-key reads of Consul "+
			"(one of each per call): the cost of min_consul_index is not bounded by Consul's changes but by the dispatchers' result rate", calls, np, gen)
	}
}
