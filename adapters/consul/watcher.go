package consul

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jonboulle/clockwork"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"

	"github.com/leasehold/leasehold/health"
)

// WatchConfig configures a Watcher. Zero values mean defaults.
type WatchConfig struct {
	Tag string // services with this tag are task types; default "leasehold"
	// Datacenter is the Consul datacenter watched through the agent (?dc=;
	// "": the agent's own, unnamed); its observations name it.
	Datacenter string
	// MaxConcurrent caps the per-task blocking queries in flight at once
	// (default 32). The Watcher adds two of its own (the service list and
	// the non-passing checks), so it never holds more than MaxConcurrent+2
	// connections, whatever the number of task types: Consul answers 429
	// past 200 per client IP.
	MaxConcurrent int
	// WaitTime is how long a per-task blocking query waits (default 60s);
	// when task watchers queue for a slot, holders wait only ContendedWait
	// (default 2s) so every task type gets its turn.
	WaitTime time.Duration
	// FastWait is how long the non-passing and service-list queries wait
	// (default 10s): their answers are small, and they keep the age of the
	// last Consul contact (readiness, the contact-age metric) under ~11s.
	FastWait time.Duration
	// Under shorter leases (a registration's lease_ttl) they wait at most a
	// third of the shortest one, so a view vouched for only within a lease
	// (the fencing API's bound) never reads as stale merely because Consul
	// had nothing new to say; until every task type has been read they wait
	// at most a second.
	ContendedWait time.Duration
	// MinInterval is the least time between two queries of one watch
	// (default 5ms for the non-passing checks, 4× that for memberships), so
	// index resets and bursts never turn into a tight loop.
	MinInterval time.Duration
	// SlowInterval is the least time between two queries of the watches
	// whose every answer costs Consul a scan of the whole datacenter: the
	// task types (every service) and every node's serfHealth (every check)
	// (default 1s). Both wake on any registration, so under churn they
	// would otherwise scan the datacenter once per registration.
	SlowInterval time.Duration
	// MaxBackoff caps the jittered back-off after errors (default 10s).
	MaxBackoff time.Duration
	// ReadRate paces the reads that grow with the fleet (task memberships,
	// generation keys): bytes of JSON per second, all watches together
	// (default 4 MiB/s; negative: unpaced). ReadBurst is what a quiet fleet
	// may read at once (default 2 s of ReadRate), so a lone change is read
	// without waiting; under churn the changes of each wait coalesce.
	ReadRate, ReadBurst int64

	Clock  clockwork.Clock
	Logger *slog.Logger
	Meter  metric.MeterProvider // default: no metrics
}

