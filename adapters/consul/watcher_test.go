package consul

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/health"
)

// scripted answers one call: a result, or it blocks like an idle blocking query.
type scripted struct {
	checks   api.HealthChecks
	services map[string][]string
	nodes    []*api.CatalogService
	entries  []*api.ServiceEntry
	kv       api.KVPairs
	index    uint64
	err      error
	bytes    int64 // decoded size the answer reports (read budget)
}

type callRec struct {
	method, task string
	index        uint64
	wait         time.Duration
	ids          []string // a health read's service ids (nil: every member)
	seq          int64    // order of the call
}

// fakeCatalog serves scripted answers per method (and task); with none
// queued a call blocks until its context ends, as an idle blocking query.
type fakeCatalog struct {
	mu       sync.Mutex
	queues   map[string][]scripted
	changed  chan struct{} // closed and replaced on every push
	calls    chan callRec
	seq      atomic.Int64
	lastSerf scripted
	// the critical checks as last answered: a fresh (index-0) read once one
	// was answered gets them unless an answer is queued
	lastCrit     scripted
	critAnswered bool
	// checkIndex is the highest index of any answer of the critical or
	// warning checks: Consul's checks had reached it, so a serfHealth
	// listing made since is at least as new (see SerfHealth).
	checkIndex uint64
}

func newFakeCatalog() *fakeCatalog {
	return &fakeCatalog{
		queues:  map[string][]scripted{},
		changed: make(chan struct{}),
		calls:   make(chan callRec, 1000),
	}
}

func (f *fakeCatalog) record(c callRec) {
	c.seq = f.seq.Add(1)
	f.calls <- c
}

func (f *fakeCatalog) push(key string, s scripted) {
	f.mu.Lock()
	f.queues[key] = append(f.queues[key], s)
	close(f.changed)
	f.changed = make(chan struct{})
	f.mu.Unlock()
}

// next takes the next answer queued under the first of keys that has one,
// waiting for one to be pushed.
func (f *fakeCatalog) next(ctx context.Context, keys ...string) (scripted, error) {
	for {
		f.mu.Lock()
		for _, key := range keys {
			if q := f.queues[key]; len(q) > 0 {
				f.queues[key] = q[1:]
				f.mu.Unlock()
				return q[0], nil
			}
		}
		changed := f.changed
		f.mu.Unlock()
		select {
		case <-ctx.Done():
			return scripted{}, ctx.Err()
		case <-changed:
		}
	}
}

