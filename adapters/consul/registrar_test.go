package consul

import (
	"context"
	"errors"
	"log/slog"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/health"
)

const (
	testHB  = 10 * time.Second
	testTTL = 35 * time.Second
)

type harness struct {
	t     *testing.T
	agent *fakeAgent
	clock *clockwork.FakeClock
	reg   *Registrar
	load  atomic.Int64
	lost  chan LeaseLoss
	done  chan error
	stop  context.CancelFunc
}

func baseConfig() Config {
	return Config{
		InstanceID: "exec-1", Tasks: []string{"transcode", "thumbnail"},
		Address: "127.0.0.1", Port: 9000, Version: "1.4.2", Capacity: 2,
		Labels: map[string]string{"zone": "eu-1"},
	}
}

func start(t *testing.T, mutate func(*Config)) *harness {
	t.Helper()
	return startOn(t, newFakeAgent(), mutate)
}

// startOn is start with an agent prepared before the Registrar runs.
func startOn(t *testing.T, agent *fakeAgent, mutate func(*Config)) *harness {
	t.Helper()
	h := &harness{
		t:     t,
		agent: agent,
		clock: clockwork.NewFakeClock(),
		lost:  make(chan LeaseLoss, 16),
		done:  make(chan error, 1),
	}
	cfg := baseConfig()
	cfg.Clock = h.clock
	cfg.Load = func() int { return int(h.load.Load()) }
	cfg.OnLeaseLost = func(l LeaseLoss) { h.lost <- l }
	cfg.FenceCheck = -1 // the timer counts below assume no fence-check ticker
	if mutate != nil {
		mutate(&cfg)
	}
	reg, err := NewRegistrar(h.agent, cfg)
	if err != nil {
		t.Fatal(err)
	}
	h.reg = reg
	ctx, cancel := context.WithCancel(context.Background())
	h.stop = cancel
	go func() { h.done <- reg.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-h.done:
		case <-time.After(5 * time.Second):
			t.Error("Run did not return after cancel")
		}
	})
	return h
}

// advance waits until the Registrar is blocked on at least n timers, then
// moves the fake clock.
func (h *harness) advance(n int, d time.Duration) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := h.clock.BlockUntilContext(ctx, n); err != nil {
		h.t.Fatalf("registrar never armed %d timers", n)
	}
	h.clock.Advance(d)
}

// session waits for a session other than prev and returns it with the calls
// of its registration (made before it was published) already consumed.
func (h *harness) session(prev *Session) *Session {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := h.reg.WaitSession(ctx, prev)
	if err != nil {
		h.t.Fatalf("no new session: %v", err)
	}
	for {
		select {
		case <-h.agent.calls:
			continue
		default:
		}
		return s
	}
}

func (h *harness) loss() LeaseLoss {
	h.t.Helper()
	select {
	case l := <-h.lost:
		return l
	case <-time.After(5 * time.Second):
		h.t.Fatal("no lease loss reported")
		return LeaseLoss{}
	}
}

func TestRegistersEveryTaskWithContractMeta(t *testing.T) {
	h := start(t, nil)
	s := h.session(nil)
	for _, task := range []string{"transcode", "thumbnail"} {
		reg := h.agent.service(health.ServiceID("exec-1", task))
		if reg == nil {
			t.Fatalf("%s not registered", task)
		}
		want := map[string]string{
			"instance_id": "exec-1",
			"session_id":  s.ID,
			"generation":  "1",
			"version":     "1.4.2",
			"capacity":    "2",
			"state":       "active",
			"label_zone":  "eu-1",
			"lease_ttl":   testTTL.String(),
		}
		if !reflect.DeepEqual(reg.Meta, want) {
			t.Errorf("meta = %v, want %v", reg.Meta, want)
		}
		if reg.Name != task || reg.Address != "127.0.0.1" || reg.Port != 9000 ||
			!reflect.DeepEqual(reg.Tags, []string{"leasehold"}) {
			t.Errorf("registration = %+v", reg)
		}
		ch := reg.Checks[0]
		if ch.CheckID != health.CheckID("exec-1", s.ID, task) || ch.TTL != "35s" ||
			ch.DeregisterCriticalServiceAfter != "10m0s" ||
			ch.Status != "passing" {
			t.Errorf("check = %+v", ch)
		}
		if out := h.agent.output(ch.CheckID); out != "load=0" { // set right after registering
			t.Errorf("initial output = %q", out)
		}
	}
}

func TestHeartbeatsCarryLoadAndStatus(t *testing.T) {
	h := start(t, nil)
	s := h.session(nil)
	h.load.Store(2) // full
	h.advance(2, testHB)
	c := h.agent.next(t, "ttl")
	if c.status != health.StatusWarning || c.output != "load=2" || c.session != s.ID {
		t.Fatalf("full heartbeat = %+v", c)
	}
	h.agent.next(t, "ttl")
	h.load.Store(1)
	h.advance(2, testHB)
	if c = h.agent.next(t, "ttl"); c.status != health.StatusPassing || c.output != "load=1" {
		t.Fatalf("recovered heartbeat = %+v", c)
	}
	if s.Err() != nil {
		t.Fatalf("session ended: %v", s.Err())
	}
}

