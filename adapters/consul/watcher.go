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
	// Generation keys (their own: another task type's debt never delays a STALE).
	genBudget *readBudget
	// Refresh rounds (their own: fencing's calls never delay the watches' reads).
	refreshBudget *readBudget
	rounds        metric.Int64Counter

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
		w.send(ctx, health.Observation{Progress: &p})
	}
	w.refresh.raise(name, at)
}