func (f *fakeCatalog) Services(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (map[string][]string, uint64, error) {
	f.record(callRec{method: "services", index: index, wait: wait})
	s, err := f.next(ctx, "services")
	if err != nil {
		return nil, 0, err
	}
	return s.services, s.index, s.err
}

func (f *fakeCatalog) ServiceNodes(
	ctx context.Context,
	task, tag string,
	index uint64,
	wait time.Duration,
) ([]*api.CatalogService, uint64, error) {
	f.record(callRec{method: "nodes", task: task, index: index, wait: wait})
	s, err := f.next(ctx, "nodes/"+task)
	if err != nil {
		return nil, 0, err
	}
	if sizes := readSizesOf(ctx); sizes != nil {
		sizes.decoded.Add(s.bytes)
	}
	return s.nodes, s.index, s.err
}

func (f *fakeCatalog) HealthService(
	ctx context.Context,
	task, tag string,
	ids []string,
) ([]*api.ServiceEntry, uint64, error) {
	f.record(callRec{method: "health", task: task, ids: ids})
	s, err := f.next(ctx, "health/"+task)
	if err != nil {
		return nil, 0, err
	}
	if sizes := readSizesOf(ctx); sizes != nil {
		sizes.decoded.Add(s.bytes)
	}
	if ids == nil {
		return s.entries, s.index, s.err
	}
	var kept []*api.ServiceEntry // as Consul's filter would
	for _, e := range s.entries {
		if slices.Contains(ids, e.Service.ID) {
			kept = append(kept, e)
		}
	}
	return kept, s.index, s.err
}

// ChecksInState serves the critical checks from "nonpassing" (as the
// tests call them; once one was answered, a fresh read with none queued
// gets the last answer again, as Consul would); the warning checks from
// "warning", answering an index-0 read at once (empty unless one is
// queued), a blocking one when queued.
func (f *fakeCatalog) ChecksInState(
	ctx context.Context,
	tag, state string,
	index uint64,
	wait time.Duration,
) (api.HealthChecks, uint64, error) {
	key := "nonpassing"
	if state == api.HealthWarning {
		key = "warning"
		f.record(callRec{method: key, index: index, wait: wait})
		f.mu.Lock()
		q := f.queues[key]
		f.mu.Unlock()
		if index == 0 && len(q) == 0 {
			return nil, 1, nil
		}
	} else {
		f.record(callRec{method: key, index: index, wait: wait})
		f.mu.Lock()
		q, last, answered := f.queues[key], f.lastCrit, f.critAnswered
		f.mu.Unlock()
		if index == 0 && len(q) == 0 && answered { // a fresh read: as last answered
			return last.checks, last.index, nil
		}
	}
	s, err := f.next(ctx, key)
	if err != nil {
		return nil, 0, err
	}
	if s.err == nil {
		f.mu.Lock()
		if key == "nonpassing" {
			f.lastCrit, f.critAnswered = s, true
		}
		if s.index > f.checkIndex {
			f.checkIndex = s.index
			close(f.changed) // a blocking serfHealth listing wakes
			f.changed = make(chan struct{})
		}
		f.mu.Unlock()
	}
	return s.checks, s.index, s.err
}

// SerfHealth answers with what "serf" holds queued; with none queued, as
// Consul's listing of every check would: an index-0 query at once and a
// blocking one once the checks passed its index (checkIndex), both with the
// nodes last listed (none at first) at the checks' index.
func (f *fakeCatalog) SerfHealth(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (api.HealthChecks, uint64, error) {
	f.record(callRec{method: "serf", index: index, wait: wait})
	for {
		f.mu.Lock()
		if q := f.queues["serf"]; len(q) > 0 {
			s := q[0]
			f.queues["serf"] = q[1:]
			if s.err == nil {
				f.lastSerf = s
			}
			f.mu.Unlock()
			return s.checks, s.index, s.err
		}
		if index == 0 || f.checkIndex > index {
			s := scripted{checks: f.lastSerf.checks, index: max(f.lastSerf.index, f.checkIndex, 1)}
			f.lastSerf = s
			f.mu.Unlock()
			return s.checks, s.index, nil
		}
		changed := f.changed
		f.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil, 0, ctx.Err()
		case <-changed:
		}
	}
}

// NodeSerf answers with what "nodeserf/<node>" holds queued (nil if none).
func (f *fakeCatalog) NodeSerf(ctx context.Context, node string) (*api.HealthCheck, error) {
	f.record(callRec{method: "nodeserf", task: node})
	f.mu.Lock()
	q := f.queues["nodeserf/"+node]
	f.mu.Unlock()
	if len(q) == 0 {
		return nil, nil
	}
	s, err := f.next(ctx, "nodeserf/"+node)
	if err != nil || len(s.checks) == 0 {
		return nil, err
	}
	return s.checks[0], s.err
}

// Generations serves "generations"; a fresh (index-0) read takes what
// "generations/fresh" holds first: a refresh's read beside the blocking
// query, which waits on "generations".
func (f *fakeCatalog) Generations(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (api.KVPairs, uint64, error) {
	f.record(callRec{method: "generations", index: index, wait: wait})
	keys := []string{"generations"}
	if index == 0 {
		keys = []string{"generations/fresh", "generations"}
	}
	s, err := f.next(ctx, keys...)
	if err != nil {
		return nil, 0, err
	}
	if sizes := readSizesOf(ctx); sizes != nil {
		sizes.decoded.Add(s.bytes)
	}
	return s.kv, s.index, s.err
}

func (f *fakeCatalog) call(t *testing.T, method string) callRec {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		select {
		case c := <-f.calls:
			if c.method == method {
				return c
			}
		case <-deadline:
			t.Fatalf("no %s call", method)
		}
	}
}

type watchHarness struct {
	t       *testing.T
	waiters int // timers pending while the watch under test pauses (default 1)
	cat     *fakeCatalog
	clock   *clockwork.FakeClock
	out     chan health.Observation
	w       *Watcher
}

func startWatcher(t *testing.T, cfg WatchConfig, before ...func(*fakeCatalog)) *watchHarness {
	h := &watchHarness{
		t:     t,
		cat:   newFakeCatalog(),
		clock: clockwork.NewFakeClock(),
		out:   make(chan health.Observation, 100),
	}
	for _, f := range before {
		f(h.cat)
	}
	cfg.Clock, cfg.Out = h.clock, h.out
	h.w = newWatcher(h.cat, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { h.w.Run(ctx); close(done) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Error("watcher did not stop")
		}
	})
	return h
}

func (h *watchHarness) observe() health.Observation {
	h.t.Helper()
	select {
	case o := <-h.out:
		return o
	case <-time.After(5 * time.Second):
		h.t.Fatal("no observation")
		return health.Observation{}
	}
}

