package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

// churnFleet is the drill's executors, registered straight through the
// agents' API (as many processes would, without their cost in the test).
type churnFleet struct {
	agents   []*api.Client
	n        int
	canaries int // executors [0, canaries) hold a short lease heartbeated by the test
	lease    time.Duration
	gens     []atomic.Uint64
	stopped  []atomic.Bool
}

func (f *churnFleet) id(i int) string         { return fmt.Sprintf("c%04d", i) }
func (f *churnFleet) agent(i int) *api.Client { return f.agents[i%len(f.agents)] }

func (f *churnFleet) session(i int) string {
	return "s" + strconv.FormatUint(f.gens[i].Load(), 10)
}

func (f *churnFleet) checkID(i int) string {
	return health.CheckID(f.id(i), f.session(i), "work")
}
func (f *churnFleet) ttl(i int) time.Duration {
	return map[bool]time.Duration{true: f.lease, false: time.Hour}[i < f.canaries]
}

// register registers executors [from, to) under their next generation
// (session s<gen>), the generation key first, as a Registrar does, 16 at a
// time.
func (f *churnFleet) register(t *testing.T, from, to int) {
	t.Helper()
	var wg sync.WaitGroup
	next := atomic.Int64{}
	next.Store(int64(from))
	errs := make(chan error, 16)
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1) - 1); i < to; i = int(next.Add(1) - 1) {
				gen := f.gens[i].Load() + 1
				c := f.agent(i)
				if _, err := c.KV().Put(&api.KVPair{Key: health.GenerationKey(f.id(i)),
					Value: []byte(strconv.FormatUint(gen, 10))}, nil); err != nil {
					errs <- err
					return
				}
				session := "s" + strconv.FormatUint(gen, 10)
				r := health.Registration{
					InstanceID: f.id(i),
					SessionID:  session,
					Generation: gen,
					Task:       "work",
					Address:    "127.0.0.1",
					Port:       30000 + i,
					Version:    "1.0.0",
					Capacity:   4,
					State:      health.StateActive,
				}
				err := c.Agent().ServiceRegisterOpts(&api.AgentServiceRegistration{
					ID: health.ServiceID(r.InstanceID,
						"work"), Name: "work", Tags: []string{health.DefaultTag},
					Address: r.Address, Port: r.Port, Meta: r.Meta(),
					Checks: api.AgentServiceChecks{
						{
							CheckID: health.CheckID(r.InstanceID, session, "work"),
							TTL:     f.ttl(i).String(),
							Status:  api.HealthPassing,
						},
					},
				}, api.ServiceRegisterOpts{ReplaceExistingChecks: true})
				if err != nil {
					errs <- err
					return
				}
				f.gens[i].Store(gen)
			}
		}()
	}
	wg.Wait()
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
}

// heartbeat renews the canaries' leases every second until ctx ends.
func (f *churnFleet) heartbeat(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for i := range f.canaries {
			if !f.stopped[i].Load() {
				f.agent(i).Agent().UpdateTTLOpts(f.checkID(i), "load=1", api.HealthPassing,
					(&api.QueryOptions{}).WithContext(ctx),
				)
			}
		}
	}
}

// falseLapses follows Consul's critical checks until ctx ends and counts
// those of a current session of an executor the test did not stop.
func (f *churnFleet) falseLapses(ctx context.Context, c *api.Client,
	log func(string, ...any)) *atomic.Int64 {
	var count atomic.Int64
	go func() {
		seen := map[string]bool{}
		var index uint64
		for ctx.Err() == nil {
			checks, meta, err := c.Health().State(api.HealthCritical,
				(&api.QueryOptions{WaitIndex: index, WaitTime: 5 * time.Second}).WithContext(ctx))
			if err != nil {
				index = 0
				select {
				case <-ctx.Done():
				case <-time.After(100 * time.Millisecond): // back-off of a failed read
				}
				continue
			}
			index = meta.LastIndex
			for _, ch := range checks {
				inst, session, _, ok := health.ParseCheckID(ch.CheckID)
				var i int
				if _, err := fmt.Sscanf(inst, "c%04d", &i); !ok || err != nil || i >= f.n ||
					seen[ch.CheckID] {
					continue
				}
				if !f.stopped[i].Load() && session == f.session(i) {
					seen[ch.CheckID] = true
					count.Add(1)
					log("FALSE LAPSE of %s session %s: %q", inst, session, ch.Output)
				}
			}
		}
	}()
	return &count
}

// readBytes is leasehold's leasehold_consul_read_bytes_total of encoding
// (wire or json), all watches together.
func readBytes(t *testing.T, admin, encoding string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "leasehold_consul_read_bytes_total{") &&
			strings.Contains(line, `encoding="`+encoding+`"`) {
			f := strings.Fields(line)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			sum += v
		}
	}
	return sum
}

