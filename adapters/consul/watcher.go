package consul

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/consul/api"
	"go.opentelemetry.io/otel/metric"

	"github.com/leasehold/leasehold/health"
)

// Watcher follows Consul with blocking queries only and reports
// observations: the membership of every task type (re-read only when the
// catalog entries of that task change, not on heartbeats) and the set of
// non-passing checks (the fast path: its size and cost do not grow with the
// number of healthy executors, so a lapse, a full executor or a recovery is
// noticed in one small response).
//
// Its state is grouped by the concern that owns it, each group under its
// own lock (or atomics), and no lock is held while an observation is sent:
// what is decided under a lock is sent after it is released (the fast path
// keeps its order with sendTurns).
type Watcher struct {
	cat catalog
	cfg WatchConfig
	log *slog.Logger
	// runDone ends sends: Run's context, not a query's, since what an
	// answer carries must go out whatever becomes of the query's context.
	runDone <-chan struct{}

	// Per-task query slots (watchloop.go): a task watch holds one while
	// its blocking query is in flight; waiting counts those queued for one.
	slots   chan struct{}
	waiting atomic.Int32

	// Contact state (contact.go), under contactMu: per watch its last
	// answer and, while it fails, its first and last error; whether Consul
	// counts as unreachable, and the failure as last reported.
	contactMu      sync.Mutex
	failing        bool
	failingWatches map[string]bool
	lastOK         map[string]time.Time // Per watch: its last successful answer.
	failedAt       map[string]time.Time // Per failing watch: its first error of the run.
	watchErr       map[string]error     // Per failing watch: its last error.
	lastContact    atomic.Int64         // Unix nanos of the last successful answer.
	problem        health.ContactProblem
	problemDetail  string

	// The non-passing checks and every node's serfHealth (fastpath.go),
	// under fast.mu.
	fast fastPath

	// The fast wait (fastwait.go), under leaseMu: the task types listed
	// last and the shortest lease each one's members declare; a shortened
	// wait is held until heldUntil (holdShort), and shorter is closed (and
	// replaced) when the wait shortens.
	leaseMu     sync.Mutex
	listedTasks map[string]bool
	taskLeases  map[string]time.Duration
	heldWait    time.Duration
	heldUntil   time.Time
	shorter     chan struct{}

	// The last generation listing (watchgenerations.go), under keysMu, for
	// the task watches' read-backs.
	keysMu    sync.Mutex
	keys      map[string]health.GenerationRecord
	keysIndex uint64

	// Metrics (watchmetrics.go) and the read budgets (budget.go; nil:
	// unpaced): the task memberships', the generation keys' (their own, so
	// another task type's debt never delays a STALE) and the refresh
	// rounds' (their own, so fencing's calls never delay the watches' reads).
	requests, errs, wakeups metric.Int64Counter
	readBytes               metric.Int64Counter
	budgetWait              metric.Float64Counter
	rounds                  metric.Int64Counter
	budget                  *readBudget
	genBudget               *readBudget
	lapseBudget             *readBudget
	refreshBudget           *readBudget
	// quiet (nil: none) is the pause of the registrations that task
	// watches in debt wait for (settle.go).
	quiet *quietProbe

	// Refresh requests (refresh.go): each watch a round asks reads afresh
	// beside its blocking query; once all have, one Refreshed observation
	// follows. freshSlot (capacity 1) is held by the fresh read in
	// progress; reached is the highest index of any answer so far;
	// refreshWake, under wakeMu, is closed and replaced by every round, so
	// that pauses end.
	refresh     refresher
	refreshable []string // The watches a round may ask, of refreshable.
	refreshC    map[string]chan uint64
	freshSlot   chan struct{}
	reached     atomic.Uint64
	wakeMu      sync.Mutex
	refreshWake chan struct{}
}

// Watches a refresh may read afresh: what can make a session STALE (the
// generation keys, raised before a new session registers) or LAPSED (the
// non-passing checks, every node's serfHealth: a node that failed and came
// back, and the lapse marks: a lapse another replica saw).
var refreshable = []string{"non-passing", "warning", "serf", "generations", "lapses"}

// NewWatcher watches Consul through client.
func NewWatcher(client *api.Client, cfg WatchConfig) *Watcher {
	return newWatcher(apiCatalog{c: client, checked: new(atomic.Uint64), dc: cfg.Datacenter,
		listed: &listedIndexes{}, sizes: &listingSizes{}}, cfg)
}