func (h *watchHarness) advance(d time.Duration) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := h.clock.BlockUntilContext(ctx, max(h.waiters, 1)); err != nil {
		h.t.Fatal("watcher never paused")
	}
	h.clock.Advance(d)
}

// stepUntil is advance(step) until a call of method comes, at most twice:
// the fake clock may count another watch's pause as the one to wait for and
// advance before this one's pause starts (a second step then ends it); a
// watch that needs more is paced slower than step: no call, the test fails.
func (h *watchHarness) stepUntil(method string, step time.Duration) callRec {
	h.t.Helper()
	deadline := time.After(5 * time.Second)
	h.advance(step)
	steps := 1
	for {
		select {
		case c := <-h.cat.calls:
			if c.method == method {
				return c
			}
		case <-time.After(500 * time.Millisecond):
			if steps < 2 { // then wait: a watch paced slower than step never calls
				h.advance(step)
				steps++
			}
		case <-deadline:
			h.t.Fatalf("no %s call after the clock moved %s %d times", method, step, steps)
		}
	}
}

// advanceUntil moves the fake clock on until a call of method comes (a
// watch may start its pause at any moment after its last answer went out).
func (h *watchHarness) advanceUntil(method string) callRec {
	h.t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		h.clock.Advance(time.Second)
		select {
		case c := <-h.cat.calls:
			if c.method == method {
				return c
			}
		case <-time.After(10 * time.Millisecond): // then advance again
		case <-deadline:
			h.t.Fatalf("no %s call", method)
		}
	}
}

// serfListedAhead has the serfHealth listing answer first at index 1000,
// above every index a test of the critical checks' rules uses, and then
// block (no check passes 1000): the fast path's sets are then at the critical
// read's index, never held back to the listing's.
func serfListedAhead(f *fakeCatalog) { f.push("serf", scripted{index: 1000}) }

func crit(node, id string, idx uint64) *api.HealthCheck {
	return &api.HealthCheck{
		Node:        node,
		CheckID:     id,
		ServiceID:   "t:x",
		Status:      "critical",
		ModifyIndex: idx,
	}
}

func TestWatcherFastPathIndexRules(t *testing.T) {
	h := startWatcher(t, WatchConfig{MinInterval: 10 * time.Millisecond}, serfListedAhead)
	if c := h.cat.call(t, "nonpassing"); c.index != 0 {
		t.Fatalf("first index %d", c.index)
	}
	// the warning and serf watches answered their first queries (the serf
	// listing at 1000) and pause: the set is not held back to the listing's
	// index
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	if err := h.clock.BlockUntilContext(ctx, 2); err != nil {
		t.Fatal("the warning and serf watches never paused")
	}
	cancel()
	h.cat.push("nonpassing", scripted{index: 10, checks: api.HealthChecks{crit("n", "a", 9)}})
	if o := h.observe(); o.NonPassing() == nil || o.NonPassing().Index != 10 ||
		len(o.NonPassing().Checks) != 1 {
		t.Fatalf("observation %+v", o)
	}
	c := h.stepUntil("nonpassing", 10*time.Millisecond) // past the pace between queries
	// the warning watch's fresh read of the critical checks after its first answer
	for c.index == 0 {
		c = h.cat.call(t, "nonpassing")
	}
	if c.index != 10 {
		t.Fatalf("second query index %d, want 10", c.index)
	}
	// identical body: no observation
	h.cat.push("nonpassing", scripted{index: 12, checks: api.HealthChecks{crit("n", "a", 9)}})
	if c := h.stepUntil("nonpassing", 10*time.Millisecond); c.index != 12 {
		t.Fatalf("third query index %d", c.index)
	}
	o := h.observe()
	for o.Progress() != nil && o.Progress().NonPassing < 12 {
		// The serf listing's progress at the earlier index.
		o = h.observe()
	}
	// (at 12 or above: an answer received after the serf listing at 1000
	// is current at 1000 too, refresh.go's receipt)
	if o.Progress() == nil || o.Progress().NonPassing < 12 || o.NonPassing() != nil {
		t.Fatalf("identical body produced %+v, want only progress to 12 or more", o)
	}
	// index went backwards (Consul restarted): reset to 0
	h.cat.push("nonpassing", scripted{index: 3})
	for o = h.observe(); o.Progress() != nil; o = h.observe() { // the serf listing's
	}
	if o.NonPassing() == nil || len(o.NonPassing().Checks) != 0 {
		t.Fatalf("observation %+v", o)
	}
	if c := h.stepUntil("nonpassing", 10*time.Millisecond); c.index != 0 {
		t.Fatalf("after going backwards index %d, want 0", c.index)
	}
	// index 0 answers never spin: each next query waits for the clock
	h.cat.push("nonpassing", scripted{index: 0})
	h.cat.push("nonpassing", scripted{index: 0})
	for range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := h.clock.BlockUntilContext(ctx, 1); err != nil {
			t.Fatal("watcher did not pause after an index-0 answer")
		}
		cancel()
		select {
		case c := <-h.cat.calls:
			if c.method == "nonpassing" {
				t.Fatalf("queried again without waiting: %+v", c)
			}
		default:
		}
		h.stepUntil("nonpassing", 10*time.Millisecond)
	}
}

