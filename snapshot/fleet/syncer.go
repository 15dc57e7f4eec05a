// Package fleet owns the state of the executor fleet. The Syncer, one
// goroutine, joins what the watches observe, fences sessions, tracks each
// datacenter's reach, remembers sessions after their registrations go,
// applies the operators' controls, decides and builds (translator) and
// publishes into the xDS cache (xdscache); every decided state is a View,
// which the fencing API and explain read.
//
// The Syncer's files, by concern:
//   - syncer.go: its configuration, its state, Run and what each observation
//     changes (apply), and the constraint sets subscribed;
//   - recompute.go: one batch's recomputation, and each group's rebuild;
//   - batch.go: the fleet state decided incrementally (join, fence, lapses);
//   - datacenters.go, generations.go, lapsemarks.go: each datacenter's state
//     and reach, the generation keys, the lapse marks;
//   - history.go, sessions.go: the sessions remembered and the fencing API's
//     index of them;
//   - control.go, readiness.go: the operators' controls, and readiness;
//   - publish.go, view.go: the snapshots set in the cache, the View and the
//     other state published for other goroutines;
//   - telemetry.go: the instruments and the trace of each change.
package fleet

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/jonboulle/clockwork"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/translator"
	"github.com/leasehold/leasehold/snapshot/xdscache"
)

// SyncConfig configures a Syncer. Zero values mean defaults.
type SyncConfig struct {
	// AddDelay is how long a change that only adds endpoints (or raises
	// weights) may wait to be coalesced with others (default 50ms). Changes
	// that remove or drain an endpoint are never delayed.
	AddDelay time.Duration
	Clock    clockwork.Clock
	Logger   *slog.Logger
	// OnPublish, if set, is called from the Run goroutine after a group's
	// snapshot is set (for telemetry and tests; it must not block).
	OnPublish func(group string, snap *cache.Snapshot)
	Tracer    trace.TracerProvider // default: no spans
	Meter     metric.MeterProvider // default: no metrics
	// Audit, if set, receives every configuration change this replica
	// applied or refused (from the Run goroutine; it must not block long).
	Audit func(AuditEvent)
	// HistoryRetention is how long sessions of an instance with no
	// registration left are remembered, so that the fencing API still
	// answers STALE or LAPSED for them, and a lapsed session whose
	// registration comes back is not routed (default DefaultHistoryRetention;
	// then UNKNOWN).
	HistoryRetention time.Duration
	// LBPolicy is the load-balancing policy of every task type the rollout
	// configuration does not choose one for (default health.DefaultLBPolicy).
	LBPolicy health.LBPolicy
	// OnLapse, if set, is called from the Run goroutine with every session
	// this replica sees lapse that no lapse mark records yet (it must not
	// block): the mark makes the lapse final for every replica and restart
	// (health.LapseMarkPrefix).
	OnLapse func(health.Executor)
	// Datacenters are the watched Consul datacenters in failover order,
	// leasehold's own first: the datacenter of a dispatcher that names none
	// (nil: one datacenter, unnamed). Observations name theirs.
	Datacenters []string
	// DatacenterQuiet is how long one of several datacenters may go without
	// an answer before its sessions are answered UNKNOWN (default 20 s: its
	// watches answer at least every 10 s); DatacenterLost how long before its
	// executors leave the assignments while another datacenter answers
	// (default health.DefaultLeaseTTL, a lease).
	DatacenterQuiet, DatacenterLost time.Duration
	// AwaitControl says a control watch feeds Run the operators' rules and
	// cordons (ControlContact): nothing is served before its first answer
	// (so no executor an operator took out is routed after a start), and
	// readiness needs it to read them.
	AwaitControl bool
	// ShardSize is the most instances a task type's load assignment holds
	// before the task is split into shards, each a cluster of its own behind
	// one weighted route (translator.ShardCount; default DefaultShardSize;
	// negative: never). Dispatchers that cannot take weighted clusters
	// (health.Dispatcher.SingleCluster) keep one cluster.
	ShardSize int
	// AwaitLapses says each datacenter's watch reads the lapse marks
	// (Observation.Lapses): nothing is served before every datacenter's
	// first answer, so a session that lapsed before a restart (or that
	// another replica saw lapse) is never routed meanwhile.
	AwaitLapses bool
	// RequireACLApprovals counts only the cordon approvals Consul
	// attributed: created and approved with two different ACL tokens
	// (health.CordonOptions.AttributedApprovals).
	RequireACLApprovals bool
}