func TestTransientErrorsAreRetriedInsideTheLease(t *testing.T) {
	h := start(t, nil)
	s := h.session(nil)
	var fail atomic.Int32
	fail.Store(3)
	h.agent.mu.Lock()
	h.agent.ttlErr = func(string) error {
		if fail.Add(-1) >= 0 {
			return errors.New("500 agent busy")
		}
		return nil
	}
	h.agent.mu.Unlock()
	h.advance(2, testHB)
	for range 3 { // each failure is retried after a backoff, well inside the lease
		if c := h.agent.next(t, "ttl"); c.err == nil {
			t.Fatalf("expected a failing heartbeat, got %+v", c)
		}
		h.advance(2, 5*time.Second)
	}
	if c := h.agent.next(t, "ttl"); c.err != nil {
		t.Fatalf("retry failed: %+v", c)
	}
	if s.Err() != nil || h.reg.Session() != s {
		t.Fatalf("transient errors ended the session: %v", s.Err())
	}
}

func TestUnreachableAgentEndsLeaseAtDeadline(t *testing.T) {
	h := start(t, nil)
	s := h.session(nil)
	h.agent.mu.Lock()
	h.agent.ttlErr = func(string) error { return errors.New("connection refused") }
	h.agent.mu.Unlock()
	// heartbeats keep failing; the clock runs past the lease in steps
	for elapsed := time.Duration(0); elapsed < testTTL; elapsed += 5 * time.Second {
		h.advance(2, 5*time.Second)
	}
	l := h.loss()
	if l.Reason != LossExpired || l.SessionID != s.ID || l.SinceAck < testTTL || l.Err == nil {
		t.Fatalf("loss = %+v", l)
	}
	<-s.Done()
	if !errors.Is(s.Err(), ErrLeaseLost) {
		t.Fatalf("session cause = %v", s.Err())
	}
}

func TestRefusedHeartbeatReregistersUnderFreshSession(t *testing.T) {
	h := start(t, nil)
	s1 := h.session(nil)
	h.agent.forget() // agent restarted without state
	h.advance(2, testHB)
	l := h.loss()
	if l.Reason != LossRefused || l.Superseded || l.SessionID != s1.ID {
		t.Fatalf("loss = %+v", l)
	}
	s2 := h.session(s1)
	if s2.ID == s1.ID {
		t.Fatal("re-registered under the same session")
	}
	if s2.Generation <= s1.Generation {
		t.Fatalf("generation %d not above the lost session's %d", s2.Generation, s1.Generation)
	}
	if got := h.agent.service(health.ServiceID("exec-1",
		"transcode")).Meta["session_id"]; got != s2.ID {
		t.Fatalf("registered session = %s, want %s", got, s2.ID)
	}
	// The agent forgot s1: this process remembers it replaced it.
	got := h.agent.service(health.ServiceID("exec-1", "transcode")).Meta[health.MetaReplaces]
	if !strings.HasPrefix(got, s1.ID) || s2.Replaces[0] != s1.ID {
		t.Fatalf("replaces meta %q, session %v: want %s", got, s2.Replaces, s1.ID)
	}
	var lle *LeaseLostError
	if !errors.As(s1.Err(), &lle) || lle.Loss.Reason != LossRefused {
		t.Fatalf("old session cause = %v", s1.Err())
	}
}

func TestSupersededProcessStopsInsteadOfFighting(t *testing.T) {
	h := start(t, nil)
	s1 := h.session(nil)
	// another process with the same instance id takes the generation key
	// and registers on the same agent
	h.agent.takeKey("exec-1", "newer", 99)
	other := baseConfig()
	for _, task := range other.Tasks {
		r := (&Registrar{cfg: other.withDefaults()}).serviceRegistration(
			sessionKey{id: "newer", generation: 99},
			task,
			health.StateActive,
		)
		if err := h.agent.Register(context.Background(), r); err != nil {
			t.Fatal(err)
		}
	}
	h.advance(2, testHB)
	l := h.loss()
	if l.Reason != LossRefused || !l.Superseded {
		t.Fatalf("loss = %+v", l)
	}
	select {
	case err := <-h.done:
		if !errors.Is(err, ErrSuperseded) {
			t.Fatalf("Run = %v, want ErrSuperseded", err)
		}
		h.done <- err // for cleanup
	case <-time.After(5 * time.Second):
		t.Fatal("Run went on after being superseded")
	}
	if got := h.agent.service(health.ServiceID("exec-1",
		"transcode")).Meta["session_id"]; got != "newer" {
		t.Fatalf("the newer registration was replaced: %s", got)
	}
	if s1.Err() == nil {
		t.Fatal("old session still current")
	}
}