func TestWatcherBacksOffAndReportsContact(t *testing.T) {
	h := startWatcher(
		t,
		WatchConfig{MinInterval: time.Millisecond, SlowInterval: time.Hour},
		serfListedAhead,
	)
	h.waiters = 2
	// the warning and serf watches answer their first queries at once and
	// pause (4× MinInterval after a fresh read): end both pauses (they then
	// block in their queries), the critical watch's back-off is the only
	// timer left
	h.advance(10 * time.Millisecond)
	h.waiters = 1
	h.cat.call(t, "nonpassing")
	h.cat.push("nonpassing", scripted{err: errors.New("connection refused")})
	o := h.observe()
	if o.Contact() == nil || o.Contact().OK {
		// the services loop may report first; either way one failure report
		t.Fatalf("want a contact failure, got %+v", o)
	}
	// exponential back-off: no query until the clock moves
	for _, d := range []time.Duration{50 * time.Millisecond, 100 * time.Millisecond} {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		h.clock.BlockUntilContext(ctx, h.waiters)
		cancel()
		h.cat.push("nonpassing", scripted{err: errors.New("connection refused")})
		h.clock.Advance(d * 4) // beyond any jittered back-off at this step
		h.cat.call(t, "nonpassing")
	}
	// recovery: one OK report, then the observation
	h.advance(time.Second)
	h.cat.push("nonpassing", scripted{index: 7})
	seenOK, seenObs := false, false
	for !(seenOK && seenObs) {
		o := h.observe()
		switch {
		case o.Contact() != nil && o.Contact().OK:
			seenOK = true
		case o.NonPassing() != nil:
			seenObs = true
		case o.Contact() != nil:
			t.Fatalf("second failure report: %+v", o.Contact())
		}
	}
	if h.w.LastContact().IsZero() {
		t.Fatal("last contact not recorded")
	}
	// after an error the index starts over: Consul may have restarted lower
	h.cat.call(t, "nonpassing") // the query answered with index 7
	h.advance(time.Millisecond)
	if c := h.cat.call(t, "nonpassing"); c.index != 7 {
		t.Fatalf("index %d, want 7", c.index)
	}
	h.cat.push("nonpassing", scripted{err: errors.New("connection reset")})
	h.advance(time.Second)
	if c := h.cat.call(t, "nonpassing"); c.index != 0 {
		t.Fatalf("index after an error = %d, want 0", c.index)
	}
}

func catalogNode(node, id string, modify uint64) *api.CatalogService {
	return &api.CatalogService{Node: node, ServiceID: id, ModifyIndex: modify}
}

func entry(task, node, instance, session string, gen int, status string) *api.ServiceEntry {
	reg := health.Registration{
		InstanceID: instance,
		SessionID:  session,
		Generation: uint64(gen),
		Task:       task,
		Address:    "127.0.0.1",
		Port:       9000,
		Version:    "1.0.0",
		Capacity:   2,
		State:      health.StateActive,
	}
	return &api.ServiceEntry{
		Node: &api.Node{Node: node, Address: "127.0.0.1"},
		Service: &api.AgentService{
			ID:      health.ServiceID(instance, task),
			Service: task,
			Address: "127.0.0.1",
			Port:    9000,
			Meta:    reg.Meta(),
		},
		Checks: api.HealthChecks{
			{Node: node, CheckID: "serfHealth", Status: "passing"},
			{
				Node:      node,
				CheckID:   health.CheckID(instance, session, task),
				ServiceID: health.ServiceID(instance, task),
				Status:    status,
				Output:    "load=1",
			},
		},
	}
}

