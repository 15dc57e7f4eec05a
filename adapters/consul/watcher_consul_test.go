package consul

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/hashicorp/go-cleanhttp"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

// countingTransport counts response bytes and requests per API path.
type countingTransport struct {
	base  http.RoundTripper
	mu    sync.Mutex
	bytes map[string]int64
	reqs  map[string]int
	last  map[string]int64 // bytes of the latest response per path
}

func newCountingTransport() *countingTransport {
	return &countingTransport{
		base:  cleanhttp.DefaultPooledTransport(),
		bytes: map[string]int64{},
		reqs:  map[string]int{},
		last:  map[string]int64{},
	}
}

func pathKey(p string) string {
	for _, prefix := range []string{"/v1/health/state/", "/v1/health/service/",
		"/v1/catalog/service/", "/v1/catalog/services"} {
		if strings.HasPrefix(p, prefix) {
			return prefix
		}
	}
	return p
}

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := c.base.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return nil, err
	}
	resp.Body = io.NopCloser(strings.NewReader(string(body)))
	k := pathKey(r.URL.Path)
	c.mu.Lock()
	c.bytes[k] += int64(len(body))
	c.reqs[k]++
	c.last[k] = int64(len(body))
	c.mu.Unlock()
	return resp, nil
}

func (c *countingTransport) snapshot(k string) (reqs int, bytes, last int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reqs[k], c.bytes[k], c.last[k]
}

// TestConsulWatchCostDoesNotGrowWithFleet registers 1,000 instances of one
// task and shows that a lapse, a full executor and a recovery each reach the
// watcher through the small non-passing response, without re-reading the
// task's members.
func TestConsulWatchCostDoesNotGrowWithFleet(t *testing.T) {
	if testing.Short() {
		t.Skip("1,000 registrations")
	}
	const n = 1000
	a := consultest.Start(t)
	a.SettleSync()
	reg := a.Client()
	registerMany(t, reg, n)

	ct := newCountingTransport()
	cfg := a.Config()
	cfg.HttpClient = &http.Client{Transport: ct}
	client, err := api.NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan health.Observation, 64)
	w := NewWatcher(client, WatchConfig{Out: out})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)

	// wait for the full membership
	deadline := time.After(30 * time.Second)
	for members := 0; members < n; {
		select {
		case o := <-out:
			if o.Members() != nil {
				members = len(o.Members().Members)
			}
		case <-deadline:
			t.Fatal("membership of 1,000 never observed")
		}
	}
	memReads, _, memBytes := ct.snapshot("/v1/health/service/")
	t.Logf("one membership read of %d instances: %d bytes", n, memBytes)
	_, catBefore, catListing := ct.snapshot("/v1/catalog/service/")

	// each change must come through the fast path alone
	victim := health.CheckID("e0500", "s", "work")
	for _, step := range []struct{ status, want string }{
		{"critical", "critical"}, // a lapse
		{"passing", ""},          // recovered: gone from the non-passing set
		{"warning", "warning"},   // full
		{"passing", ""},
	} {
		before, beforeBytes, _ := ct.snapshot("/v1/health/state/")
		start := time.Now()
		if err := reg.Agent().UpdateTTL(victim, "load=4", step.status); err != nil {
			t.Fatal(err)
		}
		var seen time.Duration
		for seen == 0 {
			select {
			case o := <-out:
				if o.NonPassing() == nil {
					continue
				}
				got := ""
				for _, c := range o.NonPassing().Checks {
					if c.CheckID == victim {
						got = string(c.Status)
					}
				}
				if got == step.want {
					seen = time.Since(start)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("%s never observed", step.status)
			}
		}
		after, afterBytes, _ := ct.snapshot("/v1/health/state/")
		perWake := (afterBytes - beforeBytes) / int64(max(after-before, 1))
		t.Logf(
			"%-8s observed after %s; fast path: %d responses, %d bytes each",
			step.status,
			seen.Round(time.Millisecond),
			after-before,
			perWake,
		)
		if perWake > 16<<10 {
			t.Errorf("fast-path response of %d bytes grows with the fleet", perWake)
		}
		if perWake*20 > memBytes {
			t.Errorf(
				"fast path (%d B) not far cheaper than a membership read (%d B)",
				perWake,
				memBytes,
			)
		}
	}
	if reads, _, _ := ct.snapshot("/v1/health/service/"); reads != memReads {
		t.Errorf("check changes re-read the membership (%d reads, want %d)", reads, memReads)
	}
	// A check's status moves the task type's catalog index too: the task
	// watch wakes, but must not list the (unchanged) registrations again.
	if _, catAfter, _ := ct.snapshot("/v1/catalog/service/"); catAfter-catBefore >= catListing {
		t.Errorf("four check changes read %d bytes of catalog listings (one listing: %d)",
			catAfter-catBefore, catListing)
	}
}

