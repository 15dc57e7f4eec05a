package consul

// Integration tests: a real Consul dev agent, short leases (1 s lease, 250 ms
// heartbeat). Waits use blocking queries with deadlines, never sleeps.

import (
	"context"
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

var shortLease = health.Lease{
	TTL:             time.Second,
	Heartbeat:       250 * time.Millisecond,
	DeregisterAfter: time.Minute,
}

type liveExecutor struct {
	reg   *Registrar
	load  atomic.Int64
	fail  atomic.Bool // probe fails
	done  chan error
	stop  context.CancelFunc
	lost  chan LeaseLoss
	agent *consultest.Agent
}

func runLive(
	t *testing.T,
	a *consultest.Agent,
	instance string,
	mutate func(*Config),
) *liveExecutor {
	t.Helper()
	e := &liveExecutor{done: make(chan error, 1), lost: make(chan LeaseLoss, 16), agent: a}
	cfg := Config{
		InstanceID: instance, Tasks: []string{"transcode"}, Address: "127.0.0.1", Port: 9100,
		Version: "1.2.3", Capacity: 2, Labels: map[string]string{"zone": "eu-1"}, Lease: shortLease,
		Load: func() int { return int(e.load.Load()) },
		Probe: func(context.Context) error {
			if e.fail.Load() {
				return errors.New("probe failing")
			}
			return nil
		},
		OnLeaseLost: func(l LeaseLoss) { e.lost <- l },
	}
	if mutate != nil {
		mutate(&cfg)
	}
	reg, err := NewRegistrar(NewAPIAgent(a.Client()), cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.reg = reg
	ctx, cancel := context.WithCancel(context.Background())
	e.stop = cancel
	go func() { e.done <- reg.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-reg.Done():
		case <-time.After(10 * time.Second):
			t.Error("Run did not return")
		}
	})
	return e
}

func (e *liveExecutor) session(t *testing.T, prev *Session) *Session {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	s, err := e.reg.WaitSession(ctx, prev)
	if err != nil {
		t.Fatalf("no session: %v", err)
	}
	return s
}

func (e *liveExecutor) loss(t *testing.T) LeaseLoss {
	t.Helper()
	select {
	case l := <-e.lost:
		return l
	case <-time.After(15 * time.Second):
		t.Fatal("no lease loss reported")
		return LeaseLoss{}
	}
}

// entryOf finds the registration of a session among health entries.
func entryOf(entries []*api.ServiceEntry, session string) (*api.ServiceEntry, *api.HealthCheck) {
	for _, e := range entries {
		if e.Service.Meta[health.MetaSessionID] != session {
			continue
		}
		for _, c := range e.Checks {
			if _, s, _, ok := health.ParseCheckID(c.CheckID); ok && s == session {
				return e, c
			}
		}
		return e, nil
	}
	return nil, nil
}

func waitCheck(
	t *testing.T,
	c *api.Client,
	session, status string,
	timeout time.Duration,
) *api.ServiceEntry {
	t.Helper()
	var found *api.ServiceEntry
	consultest.WaitService(
		t,
		c,
		"transcode",
		timeout,
		"session "+session+" "+status,
		func(es []*api.ServiceEntry) bool {
			e, ch := entryOf(es, session)
			found = e
			return ch != nil && ch.Status == status
		},
	)
	return found
}

// stayPassing watches session's registration with blocking queries for the
// whole of d and fails the moment it is not passing (or not as also wants),
// or Consul cannot be asked: an error is never taken for the end of d.
func stayPassing(
	t *testing.T,
	c *api.Client,
	session string,
	d time.Duration,
	also func(*api.ServiceEntry) bool,
) {
	t.Helper()
	end := time.Now().Add(d)
	var index uint64
	for {
		left := time.Until(end)
		if left <= 0 {
			return
		}
		// Consul ends the wait itself (WaitTime) before the deadline: a
		// cancelled request would be indistinguishable from a failing one.
		es, meta, err := c.Health().
			Service("transcode", "", false, &api.QueryOptions{WaitIndex: index, WaitTime: left})
		if err != nil {
			t.Fatalf("watching session %s stay passing: %v", session, err)
		}
		e, ch := entryOf(es, session)
		if ch == nil || ch.Status != api.HealthPassing || (also != nil && !also(e)) {
			t.Fatalf(
				"session %s not kept passing (%s before the end of the watch): %s",
				session,
				time.Until(end).Round(time.Millisecond),
				consultest.Describe(es),
			)
		}
		if meta.LastIndex < index {
			index = 0
		} else {
			index = meta.LastIndex
		}
	}
}