func TestSupersededOnAnotherNode(t *testing.T) {
	h := start(t, nil)
	s1 := h.session(nil)
	h.agent.takeKey("exec-1", "newer", 2)
	h.agent.mu.Lock()
	h.agent.others = []RemoteSession{
		{Node: "other", SessionID: "newer", Generation: 2, Status: health.StatusPassing},
	}
	h.agent.mu.Unlock()
	h.advance(2, testTTL+time.Second) // paused past the lease
	l := h.loss()
	if l.Reason != LossExpired || !l.Superseded || l.SessionID != s1.ID {
		t.Fatalf("loss = %+v", l)
	}
}

func TestPauseLongerThanLeaseNeverRenewsTheOldSession(t *testing.T) {
	h := start(t, nil)
	s1 := h.session(nil)
	h.advance(2, testTTL+5*time.Second) // the whole process was stopped
	l := h.loss()
	if l.Reason != LossExpired || l.SinceAck < testTTL {
		t.Fatalf("loss = %+v", l)
	}
	s2 := h.session(s1)
	// drain the calls made so far: not one heartbeat of the old session after the pause
	for {
		select {
		case c := <-h.agent.calls:
			if c.op == "ttl" && c.session == s1.ID {
				t.Fatalf("old session heartbeat after the lease lapsed: %+v", c)
			}
			continue
		default:
		}
		break
	}
	if s2.ID == s1.ID ||
		h.agent.service(health.ServiceID("exec-1", "transcode")).Meta["session_id"] != s2.ID {
		t.Fatal("no fresh session registered")
	}
}

func TestNoReregisterReturnsTheLoss(t *testing.T) {
	h := start(t, func(c *Config) { c.NoReregister = true })
	h.session(nil)
	h.agent.forget()
	h.advance(2, testHB)
	select {
	case err := <-h.done:
		var lle *LeaseLostError
		if !errors.As(err, &lle) || !errors.Is(err, ErrLeaseLost) {
			t.Fatalf("Run = %v", err)
		}
		h.done <- err
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return")
	}
	if h.agent.service(health.ServiceID("exec-1", "transcode")) != nil {
		t.Fatal("re-registered despite NoReregister")
	}
}

func TestDrainWaitsForInFlightWorkThenDeregisters(t *testing.T) {
	h := start(t, nil)
	s := h.session(nil)
	h.load.Store(1)
	drained := make(chan error, 1)
	go func() { drained <- h.reg.Drain(context.Background()) }()
	for range 2 {
		if c := h.agent.next(t, "register"); c.state != "draining" || c.session != s.ID {
			t.Fatalf("drain registration = %+v", c)
		}
	}
	// work goes on: heartbeats continue, nothing is deregistered
	h.advance(3, testHB)
	h.agent.next(t, "ttl")
	h.agent.noCall(t, "deregister")
	if s.Err() != nil {
		t.Fatal("session ended while work was in flight")
	}
	h.load.Store(0)
	h.advance(3, 100*time.Millisecond)
	select {
	case err := <-drained:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Drain did not return")
	}
	if h.agent.service(health.ServiceID("exec-1", "transcode")) != nil ||
		h.agent.service(health.ServiceID("exec-1", "thumbnail")) != nil {
		t.Fatal("still registered after drain")
	}
	if !errors.Is(s.Err(), ErrDrained) {
		t.Fatalf("session cause = %v", s.Err())
	}
	select {
	case err := <-h.done:
		if err != nil {
			t.Fatalf("Run after drain = %v", err)
		}
		h.done <- err
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return after drain")
	}
}