// A task watch whose blocking query ends (its wait is over, or the task
// type's index moved for a check) while no registration changed does not
// list the task type's entries again: at 10,000 executors in one task type
// each listing is ~12 MB. A registration after that is still listed.
func TestConsulQuietTaskTypeIsNotListedAgain(t *testing.T) {
	const n = 200
	a := consultest.Start(t)
	a.SettleSync()
	reg := a.Client()
	registerMany(t, reg, n)
	ct := newCountingTransport()
	cfg := a.Config()
	cfg.HttpClient = &http.Client{Transport: sizingTransport{next: ct}}
	client, err := api.NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan health.Observation, 64)
	w := NewWatcher(client, WatchConfig{Out: out, WaitTime: 200 * time.Millisecond,
		ContendedWait: 200 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)
	members := func(what string, ok func([]health.Member) bool) {
		t.Helper()
		deadline := time.After(30 * time.Second)
		for {
			select {
			case o := <-out:
				if o.Members() != nil && ok(o.Members().Members) {
					return
				}
			case <-deadline:
				t.Fatalf("%s never observed", what)
			}
		}
	}
	members("the first read", func(ms []health.Member) bool { return len(ms) == n })
	reqs, before, listing := ct.snapshot("/v1/catalog/service/")
	// Ten waits end (and a check changes status) with nothing registered.
	if err := reg.Agent().UpdateTTL(health.CheckID("e0001", "s", "work"), "", "critical"); err != nil {
		t.Fatal(err)
	}
	deadline := time.After(30 * time.Second)
	for {
		if r, _, _ := ct.snapshot("/v1/catalog/service/"); r >= reqs+10 {
			break
		}
		select {
		case <-deadline:
			t.Fatal("the task watch's queries never ended")
		case <-time.After(20 * time.Millisecond): // polling the transport's counts
		}
	}
	if _, after, _ := ct.snapshot("/v1/catalog/service/"); after-before >= listing {
		t.Fatalf("ten quiet waits read %d bytes of catalog listings (one listing: %d)",
			after-before, listing)
	}
	if err := reg.Agent().ServiceDeregister(health.ServiceID("e0002", "work")); err != nil {
		t.Fatal(err)
	}
	members("e0002's departure", func(ms []health.Member) bool { return len(ms) == n-1 })
}

// registerMany registers n instances of task "work" (e0000, e0001, …) with
// long passing leases, session "s".
func registerMany(t *testing.T, reg *api.Client, n int) {
	t.Helper()
	registerRange(t, reg, 0, n)
}

// registerRange is registerMany of instances from to to-1.
func registerRange(t *testing.T, reg *api.Client, from, to int) {
	t.Helper()
	for i := from; i < to; i++ {
		r := health.Registration{
			InstanceID: fmt.Sprintf("e%04d", i),
			SessionID:  "s",
			Generation: 1,
			Task:       "work",
			Address:    "127.0.0.1",
			Port:       10000 + i,
			Version:    "1.0.0",
			Capacity:   4,
			State:      health.StateActive,
			Labels:     map[string]string{"zone": "eu-1", "pool": "default"},
		}
		err := reg.Agent().ServiceRegisterOpts(&api.AgentServiceRegistration{
			ID: health.ServiceID(r.InstanceID, "work"), Name: "work", Tags: []string{"leasehold"},
			Address: r.Address, Port: r.Port, Meta: r.Meta(),
			Checks: api.AgentServiceChecks{
				{CheckID: health.CheckID(r.InstanceID, "s", "work"), TTL: "1h", Status: "passing"},
			},
		}, api.ServiceRegisterOpts{ReplaceExistingChecks: true})
		if err != nil {
			t.Fatal(err)
		}
	}

}