func (c WatchConfig) withDefaults() WatchConfig {
	if c.Tag == "" {
		c.Tag = health.DefaultTag
	}
	if c.MaxConcurrent <= 0 {
		c.MaxConcurrent = 32
	}
	if c.WaitTime <= 0 {
		c.WaitTime = time.Minute
	}
	if c.FastWait <= 0 {
		c.FastWait = 10 * time.Second
	}
	if c.ContendedWait <= 0 {
		c.ContendedWait = 2 * time.Second
	}
	if c.MinInterval <= 0 {
		c.MinInterval = 5 * time.Millisecond
	}
	if c.SlowInterval <= 0 {
		c.SlowInterval = time.Second
	}
	if c.MaxBackoff <= 0 {
		c.MaxBackoff = 10 * time.Second
	}
	if c.ReadRate == 0 {
		c.ReadRate = 4 << 20
	}
	if c.ReadBurst <= 0 {
		c.ReadBurst = 2 * max(c.ReadRate, 0)
	}
	if c.Clock == nil {
		c.Clock = clockwork.NewRealClock()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Meter == nil {
		c.Meter = metricnoop.NewMeterProvider()
	}
	return c
}

// Watcher follows Consul with blocking queries only and reports
// observations: the membership of every task type (re-read only when the
// catalog entries of that task change, not on heartbeats) and the set of
// non-passing checks (the fast path: its size and cost do not grow with the
// number of healthy executors, so a lapse, a full executor or a recovery is
// noticed in one small response).
type Watcher struct {
	cat catalog
	cfg WatchConfig
	log *slog.Logger
	// runDone ends sends: Run's context, not a query's — what an answer
	// carries must go out whatever becomes of the query's context.
	runDone <-chan struct{}

	slots   chan struct{} // per-task blocking query slots
	waiting atomic.Int32  // task watchers queued for a slot

	contactMu      sync.Mutex
	failing        bool
	failingWatches map[string]bool
	lastOK         map[string]time.Time // per watch: its last successful answer
	failedAt       map[string]time.Time // per failing watch: its first error of the run
	watchErr       map[string]error     // per failing watch: its last error
	lastContact    atomic.Int64         // unix nanos of the last successful answer
	// the failure as last reported, and its detail
	problem       health.ContactProblem
	problemDetail string

	fast fastPath

	// The task types listed last and the shortest lease each one's members
	// declare (fastWait).
	leaseMu     sync.Mutex
	listedTasks map[string]bool
	taskLeases  map[string]time.Duration
	heldWait    time.Duration // a shortened fast wait, held until heldUntil (holdShort)
	heldUntil   time.Time
	shorter     chan struct{} // closed (and replaced) when the fast wait shortens

	// The last generation listing, for the task watches' read-backs.
	keysMu    sync.Mutex
	keys      map[string]health.GenerationRecord
	keysIndex uint64

	requests, errs, wakeups metric.Int64Counter
	readBytes               metric.Int64Counter
	budgetWait              metric.Float64Counter
	budget                  *readBudget // task memberships; nil: unpaced
	genBudget               *readBudget // generation keys (their own: another task type's debt never delays a STALE)
	refreshBudget           *readBudget // refresh rounds (their own: fencing's calls never delay the watches' reads)
	rounds                  metric.Int64Counter

	// Refresh requests (refresh.go): each watch a round asks reads afresh
	// beside its blocking query; once all have, one Refreshed observation
	// follows.
	refresh     refresher
	refreshable []string // the watches a round may ask, of refreshable
	refreshC    map[string]chan uint64
	freshSlot   chan struct{} // held by the fresh read in progress (capacity 1)
	reached     atomic.Uint64 // the highest index of any answer so far
	wakeMu      sync.Mutex
	refreshWake chan struct{} // closed and replaced by every round: pauses end
}

// Watches a refresh may read afresh: what can make a session STALE (the
// generation keys, raised before a new session registers) or LAPSED (the
// non-passing checks, every node's serfHealth: a node that failed and came
// back, and the lapse marks: a lapse another replica saw).
var refreshable = []string{"non-passing", "warning", "serf", "generations", "lapses"}

// NewWatcher watches Consul through client.
func NewWatcher(client *api.Client, cfg WatchConfig) *Watcher {
	return newWatcher(apiCatalog{c: client, checked: new(atomic.Uint64), dc: cfg.Datacenter}, cfg)
}

func newWatcher(cat catalog, cfg WatchConfig) *Watcher {
	cfg = cfg.withDefaults()
	w := &Watcher{cat: cat, cfg: cfg, log: cfg.Logger.With("component", "consul-watch"), slots: make(chan struct{}, cfg.MaxConcurrent),
		refreshC: map[string]chan uint64{}, freshSlot: make(chan struct{}, 1), refreshWake: make(chan struct{})}
	w.fast.serf, w.fast.failing, w.fast.crossPending = map[string]health.CheckState{}, map[string]bool{}, map[string]bool{}
	if cfg.ReadRate > 0 {
		w.budget = newReadBudget(cfg.Clock, cfg.ReadRate, cfg.ReadBurst)
		w.genBudget = newReadBudget(cfg.Clock, max(cfg.ReadRate/4, 1), max(cfg.ReadBurst/4, 1))
		w.refreshBudget = newReadBudget(cfg.Clock, max(cfg.ReadRate/4, 1), max(cfg.ReadBurst/4, 1))
	}
	_, marks := cat.(lapseCatalog)
	for _, name := range refreshable {
		if name == "lapses" && !marks {
			continue // no such watch runs
		}
		w.refreshable = append(w.refreshable, name)
		w.refreshC[name] = make(chan uint64, 1)
	}
	w.refresh.init(w.refreshable)
	m := cfg.Meter.Meter("github.com/leasehold/leasehold/adapters/consul")
	w.requests, _ = m.Int64Counter("leasehold.consul.requests", metric.WithDescription("Consul HTTP queries made, by watch kind"))
	w.errs, _ = m.Int64Counter("leasehold.consul.errors", metric.WithDescription("Consul queries that failed, by watch kind"))
	w.wakeups, _ = m.Int64Counter("leasehold.consul.wakeups", metric.WithDescription("blocking queries that returned a new index, by watch kind"))
	w.readBytes, _ = m.Int64Counter("leasehold.consul.read_bytes", metric.WithUnit("By"),
		metric.WithDescription("bytes of Consul answers, by watch kind, as sent (encoding=wire, gzip) and as parsed (encoding=json)"))
	w.budgetWait, _ = m.Float64Counter("leasehold.consul.read_budget_wait", metric.WithUnit("s"),
		metric.WithDescription("time task-membership and generation watches, and refresh rounds (watch=refresh), waited for the read budget (--consul-read-rate) before querying, by watch kind"))
	w.rounds, _ = m.Int64Counter("leasehold.consul.refreshes", metric.WithDescription("refresh rounds that read Consul afresh for fencing calls whose min_consul_index the view had not reached"))
	m.Float64ObservableGauge("leasehold.consul.contact_age", metric.WithUnit("s"),
		metric.WithDescription("seconds since Consul last answered a query (-1 before the first answer)"),
		metric.WithFloat64Callback(func(_ context.Context, o metric.Float64Observer) error {
			if t := w.LastContact(); t.IsZero() {
				o.Observe(-1, w.dcAttrs())
			} else {
				o.Observe(w.cfg.Clock.Since(t).Seconds(), w.dcAttrs())
			}
			return nil
		}))
	return w
}

// LastContact is when Consul last answered a query (zero before the first).
func (w *Watcher) LastContact() time.Time {
	n := w.lastContact.Load()
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

// minFastWait bounds how short a lease makes the fast queries' wait. Any
// token that may register the task type may declare any lease; one of 1 ms
// must not have every fast watch query Consul ten times a second. The
// watches paced by SlowInterval (1 s) answer every pace + wait at worst, so
// a 2 s lease still sees a view younger than itself; a session on a lease
// under about 1.5 s reads UNKNOWN between answers (its bound is its lease).
const minFastWait = 500 * time.Millisecond

// fastWait is how long the watches that always answer wait: FastWait, or a
// third of the shortest lease declared when that is shorter — and at most a
// second while some task type's membership has not been read (its leases
// are not known yet).
func (w *Watcher) fastWait() time.Duration {
	w.leaseMu.Lock()
	defer w.leaseMu.Unlock()
	return w.fastWaitLocked()
}

// holdShort is how long a shortened fast wait stays short after the lease
// that shortened it is gone: a shortening ends the fast queries in flight
// (cutShort), and Consul holds an ended blocking query's connection until
// its wait is over, so registering and deregistering a short lease must not
// make leasehold end queries again and again (Consul answers 429 past 200
// connections per address).
const holdShort = 10 * time.Minute

func (w *Watcher) fastWaitLocked() time.Duration {
	wait := w.leaseWaitLocked()
	if w.heldWait > 0 && w.cfg.Clock.Now().Before(w.heldUntil) {
		wait = min(wait, w.heldWait)
	}
	return wait
}

// leaseWaitLocked is the fast wait the leases read now call for.
func (w *Watcher) leaseWaitLocked() time.Duration {
	wait := w.cfg.FastWait
	if w.listedTasks == nil {
		return min(wait, time.Second)
	}
	for task := range w.listedTasks {
		l, read := w.taskLeases[task]
		if !read {
			return min(wait, time.Second)
		}
		if l > 0 && l/3 < wait {
			wait = max(l/3, minFastWait)
		}
	}
	return wait
}

// shortenedLocked ends the fast queries in flight if the fast wait is now
// shorter than was: they were asked with the longer wait, and on a quiet
// Consul would answer only after it — past a lease just declared (the
// session's fencing bound, its datacenter's readiness bound).
func (w *Watcher) shortenedLocked(was time.Duration) {
	now := w.fastWaitLocked()
	if now >= was {
		return
	}
	w.heldWait, w.heldUntil = now, w.cfg.Clock.Now().Add(holdShort)
	if w.shorter != nil {
		close(w.shorter)
	}
	w.shorter = make(chan struct{})
}

// shorterC is closed when the fast wait shortens.
func (w *Watcher) shorterC() <-chan struct{} {
	w.leaseMu.Lock()
	defer w.leaseMu.Unlock()
	if w.shorter == nil {
		w.shorter = make(chan struct{})
	}
	return w.shorter
}

// cutShort makes one blocking call of a watch that always answers (wait
// being its fast wait) and, when the fast wait shortens while it is in
// flight, makes it again at once with the shorter wait (that is no
// failure). Only the call is cut short, never what the watch does with its
// answer.
func cutShort[T any](w *Watcher, ctx context.Context, wait time.Duration, call func(ctx context.Context, wait time.Duration) (T, uint64, error)) (T, uint64, error) {
	for {
		shorter := w.shorterC() // before the wait is read: a shortening after it closes this one
		if wait <= 0 {
			return call(ctx, wait) // an immediate read
		}
		wait = min(wait, w.fastWait())
		cctx, cancel := context.WithCancel(ctx)
		var cut atomic.Bool
		done := make(chan struct{})
		go func() {
			select {
			case <-shorter:
				cut.Store(true)
				cancel()
			case <-done:
			}
		}()
		v, idx, err := call(cctx, wait)
		close(done)
		cancel()
		if err == nil || !cut.Load() || ctx.Err() != nil {
			return v, idx, err
		}
	}
}

// listTasks notes the task types of the latest task list.
func (w *Watcher) listTasks(want map[string]bool) {
	w.leaseMu.Lock()
	defer w.leaseMu.Unlock()
	defer w.shortenedLocked(w.fastWaitLocked())
	w.listedTasks = maps.Clone(want)
	for task := range w.taskLeases {
		if !want[task] {
			delete(w.taskLeases, task)
		}
	}
}

// readLeases notes the shortest lease_ttl of a task type's members (0: none
// declares one).
func (w *Watcher) readLeases(task string, members []health.Member) {
	var shortest time.Duration
	for i := range members {
		if l := members[i].LeaseTTL; l > 0 && members[i].Err == nil && (shortest == 0 || l < shortest) {
			shortest = l
		}
	}
	w.leaseMu.Lock()
	defer w.leaseMu.Unlock()
	defer w.shortenedLocked(w.fastWaitLocked())
	if w.taskLeases == nil {
		w.taskLeases = map[string]time.Duration{}
	}
	w.taskLeases[task] = shortest
}

// Watches whose answers come at least every FastWait whatever happens: the
// age of their last answer bounds how old the whole view may be.
var alwaysAnswering = []string{"non-passing", "warning", "serf", "services", "generations"}

// FreshAsOf is when leasehold's view of Consul was last known current (zero
// before every watch answered once): the oldest last answer among the watches
// that answer at least every FastWait, and the first error of each per-task
// watch failing now. A per-task watch is otherwise in a blocking query, which
// Consul answers as soon as the task changes: it was current until its query
// failed (a silent Consul shows in the watches that always answer).
func (w *Watcher) FreshAsOf() time.Time {
	w.contactMu.Lock()
	defer w.contactMu.Unlock()
	var oldest time.Time
	consider := func(name string) bool {
		t, ok := w.lastOK[name]
		if !ok {
			return false
		}
		if oldest.IsZero() || t.Before(oldest) {
			oldest = t
		}
		return true
	}
	for _, name := range alwaysAnswering {
		if !consider(name) {
			return time.Time{}
		}
	}
	for name := range w.failingWatches {
		if slices.Contains(alwaysAnswering, name) {
			continue // counted above
		}
		if t := w.failedAt[name]; oldest.IsZero() || t.Before(oldest) {
			oldest = t
		}
	}
	return oldest
}

// Run watches until ctx ends, sending observations to out.
func (w *Watcher) Run(ctx context.Context, out chan<- health.Observation) error {
	w.runDone = ctx.Done()
	var wg sync.WaitGroup
	wg.Add(6)
	go func() { defer wg.Done(); w.runRefreshes(ctx, out) }()
	go func() { defer wg.Done(); w.watchNonPassing(ctx, out, api.HealthCritical) }()
	go func() { defer wg.Done(); w.watchNonPassing(ctx, out, api.HealthWarning) }()
	go func() { defer wg.Done(); w.watchSerf(ctx, out) }()
	go func() { defer wg.Done(); w.watchServices(ctx, out) }()
	go func() { defer wg.Done(); w.watchGenerations(ctx, out) }()
	if lc, ok := w.cat.(lapseCatalog); ok {
		wg.Add(1)
		go func() { defer wg.Done(); w.watchLapses(ctx, out, lc) }()
	}
	wg.Wait()
	return ctx.Err()
}

// attrs are a metric's attributes with the watched datacenter's (when named:
// a handful of configured names, a bounded label).
func (w *Watcher) attrs(kv ...attribute.KeyValue) []attribute.KeyValue {
	if w.cfg.Datacenter != "" {
		kv = append(kv, attribute.String("datacenter", w.cfg.Datacenter))
	}
	return kv
}

func (w *Watcher) dcAttrs() metric.MeasurementOption { return metric.WithAttributes(w.attrs()...) }

func (w *Watcher) send(ctx context.Context, out chan<- health.Observation, o health.Observation) bool {
	o.Datacenter = w.cfg.Datacenter
	if o.At.IsZero() {
		o.At = w.cfg.Clock.Now()
	}
	done := ctx.Done()
	if w.runDone != nil {
		done = w.runDone // the answer goes out whatever became of the query's context
	}
	select {
	case out <- o:
		return true
	case <-done:
		return false
	}
}

// contact records the outcome of one query of watch name and reports a
// change of state: Consul counts as unreachable while the last query of any
// watch failed, so one answer that was in flight when Consul went away does
// not flip the state back.
func (w *Watcher) contact(ctx context.Context, out chan<- health.Observation, name string, err error) {
	now := w.cfg.Clock.Now()
	if err == nil {
		w.lastContact.Store(now.UnixNano())
	}
	if errors.Is(err, context.Canceled) && ctx.Err() != nil {
		return
	}
	w.contactMu.Lock()
	if w.failingWatches == nil {
		w.failingWatches, w.lastOK, w.failedAt, w.watchErr = map[string]bool{}, map[string]time.Time{}, map[string]time.Time{}, map[string]error{}
	}
	if err != nil {
		if !w.failingWatches[name] {
			w.failedAt[name] = now
		}
		w.failingWatches[name] = true
		w.watchErr[name] = err
	} else {
		delete(w.failingWatches, name)
		delete(w.failedAt, name)
		delete(w.watchErr, name)
		w.lastOK[name] = now
	}
	failing := len(w.failingWatches) > 0
	changed := w.failing != failing
	w.failing = failing
	// A failure is reported again when its kind changes (a missing right
	// or a certificate problem tells more than an unreachable Consul; an
	// unreachable one is not reported again for each new error text).
	var c *health.Contact
	if failing {
		prob, detail, perr := w.worstErrLocked()
		if changed || prob != w.problem || (prob != health.ProblemUnreachable && detail != w.problemDetail) {
			c = &health.Contact{Err: perr, Problem: prob, Detail: detail}
		}
		w.problem, w.problemDetail = prob, detail
	} else if changed {
		c = &health.Contact{OK: true}
		w.problem, w.problemDetail = "", ""
	}
	w.contactMu.Unlock()
	if c != nil {
		w.send(ctx, out, health.Observation{Contact: c})
	}
}

// worstErrLocked is the failing watches' error that tells most: a missing
// right, then a certificate problem, then the first failing watch's by name.
// A missing right's detail is every right the failing watches lack.
func (w *Watcher) worstErrLocked() (health.ContactProblem, string, error) {
	rank := map[health.ContactProblem]int{health.ProblemACL: 3, health.ProblemTLS: 2}
	var (
		best     error
		bestName string
		prob     health.ContactProblem
		detail   string
		rights   []string
	)
	for name, err := range w.watchErr {
		p, d := classify(err)
		var ae *ACLError
		if errors.As(err, &ae) {
			rights = append(rights, ae.Rights...)
		}
		if best == nil || rank[p] > rank[prob] || (rank[p] == rank[prob] && name < bestName) {
			best, bestName, prob, detail = err, name, p, d
		}
	}
	if prob == health.ProblemACL && len(rights) > 0 {
		slices.Sort(rights)
		detail = strings.Join(slices.Compact(rights), " and ")
	}
	return prob, detail, best
}

// blockingLoop runs one watch: query(index, wait) until ctx ends, following
// Consul's blocking-query rules (queryIndex), never below MinInterval
// between queries (so index 0 never spins), and a
// jittered exponential back-off after errors.
func (w *Watcher) blockingLoop(ctx context.Context, out chan<- health.Observation, spec watchSpec, read readFunc) {
	name := spec.name
	kind := metric.WithAttributes(w.attrs(attribute.String("watch", watchKind(name)))...)
	var sizes, fresh *readSizes // of the query in flight, and of a refresh's fresh read in it
	queryLoop{
		clock: w.cfg.Clock, maxBackoff: w.cfg.MaxBackoff, kvListing: spec.kvListing,
		// after a fresh read (the first, or after an error) the slow pace
		// would only delay what changed since, e.g. the first task type
		// registering just after leasehold started
		interval: spec.minInterval, freshInterval: w.cfg.MinInterval * 4,
		before: func(ctx context.Context) (time.Duration, bool) {
			if spec.budget != nil && !w.awaitBudget(ctx, spec, kind) {
				return 0, false
			}
			if !spec.useSlot {
				return w.fastWait(), true
			}
			if !w.acquire(ctx) {
				return 0, false
			}
			if w.waiting.Load() > 0 {
				return w.cfg.ContendedWait, true
			}
			return w.cfg.WaitTime, true
		},
		after: func(ctx context.Context, index, next uint64, err error) bool {
			if spec.useSlot {
				<-w.slots
			}
			w.countRead(ctx, spec, sizes, spec.budget)
			w.requests.Add(ctx, 1, kind)
			if fresh != nil { // a refresh's read: charged to the refreshes' budget
				w.countRead(ctx, spec, fresh, w.refreshBudget)
				w.requests.Add(ctx, 1, kind)
			}
			if err != nil && ctx.Err() == nil {
				w.errs.Add(ctx, 1, kind)
			} else if err == nil && next != index {
				w.wakeups.Add(ctx, 1, kind)
			}
			if err == nil {
				w.noteReached(next)
			}
			w.contact(ctx, out, name, err)
			return true
		},
		failed: func(err error, retryIn time.Duration) {
			w.log.Warn("consul query failed; backing off", "watch", name, "err", err, "retry_in", retryIn)
		},
		lostState: func(ctx context.Context, from, to uint64) {
			w.log.Warn("consul index went backwards: Consul lost or restored its state; resetting", "watch", name, "from", from, "to", to)
			w.forgetIndexes()
			w.send(ctx, out, health.Observation{Contact: &health.Contact{OK: true, IndexWentBack: true}})
		},
		// The wake channel is taken before looking for a pending request: a
		// Refresh queues its request, then closes the channel, so one that
		// comes after the look still ends the pause.
		wake: func() (<-chan struct{}, bool) {
			wake := w.refreshWakeOf(name)
			return wake, len(w.refreshC[name]) > 0
		},
	}.run(ctx, func(ctx context.Context, index uint64, wait time.Duration) (uint64, error) {
		var qctx context.Context
		qctx, sizes = withReadSizes(ctx)
		next, f, err := w.runQuery(qctx, name, index, wait, read)
		fresh = f
		return next, err
	})
}

// refreshWakeOf is the channel a Refresh closes if watch name is one it
// reads afresh (nil, never ready, for the others).
func (w *Watcher) refreshWakeOf(name string) <-chan struct{} {
	if w.refreshC[name] == nil {
		return nil
	}
	w.wakeMu.Lock()
	defer w.wakeMu.Unlock()
	return w.refreshWake
}

// watchSpec names a watch and its pacing.
type watchSpec struct {
	name        string
	minInterval time.Duration // least time between two of its queries
	useSlot     bool          // holds a per-task query slot while querying
	budget      *readBudget   // answers grow with the fleet: paced by this read budget (nil: not paced)
	kvListing   bool          // a KV listing: its index also goes back when Consul reaps tombstones
}

// awaitBudget waits while the watch's read budget is in debt; a refresh
// request (fencing) ends the wait of a watch it reads afresh. False when ctx
// ended.
func (w *Watcher) awaitBudget(ctx context.Context, spec watchSpec, kind metric.MeasurementOption) bool {
	wake := w.refreshWakeOf(spec.name)
	if kick := w.refreshC[spec.name]; len(kick) > 0 {
		return ctx.Err() == nil // a refresh is pending: answer it now
	}
	waited, ok := spec.budget.wait(ctx, wake)
	if waited > 0 {
		w.budgetWait.Add(ctx, waited.Seconds(), kind)
	}
	return ok
}

// countRead records the sizes of one query's answers and charges budget
// (nil: none) with what it parsed.
func (w *Watcher) countRead(ctx context.Context, spec watchSpec, sizes *readSizes, budget *readBudget) {
	kind := w.attrs(attribute.String("watch", watchKind(spec.name)))
	if n := sizes.wire.Load(); n > 0 {
		w.readBytes.Add(ctx, n, metric.WithAttributes(append(kind, attribute.String("encoding", "wire"))...))
	}
	if n := sizes.decoded.Load(); n > 0 {
		w.readBytes.Add(ctx, n, metric.WithAttributes(append(kind, attribute.String("encoding", "json"))...))
		budget.charge(n)
	}
}

// forgetWatch drops a stopped watch from the contact state, so a task type
// that went away while failing does not keep Consul "unreachable".
func (w *Watcher) forgetWatch(name string) {
	w.contactMu.Lock()
	delete(w.failingWatches, name)
	delete(w.lastOK, name)
	delete(w.failedAt, name)
	delete(w.watchErr, name)
	w.contactMu.Unlock()
}

// watchKind is the bounded metric label of a watch name ("task X" → "task").
func watchKind(name string) string {
	kind, _, _ := strings.Cut(name, " ")
	return kind
}

func (w *Watcher) acquire(ctx context.Context) bool {
	select {
	case w.slots <- struct{}{}:
		return true
	default:
	}
	w.waiting.Add(1)
	defer w.waiting.Add(-1)
	select {
	case w.slots <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

// watchGenerations follows the generation keys in Consul KV: per instance
// the generation (and session) of its newest session, the same on every
// replica.
func (w *Watcher) watchGenerations(ctx context.Context, out chan<- health.Observation) {
	var last map[string]health.GenerationRecord
	bad := map[string]string{} // key → value already warned about
	first := true
	handle := func(ctx context.Context, pairs api.KVPairs, idx, at uint64, err error) (uint64, error) {
		if err != nil {
			first = true
			return 0, err
		}
		keys := make(map[string]health.GenerationRecord, len(pairs))
		for _, p := range pairs {
			inst, rec, err := generationPair(p)
			if err != nil {
				if bad[p.Key] != string(p.Value) {
					bad[p.Key] = string(p.Value)
					w.log.Warn("generation key ignored", "key", p.Key, "value", string(p.Value), "err", err)
				}
				continue
			}
			keys[inst] = rec
		}
		// The task watches compare new registrations with the listing only
		// once it went out (listedKeys after the send): a membership decided
		// before it must have read its keys back.
		if !first && maps.Equal(keys, last) {
			w.sendProgress(ctx, out, "generations", at, 0)
			w.listedKeys(keys, at)
			return idx, nil
		}
		first, last = false, keys
		w.send(ctx, out, health.Observation{Generations: &health.Generations{Index: idx, Keys: keys}})
		w.listedKeys(keys, at) // current at at: it holds every key written before a registration up to at
		w.sendProgress(ctx, out, "generations", at, idx)
		return idx, nil
	}
	w.blockingLoop(ctx, out, watchSpec{name: "generations", minInterval: w.cfg.MinInterval * 4, budget: w.genBudget, kvListing: true}, func(ctx context.Context, index uint64, wait time.Duration) (uint64, func() (uint64, error)) {
		pairs, idx, err := cutShort(w, ctx, wait, func(ctx context.Context, wait time.Duration) (api.KVPairs, uint64, error) {
			return w.cat.Generations(ctx, index, wait)
		})
		at := w.receipt(idx) // the index space of the checks: see refresh.go
		return idx, func() (uint64, error) { return handle(ctx, pairs, idx, at, err) }
	})
}

// generationPair reads one generation key: its instance and record.
func generationPair(p *api.KVPair) (string, health.GenerationRecord, error) {
	inst := strings.TrimPrefix(p.Key, health.GenerationKeyPrefix)
	if err := health.ValidateInstanceID(inst); err != nil {
		return "", health.GenerationRecord{}, fmt.Errorf("want %s<instance_id>: %w", health.GenerationKeyPrefix, err)
	}
	rec, err := health.ParseGenerationRecord(string(p.Value))
	if err != nil {
		return "", health.GenerationRecord{}, err
	}
	rec.ModifyIndex = p.ModifyIndex
	return inst, rec, nil
}

// listedKeys remembers the last generation listing (what the task watches
// compare new registrations with).
func (w *Watcher) listedKeys(keys map[string]health.GenerationRecord, index uint64) {
	w.keysMu.Lock()
	w.keys, w.keysIndex = keys, index
	w.keysMu.Unlock()
}

// maxKeyReads is the most generation keys a task watch reads back one by
// one; past it, one listing costs less time.
const maxKeyReads = 16

// readBackKeys reads the generation keys of the members just read that
// registered after the last generation listing and that it does not
// confirm as they are (their (generation, session) is not their key's): a
// session start writes its key before it registers, so this read, made
// after the membership, holds the key of every legitimate new session and
// the syncer confirms it at once instead of after the listing's next
// answer. A failed read only delays that confirmation: nil is returned.
func (w *Watcher) readBackKeys(ctx context.Context, entries []*api.ServiceEntry) map[string]health.GenerationRecord {
	w.keysMu.Lock()
	keys, index := w.keys, w.keysIndex
	w.keysMu.Unlock()
	var insts []string
	for _, e := range entries {
		if e.Service == nil || e.Service.ModifyIndex <= index {
			continue // the listing was read after this registration: it holds the key written before it
		}
		inst, sess := e.Service.Meta[health.MetaInstanceID], e.Service.Meta[health.MetaSessionID]
		if health.ValidateSessionQuery(inst, sess) != nil {
			continue
		}
		k := keys[inst]
		if k.SessionID == sess && strconv.FormatUint(k.Generation, 10) == e.Service.Meta[health.MetaGeneration] {
			continue
		}
		insts = append(insts, inst)
	}
	if len(insts) == 0 {
		return nil
	}
	slices.Sort(insts)
	insts = slices.Compact(insts)
	var pairs api.KVPairs
	var err error
	if len(insts) > maxKeyReads {
		pairs, _, err = w.cat.Generations(ctx, 0, 0)
	} else {
		pairs, err = w.cat.GenerationKeys(ctx, insts)
	}
	if err != nil {
		if ctx.Err() == nil {
			w.log.Warn("reading back generation keys failed: new sessions are confirmed by the next generation listing", "err", err)
		}
		return nil
	}
	out := make(map[string]health.GenerationRecord, len(pairs))
	for _, p := range pairs {
		if inst, rec, err := generationPair(p); err == nil {
			out[inst] = rec
		}
	}
	return out
}

// sendProgress says that watch name ("generations", "lapses" or the
// published non-passing set) is current at index at — a Progress, unless
// the observation it just sent says as much (its index sent) — and then
// records it for refreshes: one finding the watch current relies on what
// made it so having gone out before its marker.
func (w *Watcher) sendProgress(ctx context.Context, out chan<- health.Observation, name string, at, sent uint64) {
	if at > sent {
		var p health.Progress
		switch name {
		case "generations":
			p.Generations = at
		case "lapses":
			p.Lapses = at
		default:
			p.NonPassing = at
		}
		w.send(ctx, out, health.Observation{Progress: &p})
	}
	w.refresh.raise(name, at)
}

// watchServices follows the list of task types and runs one membership
// watch per task type, stopping those whose service disappears.
func (w *Watcher) watchServices(ctx context.Context, out chan<- health.Observation) {
	type running struct {
		cancel context.CancelFunc
		done   chan struct{}
	}
	tasks := map[string]running{}
	defer func() {
		for _, r := range tasks {
			r.cancel()
			<-r.done
		}
	}()
	w.blockingLoop(ctx, out, watchSpec{name: "services", minInterval: max(w.cfg.MinInterval*4, w.cfg.SlowInterval)}, queryRead(func(ctx context.Context, index uint64, wait time.Duration) (uint64, error) {
		services, idx, err := cutShort(w, ctx, wait, func(ctx context.Context, wait time.Duration) (map[string][]string, uint64, error) {
			return w.cat.Services(ctx, index, wait)
		})
		if err != nil {
			return 0, err
		}
		want := map[string]bool{}
		for name, tags := range services {
			for _, t := range tags {
				if t == w.cfg.Tag {
					if err := health.ValidateTask(name); err != nil {
						w.log.Warn("service tagged for leasehold has an invalid name; ignored", "service", name, "err", err)
						break
					}
					want[name] = true
					break
				}
			}
		}
		list := make([]string, 0, len(want))
		for task := range want {
			list = append(list, task)
		}
		sort.Strings(list)
		w.listTasks(want)
		if !w.send(ctx, out, health.Observation{Tasks: &health.TaskList{Index: idx, Tasks: list}}) {
			return idx, nil
		}
		for task, r := range tasks {
			if !want[task] {
				r.cancel()
				<-r.done
				delete(tasks, task)
				w.forgetWatch("task " + task)
				w.log.Info("task type gone", "task", task)
				w.send(ctx, out, health.Observation{Members: &health.TaskMembers{Task: task, Index: idx, Gone: true}})
			}
		}
		for task := range want {
			if _, ok := tasks[task]; ok {
				continue
			}
			tctx, cancel := context.WithCancel(ctx)
			r := running{cancel: cancel, done: make(chan struct{})}
			tasks[task] = r
			w.log.Info("task type found", "task", task)
			go func() { defer close(r.done); w.watchTask(tctx, out, task) }()
		}
		return idx, nil
	}))
}

// watchTask follows one task type's catalog entries (which do not change on
// heartbeats) and, when they change, reads the changed members with their
// checks (taskMembership).
func (w *Watcher) watchTask(ctx context.Context, out chan<- health.Observation, task string) {
	known, full := &taskMembership{}, true // full: read every member next time
	spec := watchSpec{name: "task " + task, minInterval: w.cfg.MinInterval * 4, useSlot: true, budget: w.budget}
	w.blockingLoop(ctx, out, spec, queryRead(func(ctx context.Context, index uint64, wait time.Duration) (uint64, error) {
		nodes, idx, err := w.cat.ServiceNodes(ctx, task, w.cfg.Tag, index, wait)
		if err != nil {
			full = true // whatever Consul says next is read in full
			return 0, err
		}
		changed, left := known.diff(nodes)
		if !full && len(changed) == 0 && !left {
			return idx, nil // identical catalog entries: nothing changed for this task
		}
		readAll := full || !known.pointReadable(changed, len(nodes))
		var entries []*api.ServiceEntry
		hidx := idx
		if readAll || len(changed) > 0 { // only departures: nothing to read
			var ids []string // nil: every member
			if !readAll {
				ids = serviceIDs(changed)
			}
			entries, hidx, err = w.cat.HealthService(ctx, task, w.cfg.Tag, ids)
			if err != nil {
				full = true
				return 0, err
			}
		}
		known, full = known.apply(task, nodes, entries, readAll, changed), false
		keys := w.readBackKeys(ctx, entries)
		members := known.list()
		w.readLeases(task, members)
		w.send(ctx, out, health.Observation{Members: &health.TaskMembers{Task: task, Index: max(idx, hidx), Members: members, Keys: keys}})
		return idx, nil
	}))
}

// member converts a health entry into the domain's Member, parsing the
// contract; bad metadata is kept (with Err) so it is shown and counted.
func member(task string, e *api.ServiceEntry) health.Member {
	addr := e.Service.Address
	if addr == "" {
		addr = e.Node.Address // Consul's rule: no service address means the node's
	}
	reg, err := health.ParseRegistration(task, addr, e.Service.Port, e.Service.Meta)
	m := health.Member{Executor: health.Executor{
		Registration: reg, ServiceID: e.Service.ID, Node: e.Node.Node, CreateIndex: e.Service.CreateIndex,
	}}
	if err != nil {
		m.Err = fmt.Errorf("registration %s on node %s: %w", e.Service.ID, e.Node.Node, err)
	}
	for _, c := range e.Checks {
		m.Checks = append(m.Checks, checkState(c))
	}
	sortChecks(m.Checks)
	return m
}

func checkState(c *api.HealthCheck) health.CheckState {
	return health.CheckState{Node: c.Node, CheckID: c.CheckID, ServiceID: c.ServiceID, Status: health.CheckStatus(c.Status), Output: c.Output, ModifyIndex: c.ModifyIndex, CreateIndex: c.CreateIndex}
}

func sortChecks(cs []health.CheckState) {
	sort.Slice(cs, func(i, j int) bool {
		if cs[i].Node != cs[j].Node {
			return cs[i].Node < cs[j].Node
		}
		return cs[i].CheckID < cs[j].CheckID
	})
}