func TestDrainDeadlineDeregistersAnyway(t *testing.T) {
	h := start(t, nil)
	h.session(nil)
	h.load.Store(2)
	ctx, cancel := context.WithCancel(context.Background())
	drained := make(chan error, 1)
	go func() { drained <- h.reg.Drain(ctx) }()
	h.agent.next(t, "register")
	cancel() // the operator's deadline
	h.advance(3, 100*time.Millisecond)
	select {
	case err := <-drained:
		if !errors.Is(err, context.Canceled) ||
			!strings.Contains(err.Error(), "2 tasks still in flight") {
			t.Fatalf("Drain = %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Drain did not return")
	}
	if h.agent.service(health.ServiceID("exec-1", "transcode")) != nil {
		t.Fatal("still registered")
	}
}

func TestProbeGatesHeartbeatsAndRegistration(t *testing.T) {
	var failing atomic.Bool
	h := start(t, func(c *Config) {
		c.Probe = func(context.Context) error {
			if failing.Load() {
				return errors.New("executor not serving")
			}
			return nil
		}
	})
	s1 := h.session(nil)
	failing.Store(true)
	for elapsed := time.Duration(0); elapsed <= testTTL; elapsed += testHB {
		h.advance(2, testHB)
	}
	l := h.loss()
	if l.Reason != LossExpired || l.Err == nil || !strings.Contains(l.Err.Error(), "probe") {
		t.Fatalf("loss = %+v", l)
	}
	h.agent.noCall(t, "ttl") // no heartbeat while the probe failed
	// no registration while it still fails
	h.advance(1, 5*time.Second)
	h.agent.noCall(t, "register")
	failing.Store(false)
	h.advance(1, 5*time.Second)
	if s2 := h.session(s1); s2.ID == s1.ID {
		t.Fatal("same session after probe recovered")
	}
}

func TestBadConfigNamesFieldAndRegistersNothing(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*Config)
		field  string
	}{
		{"empty instance", func(c *Config) { c.InstanceID = "" }, "instance_id"},
		{"no task", func(c *Config) { c.Tasks = nil }, "task"},
		{"bad task", func(c *Config) { c.Tasks = []string{"ok", "not ok"} }, "task"},
		{"duplicate task", func(c *Config) { c.Tasks = []string{"a", "a"} }, "task"},
		{"invalid semver", func(c *Config) { c.Version = "one" }, "version"},
		{"zero capacity", func(c *Config) { c.Capacity = 0 }, "capacity"},
		{"negative capacity", func(c *Config) { c.Capacity = -1 }, "capacity"},
		{"label key", func(c *Config) { c.Labels = map[string]string{"a b": "x"} }, "label_a b"},
		{
			"label value too long",
			func(c *Config) { c.Labels = map[string]string{"k": strings.Repeat("v", 513)} },
			"label_k",
		},
		{
			"lease under 2x heartbeat",
			func(c *Config) { c.Lease = health.Lease{TTL: 15 * time.Second} },
			"lease",
		},
		{"address", func(c *Config) { c.Address = "" }, "address"},
		{"unspecified address", func(c *Config) { c.Address = "0.0.0.0" }, "address"},
		{"host name address", func(c *Config) { c.Address = "exec-7.internal" }, "address"},
		{"port", func(c *Config) { c.Port = 0 }, "port"},
		{"port range", func(c *Config) { c.Port = 65536 }, "port"},
		{"tag", func(c *Config) { c.Tag = "has space" }, "tag"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := baseConfig()
			tt.mutate(&cfg)
			agent := newFakeAgent()
			_, err := NewRegistrar(agent, cfg)
			if err == nil {
				t.Fatal("accepted")
			}
			if fields := health.Fields(err); !containsStr(fields, tt.field) {
				t.Fatalf("fields %v do not name %q: %v", fields, tt.field, err)
			}
			if !strings.Contains(err.Error(), tt.field) {
				t.Fatalf("message does not name %q: %v", tt.field, err)
			}
			if len(agent.calls) != 0 {
				t.Fatal("agent was called")
			}
		})
	}
}

func containsStr(xs []string, s string) bool {
	for _, x := range xs {
		if x == s {
			return true
		}
	}
	return false
}

func TestNewerSessionOnAnotherAgentIsNoticed(t *testing.T) {
	h := start(t, func(c *Config) { c.FenceCheck = 5 * time.Second })
	s1 := h.session(nil)
	h.agent.takeKey("exec-1", "newer", s1.Generation+1)
	h.agent.mu.Lock()
	h.agent.others = []RemoteSession{
		{
			Node:       "other",
			SessionID:  "newer",
			Generation: s1.Generation + 1,
			Status:     health.StatusPassing,
		},
	}
	h.agent.mu.Unlock()
	h.advance(3, 5*time.Second)
	l := h.loss()
	if l.Reason != LossSuperseded || !l.Superseded {
		t.Fatalf("loss = %+v", l)
	}
	select {
	case err := <-h.done:
		if !errors.Is(err, ErrSuperseded) {
			t.Fatalf("Run = %v", err)
		}
		h.done <- err
	case <-time.After(5 * time.Second):
		t.Fatal("Run went on")
	}
}

// TestLeaseCheckRecreatedSoonAfterRegistrationEndsTheSession: the catalog
// re-creates the lease check (its agent left and came back) before the
// first periodic fence check, a lease after the session started. leasehold
// saw the first check when the session registered and answers the session
// LAPSED (health.LeaseCheckRecreated); the Registrar learns which check is
// its own with its first heartbeat, so it ends the session too, rather than
// taking the re-created check for the first.
func TestLeaseCheckRecreatedSoonAfterRegistrationEndsTheSession(t *testing.T) {
	agent := newFakeAgent()
	agent.sessionsRead = make(chan struct{}, 1)
	h := startOn(t, agent, func(c *Config) { c.FenceCheck = 30 * time.Second })
	s1 := h.session(nil)
	checkID := health.CheckID("exec-1", s1.ID, "transcode")
	agent.mu.Lock()
	agent.created[checkID] = 40 // synced to the catalog
	agent.mu.Unlock()
	select {
	case <-agent.sessionsRead: // the registration's own look at the catalog
	default:
	}
	// The first heartbeat (timers: heartbeat, deadline, fence ticker).
	h.advance(3, health.DefaultHeartbeat)
	select {
	case <-agent.sessionsRead:
	case <-time.After(5 * time.Second):
		t.Fatal(
			"the first heartbeat ran no fence check: the Registrar does not know its lease check " +
				"before a lease passed",
		)
	}
	agent.mu.Lock()
	agent.created[checkID] = 90 // the agent left and re-synced: the check is created anew
	agent.mu.Unlock()
	for range 2 {
		h.advance(3, health.DefaultHeartbeat)
	}
	if l := h.loss(); l.Reason != LossNodeFailed || l.SessionID != s1.ID {
		t.Fatalf("loss %+v, want %s of session %s", l, LossNodeFailed, s1.ID)
	}
}

