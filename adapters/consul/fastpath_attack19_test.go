package consul

import (
	"context"
	"sync"
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
	w := &worldCatalog{index: index, checks: map[[2]string]*api.HealthCheck{}, changed: make(chan struct{})}
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
func (w *worldCatalog) await(ctx context.Context, index uint64, match func(*api.HealthCheck) bool) (api.HealthChecks, uint64, error) {
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

func (w *worldCatalog) Services(ctx context.Context, index uint64, wait time.Duration) (map[string][]string, uint64, error) {
	if index == 0 {
		return map[string][]string{"consul": nil}, 1, nil
	}
	<-ctx.Done()
	return nil, 0, ctx.Err()
}

func (w *worldCatalog) ServiceNodes(ctx context.Context, task, tag string, index uint64, wait time.Duration) ([]*api.CatalogService, uint64, error) {
	<-ctx.Done()
	return nil, 0, ctx.Err()
}

func (w *worldCatalog) HealthService(ctx context.Context, task, tag string, ids []string) ([]*api.ServiceEntry, uint64, error) {
	return nil, 1, nil
}

func (w *worldCatalog) ChecksInState(ctx context.Context, tag, state string, index uint64, wait time.Duration) (api.HealthChecks, uint64, error) {
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

func (w *worldCatalog) SerfHealth(ctx context.Context, index uint64, wait time.Duration) (api.HealthChecks, uint64, error) {
	return w.await(ctx, index, func(c *api.HealthCheck) bool { return c.CheckID == health.SerfHealthCheckID && c.ServiceID == "" })
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

func (w *worldCatalog) Generations(ctx context.Context, index uint64, wait time.Duration) (api.KVPairs, uint64, error) {
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

func nextObs(t *testing.T, out chan health.Observation, what string, ok func(health.Observation) bool) health.Observation {
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

// The member under attack: instance a, session s1, task work on node n1,
// its lease check created at 40; its membership read (made before anything
// below) saw the lease warning (full) at 50 and n1's serfHealth at 5.
func attackMember() health.Member {
	reg := health.Registration{InstanceID: "a", SessionID: "s1", Generation: 1, Task: "work", Address: "127.0.0.1", Port: 9000, Version: "1.0.0", Capacity: 2, State: health.StateActive}
	return health.Member{
		Executor: health.Executor{Registration: reg, ServiceID: health.ServiceID("a", "work"), Node: "n1", CreateIndex: 40},
		Checks: []health.CheckState{
			{Node: "n1", CheckID: health.SerfHealthCheckID, Status: health.StatusPassing, CreateIndex: 5, ModifyIndex: 5},
			{Node: "n1", CheckID: health.CheckID("a", "s1", "work"), ServiceID: health.ServiceID("a", "work"), Status: health.StatusWarning, Output: "load=2", CreateIndex: 40, ModifyIndex: 50},
		},
	}
}

func leaseCheck(status string) *api.HealthCheck {
	return &api.HealthCheck{Node: "n1", CheckID: health.CheckID("a", "s1", "work"), ServiceID: health.ServiceID("a", "work"), ServiceTags: []string{"leasehold"}, Status: status, Output: "load=2"}
}

// TestAttack19StaleCriticalAnswerUndoesALapse (FAILS before a fix): the
// critical watch's blocking answer is read at index 61 (another executor's
// lease lapses) and arrives late; meanwhile the full executor a (lease in
// state warning) hangs and its lease goes critical at 62. The warning watch
// sees a leave the warning state, reads the critical checks afresh and
// publishes a's lapse at 62. Then the late critical answer (61, without a)
// replaces that fresher read, the warning state is re-read (a is not in it)
// and a set at index 61 goes out where a is in neither state: Join reads
// a's lease as passing. The set's index went back and the lapse vanished.
// If both sets reach the Syncer in one batch, the lapse is never observed
// and a (full a moment ago, "passing" now) is routed.
func TestAttack19StaleCriticalAnswerUndoesALapse(t *testing.T) {
	other := &api.HealthCheck{Node: "n2", CheckID: health.CheckID("b", "s1", "work"), ServiceID: health.ServiceID("b", "work"), ServiceTags: []string{"leasehold"}, Status: "passing"}
	world := newWorld(59,
		&api.HealthCheck{Node: "n1", CheckID: health.SerfHealthCheckID, Status: "passing", CreateIndex: 5, ModifyIndex: 5},
		&api.HealthCheck{Node: "n2", CheckID: health.SerfHealthCheckID, Status: "passing", CreateIndex: 6, ModifyIndex: 6},
		other)
	world.set(leaseCheck("warning")) // index 60
	_, out := runWorld(t, world, WatchConfig{MinInterval: time.Millisecond})
	nextObs(t, out, "first set with a warning", func(o health.Observation) bool {
		if o.NonPassing == nil {
			return false
		}
		c, ok := checkIn(o.NonPassing, "n1", health.CheckID("a", "s1", "work"))
		return ok && c.Status == health.StatusWarning
	})

	held, release := world.holdNextCritical()
	lapsedB := *other
	lapsedB.Status = "critical"
	world.set(&lapsedB) // 61: the critical watch reads {b} at 61 and is held
	select {
	case <-held:
	case <-time.After(5 * time.Second):
		t.Fatal("the critical watch never answered at 61")
	}
	world.set(leaseCheck("critical")) // 62: a lapses
	lapse := nextObs(t, out, "a's lapse at 62", func(o health.Observation) bool {
		if o.NonPassing == nil {
			return false
		}
		c, ok := checkIn(o.NonPassing, "n1", health.CheckID("a", "s1", "work"))
		return ok && c.Status == health.StatusCritical
	})
	t.Logf("lapse published at index %d", lapse.NonPassing.Index)
	close(release)

	for quiet := time.After(300 * time.Millisecond); ; {
		select {
		case o := <-out:
			if o.NonPassing == nil {
				continue
			}
			np := o.NonPassing
			e := health.Join(attackMember(), health.NewNonPassingSet(*np))
			if np.Index < lapse.NonPassing.Index || e.LeaseStatus != health.StatusCritical {
				t.Fatalf("after the lapse went out at index %d, a set at index %d says a's lease is %q (checks %+v): a stale critical answer replaced a fresher read",
					lapse.NonPassing.Index, np.Index, e.LeaseStatus, np.Checks)
			}
		case <-quiet:
			return
		}
	}
}

// TestAttack19RefreshVouchesForAStaleSerfHealth (FAILS before a fix): node
// n1 fails and comes back (serfHealth critical at 101, passing at 102)
// between two reads of the critical checks (a back-off after an error, a
// slow re-read under the fast path's lock, two changes coalesced into one
// wake-up). The critical and warning watches never see serfHealth in their
// states; the serf listing is paced at 1 s. The critical watch's answer at
// 102 goes out as progress at 102, and a Refresh (fencing, min_consul_index
// 102) is answered with a Refreshed marker at 102 — yet the set still
// carries n1's serfHealth from before the failure (modified at 5), so Join
// does not see that n1 failed after session s1's lease check was created
// (40): the fencing API answers CURRENT at min_consul_index 102 for a
// session whose node failed at 101. (Before issue 19 the one query carried
// every serfHealth, passing or not, so any answer at 102 had its new
// indexes.) "serf" is not refreshable, and the set's index is the critical
// read's, whatever the age of the serf listing inside it.
func TestAttack19RefreshVouchesForAStaleSerfHealth(t *testing.T) {
	serf := &api.HealthCheck{Node: "n1", CheckID: health.SerfHealthCheckID, Status: "passing", CreateIndex: 5, ModifyIndex: 5}
	world := newWorld(99, serf)
	world.set(leaseCheck("passing"))                                         // 100
	w, out := runWorld(t, world, WatchConfig{MinInterval: time.Millisecond}) // default SlowInterval: 1 s
	first := nextObs(t, out, "a set with n1's serfHealth", func(o health.Observation) bool {
		if o.NonPassing == nil {
			return false
		}
		_, ok := checkIn(o.NonPassing, "n1", health.SerfHealthCheckID)
		return ok
	})
	start := time.Now()
	failed, back := *serf, *serf
	failed.Status = "critical"
	world.set(&failed, &back) // 101 critical, 102 passing again

	last := first.NonPassing
	var progress uint64
	seq, err := w.Refresh(context.Background(), 102)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.After(5 * time.Second); ; {
		var o health.Observation
		select {
		case o = <-out:
		case <-deadline:
			t.Fatal("no Refreshed marker")
		}
		switch {
		case o.NonPassing != nil:
			last = o.NonPassing
			progress = max(progress, o.NonPassing.Index)
		case o.Progress != nil:
			progress = max(progress, o.Progress.NonPassing)
		case o.Refreshed != nil && *o.Refreshed >= seq:
			progress = max(progress, o.RefreshedAtLeast)
		}
		if o.Refreshed != nil && *o.Refreshed >= seq {
			break
		}
	}
	if progress < 102 {
		t.Fatalf("progress %d after the refresh, want ≥ 102", progress)
	}
	e := health.Join(attackMember(), health.NewNonPassingSet(*last))
	c, _ := checkIn(last, "n1", health.SerfHealthCheckID)
	if !e.NodeFailed {
		t.Fatalf("%s after n1 failed at 101: the view is vouched current at %d (Refreshed), but its set (index %d) has n1's serfHealth %+v from before the failure: NodeFailed false, session s1 (lease check created at 40) is answered CURRENT",
			time.Since(start).Round(time.Millisecond), progress, last.Index, c)
	}
}

// TestAttack19NodeBackSeenByTheWarningWatchIsNeverReadByNode (FAILS before
// a fix): n1 fails (serfHealth critical at 101) and the set says so; n1 comes
// back at 102. The critical watch's answer at 102 is slow to arrive; a
// warning change at 103 (executor a full) makes the warning watch read the
// critical checks afresh, which replaces the critical state without the
// node-back point read (that read only happens for the critical watch's own
// answers, comparing with the state it finds, which is now the warning
// watch's). The set then carries n1's serfHealth from the serf listing
// made before the failure (passing, modified at 5): the failure vanished
// from the set, and Join no longer sees that n1 failed after session s1's
// lease check (40). A Syncer that takes both sets in one batch never
// observes the lapse: s1 is routed and answered CURRENT until the paced
// serf listing (1 s) answers.
func TestAttack19NodeBackSeenByTheWarningWatchIsNeverReadByNode(t *testing.T) {
	serf := &api.HealthCheck{Node: "n1", CheckID: health.SerfHealthCheckID, Status: "passing", CreateIndex: 5, ModifyIndex: 5}
	world := newWorld(99, serf)
	world.set(leaseCheck("passing")) // 100
	_, out := runWorld(t, world, WatchConfig{MinInterval: time.Millisecond})
	nextObs(t, out, "a set with n1's serfHealth", func(o health.Observation) bool {
		if o.NonPassing == nil {
			return false
		}
		_, ok := checkIn(o.NonPassing, "n1", health.SerfHealthCheckID)
		return ok
	})
	failed := *serf
	failed.Status = "critical"
	world.set(&failed) // 101
	nextObs(t, out, "n1 failed", func(o health.Observation) bool {
		if o.NonPassing == nil {
			return false
		}
		c, _ := checkIn(o.NonPassing, "n1", health.SerfHealthCheckID)
		return c.Status == health.StatusCritical
	})
	held, release := world.holdNextCritical()
	world.set(serf) // 102: n1 back
	select {
	case <-held:
	case <-time.After(5 * time.Second):
		t.Fatal("the critical watch never answered at 102")
	}
	world.set(leaseCheck("warning")) // 103: a is full
	defer close(release)
	for quiet := time.After(300 * time.Millisecond); ; {
		select {
		case o := <-out:
			if o.NonPassing == nil {
				continue
			}
			c, _ := checkIn(o.NonPassing, "n1", health.SerfHealthCheckID)
			if e := health.Join(attackMember(), health.NewNonPassingSet(*o.NonPassing)); !e.NodeFailed {
				t.Fatalf("n1 failed at 101 and came back at 102; the set at index %d carries its serfHealth %+v (the listing from before the failure): NodeFailed false for session s1, whose lease check was created at 40",
					o.NonPassing.Index, c)
			}
		case <-quiet:
			return
		}
	}
}

func (w *worldCatalog) GenerationKeys(context.Context, []string) (api.KVPairs, error) {
	return nil, nil
}