func TestConsulRegisterHeartbeatAndLapse(t *testing.T) {
	a := consultest.Start(t)
	a.SettleSync() // lapse timing is measured below
	c := a.Client()
	ex := runLive(t, a, "exec-1", nil)
	s := ex.session(t, nil)

	e := waitCheck(t, c, s.ID, api.HealthPassing, 10*time.Second)
	want := map[string]string{
		"instance_id": "exec-1",
		"session_id":  s.ID,
		"version":     "1.2.3",
		"capacity":    "2",
		"state":       "active",
		"label_zone":  "eu-1",
	}
	for k, v := range want {
		if e.Service.Meta[k] != v {
			t.Errorf("meta %s = %q, want %q (all: %v)", k, e.Service.Meta[k], v, e.Service.Meta)
		}
	}
	if e.Service.ID != "transcode:exec-1" || e.Service.Address != "127.0.0.1" ||
		e.Service.Port != 9100 ||
		len(e.Service.Tags) != 1 ||
		e.Service.Tags[0] != "leasehold" {
		t.Errorf("service = %+v", e.Service)
	}
	_, ch := entryOf([]*api.ServiceEntry{e}, s.ID)
	if ch.CheckID != health.CheckID("exec-1", s.ID, "transcode") || ch.Type != "ttl" {
		t.Errorf("check = %+v", ch)
	}

	// Heartbeats keep it passing: watch three whole leases for any change.
	stayPassing(t, c, s.ID, 3*shortLease.TTL, nil)

	// Heartbeats stop (the probe fails): critical within lease + margin.
	stopped := time.Now()
	ex.fail.Store(true)
	waitCheck(t, c, s.ID, api.HealthCritical, 5*time.Second)
	if took := time.Since(stopped); took > shortLease.TTL+750*time.Millisecond {
		t.Errorf(
			"critical %s after heartbeats stopped, want ≤ lease (%s) + 750ms",
			took,
			shortLease.TTL,
		)
	}
	if l := ex.loss(t); l.Reason != LossExpired || l.SessionID != s.ID {
		t.Fatalf("loss = %+v", l)
	}
	// Probe recovers: a new session, never the old one back to passing.
	ex.fail.Store(false)
	s2 := ex.session(t, s)
	es := consultest.WaitService(
		t,
		c,
		"transcode",
		10*time.Second,
		"new session passing",
		func(es []*api.ServiceEntry) bool {
			_, ch := entryOf(es, s2.ID)
			return ch != nil && ch.Status == api.HealthPassing
		},
	)
	if e, _ := entryOf(es, s.ID); e != nil {
		t.Fatalf("old session still registered: %s", consultest.Describe(es))
	}
	if len(es) != 1 {
		t.Fatalf("want exactly one registration: %s", consultest.Describe(es))
	}
}

func TestConsulFullIsWarningThenPassing(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	ex := runLive(t, a, "exec-1", nil)
	s := ex.session(t, nil)
	waitCheck(t, c, s.ID, api.HealthPassing, 10*time.Second)
	ex.load.Store(2)
	e := waitCheck(t, c, s.ID, api.HealthWarning, 5*time.Second)
	if _, ch := entryOf([]*api.ServiceEntry{e}, s.ID); ch.Output != "load=2" {
		t.Errorf("output = %q", ch.Output)
	}
	ex.load.Store(1)
	e = waitCheck(t, c, s.ID, api.HealthPassing, 5*time.Second)
	if _, ch := entryOf([]*api.ServiceEntry{e}, s.ID); ch.Output != "load=1" {
		t.Errorf("output = %q", ch.Output)
	}
}

