package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/hashicorp/consul/api"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// stormReg is what the storm knows of one instance's registration. Its lock
// is held for a whole Consul operation on the instance, so the test knows
// Consul's state exactly and no operation can fail because another one
// raced it.
type stormReg struct {
	mu       sync.Mutex
	session  string
	addr     string
	present  bool
	critical bool // its check is critical in Consul now
}

// stormLedger records every session that went critical, as the storm wrote
// it, Consul reported it or leasehold answered it, and every breach of the
// rule that such a session is never routed again.
type stormLedger struct {
	mu       sync.Mutex
	critical map[string]string // session → who reported it critical first
	// session → when leasehold's first LAPSED answer for it was received
	lapsedAt   map[string]time.Time
	violations []string
	errs       []string
	stop       context.CancelFunc // ends the storm at the first failure
}

func (l *stormLedger) wentCritical(session, by string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.critical[session]; !ok {
		l.critical[session] = by
	}
}

func (l *stormLedger) isCritical(session string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.critical[session]
	return ok
}

func (l *stormLedger) violate(format string, args ...any) {
	l.mu.Lock()
	l.violations = append(l.violations, fmt.Sprintf(format, args...))
	l.mu.Unlock()
	l.stop()
}

// fail records an error the drill cannot explain.
func (l *stormLedger) fail(format string, args ...any) {
	l.mu.Lock()
	l.errs = append(l.errs, fmt.Sprintf(format, args...))
	l.mu.Unlock()
	l.stop()
}

// answered checks a fencing answer to a question sent at sent: once
// leasehold has answered LAPSED, a later question must never get CURRENT.
// It reports whether the answer broke that.
func (l *stormLedger) answered(r *leaseholdv1.CheckSessionResponse, sent time.Time) bool {
	l.mu.Lock()
	lapsed, wasLapsed := l.lapsedAt[r.SessionId]
	if r.State == leaseholdv1.SessionState_LAPSED && !wasLapsed {
		l.lapsedAt[r.SessionId] = time.Now()
		if _, ok := l.critical[r.SessionId]; !ok {
			l.critical[r.SessionId] = "leasehold"
		}
	}
	l.mu.Unlock()
	if r.State == leaseholdv1.SessionState_CURRENT && wasLapsed && sent.After(lapsed) {
		l.violate("session %s/%s answered CURRENT after leasehold had answered LAPSED for it",
			r.InstanceId, r.SessionId)
		return true
	}
	return false
}

// served checks one EDS response, requested by an ACK sent at acked: the
// server built it from its cache after that ACK, and leasehold puts a
// removal into the cache before its fencing answer says LAPSED, so no
// session answered LAPSED before acked may be in it.
func (l *stormLedger) served(eps endpoints, acked time.Time) {
	l.mu.Lock()
	var bad []string
	for e := range eps {
		if at, ok := l.lapsedAt[e.session]; ok && at.Before(acked) {
			bad = append(bad, e.instance+"/"+e.session)
		}
	}
	l.mu.Unlock()
	if len(bad) > 0 {
		l.violate("EDS response requested %s after LAPSED still routes %v",
			acked.Format("15:04:05.000"), bad)
	}
}

func (l *stormLedger) report(t *testing.T) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, list := range [][]string{l.errs, l.violations} {
		for i, s := range list {
			if i == 10 {
				t.Errorf("… and %d more", len(list)-10)
				break
			}
			t.Error(s)
		}
	}
	if len(l.errs)+len(l.violations) > 0 {
		t.FailNow()
	}
}