func newWatcher(cat catalog, cfg WatchConfig) *Watcher {
	cfg = cfg.withDefaults()
	w := &Watcher{
		cat:         cat,
		cfg:         cfg,
		log:         cfg.Logger.With("component", "consul-watch"),
		slots:       make(chan struct{}, cfg.MaxConcurrent),
		refreshC:    map[string]chan uint64{},
		freshSlot:   make(chan struct{}, 1),
		refreshWake: make(chan struct{}),
	}
	w.fast.serf = map[string]health.CheckState{}
	w.fast.failing, w.fast.crossPending = map[string]bool{}, map[string]bool{}
	if cfg.ReadRate > 0 {
		// The membership and generation reads slow down while the
		// catalog is being written (readBudget.writing); a fencing call
		// that needs the generation keys afresh refreshes them without
		// waiting. The lapse marks do not yield: a LAPSED answer waits
		// for its mark to be read back, with no refresh.
		w.budget = newReadBudget(cfg.Clock, cfg.ReadRate, cfg.ReadBurst)
		w.genBudget = newReadBudget(cfg.Clock, max(cfg.ReadRate/4, 1), max(cfg.ReadBurst/4, 1))
		w.lapseBudget = newReadBudget(cfg.Clock, max(cfg.ReadRate/4, 1), max(cfg.ReadBurst/4, 1))
		w.budget.yields, w.genBudget.yields = true, true
		w.refreshBudget = newReadBudget(cfg.Clock, max(cfg.ReadRate/4, 1), max(cfg.ReadBurst/4, 1))
		if _, ok := cat.(servicesIndexCatalog); ok {
			w.quiet = newQuietProbe()
		}
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
	w.initMetrics(cfg.Meter)
	return w
}

// Run watches until ctx ends, sending observations to WatchConfig.Out, and
// returns ctx's error then. It fails at once, with an error naming the
// field, when Out is nil.
func (w *Watcher) Run(ctx context.Context) error {
	if w.cfg.Out == nil {
		return errNoOut
	}
	w.runDone = ctx.Done()
	var wg sync.WaitGroup
	wg.Add(6)
	go func() { defer wg.Done(); w.runRefreshes(ctx) }()
	go func() { defer wg.Done(); w.watchNonPassing(ctx, api.HealthCritical) }()
	go func() { defer wg.Done(); w.watchNonPassing(ctx, api.HealthWarning) }()
	go func() { defer wg.Done(); w.watchSerf(ctx) }()
	go func() { defer wg.Done(); w.watchServices(ctx) }()
	go func() { defer wg.Done(); w.watchGenerations(ctx) }()
	if sc, ok := w.cat.(servicesIndexCatalog); ok && w.quiet != nil {
		wg.Add(1)
		go func() { defer wg.Done(); w.probeQuiet(ctx, sc) }()
	}
	if lc, ok := w.cat.(lapseCatalog); ok {
		wg.Add(1)
		go func() { defer wg.Done(); w.watchLapses(ctx, lc) }()
	}
	wg.Wait()
	return ctx.Err()
}

// send sends o to WatchConfig.Out, stamped with the datacenter and the
// time; false when the Watcher stops first.
func (w *Watcher) send(ctx context.Context, o health.Observation) bool {
	o.Datacenter = w.cfg.Datacenter
	if o.At.IsZero() {
		o.At = w.cfg.Clock.Now()
	}
	select {
	case w.cfg.Out <- o:
		return true
	case <-w.stopping(ctx):
		return false
	}
}

// stopping is closed when the Watcher stops: Run's context, not a query's
// (ctx's only outside Run), since what an answer carries goes out whatever
// became of the query's context.
func (w *Watcher) stopping(ctx context.Context) <-chan struct{} {
	if w.runDone != nil {
		return w.runDone
	}
	return ctx.Done()
}

// sendProgress says that watch name ("generations", "lapses" or the
// published non-passing set) is current at index at — a Progress, unless
// the observation it just sent says as much (its index sent) — and then
// records it for refreshes: one finding the watch current relies on what
// made it so having gone out before its marker.
func (w *Watcher) sendProgress(ctx context.Context, name string, at, sent uint64) {
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
		w.send(ctx, health.Observation{Data: &p})
	}
	w.refresh.raise(name, at)
}