// TestConsulMembershipChangeReadsWhatChanged: on a real agent, after the first
// read of 1,000 members, a restart under a new session re-reads that
// registration alone (by service id, gzip-compressed), and a departure reads
// only the catalog listing.
func TestConsulMembershipChangeReadsWhatChanged(t *testing.T) {
	if testing.Short() {
		t.Skip("1,000 registrations")
	}
	const n = 1000
	a := consultest.Start(t)
	a.SettleSync()
	reg := a.Client()
	registerMany(t, reg, n)

	ct := newCountingTransport()
	cfg := a.Config()
	cfg.HttpClient = &http.Client{Transport: sizingTransport{next: ct}}
	client, err := api.NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan health.Observation, 64)
	w := NewWatcher(client, WatchConfig{Out: out})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)
	members := func(what string, ok func([]health.Member) bool) {
		t.Helper()
		deadline := time.After(30 * time.Second)
		for {
			select {
			case o := <-out:
				if o.Members() != nil && ok(o.Members().Members) {
					return
				}
			case <-deadline:
				t.Fatalf("%s never observed", what)
			}
		}
	}
	session := func(ms []health.Member, inst string) string {
		for _, m := range ms {
			if m.InstanceID == inst {
				return m.SessionID
			}
		}
		return ""
	}
	members("the first read", func(ms []health.Member) bool { return len(ms) == n })
	_, fullBytes, _ := ct.snapshot("/v1/health/service/")
	_, catBytes, catLast := ct.snapshot("/v1/catalog/service/")
	t.Logf(
		"first read of %d members: health %d bytes on the wire, catalog listing %d",
		n,
		fullBytes,
		catLast,
	)

	// e0007 restarts under session s2
	r := health.Registration{
		InstanceID: "e0007",
		SessionID:  "s2",
		Generation: 2,
		Task:       "work",
		Address:    "127.0.0.1",
		Port:       10007,
		Version:    "1.0.0",
		Capacity:   4,
		State:      health.StateActive,
	}
	if err := reg.Agent().ServiceRegisterOpts(&api.AgentServiceRegistration{
		ID: health.ServiceID("e0007", "work"), Name: "work", Tags: []string{"leasehold"},
		Address: r.Address, Port: r.Port, Meta: r.Meta(),
		Checks: api.AgentServiceChecks{{CheckID: health.CheckID("e0007", "s2", "work"), TTL: "1h",
			Status: "passing"}},
	}, api.ServiceRegisterOpts{ReplaceExistingChecks: true}); err != nil {
		t.Fatal(err)
	}
	members(
		"e0007's new session",
		func(ms []health.Member) bool { return len(ms) == n && session(ms, "e0007") == "s2" },
	)
	_, afterBytes, _ := ct.snapshot("/v1/health/service/")
	_, catAfter, _ := ct.snapshot("/v1/catalog/service/")
	t.Logf(
		"a new session: health %d bytes, catalog %d bytes on the wire",
		afterBytes-fullBytes,
		catAfter-catBytes,
	)
	if d := afterBytes - fullBytes; d <= 0 || d > 8<<10 {
		t.Errorf("a new session re-read %d bytes of members (want one registration's, ≤ 8 KiB)",
			d)
	}
	// e0008 leaves: the catalog listing alone
	if err := reg.Agent().ServiceDeregister(health.ServiceID("e0008", "work")); err != nil {
		t.Fatal(err)
	}
	members(
		"e0008's departure",
		func(ms []health.Member) bool { return len(ms) == n-1 && session(ms, "e0008") == "" },
	)
	if _, b, _ := ct.snapshot("/v1/health/service/"); b != afterBytes {
		t.Errorf("a departure re-read %d bytes of members", b-afterBytes)
	}
	if catLast > 100<<10 { // ~1 MB of JSON
		t.Errorf(
			"the catalog listing of %d members is %d bytes on the wire: not compressed?",
			n,
			catLast,
		)
	}
}

// laggingListing is a real catalog whose generation listing answers once
// and then never again: a listing lagging behind every later key write.
type laggingListing struct {
	apiCatalog
	answered atomic.Bool
}