// localDC is leasehold's own datacenter ("" with one, unnamed).
func (s *Syncer) localDC() string { return s.cfg.failover().Local }

// multi reports whether several datacenters are watched.
func (c SyncConfig) multi() bool { return len(c.Datacenters) > 1 }

// failover is the datacenters' order for the translator.
func (c SyncConfig) failover() translator.Failover {
	if len(c.Datacenters) == 0 {
		return translator.Failover{}
	}
	return translator.Failover{Local: c.Datacenters[0], Order: c.Datacenters}
}

// DefaultHistoryRetention outlasts Consul's default reconnect_timeout (72 h):
// a failed node's registrations cannot come back after leasehold forgot them.
const DefaultHistoryRetention = 73 * time.Hour

// DefaultShardSize is SyncConfig.ShardSize's default. A lapse resends its
// shard to every stream of the task: at 100 streams per task type on 2
// cores, the push of a 1,000-endpoint shard (~120 KB each) took lapse → stop
// to p99 189–333 ms, a 250-endpoint one to 55–75 ms (BENCHMARKS.md, "Shards
// of 250").
const DefaultShardSize = 250

func (c SyncConfig) withDefaults() SyncConfig {
	if c.ShardSize == 0 {
		c.ShardSize = DefaultShardSize
	}
	if c.AddDelay <= 0 {
		c.AddDelay = 50 * time.Millisecond
	}
	if c.Clock == nil {
		c.Clock = clockwork.NewRealClock()
	}
	if c.HistoryRetention <= 0 {
		c.HistoryRetention = DefaultHistoryRetention
	}
	if c.LBPolicy == "" {
		c.LBPolicy = health.DefaultLBPolicy
	}
	if c.DatacenterQuiet <= 0 {
		c.DatacenterQuiet = 20 * time.Second
	}
	if c.DatacenterLost <= 0 {
		c.DatacenterLost = health.DefaultLeaseTTL
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Tracer == nil {
		c.Tracer = tracenoop.NewTracerProvider()
	}
	if c.Meter == nil {
		c.Meter = metricnoop.NewMeterProvider()
	}
	return c
}

// Syncer owns the fleet state. Its Run goroutine consumes Consul
// observations, decides eligibility per dispatcher constraint set and keeps
// the xDS cache up to date: one snapshot per constraint set, rebuilt only for
// the task types that changed.
type Syncer struct {
	cfg   SyncConfig
	log   *slog.Logger
	cache *xdscache.Cache

	// Shared with other goroutines: the requests Run serves and what it
	// publishes for them (publish.go, readiness.go, view.go). Everything
	// after this group is owned by Run.
	subs     chan subscription
	stopped  chan struct{}                       // closed when Run returns
	ready    atomic.Bool                         // readyWhy.Ready
	readyWhy atomic.Pointer[Readiness]           // ready with its reason
	view     atomic.Pointer[View]                // the latest decided state
	progress atomic.Pointer[map[string]Progress] // per datacenter: how far its view is current

	// Datacenters (datacenters.go).
	dcs     map[string]*dcState // per datacenter
	started time.Time           // a datacenter never heard from is silent since then
	synced  bool                // the whole fleet has been read once

	// The fleet state as last decided (batch.go), per datacenter and task
	// type: the last membership read, the registrations as decided, and
	// their executors' print when last decided.
	members     map[fleetKey]*health.TaskMembers
	fleet       map[fleetKey]*taskState
	printOf     map[fleetKey]taskPrint
	fullBatches bool // tests: decide every registration and build afresh on every batch

	// Generation keys (generations.go): per instance, its key (the newest of
	// any datacenter), and the instances whose key changed since the fleet
	// state was last fenced.
	keys        map[string]health.GenerationRecord
	keysChanged map[string]struct{}

	// Lapse marks (lapsemarks.go).
	marks lapseMarks

	// Sessions and their history (batch.go, history.go, sessions.go). The
	// sessions and instances present count their registrations with valid
	// metadata; lapsed holds the sessions present seen with a critical lease
	// or a failed node.
	lapsed    map[health.SessionKey]bool
	sessions  map[health.SessionKey]int
	instances map[string]int
	history   sessionHistory       // sessions seen, kept after their registrations are gone
	sessionIx sessionIndex         // the fencing API's answers, per instance
	lastSeen  map[string]time.Time // per absent instance: when its last registration went
	prunedAt  time.Time            // when absent instances were last pruned from the history

	// Groups and publishing (recompute.go, publish.go).
	groups      map[string]*group     // per constraint set with streams
	flushAt     time.Time             // when the groups coalescing additions are published
	statics     map[string]staticMemo // listeners, routes and clusters made, by key
	listeners   []func(Publication)   // Notify's
	batchStart  time.Time             // when Consul's answer behind the current batch arrived
	batchLapse  time.Time             // batchStart, when the batch holds a new lapse
	batchChange trace.SpanContext     // the current batch's consul_change span, if traced

	// The operators' controls and what readiness knows of the reads'
	// failures (control.go, readiness.go).
	ctl control
	rd  readiness

	syncTelemetry // instruments and tracer (telemetry.go)
}

// subscription is a request to Run to add (or release) a stream of a
// constraint set; done is closed once it is served.
type subscription struct {
	d    health.Dispatcher
	add  bool
	done chan struct{}
}

// group is one constraint set with streams: its load assignments per task
// type, and what its next publication must say.
type group struct {
	d        health.Dispatcher
	refs     int                            // streams of the set
	loads    map[string][]translator.Shard  // per task type: its shards' load assignments
	routes   map[string]shardedRoute        // per sharded task type: its route
	builders map[string]*translator.Builder // per task type

	// Since the last publish.
	dirty        bool      // something changed
	urgent       bool      // an endpoint was removed or started draining: publish at once
	removedTasks []string  // tasks whose endpoints lost or drained one
	removedLoads []string  // their load assignments that changed (a shard's, or the task's)
	lapsedAt     time.Time // when Consul reported the earliest lapse behind them
	// The consul_change spans of the batches that changed it (markDirty).
	changes []trace.SpanContext
}

// NewSyncer returns a Syncer with an empty cache. Dispatchers' nodes are
// grouped by constraint set (xdscache.GroupOf).
func NewSyncer(cfg SyncConfig) *Syncer {
	cfg = cfg.withDefaults()
	s := &Syncer{
		cfg: cfg, log: cfg.Logger.With("component", "syncer"),
		cache:     xdscache.New(),
		subs:      make(chan subscription),
		stopped:   make(chan struct{}),
		members:   map[fleetKey]*health.TaskMembers{},
		dcs:       map[string]*dcState{},
		started:   cfg.Clock.Now(),
		lapsed:    map[health.SessionKey]bool{},
		keys:      map[string]health.GenerationRecord{},
		fleet:     map[fleetKey]*taskState{},
		printOf:   map[fleetKey]taskPrint{},
		sessions:  map[health.SessionKey]int{},
		instances: map[string]int{},
		groups:    map[string]*group{},
		lastSeen:  map[string]time.Time{},
	}
	for _, dc := range cfg.Datacenters {
		s.dc(dc)
	}
	s.view.Store(emptyView())
	s.initTelemetry()
	return s
}

// Cache is the xDS cache the server serves from.
func (s *Syncer) Cache() cache.Cache { return s.cache }

// Snapshot is the current snapshot of a constraint-set group.
func (s *Syncer) Snapshot(group string) (*cache.Snapshot, bool) { return s.cache.Snapshot(group) }

// Ready is true once the whole fleet has been read (the task list, every
// task's members and the non-passing checks) and while Consul answers
// (and, with AwaitControl, while the operators' controls are read; see
// Readiness for why not).
// Dispatchers keep being served the last snapshot either way; before the
// first full read no snapshot is served at all, so no client ever sees a
// half-read fleet.
func (s *Syncer) Ready() bool { return s.ready.Load() }

// Subscribe registers a dispatcher stream's constraint set; its group's
// snapshot is built (and set in the cache) before it returns, if it is the
// first stream of the set. Safe from any goroutine; returns at once if Run
// has ended.
func (s *Syncer) Subscribe(d health.Dispatcher) { s.request(subscription{d: d, add: true}) }

// Unsubscribe releases what Subscribe took; a group with no streams is dropped.
func (s *Syncer) Unsubscribe(d health.Dispatcher) { s.request(subscription{d: d}) }

func (s *Syncer) request(sub subscription) {
	sub.done = make(chan struct{})
	select {
	case s.subs <- sub:
	case <-s.stopped:
		return
	}
	select {
	case <-sub.done:
	case <-s.stopped:
	}
}

// Run applies observations until ctx ends.
func (s *Syncer) Run(ctx context.Context, obs <-chan health.Observation) error {
	var flush, reach clockwork.Timer
	var flushC, reachC <-chan time.Time
	var reachAt time.Time
	defer func() {
		if flush != nil {
			flush.Stop()
		}
		if reach != nil {
			reach.Stop()
		}
		close(s.stopped)
	}()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-reachC:
			reachC, reachAt = nil, time.Time{}
			if s.updateReach(s.cfg.Clock.Now()) {
				s.batchStart = s.cfg.Clock.Now()
				s.recompute(ctx)
			}
		case o := <-obs:
			s.batchStart = o.At
			if s.batchStart.IsZero() {
				s.batchStart = time.Now()
			}
			content := s.apply(o)
			for more := true; more; { // coalesce whatever else already arrived
				select {
				case o := <-obs:
					content = s.apply(o) || content
				default:
					more = false
				}
			}
			if s.updateReach(s.cfg.Clock.Now()) {
				content = true
			}
			if content { // progress alone changes no decision: no recompute
				s.recompute(ctx)
			}
			s.publishProgress()
		case sub := <-s.subs:
			s.subscribe(ctx, sub)
			s.publishView()
			close(sub.done)
		case <-flushC:
			flushC = nil
			s.flushAt = time.Time{}
			s.publishDirty(ctx, false)
		}
		if next := s.nextReachChange(s.cfg.Clock.Now()); !next.IsZero() &&
			(reachC == nil || next.Before(reachAt)) {
			if reach == nil {
				reach = s.cfg.Clock.NewTimer(s.cfg.Clock.Until(next))
			} else {
				reach.Stop()
				reach.Reset(s.cfg.Clock.Until(next))
			}
			reachC, reachAt = reach.Chan(), next
		}
		if !s.flushAt.IsZero() && flushC == nil {
			if flush == nil {
				flush = s.cfg.Clock.NewTimer(s.cfg.Clock.Until(s.flushAt))
			} else {
				flush.Reset(s.cfg.Clock.Until(s.flushAt))
			}
			flushC = flush.Chan()
		}
	}
}