func TestWatcherMembershipFollowsCatalogAndDropsGoneTasks(t *testing.T) {
	h := startWatcher(t, WatchConfig{MinInterval: time.Millisecond})
	h.cat.call(t, "services")
	h.cat.push(
		"services",
		scripted{
			index: 5,
			services: map[string][]string{
				"work":     {"leasehold"},
				"web":      {"other"},
				"bad_name": {"leasehold"},
				"consul":   nil,
			},
		},
	)
	if c := h.cat.call(t, "nodes"); c.task != "work" {
		t.Fatalf("watching %q", c.task)
	}
	h.cat.push(
		"nodes/work",
		scripted{index: 8, nodes: []*api.CatalogService{catalogNode("n1", "work:a", 7)}},
	)
	h.cat.push(
		"health/work",
		scripted{
			index:   9,
			entries: []*api.ServiceEntry{entry("work", "n1", "a", "s1", 1, "passing")},
		},
	)
	o := h.observe()
	if o.Tasks() == nil || len(o.Tasks().Tasks) != 1 || o.Tasks().Tasks[0] != "work" {
		t.Fatalf("task list %+v", o)
	}
	o = h.observe()
	if o.Members() == nil || o.Members().Task != "work" || len(o.Members().Members) != 1 {
		t.Fatalf("members %+v", o)
	}
	m := o.Members().Members[0]
	if m.Err != nil || m.InstanceID != "a" || m.SessionID != "s1" || len(m.Checks) != 2 {
		t.Fatalf("member %+v", m)
	}
	// the same catalog entries again (a heartbeat bumped the index): no re-read
	// (the watch pauses on the fake clock after sending; advance until it asks)
	if c := h.advanceUntil("nodes"); c.index != 8 {
		t.Fatalf("next index %d", c.index)
	}
	h.cat.push(
		"nodes/work",
		scripted{index: 11, nodes: []*api.CatalogService{catalogNode("n1", "work:a", 7)}},
	)
	h.advanceUntil("nodes")
	select {
	case c := <-h.cat.calls:
		if c.method == "health" {
			t.Fatal("re-read members though the catalog entries did not change")
		}
	default:
	}
	// bad metadata is reported, not dropped
	h.cat.push(
		"nodes/work",
		scripted{index: 12, nodes: []*api.CatalogService{catalogNode("n1", "work:a", 12)}},
	)
	bad := entry("work", "n1", "a", "s1", 1, "passing")
	bad.Service.Meta["capacity"] = "abc"
	h.cat.push("health/work", scripted{index: 12, entries: []*api.ServiceEntry{bad}})
	for o = h.observe(); o.Members() == nil; o = h.observe() { // the query is in flight already
	}
	if o.Members().Members[0].Err == nil {
		t.Fatalf("bad metadata not reported: %+v", o.Members())
	}
	// the task's service disappears: Gone, and its watch stops
	h.clock.Advance(time.Second)
	h.cat.push("services", scripted{index: 20, services: map[string][]string{"web": {"other"}}})
	for {
		o = h.observe()
		if o.Members() != nil && o.Members().Gone {
			break
		}
	}
	if o.Members().Task != "work" {
		t.Fatalf("gone %+v", o.Members())
	}
}

func TestWatcherBoundsConcurrentTaskQueries(t *testing.T) {
	h := startWatcher(
		t,
		WatchConfig{
			MinInterval:   time.Millisecond,
			MaxConcurrent: 2,
			WaitTime:      time.Minute,
			ContendedWait: 3 * time.Second,
		},
	)
	h.cat.call(t, "services")
	services := map[string][]string{}
	for _, s := range []string{"t1", "t2", "t3", "t4", "t5"} {
		services[s] = []string{"leasehold"}
	}
	h.cat.push("services", scripted{index: 5, services: services})
	// two slots: exactly two task queries in flight, the others queue
	var first callRec
	for i := range 2 {
		c := h.cat.call(t, "nodes")
		if i == 0 {
			first = c
		}
	}
	for quiet := time.After(50 * time.Millisecond); ; { // absence check only
		select {
		case c := <-h.cat.calls:
			if c.method == "nodes" { // the fast watches' first queries may come late
				t.Fatalf("a third task query went out while two hold the slots: %+v", c)
			}
			continue
		case <-quiet:
		}
		break
	}
	if len(h.w.slots) != 2 || h.w.waiting.Load() != 3 {
		t.Fatalf("slots %d waiting %d", len(h.w.slots), h.w.waiting.Load())
	}
	// one answers: its slot goes to a queued task, whose query is short
	// because others still queue (every task type gets its turn)
	h.cat.push("nodes/"+first.task, scripted{index: 9})
	h.cat.push("health/"+first.task, scripted{index: 9})
	for {
		c := h.cat.call(t, "nodes")
		if c.task != first.task {
			if c.wait != 3*time.Second {
				t.Fatalf("contended wait %s, want 3s", c.wait)
			}
			break
		}
	}
}

