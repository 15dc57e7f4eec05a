package consul

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// worldCatalog is a tiny model of Consul's check state: one global index,
// checks by (node, check id), blocking queries that answer once the index
// passed theirs with the state at the moment they answer. A test may hold
// the next blocking answer of the critical checks after it was read (the
// answer is then older than what Consul holds when it arrives: a slow
// network, a GC pause, the watch descheduled).
type worldCatalog struct {
	mu      sync.Mutex
	index   uint64
	checks  map[[2]string]*api.HealthCheck
	changed chan struct{}

	holdCrit chan struct{} // non-nil: the next blocking critical answer waits for it to close
	heldCrit chan struct{} // closed when that answer was read and is held
}

func newWorld(index uint64, checks ...*api.HealthCheck) *worldCatalog {
	w := &worldCatalog{
		index:   index,
		checks:  map[[2]string]*api.HealthCheck{},
		changed: make(chan struct{}),
	}
	for _, c := range checks {
		cc := *c
		w.checks[[2]string{c.Node, c.CheckID}] = &cc
	}
	return w
}

// set applies changes at successive indexes (all at once: no query of the
// world sees a state in between).
func (w *worldCatalog) set(cs ...*api.HealthCheck) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, c := range cs {
		w.index++
		cc := *c
		k := [2]string{c.Node, c.CheckID}
		if old, ok := w.checks[k]; ok {
			cc.CreateIndex = old.CreateIndex
		} else {
			cc.CreateIndex = w.index
		}
		cc.ModifyIndex = w.index
		w.checks[k] = &cc
	}
	close(w.changed)
	w.changed = make(chan struct{})
}

func (w *worldCatalog) holdNextCritical() (held, release chan struct{}) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.holdCrit, w.heldCrit = make(chan struct{}), make(chan struct{})
	return w.heldCrit, w.holdCrit
}

// await blocks until the world's index passed index (index 0: at once) and
// returns the matching checks and the index, read at that moment.
func (w *worldCatalog) await(
	ctx context.Context,
	index uint64,
	match func(*api.HealthCheck) bool,
) (api.HealthChecks, uint64, error) {
	for {
		w.mu.Lock()
		if index == 0 || w.index > index {
			var out api.HealthChecks
			for _, c := range w.checks {
				if match(c) {
					cc := *c
					out = append(out, &cc)
				}
			}
			idx := w.index
			w.mu.Unlock()
			return out, idx, nil
		}
		ch := w.changed
		w.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil, 0, ctx.Err()
		case <-ch:
		}
	}
}