// 500 registrations come and go and flip between passing, warning and
// critical for 10 s. A session set critical stays critical until leasehold's
// fencing API has answered LAPSED for it; then the storm may set it passing
// again, as a confused or hostile agent could. Throughout, no session
// answered LAPSED is in any later EDS response or answered CURRENT, and
// every Consul or leasehold error fails the drill. Afterwards leasehold
// routes exactly the passing registrations never seen critical, answers
// LAPSED for every registered session that went critical, its heap is of the
// same order and no goroutines are left behind.
func TestFlapStorm(t *testing.T) {
	if testing.Short() {
		t.Skip("10 s storm")
	}
	const n = 500
	a := consultest.Start(t)
	c := a.Client()
	var gen atomic.Uint64
	regs := make([]stormReg, n)
	instance := func(i int) string { return fmt.Sprintf("f%03d", i) }
	// register replaces instance i's registration by a fresh passing session
	// (lock held).
	register := func(i int) error {
		g := gen.Add(1)
		s := fmt.Sprintf("s%d", g)
		r := health.Registration{InstanceID: instance(i), SessionID: s, Generation: g, Task: "work",
			Address: "127.0.0.1", Port: 30000 + i, Version: "1.0.0", Capacity: 4,
			State: health.StateActive}
		err := c.Agent().ServiceRegisterOpts(&api.AgentServiceRegistration{
			ID: health.ServiceID(r.InstanceID,
				"work"), Name: "work", Tags: []string{"leasehold"}, Address: r.Address,
			Port: r.Port, Meta: r.Meta(),
			Checks: api.AgentServiceChecks{
				{CheckID: health.CheckID(r.InstanceID, s, "work"), TTL: "1h", Status: "passing"},
			},
		}, api.ServiceRegisterOpts{ReplaceExistingChecks: true})
		if err != nil {
			return fmt.Errorf("register %s/%s: %w", r.InstanceID, s, err)
		}
		regs[i].session, regs[i].addr, regs[i].present, regs[i].critical = s, fmt.Sprintf(
			"127.0.0.1:%d", r.Port), true, false
		return nil
	}
	for i := range n {
		if err := register(i); err != nil {
			t.Fatal(err)
		}
	}
	addrs := startServe(t, a)
	fc := fencingClient(t, addrs.xds)

	stormCtx, endStorm := context.WithCancel(context.Background())
	defer endStorm()
	ledger := &stormLedger{
		critical: map[string]string{},
		lapsedAt: map[string]time.Time{},
		stop:     endStorm,
	}
	watchCtx, endWatch := context.WithCancel(context.Background())
	var watchers sync.WaitGroup
	defer func() { endWatch(); watchers.Wait() }()

	// What Consul reports critical, followed with blocking queries.
	watchers.Add(1)
	go func() {
		defer watchers.Done()
		var index uint64
		for {
			checks, meta, err := c.Health().State(api.HealthCritical,
				(&api.QueryOptions{WaitIndex: index, WaitTime: 5 * time.Second}).WithContext(
					watchCtx),
			)
			if err != nil {
				if watchCtx.Err() != nil {
					return // the drill is over
				}
				ledger.fail("watching Consul's critical checks: %v", err)
				return
			}
			for _, ch := range checks {
				if _, s, _, ok := health.ParseCheckID(ch.CheckID); ok {
					ledger.wentCritical(s, "consul")
				}
			}
			if meta.LastIndex < index {
				index = 0
			} else {
				index = meta.LastIndex
			}
		}
	}()

	// Every EDS response leasehold sends, checked as it arrives; the test
	// goroutine gets the latest.
	ads := dialADS(t, addrs.xds, &corev3.Node{Id: "storm-probe"})
	context.AfterFunc(watchCtx, ads.Close)
	latest := make(chan endpoints, 1)
	ended := ads.Follow(resource.EndpointType, []string{"work"},
		func(r *discovery.DiscoveryResponse, requested, _ time.Time) {
			eps := endpointsOf(r)
			ledger.served(eps, requested)
			select { // keep only the newest for the test goroutine
			case <-latest:
			default:
			}
			latest <- eps
		},
	)
	watchers.Add(1)
	go func() {
		defer watchers.Done()
		if err := <-ended; watchCtx.Err() == nil || status.Code(err) != codes.Canceled {
			ledger.fail("EDS stream: %v", err)
		}
	}()
	// awaitEDS waits until the served set satisfies ok, naming what on failure.
	awaitEDS := func(timeout time.Duration, what string, ok func(endpoints) bool) endpoints {
		t.Helper()
		deadline := time.After(timeout)
		var got endpoints
		for {
			select {
			case got = <-latest:
				if ok(got) {
					return got
				}
			case <-deadline:
				ledger.report(t)
				t.Fatalf("%s not served within %s; last EDS response %v", what, timeout, got)
			}
		}
	}
	awaitEDS(20*time.Second, fmt.Sprintf("all %d registrations", n),
		func(e endpoints) bool { return len(e) == n })

	baseline := runtime.NumGoroutine()
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)

	// the storm: 4 workers for 10 s (LEASEHOLD_STORM sets another duration: make soak)
	storm := 10 * time.Second
	if v, err := time.ParseDuration(os.Getenv("LEASEHOLD_STORM")); err == nil {
		storm = v
	}
	timer := time.AfterFunc(storm, endStorm)
	defer timer.Stop()
	var ops, revived, refusedRevivals atomic.Int64
	op := func(rng *rand.Rand) error {
		ops.Add(1)
		i := rng.IntN(n)
		id := instance(i)
		r := &regs[i]
		r.mu.Lock()
		defer r.mu.Unlock()
		switch op := rng.IntN(10); {
		case !r.present || op == 0: // (re)register under a fresh session
			return register(i)
		case op == 1:
			if err := c.Agent().ServiceDeregister(health.ServiceID(id, "work")); err != nil {
				return fmt.Errorf("deregister %s: %w", id, err)
			}
			r.present = false
			return nil
		}
		st := []string{api.HealthPassing, api.HealthWarning, api.HealthCritical}[rng.IntN(3)]
		if r.critical && st != api.HealthCritical {
			// Revive it only once leasehold has said LAPSED: before that,
			// leasehold may never have seen it critical (Consul keeps no
			// history), and could not be blamed for routing it.
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			sent := time.Now()
			ans, err := fc.CheckSession(ctx,
				&leaseholdv1.CheckSessionRequest{InstanceId: id, SessionId: r.session})
			if err != nil {
				return fmt.Errorf("CheckSession %s/%s: %w", id, r.session, err)
			}
			ledger.answered(ans, sent)
			if ans.State != leaseholdv1.SessionState_LAPSED {
				refusedRevivals.Add(1)
				return nil
			}
			revived.Add(1)
		}
		if st == api.HealthCritical {
			// Recorded before the write: from the moment it is sent,
			// leasehold may see it.
			ledger.wentCritical(r.session, "storm")
		}
		if err := c.Agent().UpdateTTL(health.CheckID(id, r.session, "work"), "", st); err != nil {
			return fmt.Errorf("set %s/%s %s: %w", id, r.session, st, err)
		}
		r.critical = st == api.HealthCritical
		return nil
	}
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for stormCtx.Err() == nil {
				if err := op(rng); err != nil {
					ledger.fail("storm: %v", err)
				}
			}
		}()
	}
	wg.Wait()
	ledger.report(t)

	// Consul's final state must be the one the storm wrote.
	entries, _, err := c.Health().Service("work", "", false, nil)
	if err != nil {
		t.Fatal(err)
	}
	inConsul := map[string]*api.ServiceEntry{}
	for _, e := range entries {
		inConsul[e.Service.Meta[health.MetaInstanceID]] = e
	}
	want := endpoints{}
	var lapsed, current []endpoint
	for i := range regs {
		r := &regs[i]
		e := inConsul[instance(i)]
		if !r.present {
			if e != nil {
				t.Fatalf("%s deregistered by the storm, in Consul: %s",
					instance(i), consultest.Describe([]*api.ServiceEntry{e}))
			}
			continue
		}
		if e == nil || e.Service.Meta[health.MetaSessionID] != r.session {
			t.Fatalf("%s registered by the storm under %s, in Consul: %s",
				instance(i), r.session, consultest.Describe([]*api.ServiceEntry{e}))
		}
		ep := endpoint{instance: instance(i), session: r.session, addr: r.addr}
		switch {
		case ledger.isCritical(r.session):
			lapsed = append(lapsed, ep)
		case e.Checks.AggregatedStatus() == api.HealthPassing:
			want[ep] = 1
			current = append(current, ep)
		}
	}
	t.Logf(
		"after %d operations: %d registrations, %d routable, %d went critical and are still "+
			"registered (%d revived after LAPSED, %d revivals held back until leasehold saw the "+
			"lapse)",
		ops.Load(), len(entries), len(want), len(lapsed), revived.Load(), refusedRevivals.Load())

	// leasehold converges to exactly the passing sessions never seen critical.
	awaitEDS(20*time.Second,
		fmt.Sprintf("exactly the %d passing sessions never seen critical", len(want)), want.equal)
	// and its fencing answers agree, each awaited with WatchSession
	awaitAnswer := func(ep endpoint, wantState leaseholdv1.SessionState) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		sent := time.Now()
		w, err := fc.WatchSession(ctx,
			&leaseholdv1.CheckSessionRequest{InstanceId: ep.instance, SessionId: ep.session})
		if err != nil {
			t.Fatal(err)
		}
		for {
			r, err := w.Recv()
			if err != nil {
				ledger.report(t)
				t.Fatalf("%s/%s never answered %s: %v", ep.instance, ep.session, wantState, err)
			}
			if ledger.answered(r, sent) {
				ledger.report(t)
			}
			if r.State == wantState {
				return
			}
		}
	}
	for _, ep := range lapsed {
		awaitAnswer(ep, leaseholdv1.SessionState_LAPSED)
	}
	for _, ep := range current {
		awaitAnswer(ep, leaseholdv1.SessionState_CURRENT)
	}
	endWatch()
	watchers.Wait()
	ledger.report(t)
	whoSaw := map[string]int{}
	ledger.mu.Lock()
	for _, by := range ledger.critical {
		whoSaw[by]++
	}
	ledger.mu.Unlock()
	seen := make([]string, 0, len(whoSaw))
	for by, k := range whoSaw {
		seen = append(seen, fmt.Sprintf("%s %d", by, k))
	}
	sort.Strings(seen)
	t.Logf("sessions that went critical, by first reporter: %s", strings.Join(seen, ", "))

	// memory stays bounded: the heap after the storm is of the same order
	var after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&after)
	t.Logf("heap before %.1f MB, after %.1f MB",
		float64(before.HeapAlloc)/(1<<20), float64(after.HeapAlloc)/(1<<20))
	if after.HeapAlloc > 2*before.HeapAlloc+32<<20 {
		t.Fatalf("heap grew from %d to %d bytes over the storm", before.HeapAlloc, after.HeapAlloc)
	}
	// goroutines settle back
	settle := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > baseline+20 {
		if time.Now().After(settle) {
			t.Fatalf("goroutines %d after the storm, %d before", runtime.NumGoroutine(), baseline)
		}
		<-time.After(100 * time.Millisecond) // goroutines have no event to wait on
	}
}