func TestConsulRestartWithSameInstanceID(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	old := runLive(t, a, "exec-1", nil)
	s1 := old.session(t, nil)
	waitCheck(t, c, s1.ID, api.HealthPassing, 10*time.Second)

	newer := runLive(t, a, "exec-1", nil) // a second process, same instance id
	s2 := newer.session(t, nil)
	if s2.ID == s1.ID {
		t.Fatal("same session id")
	}
	l := old.loss(t)
	if l.Reason != LossRefused || !l.Superseded || !errors.Is(l.Err, ErrUnknownCheck) {
		t.Fatalf("old process loss = %+v", l)
	}
	select {
	case err := <-old.done:
		if !errors.Is(err, ErrSuperseded) {
			t.Fatalf("old Run = %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("old process kept running")
	}
	if !errors.Is(s1.Err(), ErrLeaseLost) {
		t.Fatalf("old session cause = %v", s1.Err())
	}
	es := waitCheck(t, c, s2.ID, api.HealthPassing, 5*time.Second)
	_ = es
	all, _, err := c.Health().Service("transcode", "", false, nil)
	if err != nil || len(all) != 1 || all[0].Service.Meta["session_id"] != s2.ID {
		t.Fatalf("want only the new session: %v %s", err, consultest.Describe(all))
	}
	// the old process stopping must not remove the newer registration
	old.stop()
	waitCheck(t, c, s2.ID, api.HealthPassing, 5*time.Second)
	if newer.reg.Session() != s2 || s2.Err() != nil {
		t.Fatal("newer session disturbed")
	}
}

func TestConsulAgentRestartReregisters(t *testing.T) {
	a := consultest.Start(t)
	ex := runLive(t, a, "exec-1", nil)
	s1 := ex.session(t, nil)
	waitCheck(t, a.Client(), s1.ID, api.HealthPassing, 10*time.Second)
	a.Restart() // the agent lost its state: the session is gone
	l := ex.loss(t)
	if l.SessionID != s1.ID || l.Superseded {
		t.Fatalf("loss = %+v", l)
	}
	s2 := ex.session(t, s1)
	waitCheck(t, a.Client(), s2.ID, api.HealthPassing, 15*time.Second)
}

func TestConsulAgentRestartKeepingStateKeepsSession(t *testing.T) {
	a := consultest.Start(t)
	ex := runLive(t, a, "exec-1", nil)
	s1 := ex.session(t, nil)
	waitCheck(t, a.Client(), s1.ID, api.HealthPassing, 10*time.Second)
	a.RestartKeepingState() // restores the service and its TTL check
	waitCheck(t, a.Client(), s1.ID, api.HealthPassing, 10*time.Second)
	// a further lease passes without loss: the session survived the restart
	select {
	case l := <-ex.lost:
		t.Logf("restart took longer than the lease here: %+v", l) // legitimate on a loaded machine
		ex.session(t, s1)
	case <-time.After(2 * shortLease.TTL):
		if ex.reg.Session() != s1 || s1.Err() != nil {
			t.Fatal("session changed without a reported loss")
		}
	}
}

func TestConsulDrain(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	ex := runLive(t, a, "exec-1", nil)
	s := ex.session(t, nil)
	waitCheck(t, c, s.ID, api.HealthPassing, 10*time.Second)
	ex.load.Store(1) // a task in flight
	drained := make(chan error, 1)
	go func() { drained <- ex.reg.Drain(context.Background()) }()
	consultest.WaitService(
		t,
		c,
		"transcode",
		15*time.Second,
		"state=draining",
		func(es []*api.ServiceEntry) bool {
			e, ch := entryOf(es, s.ID)
			return e != nil && e.Service.Meta["state"] == "draining" && ch != nil &&
				ch.Status == api.HealthPassing
		},
	)
	// In-flight work keeps the lease: two more leases pass, still registered, draining and passing.
	stayPassing(
		t,
		c,
		s.ID,
		2*shortLease.TTL,
		func(e *api.ServiceEntry) bool { return e.Service.Meta["state"] == "draining" },
	)
	select {
	case err := <-drained:
		t.Fatalf("drain returned with work in flight: %v", err)
	default:
	}
	ex.load.Store(0)
	select {
	case err := <-drained:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("drain did not finish")
	}
	consultest.WaitService(
		t,
		c,
		"transcode",
		15*time.Second,
		"deregistered",
		func(es []*api.ServiceEntry) bool { return len(es) == 0 },
	)
	if !errors.Is(s.Err(), ErrDrained) {
		t.Fatalf("session cause = %v", s.Err())
	}
}

func TestConsulBadInputRegistersNothing(t *testing.T) {
	a := consultest.Start(t)
	_, err := NewRegistrar(
		NewAPIAgent(a.Client()),
		Config{
			InstanceID: "exec-1",
			Tasks:      []string{"transcode"},
			Address:    "127.0.0.1",
			Port:       9100,
			Version:    "1.2",
			Capacity:   2,
		},
	)
	if err == nil || !containsStr(health.Fields(err), "version") {
		t.Fatalf("err = %v", err)
	}
	services, err := a.Client().Agent().Services()
	if err != nil || len(services) != 0 {
		t.Fatalf("agent has services %v (%v)", services, err)
	}
}

func TestConsulNextGenerationIsStrictlyIncreasing(t *testing.T) {
	a := consultest.Start(t)
	ag := NewAPIAgent(a.Client())
	ctx := context.Background()
	if g, err := ag.NextGeneration(ctx, "exec-1", "s", 0); err != nil || g != 1 {
		t.Fatalf("first = %d, %v", g, err)
	}
	// concurrent session starts of one instance never share a generation
	const n = 8
	got := make(chan uint64, n)
	for range n {
		go func() {
			g, err := ag.NextGeneration(ctx, "exec-1", "s", 0)
			if err != nil {
				t.Error(err)
			}
			got <- g
		}()
	}
	seen := map[uint64]bool{}
	for range n {
		g := <-got
		if seen[g] || g < 2 || g > n+1 {
			t.Fatalf("generation %d repeated or out of range (seen %v)", g, seen)
		}
		seen[g] = true
	}
	// KV lost: the floor (highest generation still registered) keeps the order
	if _, err := a.Client().KV().Delete(health.GenerationKey("exec-1"), nil); err != nil {
		t.Fatal(err)
	}
	if g, err := ag.NextGeneration(ctx, "exec-1", "s", 42); err != nil || g != 43 {
		t.Fatalf("after KV loss = %d, %v; want 43", g, err)
	}
	// other instances have their own sequence
	if g, _ := ag.NextGeneration(ctx, "exec-2", "s", 0); g != 1 {
		t.Fatalf("exec-2 first = %d", g)
	}
}

func TestConsulRestartAfterKVLossStillGetsHigherGeneration(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	first := runLive(t, a, "exec-1", nil)
	s1 := first.session(t, nil)
	e := waitCheck(t, c, s1.ID, api.HealthPassing, 10*time.Second)
	if e.Service.Meta[health.MetaGeneration] != "1" || s1.Generation != 1 {
		t.Fatalf(
			"generation meta = %q, session %d",
			e.Service.Meta[health.MetaGeneration],
			s1.Generation,
		)
	}
	// The KV entry is lost while the first process is still registered: a
	// restarted process must still be newer than what the catalog holds.
	if _, err := c.KV().Delete(health.GenerationKey("exec-1"), nil); err != nil {
		t.Fatal(err)
	}
	second := runLive(t, a, "exec-1", nil)
	s2 := second.session(t, nil)
	if s2.Generation <= s1.Generation {
		t.Fatalf("restarted process generation %d not above %d", s2.Generation, s1.Generation)
	}
	if l := first.loss(t); !l.Superseded {
		t.Fatalf("first process not superseded: %+v", l)
	}
}

// registerGarbageGeneration registers, on the same agent under another service
// id, a registration of instance victim whose generation is above 2^53:
// garbage by the contract and for leasehold (ParseRegistration refuses it, so
// it orders nothing: health.Executor.Orders is false). A buggy sidecar that
// uses a nanosecond timestamp as its generation writes exactly such a value;
// so can any token allowed to register the task's service. With passing, it
// carries a passing lease check of its own.
func registerGarbageGeneration(t *testing.T, c *api.Client, generation uint64, passing bool) {
	t.Helper()
	reg := &api.AgentServiceRegistration{
		ID: "junk-victim", Name: "transcode", Tags: []string{health.DefaultTag},
		Address: "127.0.0.1", Port: 9999,
		Meta: map[string]string{
			health.MetaInstanceID: "victim",
			health.MetaSessionID:  "junk",
			health.MetaGeneration: strconv.FormatUint(generation, 10),
			health.MetaVersion:    "1.2.3",
			health.MetaCapacity:   "1",
			health.MetaState:      "active",
		},
	}
	if passing {
		reg.Checks = api.AgentServiceChecks{
			{
				CheckID: health.CheckID("victim", "junk", "transcode"),
				Name:    "lease",
				TTL:     "1h",
				Status:  api.HealthPassing,
			},
		}
	}
	if err := c.Agent().ServiceRegister(reg); err != nil {
		t.Fatal(err)
	}
	e, err := health.ParseRegistration("transcode", "127.0.0.1", 9999, reg.Meta)
	if err == nil || (health.Executor{Registration: e, Err: err}).Orders() {
		t.Fatalf("premise: leasehold takes generation %d as valid (err %v)", generation, err)
	}
}

// TestConsulGarbageGenerationSupersedesNothing: a registration whose
// generation is garbage, with a passing lease check of its own, does not make
// the Registrar's fence check report LossSuperseded, nor Run return
// ErrSuperseded: leasehold ignores that registration and keeps the executor's
// session CURRENT, so the executor must not stop for it.
func TestConsulGarbageGenerationSupersedesNothing(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	ex := runLive(t, a, "victim", nil)
	ex.session(t, nil)
	registerGarbageGeneration(t, c, health.MaxGeneration+1, true)
	select {
	case err := <-ex.done:
		if errors.Is(err, ErrSuperseded) {
			t.Fatalf(
				"a registration with generation 2^53+1 (garbage for leasehold, which keeps the "+
					"executor's session CURRENT) made Run return: %v",
				err,
			)
		}
		t.Fatalf("Run returned: %v", err)
	case <-time.After(4 * shortLease.TTL):
	}
}