func TestWatcherRereadsWhenContentChangesAtTheSameIndex(t *testing.T) {
	h := startWatcher(t, WatchConfig{MinInterval: time.Millisecond})
	h.cat.call(t, "services")
	h.cat.push("services", scripted{index: 5, services: map[string][]string{"work": {"leasehold"}}})
	h.cat.call(t, "nodes")
	node := func(session string) *api.CatalogService {
		return &api.CatalogService{
			Node:        "n1",
			ServiceID:   "work:a",
			ModifyIndex: 7,
			CreateIndex: 7,
			ServiceMeta: map[string]string{"session_id": session},
		}
	}
	h.cat.push("nodes/work", scripted{index: 8, nodes: []*api.CatalogService{node("s1")}})
	h.cat.push(
		"health/work",
		scripted{
			index:   8,
			entries: []*api.ServiceEntry{entry("work", "n1", "a", "s1", 1, "passing")},
		},
	)
	for o := h.observe(); o.Members() == nil; o = h.observe() {
	}
	// a restarted agent replays the same indexes with a new session
	h.cat.push("nodes/work", scripted{index: 8, nodes: []*api.CatalogService{node("s2")}})
	h.cat.push(
		"health/work",
		scripted{
			index:   8,
			entries: []*api.ServiceEntry{entry("work", "n1", "a", "s2", 1, "passing")},
		},
	)
	// The task watch pauses on the fake clock between queries; the pause may
	// start after any single Advance, so advance until the re-read arrives.
	deadline := time.After(5 * time.Second)
	for {
		h.clock.Advance(time.Second)
		select {
		case o := <-h.out:
			if o.Members() == nil {
				continue
			}
			if o.Members().Members[0].SessionID != "s2" {
				t.Fatalf("members not re-read: %+v", o.Members().Members[0])
			}
			return
		case <-time.After(10 * time.Millisecond): // then advance again
		case <-deadline:
			t.Fatal("members never re-read")
		}
	}
}

func TestFreshAsOf(t *testing.T) {
	clock := clockwork.NewFakeClock()
	out := make(chan health.Observation, 16)
	w := newWatcher(newFakeCatalog(), WatchConfig{Clock: clock, Out: out})
	ctx := context.Background()
	if !w.FreshAsOf().IsZero() {
		t.Fatal("fresh before any answer")
	}
	w.contact(ctx, "non-passing", nil)
	w.contact(ctx, "serf", nil)
	w.contact(ctx, "warning", nil)
	w.contact(ctx, "services", nil)
	if !w.FreshAsOf().IsZero() {
		t.Fatal("fresh before the generation keys answered")
	}
	t0 := clock.Now()
	w.contact(ctx, "generations", nil)
	w.contact(ctx, "task work", nil)
	if got := w.FreshAsOf(); !got.Equal(t0) {
		t.Fatalf("FreshAsOf = %v, want %v", got, t0)
	}
	// The fast watches answer again; a task watch last answered long ago
	// and is idle in its blocking query: the view is as fresh as the fast ones.
	clock.Advance(50 * time.Second)
	t1 := clock.Now()
	w.contact(ctx, "non-passing", nil)
	w.contact(ctx, "serf", nil)
	w.contact(ctx, "warning", nil)
	w.contact(ctx, "services", nil)
	w.contact(ctx, "generations", nil)
	if got := w.FreshAsOf(); !got.Equal(t1) {
		t.Fatalf("FreshAsOf = %v, want %v", got, t1)
	}
	// The task watch fails: the view is current up to its first error, and
	// stays at that point through further errors.
	clock.Advance(time.Second)
	t2 := clock.Now()
	w.contact(ctx, "task work", errors.New("boom"))
	clock.Advance(5 * time.Second)
	w.contact(ctx, "task work", errors.New("boom"))
	w.contact(ctx, "non-passing", nil)
	w.contact(ctx, "serf", nil)
	w.contact(ctx, "warning", nil)
	w.contact(ctx, "services", nil)
	w.contact(ctx, "generations", nil)
	if got := w.FreshAsOf(); !got.Equal(t2) {
		t.Fatalf("FreshAsOf = %v, want the failing task's first error %v", got, t2)
	}
	clock.Advance(time.Minute)
	w.contact(ctx, "non-passing", nil)
	w.contact(ctx, "serf", nil)
	w.contact(ctx, "warning", nil)
	w.contact(ctx, "services", nil)
	w.contact(ctx, "generations", nil)
	if got := w.FreshAsOf(); !got.Equal(t2) {
		t.Fatalf("FreshAsOf = %v, want the failing task's first error %v", got, t2)
	}
	w.contact(ctx, "task work", nil)
	if got := w.FreshAsOf(); !got.Equal(clock.Now()) {
		t.Fatalf("FreshAsOf = %v after the task answered again, want now", got)
	}
	// A fast watch failing holds the view at its last answer.
	clock.Advance(time.Second)
	w.contact(ctx, "generations", errors.New("boom"))
	if got := w.FreshAsOf(); !got.Equal(clock.Now().Add(-time.Second)) {
		t.Fatalf("FreshAsOf = %v with the generation watch failing", got)
	}
}

