// Package fleet owns the state of the executor fleet: the Syncer, one
// goroutine, joins what the watches observe, fences sessions, tracks each
// datacenter's reach, remembers sessions after their registrations go,
// applies the operators' controls, decides and builds (translator) and
// publishes into the xDS cache (xdscache); every decided state is a View,
// which the fencing API and explain read.
package fleet

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/jonboulle/clockwork"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/protobuf/proto"

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
	// AwaitControl: a control watch feeds Run the operators' rules and
	// cordons (ControlContact): nothing is served before its first answer
	// (so no executor an operator took out is routed after a start), and
	// readiness needs it to read them.
	AwaitControl bool
	// AwaitLapses: each datacenter's watch reads the lapse marks
	// (Observation.Lapses): nothing is served before every datacenter's
	// first answer, so a session that lapsed before a restart (or that
	// another replica saw lapse) is never routed meanwhile.
	AwaitLapses bool
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

func (c SyncConfig) withDefaults() SyncConfig {
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
	cfg     SyncConfig
	log     *slog.Logger
	cache   *xdscache.Cache
	subs    chan subscription
	stopped chan struct{} // closed when Run returns
	ready   atomic.Bool
	view    atomic.Pointer[View]
	// readyWhy is ready with its reason (readiness.go).
	readyWhy atomic.Pointer[Readiness]
	// progress is, per datacenter, how far its view is known current
	// (publishProgress).
	progress atomic.Pointer[map[string]Progress]

	// Owned by Run.
	members        map[fleetKey]*health.TaskMembers
	dcs            map[string]*dcState // per datacenter (datacenters.go)
	started        time.Time
	synced         bool                               // the whole fleet has been read once
	lapsed         map[[2]string]bool                 // instance, session seen with a critical lease or failed node
	keys           map[string]health.GenerationRecord // per instance: its generation key, the newest of any datacenter (generations.go)
	fleet          map[fleetKey]*taskState            // per datacenter and task type: the registrations as decided (fleet.go)
	staticVersions map[string]string                  // listeners', routes' and clusters' versions by type URL and key (staticVersion)
	printOf        map[fleetKey]taskPrint             // per datacenter and task type: its executors' combined print when last decided
	keysChanged    map[string]struct{}                // instances whose key changed since the fleet state was fenced
	marked         map[[2]string]health.LapseMark     // every datacenter's lapse marks, by instance and session
	markedBy       map[string][]health.LapseMark      // the same, by instance
	marksGen       uint64                             // bumped when a datacenter's marks are replaced
	unmarked       map[[2]string]struct{}             // sessions handed to OnLapse whose mark has not been read back yet (with AwaitLapses)
	unmarkedView   map[[2]string]struct{}             // the copy of unmarked the latest view shares (nil: to be made)
	marksJoinedGen uint64
	sessions       map[[2]string]int // instance, session: registrations present (valid metadata)
	instances      map[string]int    // instance: registrations present (valid metadata)
	fullBatches    bool              // tests: decide every registration on every batch
	groups         map[string]*group
	flushAt        time.Time
	history        sessionHistory       // sessions seen, kept after their registrations are gone (history.go)
	sessionIx      sessionIndex         // the fencing API's answers, per instance (sessions.go)
	lastSeen       map[string]time.Time // per absent instance: when its last registration went
	prunedAt       time.Time            // when absent instances were last pruned from history
	batchStart     time.Time            // when Consul's answer behind the current batch arrived
	batchLapse     time.Time            // batchStart, when the batch holds a new lapse
	listeners      []func(Publication)
	ctl            control
	rd             readiness
	syncTelemetry
}

type subscription struct {
	d    health.Dispatcher
	add  bool
	done chan struct{}
}