// A crashed predecessor's registration still passing on another agent has
// an older generation: it supersedes nothing, the live process registers a
// new session instead of exiting.
func TestOlderSessionElsewhereSupersedesNothing(t *testing.T) {
	agent := newFakeAgent()
	// The predecessor took 4; this process takes 5 (set before Run reads it).
	agent.gens["exec-1"] = 4
	h := startOn(t, agent, func(*Config) {})
	s1 := h.session(nil)
	if s1.Generation != 5 {
		t.Fatalf("generation %d, want 5", s1.Generation)
	}
	h.agent.mu.Lock()
	h.agent.others = []RemoteSession{
		{Node: "other", SessionID: "crashed", Generation: 4, Status: health.StatusPassing},
	}
	h.agent.mu.Unlock()
	h.advance(2, testTTL+time.Second) // paused past the lease
	if l := h.loss(); l.Reason != LossExpired || l.Superseded {
		t.Fatalf("loss = %+v, want expired and not superseded", l)
	}
	if s2 := h.session(s1); s2.Generation != 6 {
		t.Fatalf("re-registered at generation %d, want 6", s2.Generation)
	}
}

// TestNewSessionNamesThoseItReplaces: a new process names the sessions the
// catalog shows for its instance and those they named, newest first, at
// most health.MaxReplaces, never one without a generation; a session
// re-registered by the same process keeps naming the older ones.
func TestNewSessionNamesThoseItReplaces(t *testing.T) {
	agent := newFakeAgent()
	agent.others = []RemoteSession{
		{
			Node:       "other",
			SessionID:  "crashed",
			Generation: 4,
			Status:     health.StatusCritical,
			Replaces:   []string{"older", "oldest"},
		},
		{Node: "other", SessionID: "garbage", Generation: 0, Status: health.StatusPassing},
		{Node: "other", SessionID: "ancient", Generation: 1, Status: health.StatusCritical},
	}
	h := startOn(t, agent, nil)
	s1 := h.session(nil)
	if want := []string{"crashed", "older", "oldest"}; !reflect.DeepEqual(s1.Replaces, want) {
		t.Fatalf("replaces %v, want %v", s1.Replaces, want)
	}
	for _, task := range baseConfig().Tasks {
		if got := h.agent.service(health.ServiceID("exec-1",
			task)).Meta[health.MetaReplaces]; got != "crashed,older,oldest" {
			t.Fatalf("%s: replaces meta %q", task, got)
		}
	}
	h.agent.mu.Lock()
	h.agent.others = nil
	h.agent.mu.Unlock()
	h.agent.forget()
	h.advance(2, testHB)
	h.loss()
	s2 := h.session(s1)
	if want := []string{s1.ID, "crashed", "older"}; !reflect.DeepEqual(s2.Replaces, want) {
		t.Fatalf("after a re-registration: replaces %v, want %v", s2.Replaces, want)
	}
}