// 1,000 executors of one task type over a server and two client agents
// register and then restart under new sessions, 16 at a time, under a
// watching leasehold. Canaries on a 3 s lease heartbeat every second
// throughout: none lapses falsely; two stop during the restart and leave the
// assignment; what leasehold reads from Consul per change stays bounded (≤
// 10 KB on the wire, whatever the task size: reads coalesce under churn and
// a change re-reads only its registration); and afterwards the assignment is
// exactly what Consul shows passing.
func TestChurnDrill(t *testing.T) {
	if testing.Short() {
		t.Skip("1,000 registrations, twice")
	}
	server := consultest.Start(t)
	agents := []*api.Client{server.Client()}
	for k := 1; k <= 2; k++ {
		agents = append(agents,
			consultest.Start(t,
				consultest.Options{NodeName: fmt.Sprintf("churn-%d", k), JoinClientOf: server},
			).Client(),
		)
	}
	const n, canaries = 1000, 12
	f := &churnFleet{
		agents:   agents,
		n:        n,
		canaries: canaries,
		lease:    3 * time.Second,
		gens:     make([]atomic.Uint64, n),
		stopped:  make([]atomic.Bool, n),
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	f.register(t, 0, canaries)
	go f.heartbeat(ctx)
	lapses := f.falseLapses(ctx, server.Client(), t.Logf)
	// One cluster, whatever the size: the drill follows the task's one load
	// assignment (sharding has drills of its own).
	addrs := startServeTo(t, server, testWriter{t, "serve"},
		func(c *serveConfig) { c.shardSize = 0 })
	eds := latestEDS(t, addrs.xds)

	// awaitConsul waits until the assignment is what Consul shows passing.
	awaitConsul := func(what string) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for {
			entries, _, err := server.Client().Health().Service("work",
				health.DefaultTag, true, nil)
			if err != nil {
				t.Fatal(err)
			}
			want := endpoints{}
			for _, e := range entries {
				meta := e.Service.Meta
				addr := "127.0.0.1:" + strconv.Itoa(e.Service.Port)
				want[endpoint{meta[health.MetaInstanceID], meta[health.MetaSessionID], addr}]++
			}
			got, changed := eds.latest()
			if err := eds.failed(); err != nil {
				t.Fatalf("%s: the EDS stream failed: %v", what, err)
			}
			if got.equal(want) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: leasehold serves %d endpoints, Consul shows %d passing",
					what, len(got), len(want))
			}
			select { // a new assignment, or Consul's answer may have moved
			case <-changed:
			case <-time.After(500 * time.Millisecond):
			}
		}
	}
	awaitConsul("the canaries")

	start := time.Now()
	f.register(t, canaries, n)
	t.Logf("%d registrations in %s", n-canaries, time.Since(start).Round(time.Millisecond))
	awaitConsul("after the registrations")

	wire0, json0 := readBytes(t, addrs.admin, "wire"), readBytes(t, addrs.admin, "json")
	start = time.Now()
	restarted := make(chan struct{})
	go func() { defer close(restarted); f.register(t, 0, n) }()
	// two canaries stop heartbeating during the restart
	for _, i := range []int{3, 7} {
		time.Sleep(time.Second) // spacing of the drill, not a wait for a result
		f.stopped[i].Store(true)
	}
	<-restarted
	changes := float64(n)
	wire, json := readBytes(t, addrs.admin, "wire")-wire0, readBytes(t, addrs.admin, "json")-json0
	t.Logf(
		"rolling restart of %d in %s; leasehold read %.1f KB per change on the wire, %.1f KB of "+
			"JSON",
		n, time.Since(start).Round(time.Millisecond), wire/changes/1000, json/changes/1000)
	for _, i := range []int{3, 7} {
		awaitCheck(t, server.Client(), f.id(i), api.HealthCritical)
	}
	awaitConsul("after the rolling restart and two lapses")
	got, _ := eds.latest()
	for _, i := range []int{3, 7} {
		if got.has(f.id(i), f.session(i)) {
			t.Errorf("canary %s stopped heartbeating and is still served", f.id(i))
		}
	}
	if l := lapses.Load(); l > 0 {
		t.Errorf("%d false lapses: executors heartbeating normally lapsed during the churn", l)
	}
	if wire/changes > 10_000 {
		t.Errorf("leasehold read %.1f KB per change on the wire during the restart, want ≤ 10 KB",
			wire/changes/1000)
	}
}

// edsLatest follows task work's assignment on one ADS stream, keeping only
// the latest.
type edsLatest struct {
	mu      sync.Mutex
	set     endpoints
	err     error
	changed chan struct{}
}

func latestEDS(t *testing.T, xdsAddr string) *edsLatest {
	t.Helper()
	s := dialADS(t, xdsAddr, &corev3.Node{Id: "churn-drill"})
	e := &edsLatest{changed: make(chan struct{})}
	note := func(set endpoints, err error) {
		e.mu.Lock()
		defer e.mu.Unlock()
		if err != nil {
			e.err = err
		} else {
			e.set = set
		}
		close(e.changed)
		e.changed = make(chan struct{})
	}
	ended := s.Follow(resource.EndpointType, []string{"work"},
		func(resp *discovery.DiscoveryResponse, _, _ time.Time) {
			note(endpointsOf(resp), nil)
		},
	)
	go func() { note(nil, <-ended) }()
	return e
}

// latest is the last assignment received and a channel closed at the next.
func (e *edsLatest) latest() (endpoints, <-chan struct{}) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.set, e.changed
}

func (e *edsLatest) failed() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.err
}