func (l *laggingListing) Generations(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (api.KVPairs, uint64, error) {
	if l.answered.Swap(true) {
		<-ctx.Done()
		return nil, 0, ctx.Err()
	}
	return l.apiCatalog.Generations(ctx, index, wait)
}

// TestConsulNewSessionsKeyComesWithItsMembership: a session start takes its
// generation key, then registers; however far the generation listing lags,
// the membership that first shows the registration carries the key as read
// after it (one transaction on the real agent), so leasehold confirms the
// new session at once — and the next session of the instance too.
func TestConsulNewSessionsKeyComesWithItsMembership(t *testing.T) {
	a := consultest.Start(t)
	_, out := runWorld(
		t,
		&laggingListing{apiCatalog: apiCatalog{c: a.Client(), checked: new(atomic.Uint64)}},
		WatchConfig{},
	)
	nextObs(
		t,
		out,
		"the one generation listing",
		func(o health.Observation) bool { return o.Generations() != nil },
	)
	e := runLive(t, a, "exec-1", nil)
	keyOf := func(s *Session) {
		t.Helper()
		o := nextObs(t, out, "the membership with session "+s.ID, func(o health.Observation) bool {
			if o.Members() == nil {
				return false
			}
			for _, m := range o.Members().Members {
				if m.InstanceID == "exec-1" && m.SessionID == s.ID {
					return true
				}
			}
			return false
		})
		k := o.Members().Keys["exec-1"]
		if k.Generation != s.Generation || k.SessionID != s.ID || k.ModifyIndex == 0 {
			t.Fatalf(
				"the membership carries exec-1's key %+v, want generation %d of session %s",
				k,
				s.Generation,
				s.ID,
			)
		}
	}
	s1 := e.session(t, nil)
	keyOf(s1)
	e.stop() // the process ends; the next one of the instance starts
	<-e.reg.Done()
	e2 := runLive(t, a, "exec-1", nil)
	keyOf(e2.session(t, nil))
}

// TestConsulNodeChangesOfATaskAreListed: on a real agent, after the first
// listing, changes that touch a registration only through its node — the
// node's address (a service without an address of its own is reached at
// its node's), and a registration moving to another node — are listed and
// sent, though no check changed and the task watch skips wakes in which
// no registration or node changed.
func TestConsulNodeChangesOfATaskAreListed(t *testing.T) {
	a := consultest.Start(t)
	a.SettleSync()
	reg := a.Client()
	r := health.Registration{InstanceID: "x1", SessionID: "s", Generation: 1, Task: "work",
		Port: 10001, Version: "1.0.0", Capacity: 4, State: health.StateActive}
	register := func(node, addr string) {
		t.Helper()
		_, err := reg.Catalog().Register(&api.CatalogRegistration{Node: node, Address: addr,
			Service: &api.AgentService{ID: health.ServiceID("x1", "work"), Service: "work",
				Tags: []string{"leasehold"}, Port: r.Port, Meta: r.Meta()}}, nil)
		if err != nil {
			t.Fatal(err)
		}
	}
	register("ext-1", "127.0.0.2")
	registerMany(t, reg, 3) // agent-registered neighbours, so the task type is listed
	out := make(chan health.Observation, 64)
	w := NewWatcher(reg, WatchConfig{Out: out, WaitTime: 200 * time.Millisecond,
		ContendedWait: 200 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)
	seen := func(what string, ok func(health.Member) bool) {
		t.Helper()
		deadline := time.After(30 * time.Second)
		for {
			select {
			case o := <-out:
				if o.Members() == nil {
					continue
				}
				for _, m := range o.Members().Members {
					if m.InstanceID == "x1" && ok(m) {
						return
					}
				}
			case <-deadline:
				t.Fatalf("%s never observed", what)
			}
		}
	}
	seen("x1 at its node's address", func(m health.Member) bool {
		return m.Address == "127.0.0.2" && m.Node == "ext-1"
	})
	register("ext-1", "127.0.0.3")
	seen("x1 at its node's new address", func(m health.Member) bool {
		return m.Address == "127.0.0.3"
	})
	if _, err := reg.Catalog().Deregister(&api.CatalogDeregistration{Node: "ext-1",
		ServiceID: health.ServiceID("x1", "work")}, nil); err != nil {
		t.Fatal(err)
	}
	register("ext-2", "127.0.0.4")
	seen("x1 on its new node", func(m health.Member) bool {
		return m.Node == "ext-2" && m.Address == "127.0.0.4"
	})
}