func TestFenceCheck(t *testing.T) {
	clock := clockwork.NewFakeClock()
	agent := newFakeAgent()
	cfg := baseConfig()
	cfg.Clock = clock
	r, err := NewRegistrar(agent, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.own["mine"] = true
	sess := &Session{ID: "mine", Generation: 5}
	set := func(others []RemoteSession, kv uint64) {
		agent.mu.Lock()
		agent.others, agent.gens["exec-1"] = others, kv
		agent.mu.Unlock()
	}
	check := func(want LossReason) {
		t.Helper()
		var st fenceState
		if got, err := r.fenceCheck(context.Background(), sess, &st); got != want {
			t.Fatalf("fenceCheck = %q (%v), want %q", got, err, want)
		}
	}
	mine := RemoteSession{
		Node:       "n1",
		SessionID:  "mine",
		Generation: 5,
		Status:     health.StatusPassing,
	}

	set([]RemoteSession{mine}, 5)
	check("")
	set(
		[]RemoteSession{
			mine,
			{Node: "n2", SessionID: "older", Generation: 4, Status: health.StatusPassing},
		},
		5,
	)
	check("")
	set(
		[]RemoteSession{
			mine,
			{Node: "n2", SessionID: "newer", Generation: 6, Status: health.StatusPassing},
		},
		6,
	)
	check(LossSuperseded)
	set(
		[]RemoteSession{
			mine,
			{Node: "n2", SessionID: "newer", Generation: 6, Status: health.StatusCritical},
		},
		6,
	)
	// A dead newer session fences us too (leasehold calls us STALE): "overtaken", but only after a
	// lease.
	check("")
	failed := mine
	failed.NodeFailed = true
	set([]RemoteSession{failed}, 5)
	check(LossNodeFailed)

	// The catalog lost our lease check and re-created it (node reaped or
	// force-left, then re-synced): the session is over.
	withIndex := func(created uint64) []RemoteSession {
		m := mine
		m.LeaseCreateIndex = created
		return []RemoteSession{m}
	}
	var lost fenceState
	set(withIndex(40), 5)
	if got, _ := r.fenceCheck(context.Background(), sess, &lost); got != "" {
		t.Fatalf("first sight of the lease check: %q", got)
	}
	if got, _ := r.fenceCheck(context.Background(), sess, &lost); got != "" {
		t.Fatalf("same lease check: %q", got)
	}
	set(withIndex(90), 5)
	if got, _ := r.fenceCheck(context.Background(), sess, &lost); got != LossNodeFailed {
		t.Fatalf("re-created lease check: %q, want node-failed", got)
	}

	// A generation taken above ours and never registered: only after a lease.
	set([]RemoteSession{mine}, 7)
	var st fenceState
	if got, _ := r.fenceCheck(context.Background(), sess, &st); got != "" {
		t.Fatalf("overtaken at once: %q", got)
	}
	clock.Advance(r.cfg.Lease.TTL / 2)
	if got, _ := r.fenceCheck(context.Background(), sess, &st); got != "" {
		t.Fatalf("overtaken after half a lease: %q", got)
	}
	set([]RemoteSession{mine}, 5) // e.g. the key was restored: the count starts over
	if got, _ := r.fenceCheck(context.Background(), sess, &st); got != "" ||
		!st.aheadSince.IsZero() {
		t.Fatalf("fenceCheck = %q, aheadSince %v", got, st.aheadSince)
	}
	set([]RemoteSession{mine}, 7)
	r.fenceCheck(context.Background(), sess, &st)
	clock.Advance(r.cfg.Lease.TTL)
	if got, err := r.fenceCheck(context.Background(), sess, &st); got != LossOvertaken {
		t.Fatalf("fenceCheck = %q (%v), want overtaken after a lease", got, err)
	}
}

// Full and free again go out when they happen (LoadChanged), not at the
// next heartbeat: no heartbeat is due (the clock moves only the 100 ms the
// spacing asks), yet the status reaches the agent; a change that does not
// cross the capacity sends nothing.
func TestLoadChangedSendsFullAndFreeAtOnce(t *testing.T) {
	h := start(t, nil) // capacity 2
	s := h.session(nil)
	ttl := func(want health.CheckStatus) {
		t.Helper()
		deadline := time.After(5 * time.Second)
		seen := 0
		for seen < 2 { // one per task type
			select {
			case c := <-h.agent.calls:
				if c.op == "ttl" && c.session == s.ID {
					if c.status != want {
						t.Fatalf("heartbeat %s, want %s", c.status, want)
					}
					seen++
				}
			case <-deadline:
				t.Fatalf("no %s sent (the next heartbeat is %s away)", want, testHB)
			}
		}
	}
	h.advance(2, 100*time.Millisecond) // past the spacing; the next heartbeat is due in testHB
	h.load.Store(1)
	h.reg.LoadChanged() // 1 of 2: not full, nothing to send
	h.load.Store(2)
	h.reg.LoadChanged()
	ttl(health.StatusWarning)
	h.advance(2, 100*time.Millisecond)
	h.load.Store(0)
	h.reg.LoadChanged()
	ttl(health.StatusPassing)
	select {
	case c := <-h.agent.calls:
		t.Fatalf("a call more than the status changes: %+v", c)
	default:
	}
}

// TestForgedNewerSessionSupersedesNothing: a registration of this instance
// with a higher generation that the generation key does not name — any
// token that may register the task type can write one — neither supersedes
// nor overtakes the live session (leasehold does not route it either).
func TestForgedNewerSessionSupersedesNothing(t *testing.T) {
	h := start(t, func(c *Config) { c.FenceCheck = 5 * time.Second })
	s1 := h.session(nil)
	h.agent.mu.Lock()
	h.agent.others = []RemoteSession{
		{
			Node:       "evil",
			SessionID:  "forged",
			Generation: s1.Generation + 1,
			Status:     health.StatusPassing,
		},
		{
			Node:       "evil",
			SessionID:  "forged-dead",
			Generation: s1.Generation + 5,
			Status:     health.StatusCritical,
		},
	}
	h.agent.mu.Unlock()
	// Fence checks and heartbeats run for longer than a lease (a generation
	// "ahead" would have overtaken us by then); each advance waits for the
	// timers the previous step re-armed.
	for range 2 * int(testTTL/(5*time.Second)) {
		h.advance(3, 5*time.Second)
	}
	select {
	case l := <-h.lost:
		t.Fatalf("loss %+v: a registration the generation key does not name ended the session", l)
	default:
	}
	if s1.Err() != nil {
		t.Fatalf("session ended: %v", s1.Err())
	}
}

// TestGenerationKeyNamingAnotherSessionEndsOurs: the key no longer names
// this session at its generation (Consul's KV restored or rewritten):
// leasehold calls the session unconfirmed, so the Registrar starts a new one
// above every generation it knows.
func TestGenerationKeyNamingAnotherSessionEndsOurs(t *testing.T) {
	h := start(t, func(c *Config) { c.FenceCheck = 5 * time.Second })
	s1 := h.session(nil)
	h.agent.takeKey("exec-1", "someone-else", s1.Generation)
	h.advance(3, 5*time.Second)
	if l := h.loss(); l.Reason != LossOvertaken || l.SessionID != s1.ID {
		t.Fatalf("loss = %+v, want overtaken", l)
	}
	if s2 := h.session(s1); s2.Generation <= s1.Generation {
		t.Fatalf("new session at generation %d, not above %d", s2.Generation, s1.Generation)
	}
}

// TestACopyOfOurSessionOnAnotherNodeEndsNothing: another instance's token
// registers, through its own agent, a copy of this session (its id and
// generation, a lease check of its own) — the session id is in the catalog
// for anyone to read — and that node then fails. Neither the copy's lease
// check (created at another index) nor its node's failure is this
// session's: a session is one process on one agent, and leasehold does not
// take the copy for it either. The session goes on.
func TestACopyOfOurSessionOnAnotherNodeEndsNothing(t *testing.T) {
	for _, tc := range []struct {
		name string
		copy func(s *Session) RemoteSession
	}{
		{"its own lease check", func(s *Session) RemoteSession {
			return RemoteSession{Node: "evil", SessionID: s.ID, Generation: s.Generation,
				Status: health.StatusPassing, LeaseCreateIndex: 77}
		}},
		{"its node failed", func(s *Session) RemoteSession {
			return RemoteSession{Node: "evil", SessionID: s.ID, Generation: s.Generation,
				Status: health.StatusCritical, NodeFailed: true}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			agent := newFakeAgent()
			h := startOn(t, agent, func(c *Config) { c.FenceCheck = 5 * time.Second })
			s1 := h.session(nil)
			agent.mu.Lock()
			// ours, synced to the catalog.
			agent.created[health.CheckID("exec-1", s1.ID, "transcode")] = 40
			agent.others = []RemoteSession{tc.copy(s1)}
			agent.mu.Unlock()
			for range 2 * int(testTTL/(5*time.Second)) {
				h.advance(3, 5*time.Second)
			}
			select {
			case l := <-h.lost:
				t.Fatalf("loss %+v: a copy of the session on another node ended it", l)
			default:
			}
			if s1.Err() != nil {
				t.Fatalf("session ended: %v", s1.Err())
			}
		})
	}
}

// TestFenceCheckActsOnADeadNewerRegistrationItsKeyDoesNotHold: leasehold
// fences a session when any registration of its instance carries a higher
// generation, whatever its lease status (health.Fence). A dead newer
// registration (a crashed process's, lingering critical until
// DeregisterCriticalServiceAfter, or for ever when registered without it or
// straight into the catalog) whose generation the KV key does not hold (the
// operator deleted the keys, KV was restored from an older snapshot, a
// registration was written without the check-and-set) therefore keeps the live
// session STALE. The Registrar's fence check must notice it within a few
// leases and move on (a newer generation of its own), or the live executor is
// never routed again.
func TestFenceCheckActsOnADeadNewerRegistrationItsKeyDoesNotHold(t *testing.T) {
	// leasehold's side: the live session is STALE.
	live := health.Executor{
		Registration: health.Registration{
			InstanceID: "exec-1",
			SessionID:  "mine",
			Generation: 5,
			Task:       "work",
		},
		LeaseStatus: health.StatusPassing,
		LeaseFound:  true,
	}
	dead := health.Executor{
		Registration: health.Registration{
			InstanceID: "exec-1",
			SessionID:  "crashed",
			Generation: 6,
			Task:       "work",
		},
		LeaseStatus: health.StatusCritical,
		LeaseFound:  true,
	}
	es := []health.Executor{live, dead}
	health.Fence(es, nil) // no generation key
	if !es[0].Fenced {
		t.Fatal("premise: leasehold does not fence the live session")
	}

	// The Registrar's side: its fence check, lease after lease.
	clock := clockwork.NewFakeClock()
	agent := newFakeAgent()
	cfg := baseConfig()
	cfg.Clock = clock
	r, err := NewRegistrar(agent, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.own["mine"] = true
	sess := &Session{ID: "mine", Generation: 5}
	agent.mu.Lock()
	agent.others = []RemoteSession{
		{Node: "n1", SessionID: "mine", Generation: 5, Status: health.StatusPassing},
		{Node: "n2", SessionID: "crashed", Generation: 6, Status: health.StatusCritical},
	}
	agent.gens["exec-1"] = 0 // the key is gone
	agent.mu.Unlock()
	var st fenceState
	for range 5 {
		if got, _ := r.fenceCheck(context.Background(), sess, &st); got != "" {
			return // the Registrar moves on: fine
		}
		clock.Advance(r.cfg.Lease.TTL)
	}
	t.Fatalf(
		"leasehold calls session mine (generation 5) STALE because of the dead registration at "+
			"generation 6, but after %d leases the Registrar's fence check still sees nothing to "+
			"do: the live executor is never routed again",
		5,
	)
}

// TestOwnPreviousGenerationIsAFloor: when the agent forgot this process's
// registrations (restarted without state) and the generation key is gone too
// (KV lost or deleted), the next session still gets a generation above the one
// it replaces, and names it in its replaces meta: the process's own highest
// generation is a floor, besides the KV and the catalog. A lower one would
// make a leasehold that remembers the old session rank it above the new one
// (UNKNOWN, not STALE), and the old registration, should it resurface, would
// fence the live session.
func TestOwnPreviousGenerationIsAFloor(t *testing.T) {
	agent := newFakeAgent()
	agent.gens["exec-1"] = 6 // earlier processes of the instance
	h := startOn(t, agent, nil)
	s1 := h.session(nil)
	if s1.Generation != 7 {
		t.Fatalf("premise: s1 generation %d", s1.Generation)
	}
	h.agent.forget() // agent restarted without state
	h.agent.mu.Lock()
	delete(h.agent.gens, "exec-1") // and the generation key is lost
	h.agent.mu.Unlock()
	h.advance(2, testHB)
	if l := h.loss(); l.Reason != LossRefused {
		t.Fatalf("loss %+v", l)
	}
	s2 := h.session(s1)
	if s2.Generation <= s1.Generation {
		t.Errorf(
			"new session generation %d not above the replaced session's %d",
			s2.Generation,
			s1.Generation,
		)
	}
	if len(s2.Replaces) == 0 || s2.Replaces[0] != s1.ID {
		t.Errorf("new session replaces %v, want %s first", s2.Replaces, s1.ID)
	}
}

// A registration Consul's ACLs refuse (403) ends Run after a bounded retry
// with a *PermissionError naming the right, instead of retrying for ever.
func TestRegistrationRefusedByACLsEndsWithAPermissionError(t *testing.T) {
	agent := newFakeAgent()
	agent.regErr = func() error {
		return permissionError(api.StatusError{Code: 403, Body: "Permission denied"},
			"register service transcode:exec-1", `service "transcode" { policy = "write" }`)
	}
	h := startOn(t, agent, nil)
	var err error
	for attempts := 1; err == nil; attempts++ {
		select {
		case err = <-h.done:
		case c := <-agent.calls:
			if c.op != "register" {
				continue
			}
			if attempts > permissionAttempts {
				t.Fatalf("registration attempt %d after %d refusals", attempts, permissionAttempts)
			}
			if attempts < permissionAttempts {
				h.advance(1, time.Minute) // the back-off before the next attempt
			}
		case <-time.After(5 * time.Second):
			t.Fatal("Run did not end after the refusals")
		}
	}
	h.done <- err // for the cleanup, which waits for Run to have ended
	var perr *PermissionError
	if !errors.Is(err, ErrPermission) || !errors.As(err, &perr) ||
		!strings.Contains(err.Error(), `service "transcode" { policy = "write" }`) {
		t.Fatalf("Run: %v, want a *PermissionError naming the right", err)
	}
}

// Other registration failures are still retried: a refusal among them
// counts only in a row.
func TestPermissionErrorOnlyFromA403(t *testing.T) {
	if err := permissionError(api.StatusError{Code: 500, Body: "boom"}, "op", "r"); err != nil {
		t.Fatalf("a 500 is no permission error: %v", err)
	}
	err := permissionError(api.StatusError{Code: 403, Body: "ACL not found"}, "op", "r")
	if !errors.Is(err, ErrPermission) || !strings.Contains(err.Error(), "token Consul knows") {
		t.Fatalf("an unknown token: %v", err)
	}
}

// "drained and deregistered" is said only when both happened: a
// deregistration the agent refuses makes Drain return its error, and the log
// says the registration lapses with its lease instead.
func TestDrainSaysDeregisteredOnlyWhenItWas(t *testing.T) {
	for _, tc := range []struct {
		name    string
		refuse  bool
		wantLog string
	}{
		{"deregistered", false, "drained and deregistered"},
		{"refused", true, "not deregistered"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs lockedBuffer
			agent := newFakeAgent()
			h := startOn(t, agent, func(c *Config) {
				c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
			})
			h.session(nil)
			if tc.refuse {
				agent.mu.Lock()
				agent.deregErr = func(string) error { return errors.New("agent unreachable") }
				agent.mu.Unlock()
			}
			drained := make(chan error, 1)
			go func() { drained <- h.reg.Drain(context.Background()) }()
			h.advance(3, 100*time.Millisecond)
			var err error
			select {
			case err = <-drained:
			case <-time.After(5 * time.Second):
				t.Fatal("Drain did not return")
			}
			if tc.refuse != (err != nil) ||
				(tc.refuse && !strings.Contains(err.Error(), "agent unreachable")) {
				t.Fatalf("Drain = %v, want an error: %v", err, tc.refuse)
			}
			out := logs.String()
			if !strings.Contains(out, tc.wantLog) ||
				(tc.refuse && strings.Contains(out, "drained and deregistered")) {
				t.Fatalf("log, want %q:\n%s", tc.wantLog, out)
			}
		})
	}
}