type group struct {
	removedTasks []string  // tasks whose endpoints lost or drained one since the last publish
	lapsedAt     time.Time // when Consul reported the earliest lapse behind them
	d            health.Dispatcher
	refs         int
	loads        map[string]*endpointv3.ClusterLoadAssignment
	claVersion   map[string]string // content version of each load assignment
	builders     map[string]*translator.Builder
	dirty        bool
	urgent       bool
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
		lapsed:    map[[2]string]bool{},
		keys:      map[string]health.GenerationRecord{},
		fleet:     map[fleetKey]*taskState{},
		printOf:   map[fleetKey]taskPrint{},
		sessions:  map[[2]string]int{},
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
		if next := s.nextReachChange(s.cfg.Clock.Now()); !next.IsZero() && (reachC == nil || next.Before(reachAt)) {
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
	switch { // leasehold's own configuration: no datacenter's answer
	case o.Rules != nil:
		s.applyRules(o.Rules)
		return true
	case o.Cordons != nil:
		s.applyCordons(o.Cordons)
		return true
	case o.ControlContact != nil:
		s.applyControlContact(*o.ControlContact)
		return true
	}
	d := s.dc(o.Datacenter)
	d.answered(o, s.cfg.Clock.Now())
	if p := o.Progress; p != nil {
		d.progressNP, d.progressGen = max(d.progressNP, p.NonPassing), max(d.progressGen, p.Generations)
		d.progressLapses = max(d.progressLapses, p.Lapses)
		return false
	}
	switch {
	case o.Tasks != nil:
		d.tasks = append([]string{}, o.Tasks.Tasks...)
	case o.Members != nil:
		k := fleetKey{o.Datacenter, o.Members.Task}
		if o.Members.Gone {
			delete(s.members, k)
		} else {
			s.members[k] = o.Members
			s.applyKeyReads(d, o.Members.Keys)
		}
	case o.NonPassing != nil:
		d.np = health.NewNonPassingSet(*o.NonPassing)
		d.haveNP = true
	case o.Refreshed != nil:
		d.refreshed = max(d.refreshed, *o.Refreshed)
		// Read afresh once Consul was at RefreshedAtLeast: current there.
		d.progressNP, d.progressGen = max(d.progressNP, o.RefreshedAtLeast), max(d.progressGen, o.RefreshedAtLeast)
		d.progressLapses = max(d.progressLapses, o.RefreshedAtLeast)
	case o.Lapses != nil:
		d.marks, d.haveMarks, d.marksIndex = o.Lapses.Marks, true, o.Lapses.Index
		s.marksGen++
	case o.Generations != nil:
		s.applyListing(d, o.Generations)
	case o.Contact != nil && o.Contact.IndexWentBack:
		// Consul's past is gone: generations come again from its KV (the
		// watch reads them anew). The session history stays: session ids are
		// unique, and a lapse must stay final whatever Consul forgot.
		s.log.Warn("Consul's index went backwards: session generations are read anew; lapses seen before stay final", "datacenter", o.Datacenter)
		s.forgetKeyReads(d)
		d.progressNP, d.progressGen, d.progressLapses = 0, 0, 0 // indexes of before are not comparable
	case o.Contact != nil:
		if !o.Contact.OK && !d.failing {
			d.failedAt = o.At
		}
		d.failing = !o.Contact.OK
		s.noteContact(o.Datacenter, *o.Contact)
		if !o.Contact.OK {
			s.log.Warn(contactMessage(o.Contact.Problem), "datacenter", o.Datacenter, "err", o.Contact.Err)
		} else {
			s.log.Info("consul reachable again", "datacenter", o.Datacenter)
		}
	}
	return true
}

// publishProgress makes the indexes at which each datacenter's non-passing
// checks, generation keys and lapse marks are known current visible to
// Progress; called after the batch's view is published, so a reader that
// sees an index then loads a view that includes everything up to it.
func (s *Syncer) publishProgress() {
	p := make(map[string]Progress, len(s.dcs))
	for name, d := range s.dcs {
		p[name] = Progress{NonPassing: max(d.progressNP, d.np.Index()), Generations: max(d.progressGen, d.genIndex),
			Lapses: max(d.progressLapses, d.marksIndex), ReadsLapses: s.cfg.AwaitLapses}
	}
	s.progress.Store(&p)
}

// Progress is how far the latest view of datacenter dc ("" with one,
// unnamed) is known current (it may be ahead of the view's own indexes: a
// watch answered again with the same content). Safe from any goroutine.
func (s *Syncer) Progress(dc string) Progress {
	if p := s.progress.Load(); p != nil {
		return (*p)[dc]
	}
	return Progress{ReadsLapses: s.cfg.AwaitLapses}
}

// recompute joins, fences and decides; only task types whose executors
// changed are rebuilt, and only changed load assignments are published.
func (s *Syncer) recompute(ctx context.Context) {
	started := time.Now()
	r := s.decideChanges(ctx)
	changed, lapses := r.changed, r.lapses
	if s.cfg.OnLapse != nil {
		for _, e := range lapses {
			k := [2]string{e.InstanceID, e.SessionID}
			if _, marked := s.marked[k]; !marked {
				s.cfg.OnLapse(e)
				s.awaitMark(k)
			}
		}
	}
	decided := time.Now()

	// One trace per change that matters: the root span covers the batch, its
	// children eligibility, the snapshot build and the cache update.
	traced := len(changed) > 0 || len(lapses) > 0
	var root trace.Span
	if traced {
		diff := r.diff
		ctx, root = s.tracer.Start(ctx, "leasehold.consul_change", trace.WithTimestamp(s.batchStart),
			trace.WithAttributes(
				attribute.Int64("consul.index", int64(s.consulIndex(s.localDC()))),
				attribute.StringSlice("leasehold.tasks_changed", changed),
				attribute.Int("leasehold.instances.added", diff.added),
				attribute.Int("leasehold.instances.changed", diff.changed),
				attribute.Int("leasehold.instances.removed", diff.removed),
				attribute.Int("leasehold.instances.lapsed", len(lapses)),
			))
		for _, e := range lapses {
			root.AddEvent("lease lapsed", trace.WithAttributes(
				attribute.String("leasehold.instance_id", e.InstanceID), attribute.String("leasehold.session_id", e.SessionID),
				attribute.String("leasehold.task", e.Task)))
		}
		_, el := s.tracer.Start(ctx, "leasehold.eligibility", trace.WithTimestamp(started), trace.WithAttributes(attribute.Int("leasehold.executors", r.present)))
		el.End(trace.WithTimestamp(decided))
	}
	if len(lapses) > 0 {
		s.batchLapse = s.batchStart
	}
	var build trace.Span // a leaf: the rebuilds below are not traced one by one
	if traced {
		_, build = s.tracer.Start(ctx, "leasehold.snapshot_build", trace.WithAttributes(attribute.Int("leasehold.groups", len(s.groups)), attribute.StringSlice("leasehold.tasks", changed)))
	}
	for _, g := range s.groups {
		for _, task := range changed {
			s.rebuild(g, task)
		}
		if s.ctl.clusters { // the load-balancing policies may have changed
			g.dirty = true
		}
	}
	s.ctl.clusters = false
	s.buildTime.Record(ctx, time.Since(decided).Seconds())
	if build != nil {
		build.End()
	}
	if !s.synced && s.allRead() {
		s.synced = true
		s.log.Info("fleet read: serving", "tasks", len(taskNames(s.members)), "executors", r.present, "datacenters", len(s.dcs))
		for key, g := range s.groups { // waiting dispatchers get their first snapshot
			s.publish(ctx, key, g)
		}
	}
	s.storeReadiness()
	s.publishDirty(ctx, true)
	s.publishView() // after the removals are in the cache
	s.batchLapse = time.Time{}
	if root != nil {
		root.End()
	}
}

// allRead reports whether the whole fleet has been read once: in every
// datacenter the task list, every task's members, the non-passing checks and
// the generation keys — or the datacenter is lost (others answer, it has not
// for a lease: serving does not wait for it).
func (s *Syncer) allRead() bool {
	if s.cfg.AwaitControl && !s.rd.ctlRead {
		return false // and the operators' controls
	}
	for name, d := range s.dcs {
		if d.reach == health.Lost {
			continue
		}
		if !d.haveNP || !d.haveGen || d.tasks == nil || (s.cfg.AwaitLapses && !d.haveMarks) {
			return false
		}
		for _, task := range d.tasks {
			if _, ok := s.members[fleetKey{name, task}]; !ok {
				return false
			}
		}
	}
	return len(s.dcs) > 0
}

// anyReachable: Consul answers in some datacenter (with one, in it).
func (s *Syncer) anyReachable() bool {
	for _, d := range s.dcs {
		if !d.failing {
			return true
		}
	}
	return false
}

// taskExecutors are task's registrations in every datacenter, in
// datacenter order, with their prints (nil, nil: the task is nowhere).
func (s *Syncer) taskExecutors(task string) ([]health.Executor, []uint64) {
	if len(s.dcs) == 1 { // the common case: no names to sort, no copy
		for name := range s.dcs {
			if ts := s.fleet[fleetKey{name, task}]; ts != nil {
				return ts.execs, ts.prints
			}
		}
		return nil, nil
	}
	var one *taskState
	n, parts := 0, 0
	for _, name := range s.dcNames() {
		if ts := s.fleet[fleetKey{name, task}]; ts != nil {
			one, n, parts = ts, n+len(ts.execs), parts+1
		}
	}
	switch parts {
	case 0:
		return nil, nil
	case 1:
		return one.execs, one.prints // the common case: no copy
	}
	execs, prints := make([]health.Executor, 0, n), make([]uint64, 0, n)
	for _, name := range s.dcNames() {
		if ts := s.fleet[fleetKey{name, task}]; ts != nil {
			execs, prints = append(execs, ts.execs...), append(prints, ts.prints...)
		}
	}
	return execs, prints
}

// rebuild recomputes one task's load assignment for a group and marks the
// group dirty (urgent when an endpoint was removed or started draining).
func (s *Syncer) rebuild(g *group, task string) {
	old := g.loads[task]
	execs, prints := s.taskExecutors(task)
	if execs == nil {
		delete(g.builders, task)
		if old != nil {
			delete(g.loads, task)
			delete(g.claVersion, task)
			g.dirty, g.urgent = true, true
		}
		return
	}
	if !g.d.AllowsTask(task) {
		return // never published to this group
	}
	b := g.builders[task]
	if b == nil {
		b = &translator.Builder{Failover: s.cfg.failover()}
		g.builders[task] = b
	}
	r := b.BuildPrinted(task, execs, prints, g.d, s.observed(task, g.d)...)
	cla, version := r.CLA, r.Version
	for _, o := range r.Observed {
		for _, x := range o.Exclusions {
			s.wouldExclude.Add(context.Background(), 1, metric.WithAttributes(attribute.String("rule", string(x.Reason)), attribute.String("task", task)))
			s.log.Info("rule in observe mode would exclude; routed", "rule", x.Reason, "detail", x.Detail, "instance_id", o.InstanceID, "session_id", o.SessionID, "task", task, "group", g.d.Key())
		}
	}
	if s.log.Enabled(context.Background(), slog.LevelDebug) {
		for _, d := range translator.Decide(execs, g.d, s.observed(task, g.d)...) {
			s.log.Debug("decision", "group", g.d.Key(), "task", task, "instance_id", d.Executor.InstanceID, "session_id", d.Executor.SessionID, "route", d.Verdict.Route, "reason", d.Verdict.Reason, "detail", d.Verdict.Detail)
		}
	}
	if old != nil && g.claVersion[task] == version {
		return // same content
	}
	g.loads[task] = cla
	g.claVersion[task] = version
	g.dirty = true
	removes := r.RemovesOrDrains
	if r.Restarted { // e.g. a rule went from observe to enforce: compare whole
		removes = translator.RemovesOrDrainsBetween(old, cla)
	}
	if old != nil && removes {
		g.urgent = true
		g.removedTasks = append(g.removedTasks, task)
		if !s.batchLapse.IsZero() && (g.lapsedAt.IsZero() || s.batchLapse.Before(g.lapsedAt)) {
			g.lapsedAt = s.batchLapse
		}
	}
}

// publishDirty publishes urgent groups now and schedules the rest.
func (s *Syncer) publishDirty(ctx context.Context, onlyUrgent bool) {
	if !s.synced {
		return // nothing is served before the fleet has been read once
	}
	for key, g := range s.groups {
		if !g.dirty {
			continue
		}
		if onlyUrgent && !g.urgent {
			at := s.cfg.Clock.Now().Add(s.cfg.AddDelay)
			if s.flushAt.IsZero() || at.Before(s.flushAt) {
				s.flushAt = at
			}
			continue
		}
		s.publish(ctx, key, g)
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
			}
		}
		return
	}
	if g != nil {
		g.refs++
		return
	}
	g = &group{d: sub.d, refs: 1, loads: map[string]*endpointv3.ClusterLoadAssignment{}, claVersion: map[string]string{}, builders: map[string]*translator.Builder{}}
	s.groups[key] = g
	for _, task := range taskNames(s.members) {
		s.rebuild(g, task)
	}
	s.log.Info("constraint set added", "group", key, "groups", len(s.groups))
	if s.synced {
		s.publish(ctx, key, g)
	}
}