// apply takes one observation in; it reports whether it may change a
// decision (everything but Progress).
func (s *Syncer) apply(o health.Observation) bool {
	switch x := o.Data.(type) { // leasehold's own configuration: no datacenter's answer
	case *health.RulesSource:
		s.applyRules(x)
		return true
	case *health.CordonSet:
		s.applyCordons(x)
		return true
	case *health.ControlContact:
		s.applyControlContact(health.Contact(*x))
		return true
	case nil:
		s.log.Error("an observation without data: ignored", "datacenter", o.Datacenter)
		return false
	}
	d := s.dc(o.Datacenter)
	d.answered(o, s.cfg.Clock.Now())
	switch x := o.Data.(type) {
	case *health.Progress:
		d.progressNP = max(d.progressNP, x.NonPassing)
		d.progressGen = max(d.progressGen, x.Generations)
		d.progressLapses = max(d.progressLapses, x.Lapses)
		return false
	case *health.TaskList:
		d.tasks = append([]string{}, x.Tasks...)
	case *health.TaskMembers:
		k := fleetKey{o.Datacenter, x.Task}
		if x.Gone {
			delete(s.members, k)
		} else {
			s.members[k] = x
			s.applyKeyReads(d, x.Keys)
		}
	case *health.NonPassing:
		d.np = health.NewNonPassingSet(*x)
		d.haveNP = true
	case *health.Refreshed:
		d.refreshed = max(d.refreshed, x.Seq)
		// Read afresh once Consul was at AtLeast: current there.
		d.progressNP = max(d.progressNP, x.AtLeast)
		d.progressGen = max(d.progressGen, x.AtLeast)
		d.progressLapses = max(d.progressLapses, x.AtLeast)
	case *health.LapseMarks:
		d.marks, d.haveMarks, d.marksIndex = x.Marks, true, x.Index
		s.marks.gen++
	case *health.Generations:
		s.applyListing(d, x)
	case *health.Contact:
		s.applyContact(o, d, x)
	}
	return true
}