func (w *worldCatalog) Services(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (map[string][]string, uint64, error) {
	if index == 0 {
		return map[string][]string{"consul": nil}, 1, nil
	}
	<-ctx.Done()
	return nil, 0, ctx.Err()
}

func (w *worldCatalog) ServiceNodes(
	ctx context.Context,
	task, tag string,
	index uint64,
	wait time.Duration,
) ([]*api.CatalogService, uint64, error) {
	<-ctx.Done()
	return nil, 0, ctx.Err()
}

func (w *worldCatalog) HealthService(
	ctx context.Context,
	task, tag string,
	ids []string,
) ([]*api.ServiceEntry, uint64, error) {
	return nil, 1, nil
}

func (w *worldCatalog) ChecksInState(
	ctx context.Context,
	tag, state string,
	index uint64,
	wait time.Duration,
) (api.HealthChecks, uint64, error) {
	cs, idx, err := w.await(ctx, index, func(c *api.HealthCheck) bool { return c.Status == state })
	if err != nil {
		return nil, 0, err
	}
	if state == api.HealthCritical && index != 0 {
		w.mu.Lock()
		hold, held := w.holdCrit, w.heldCrit
		w.holdCrit, w.heldCrit = nil, nil
		w.mu.Unlock()
		if hold != nil {
			close(held)
			select {
			case <-hold:
			case <-ctx.Done():
				return nil, 0, ctx.Err()
			}
		}
	}
	return cs, idx, nil
}

func (w *worldCatalog) SerfHealth(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (api.HealthChecks, uint64, error) {
	return w.await(ctx, index, func(c *api.HealthCheck) bool {
		return c.CheckID == health.SerfHealthCheckID && c.ServiceID == ""
	})
}

func (w *worldCatalog) NodeSerf(ctx context.Context, node string) (*api.HealthCheck, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if c, ok := w.checks[[2]string{node, health.SerfHealthCheckID}]; ok {
		cc := *c
		return &cc, nil
	}
	return nil, nil
}

func (w *worldCatalog) Generations(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (api.KVPairs, uint64, error) {
	if index == 0 {
		w.mu.Lock()
		defer w.mu.Unlock()
		return nil, w.index, nil
	}
	<-ctx.Done()
	return nil, 0, ctx.Err()
}

// runWorld runs a Watcher on a test catalog until the test ends.
func runWorld(t *testing.T, world catalog, cfg WatchConfig) (*Watcher, chan health.Observation) {
	t.Helper()
	out := make(chan health.Observation, 10000)
	cfg.Out = out
	w := newWatcher(world, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.Run(ctx); close(done) }()
	t.Cleanup(func() {
		cancel()
		for {
			select {
			case <-done:
				return
			case <-out: // never let a send block the shutdown
			case <-time.After(5 * time.Second):
				t.Error("watcher did not stop")
				return
			}
		}
	})
	return w, out
}

func nextObs(
	t *testing.T,
	out chan health.Observation,
	what string,
	ok func(health.Observation) bool,
) health.Observation {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		select {
		case o := <-out:
			if ok(o) {
				return o
			}
		case <-deadline:
			t.Fatalf("no observation: %s", what)
		}
	}
}

func checkIn(np *health.NonPassing, node, id string) (health.CheckState, bool) {
	for _, c := range np.Checks {
		if c.Node == node && c.CheckID == id {
			return c, true
		}
	}
	return health.CheckState{}, false
}

// memberA is executor a as the tests of the fast path find it: instance a,
// session s1, task work on node n1, its lease check created at 40; its
// membership read (made before anything the tests do) saw the lease warning
// (full) at 50 and n1's serfHealth at 5.
func memberA() health.Member {
	reg := health.Registration{
		InstanceID: "a",
		SessionID:  "s1",
		Generation: 1,
		Task:       "work",
		Address:    "127.0.0.1",
		Port:       9000,
		Version:    "1.0.0",
		Capacity:   2,
		State:      health.StateActive,
	}
	return health.Member{
		Observed: health.Observed{
			Registration: reg,
			ServiceID:    health.ServiceID("a", "work"),
			Node:         "n1",
			CreateIndex:  40,
		},
		Checks: []health.CheckState{
			{
				Node:        "n1",
				CheckID:     health.SerfHealthCheckID,
				Status:      health.StatusPassing,
				CreateIndex: 5,
				ModifyIndex: 5,
			},
			{
				Node:        "n1",
				CheckID:     health.CheckID("a", "s1", "work"),
				ServiceID:   health.ServiceID("a", "work"),
				Status:      health.StatusWarning,
				Output:      "load=2",
				CreateIndex: 40,
				ModifyIndex: 50,
			},
		},
	}
}

func leaseCheck(status string) *api.HealthCheck {
	return &api.HealthCheck{
		Node:        "n1",
		CheckID:     health.CheckID("a", "s1", "work"),
		ServiceID:   health.ServiceID("a", "work"),
		ServiceTags: []string{"leasehold"},
		Status:      status,
		Output:      "load=2",
	}
}

func (w *worldCatalog) GenerationKeys(context.Context, []string) (api.KVPairs, error) {
	return nil, nil
}

// faultyWorld is a worldCatalog whose queries can be made to fail or to be
// slow.
type faultyWorld struct {
	*worldCatalog
	mu sync.Mutex
	// failFresh[state]: how many of the next fresh (index 0) reads of the
	// checks in state fail
	failFresh map[string]int
	// failAll[state]: every read of the checks in state fails
	failAll   map[string]bool
	nodeDelay time.Duration
	// freshDelay[state]: how long every fresh (index 0) read of the checks
	// in state takes (a Consul busy serving a large listing)
	freshDelay map[string]time.Duration
	serfCalls  atomic.Int64
	nodeCalls  atomic.Int64
	freshCalls atomic.Int64
}

func newFaulty(w *worldCatalog) *faultyWorld {
	return &faultyWorld{worldCatalog: w, failFresh: map[string]int{}, failAll: map[string]bool{},
		freshDelay: map[string]time.Duration{}}
}

var errInjected = errors.New("injected: 500 rpc error")

func (f *faultyWorld) ChecksInState(
	ctx context.Context,
	tag, state string,
	index uint64,
	wait time.Duration,
) (api.HealthChecks, uint64, error) {
	f.mu.Lock()
	fail := f.failAll[state]
	var delay time.Duration
	if index == 0 {
		f.freshCalls.Add(1)
		if f.failFresh[state] > 0 {
			f.failFresh[state]--
			fail = true
		}
		delay = f.freshDelay[state]
	}
	f.mu.Unlock()
	if delay > 0 {
		select {
		case <-time.After(delay):
		case <-ctx.Done():
			return nil, 0, ctx.Err()
		}
	}
	if fail {
		return nil, 0, errInjected
	}
	cs, idx, err := f.worldCatalog.ChecksInState(ctx, tag, state, index, wait)
	return cs, idx, err
}

func (f *faultyWorld) SerfHealth(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (api.HealthChecks, uint64, error) {
	f.serfCalls.Add(1)
	return f.worldCatalog.SerfHealth(ctx, index, wait)
}

func (f *faultyWorld) NodeSerf(ctx context.Context, node string) (*api.HealthCheck, error) {
	f.nodeCalls.Add(1)
	f.mu.Lock()
	d := f.nodeDelay
	f.mu.Unlock()
	if d > 0 {
		select {
		case <-time.After(d):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return f.worldCatalog.NodeSerf(ctx, node)
}