// staticVersion is translator.Version of a listener, route or cluster,
// computed once per key (which names everything its content depends on: a
// cluster's load-balancing policy too).
func (s *Syncer) staticVersion(typeURL, key string, m proto.Message) string {
	k := typeURL + "/" + key
	if v, ok := s.staticVersions[k]; ok {
		return v
	}
	v := translator.Version(m)
	if s.staticVersions == nil {
		s.staticVersions = map[string]string{}
	}
	s.staticVersions[k] = v
	return v
}

// publish builds the group's snapshot (listener, route and cluster per task,
// its load assignments) with content-hash versions per type.
func (s *Syncer) publish(ctx context.Context, key string, g *group) {
	tasks := taskNames(s.members)
	res := map[types.ResponseType][]types.Resource{}
	versions := map[string]map[string]string{ // type URL → name → content version
		resource.ListenerType: {}, resource.RouteType: {}, resource.ClusterType: {}, resource.EndpointType: {},
	}
	for _, task := range tasks {
		if !g.d.AllowsTask(task) {
			continue // not granted: as if it did not exist (same versions too)
		}
		lb := s.ctl.rollout.LBPolicyOf(task, s.cfg.LBPolicy)
		l, r, c := translator.Listener(task), translator.Route(task), translator.Cluster(task, lb)
		res[types.Listener] = append(res[types.Listener], l)
		res[types.Route] = append(res[types.Route], r)
		res[types.Cluster] = append(res[types.Cluster], c)
		versions[resource.ListenerType][task] = s.staticVersion(resource.ListenerType, task, l)
		versions[resource.RouteType][task] = s.staticVersion(resource.RouteType, task, r)
		versions[resource.ClusterType][task] = s.staticVersion(resource.ClusterType, task+"\x00"+string(lb), c)
		if cla := g.loads[task]; cla != nil {
			res[types.Endpoint] = append(res[types.Endpoint], cla)
			versions[resource.EndpointType][task] = g.claVersion[task]
		}
	}
	// The delta cache takes our per-resource content versions instead of
	// marshalling and hashing every resource of the group on every change
	// while a delta client is connected (ConstructVersionMap keeps a map
	// that is already set).
	snap := &cache.Snapshot{VersionMap: versions}
	for _, typ := range []types.ResponseType{types.Cluster, types.Endpoint, types.Listener, types.Route} {
		url, _ := cache.GetResponseTypeURL(typ)
		snap.Resources[typ] = cache.NewResources(xdscache.TypeVersion(versions[url]), res[typ])
	}
	// go-control-plane's own Snapshot.Consistent does not follow API
	// listeners to their routes; ours does.
	if err := consistentSet(res); err != nil {
		s.log.Error("inconsistent snapshot not published", "group", key, "err", err)
		return
	}
	ctx, span := s.tracer.Start(ctx, "leasehold.cache_update", trace.WithAttributes(
		attribute.String("leasehold.constraint_set", key),
		attribute.String("xds.version.endpoints", snap.Resources[types.Endpoint].Version),
		attribute.Int("xds.resources", len(res[types.Endpoint])+len(res[types.Listener])+len(res[types.Route])+len(res[types.Cluster])),
	))
	// Listeners hear of the publication before any response it causes.
	pub := Publication{Group: key, Snapshot: snap, Ctx: ctx, LapsedAt: g.lapsedAt, RemovedTasks: g.removedTasks}
	for _, f := range s.listeners {
		f(pub)
	}
	err := s.cache.Set(ctx, key, snap, versions)
	span.End()
	if err != nil {
		s.log.Error("set snapshot", "group", key, "err", err)
		return
	}
	g.dirty, g.urgent, g.lapsedAt, g.removedTasks = false, false, time.Time{}, nil
	if s.cfg.OnPublish != nil {
		s.cfg.OnPublish(key, snap)
	}
}

func consistentSet(res map[types.ResponseType][]types.Resource) error {
	var (
		ls []*listenerv3.Listener
		rs []*routev3.RouteConfiguration
		cs []*clusterv3.Cluster
		es []*endpointv3.ClusterLoadAssignment
	)
	for _, r := range res[types.Listener] {
		ls = append(ls, r.(*listenerv3.Listener))
	}
	for _, r := range res[types.Route] {
		rs = append(rs, r.(*routev3.RouteConfiguration))
	}
	for _, r := range res[types.Cluster] {
		cs = append(cs, r.(*clusterv3.Cluster))
	}
	for _, r := range res[types.Endpoint] {
		es = append(es, r.(*endpointv3.ClusterLoadAssignment))
	}
	return translator.Consistent(ls, rs, cs, es)
}