// applyContact takes a datacenter watch's contact report in.
func (s *Syncer) applyContact(o health.Observation, d *dcState, c *health.Contact) {
	if c.IndexWentBack {
		// Consul's past is gone: generations come again from its KV (the
		// watch reads them anew). The session history stays: session ids are
		// unique, and a lapse must stay final whatever Consul forgot.
		s.log.Warn("Consul's index went backwards: session generations are read anew; lapses "+
			"seen before stay final", "datacenter", o.Datacenter)
		s.forgetKeyReads(d)
		// The indexes of before are not comparable with those to come.
		d.progressNP, d.progressGen, d.progressLapses = 0, 0, 0
		return
	}
	if !c.OK && !d.failing {
		d.failedAt = o.At
	}
	d.failing = !c.OK
	s.noteContact(o.Datacenter, *c)
	if !c.OK {
		s.log.Warn(contactMessage(c.Problem, s.synced), "datacenter", o.Datacenter, "err", c.Err)
	} else {
		s.log.Info("consul reachable again", "datacenter", o.Datacenter)
	}
}

func (s *Syncer) subscribe(ctx context.Context, sub subscription) {
	defer func() { s.groupCount.Store(int64(len(s.groups))) }()
	key := sub.d.Key()
	g := s.groups[key]
	if !sub.add {
		if g != nil {
			if g.refs--; g.refs <= 0 {
				delete(s.groups, key)
				s.cache.Clear(key)
				s.log.Info("constraint set unused: dropped", "group", key)
				s.setsChanged(ctx)
			}
		}
		return
	}
	if g != nil {
		g.refs++
		return
	}
	g = &group{d: sub.d, refs: 1, loads: map[string][]translator.Shard{},
		routes: map[string]shardedRoute{}, builders: map[string]*translator.Builder{}}
	s.groups[key] = g
	if !s.setsChanged(ctx) { // (which rebuilt every group, this one too)
		for _, task := range taskNames(s.members) {
			s.rebuild(g, task)
		}
	}
	s.log.Info("constraint set added", "group", key, "groups", len(s.groups))
	if s.synced {
		s.publish(ctx, key, g)
	}
}