// Refresh reads the non-passing checks and the generation keys afresh
// (index 0: Consul answers at once) beside their blocking queries, and
// reports Refreshed only after the fresh answers went out.
func TestWatcherRefreshReadsAfresh(t *testing.T) {
	h := startWatcher(t, WatchConfig{MinInterval: 10 * time.Millisecond}, serfListedAhead)
	h.cat.push("nonpassing", scripted{index: 10})
	h.cat.push("generations", scripted{index: 5})
	for np, gen := false, false; !np || !gen; {
		o := h.observe()
		np, gen = np || o.NonPassing() != nil, gen || o.Generations() != nil
	}
	mark := h.cat.seq.Load()
	seq, err := h.w.Refresh(context.Background(), everything)
	if err != nil || seq != 1 {
		t.Fatalf("Refresh = %d, %v", seq, err)
	}
	h.cat.push(
		"generations/fresh",
		scripted{index: 40, kv: api.KVPairs{{Key: "leasehold/generation/x", Value: []byte("2")}}},
	)
	var floor, checks bool
	for o := h.observe(); o.Refreshed() == nil; o = h.observe() {
		floor = floor || (o.Generations() != nil && o.Generations().Keys["x"].Generation == 2)
		checks = checks || (o.Progress() != nil && o.Progress().NonPassing >= 10)
	}
	if !floor || !checks {
		t.Fatalf(
			"Refreshed before the fresh answers: generation keys %v, non-passing checks %v",
			floor,
			checks,
		)
	}
	fresh := map[string]bool{}
	for more := true; more; {
		select {
		case c := <-h.cat.calls:
			if c.seq > mark && c.index == 0 {
				fresh[c.method] = true
			}
		default:
			more = false
		}
	}
	for _, m := range []string{"nonpassing", "warning", "serf", "generations"} {
		if !fresh[m] {
			t.Errorf("no fresh read of %s for the refresh (fresh reads: %v)", m, fresh)
		}
	}
}

func (f *fakeCatalog) GenerationKeys(
	context.Context,
	[]string,
) (api.KVPairs, error) {
	return nil, nil
}

// TestFastWaitFollowsTheShortestLease: the watches that always answer wait
// a third of the shortest lease declared (never under minFastWait), FastWait
// without one, and at most a second until every task type listed has been
// read (its leases unknown).
func TestFastWaitFollowsTheShortestLease(t *testing.T) {
	clock := clockwork.NewFakeClock()
	w := newWatcher(newFakeCatalog(), WatchConfig{FastWait: 10 * time.Second, Clock: clock})
	lease := func(d time.Duration) []health.Member {
		var m health.Member
		m.LeaseTTL = d
		return []health.Member{m}
	}
	steps := []struct {
		name string
		do   func()
		want time.Duration
	}{
		{"no task list yet", func() {}, time.Second},
		{
			"a task listed, not read",
			func() { w.listTasks(map[string]bool{"a": true, "b": true}) },
			time.Second,
		},
		{"one of two read", func() { w.readLeases("a", lease(0)) }, time.Second},
		{"both read, no lease declared", func() { w.readLeases("b", nil) }, 10 * time.Second},
		{"a 6 s lease", func() { w.readLeases("b", lease(6*time.Second)) }, 2 * time.Second},
		{"a 150 ms lease", func() { w.readLeases("a", lease(150*time.Millisecond)) }, minFastWait},
		// A shortened wait holds (holdShort): a short lease registered and
		// deregistered again and again ends the queries in flight once.
		{
			"its task type gone: the short wait holds",
			func() { w.listTasks(map[string]bool{"b": true}) },
			minFastWait,
		},
		{"the hold over", func() { clock.Advance(holdShort) }, 2 * time.Second},
		{"no lease any more", func() { w.readLeases("b", nil) }, 10 * time.Second},
		{
			"a lease again: shortened and held",
			func() { w.readLeases("b", lease(6*time.Second)) },
			2 * time.Second,
		},
		{"gone again: the 2 s wait holds", func() { w.readLeases("b", nil) }, 2 * time.Second},
	}
	for _, st := range steps {
		st.do()
		if got := w.fastWait(); got != st.want {
			t.Fatalf("%s: fast wait %s, want %s", st.name, got, st.want)
		}
	}
}

// TestAFastCallInFlightIsAskedAgainWhenALeaseShortensItsWait: a watch that
// always answers is in a 10 s blocking call (no lease declared) when a
// membership read declares a 3 s lease: the call is cut short and made
// again at once with the 1 s wait, and that is no failure. A longer lease
// cuts nothing.
func TestAFastCallInFlightIsAskedAgainWhenALeaseShortensItsWait(t *testing.T) {
	clock := clockwork.NewFakeClock()
	w := newWatcher(newFakeCatalog(), WatchConfig{FastWait: 10 * time.Second, Clock: clock})
	w.listTasks(map[string]bool{"a": true})
	w.readLeases("a", nil)
	lease := func(d time.Duration) []health.Member {
		var m health.Member
		m.LeaseTTL = d
		return []health.Member{m}
	}
	waits := make(chan time.Duration, 4)
	answer := make(chan struct{})
	type result struct {
		idx uint64
		err error
	}
	res := make(chan result, 1)
	go func() {
		_, idx, err := cutShort(
			w,
			context.Background(),
			w.fastWait(),
			func(ctx context.Context, wait time.Duration) (struct{}, uint64, error) {
				waits <- wait
				select {
				case <-ctx.Done():
					return struct{}{}, 0, ctx.Err()
				case <-answer:
					return struct{}{}, 7, nil
				}
			},
		)
		res <- result{idx, err}
	}()
	next := func() time.Duration {
		t.Helper()
		select {
		case d := <-waits:
			return d
		case <-time.After(5 * time.Second):
			t.Fatal("no call")
			return 0
		}
	}
	if d := next(); d != 10*time.Second {
		t.Fatalf("first call waits %s, want 10s", d)
	}
	w.readLeases("a", lease(time.Minute)) // longer than the wait: nothing cut
	w.readLeases("a", lease(3*time.Second))
	if d := next(); d != time.Second {
		t.Fatalf("after a 3 s lease the call is made again waiting %s, want 1s", d)
	}
	select {
	case d := <-waits:
		t.Fatalf("a third call (%s): the longer lease cut a call short", d)
	default:
	}
	close(answer)
	if r := <-res; r.err != nil || r.idx != 7 {
		t.Fatalf("cut short: %+v, want the second call's answer and no error", r)
	}
}

// TestRunWithoutOutNamesTheField: a Watcher, the Watchers of several
// datacenters and the control watch all fail at once, naming the missing
// field, when the config gives them no channel for their observations.
func TestRunWithoutOutNamesTheField(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	client, err := api.NewClient(api.DefaultConfig()) // never asked: nothing runs
	if err != nil {
		t.Fatal(err)
	}
	ws, err := NewWatchers(client, WatchConfig{}, []string{"dc1", "dc2"})
	if err != nil {
		t.Fatal(err)
	}
	for name, run := range map[string]func(context.Context) error{
		"Watcher":      newWatcher(newFakeCatalog(), WatchConfig{}).Run,
		"Watchers":     ws.Run,
		"ControlWatch": NewControlWatch(client, WatchConfig{}).Run,
	} {
		if err := run(ctx); err == nil || !strings.Contains(err.Error(), "Out") {
			t.Errorf("%s.Run without Out: %v, want an error naming Out", name, err)
		}
	}
	if err := ws.Run(ctx); err == nil || !strings.Contains(err.Error(), `datacenter "dc`) {
		t.Errorf("Watchers.Run without Out: %v, want the failing datacenter named", err)
	}
}

// lockedBuffer is a log sink safe for the watches' goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// A badly named service tagged for leasehold is warned of once when it
// appears, not at every answer of the services watch; once gone and back, it
// is warned of again.
func TestWatcherWarnsOfABadServiceNameOncePerChange(t *testing.T) {
	var logs lockedBuffer
	h := startWatcher(t, WatchConfig{MinInterval: time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	withBad := map[string][]string{"bad_name": {"leasehold"}}
	answers := []map[string][]string{withBad, withBad, withBad, {}, withBad}
	warnings := func() int { return strings.Count(logs.String(), "invalid name") }
	want := []int{1, 1, 1, 1, 2}
	for i, services := range answers {
		if i == 0 {
			h.cat.call(t, "services")
		} else {
			h.advanceUntil("services")
		}
		h.cat.push("services", scripted{index: uint64(10 + i), services: services})
		if o := h.observe(); o.Tasks() == nil {
			t.Fatalf("answer %d: %+v, want a task list", i, o)
		}
		if got := warnings(); got != want[i] {
			t.Fatalf("after answer %d: %d warnings, want %d:\n%s", i, got, want[i], logs.String())
		}
	}
}
