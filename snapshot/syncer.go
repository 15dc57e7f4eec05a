package snapshot

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"log/slog"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
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

	"github.com/leasehold/leasehold/health"
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
	cache   *xdsCache
	subs    chan subscription
	stopped chan struct{} // closed when Run returns
	ready   atomic.Bool
	view    atomic.Pointer[View]

	// Owned by Run.
	members     map[string]*health.TaskMembers
	np          *health.NonPassingSet
	haveNP      bool
	tasks       []string           // task types Consul lists; nil until first read
	synced      bool               // the whole fleet has been read once
	unreachable bool               // Consul's last answer was an error
	lapsed      map[[2]string]bool // instance, session seen with a critical lease or failed node
	floor       map[string]uint64  // per instance: the generation in Consul KV (Generations)
	haveGen     bool               // the generation keys have been read
	genIndex    uint64
	refreshed   uint64 // the latest refresh request the watch answered afresh
	progressNP  uint64 // Progress seen in the current batch, published after it
	progressGen uint64
	progress    atomic.Pointer[[2]uint64] // non-passing, generations: current at these indexes
	byTask      map[string][]health.Executor
	printsBy    map[string][]uint64 // executorPrint of byTask's executors, aligned
	taskPrint   map[string]taskPrint
	badSeen     map[string]string
	groups      map[string]*group
	flushAt     time.Time
	history     map[string][]health.PastSession // per instance, newest first, for sessions whose registrations are gone
	lastSeen    map[string]time.Time            // per instance in history: when it last had a registration
	prunedAt    time.Time                       // when absent instances were last pruned from history
	batchStart  time.Time                       // when Consul's answer behind the current batch arrived
	batchLapse  time.Time                       // batchStart, when the batch holds a new lapse
	execPrint   map[string]uint64               // per registration, for added/changed/removed counts
	listeners   []func(Publication)
	historyGen  uint64 // bumped when history changes
	pastList    []health.PastSession
	pastGen     uint64
	ctl         control
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
	builders     map[string]*Builder
	dirty        bool
	urgent       bool
}

// NewSyncer returns a Syncer with an empty cache. Dispatchers' nodes are
// grouped by constraint set (GroupOf).
func NewSyncer(cfg SyncConfig) *Syncer {
	cfg = cfg.withDefaults()
	s := &Syncer{
		cfg: cfg, log: cfg.Logger.With("component", "syncer"),
		cache: &xdsCache{
			sotw: newSotwCache(GroupOf),
			// ads=false: go-control-plane's ADS mode never answers a request
			// for a subset of a type's names, and gRPC clients ask for exact names.
			delta: cache.NewSnapshotCache(false, cacheGroups{}, nil),
		},
		subs:      make(chan subscription),
		stopped:   make(chan struct{}),
		members:   map[string]*health.TaskMembers{},
		lapsed:    map[[2]string]bool{},
		floor:     map[string]uint64{},
		byTask:    map[string][]health.Executor{},
		taskPrint: map[string]taskPrint{},
		badSeen:   map[string]string{},
		groups:    map[string]*group{},
		history:   map[string][]health.PastSession{},
		lastSeen:  map[string]time.Time{},
		execPrint: map[string]uint64{},
	}
	s.view.Store(emptyView())
	s.initTelemetry()
	return s
}

type cacheGroups struct{}

func (cacheGroups) ID(node *corev3.Node) string { return GroupOf(node) }

// Cache is the xDS cache the server serves from.
func (s *Syncer) Cache() cache.Cache { return s.cache }

// Snapshot is the current snapshot of a constraint-set group.
func (s *Syncer) Snapshot(group string) (*cache.Snapshot, bool) { return s.cache.sotw.snapshot(group) }

// Ready is true once the whole fleet has been read (the task list, every
// task's members and the non-passing checks) and while Consul answers.
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
	var flush clockwork.Timer
	var flushC <-chan time.Time
	defer func() {
		if flush != nil {
			flush.Stop()
		}
		close(s.stopped)
	}()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
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
	if p := o.Progress; p != nil {
		s.progressNP, s.progressGen = max(s.progressNP, p.NonPassing), max(s.progressGen, p.Generations)
		return false
	}
	switch {
	case o.Tasks != nil:
		s.tasks = append([]string{}, o.Tasks.Tasks...)
	case o.Members != nil:
		if o.Members.Gone {
			delete(s.members, o.Members.Task)
		} else {
			s.members[o.Members.Task] = o.Members
		}
	case o.NonPassing != nil:
		s.np = health.NewNonPassingSet(*o.NonPassing)
		s.haveNP = true
	case o.Refreshed != nil:
		s.refreshed = max(s.refreshed, *o.Refreshed)
		// Read afresh once Consul was at RefreshedAtLeast: current there.
		s.progressNP, s.progressGen = max(s.progressNP, o.RefreshedAtLeast), max(s.progressGen, o.RefreshedAtLeast)
	case o.Generations != nil:
		s.floor = o.Generations.Floor
		if s.floor == nil {
			s.floor = map[string]uint64{}
		}
		s.haveGen = true
		s.genIndex = o.Generations.Index
	case o.Rules != nil:
		s.applyRules(o.Rules)
	case o.Cordons != nil:
		s.applyCordons(o.Cordons)
	case o.Contact != nil && o.Contact.IndexWentBack:
		// Consul's past is gone: generations come again from its KV (the
		// watch reads them anew). The session history stays: session ids are
		// unique, and a lapse must stay final whatever Consul forgot.
		s.log.Warn("Consul's index went backwards: session generations are read anew; lapses seen before stay final")
		s.progressNP, s.progressGen = 0, 0 // indexes of before are not comparable
	case o.Contact != nil:
		s.unreachable = !o.Contact.OK
		if !o.Contact.OK {
			s.log.Warn("consul unreachable: serving the last known snapshot", "err", o.Contact.Err)
		} else {
			s.log.Info("consul reachable again")
		}
	}
	return true
}

// publishProgress makes the indexes at which the non-passing checks and the
// generation keys are known current visible to Progress; called after the
// batch's view is published, so a reader that sees an index then loads a
// view that includes everything up to it.
func (s *Syncer) publishProgress() {
	s.progress.Store(&[2]uint64{max(s.progressNP, s.np.Index()), max(s.progressGen, s.genIndex)})
}

// Progress is the indexes at which the latest view's non-passing checks and
// generation keys are known current (they may be ahead of the view's own
// NonPassingIndex and GenerationsIndex: a watch answered again with the
// same content). Safe from any goroutine.
func (s *Syncer) Progress() (nonPassing, generations uint64) {
	if p := s.progress.Load(); p != nil {
		return p[0], p[1]
	}
	return 0, 0
}

// recompute joins, fences and decides; only task types whose executors
// changed are rebuilt, and only changed load assignments are published.
func (s *Syncer) recompute(ctx context.Context) {
	started := time.Now()
	var all []health.Executor
	var lapses []health.Executor
	present := map[[2]string]bool{}
	badPresent := map[string]bool{}
	for _, task := range sortedTasks(s.members) {
		for _, m := range s.members[task].Members {
			e := health.Join(m, s.np)
			if e.Err != nil {
				key := e.ServiceID + "@" + e.Node
				badPresent[key] = true
				if s.badSeen[key] != e.Err.Error() {
					s.badSeen[key] = e.Err.Error()
					s.badMeta.Add(ctx, 1)
					s.log.Warn("bad registration metadata: excluded", "service_id", e.ServiceID, "node", e.Node, "err", e.Err)
				}
			} else {
				// Session ids are only unique per instance by contract.
				sk := [2]string{e.InstanceID, e.SessionID}
				present[sk] = true
				if !s.lapsed[sk] && s.lapsedBefore(e) {
					s.lapsed[sk] = true // it reappeared: once lapsed, always lapsed
				}
				if (e.Lease == health.StatusCritical || e.NodeFailed) && !s.lapsed[sk] {
					s.lapsed[sk] = true
					lapses = append(lapses, e)
					s.lapseCount.Add(ctx, 1, metric.WithAttributes(attribute.String("task", e.Task)))
					s.log.Info("lease lapsed", "instance_id", e.InstanceID, "session_id", e.SessionID, "task", e.Task, "node_failed", e.NodeFailed)
				}
				e.LapseObserved = s.lapsed[sk]
			}
			all = append(all, e)
		}
	}
	for sess := range s.lapsed { // gone: the history remembers it (lapsedBefore)
		if !present[sess] {
			delete(s.lapsed, sess)
		}
	}
	for key := range s.badSeen {
		if !badPresent[key] {
			delete(s.badSeen, key)
		}
	}
	health.Fence(all, s.floor)
	s.applyControl(ctx, all, nil)
	s.remember(all)
	byTask := map[string][]health.Executor{}
	printsBy := map[string][]uint64{}
	prints := map[string]*taskPrint{}
	execPrints := make([]uint64, len(all))
	for i := range all {
		e := &all[i]
		x := executorPrint(e)
		byTask[e.Task] = append(byTask[e.Task], *e)
		printsBy[e.Task] = append(printsBy[e.Task], x)
		p := prints[e.Task]
		if p == nil {
			p = &taskPrint{}
			prints[e.Task] = p
		}
		p.add(x)
		execPrints[i] = x
	}
	var changed []string
	for task := range s.members {
		fp := taskPrint{}
		if p := prints[task]; p != nil {
			fp = *p
		}
		if cur, ok := s.taskPrint[task]; !ok || cur != fp {
			changed = append(changed, task)
			s.taskPrint[task] = fp
		}
	}
	for task := range s.taskPrint {
		if _, ok := s.members[task]; !ok {
			changed = append(changed, task)
			delete(s.taskPrint, task)
		}
	}
	if s.ctl.dirty { // rule modes changed: every task type is decided again
		s.ctl.dirty = false
		changed = changed[:0]
		for task := range s.members {
			changed = append(changed, task)
		}
		for task := range s.taskPrint {
			if _, ok := s.members[task]; !ok {
				changed = append(changed, task)
			}
		}
	}
	s.byTask, s.printsBy = byTask, printsBy
	decided := time.Now()

	// One trace per change that matters: the root span covers the batch, its
	// children eligibility, the snapshot build and the cache update.
	traced := len(changed) > 0 || len(lapses) > 0
	var root trace.Span
	if traced {
		diff := s.diffExecutors(all, execPrints)
		ctx, root = s.tracer.Start(ctx, "leasehold.consul_change", trace.WithTimestamp(s.batchStart),
			trace.WithAttributes(
				attribute.Int64("consul.index", int64(s.consulIndex())),
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
		_, el := s.tracer.Start(ctx, "leasehold.eligibility", trace.WithTimestamp(started), trace.WithAttributes(attribute.Int("leasehold.executors", len(all))))
		el.End(trace.WithTimestamp(decided))
	}
	if len(lapses) > 0 {
		s.batchLapse = s.batchStart
	}
	buildCtx := ctx
	var build trace.Span
	if traced {
		buildCtx, build = s.tracer.Start(ctx, "leasehold.snapshot_build", trace.WithAttributes(attribute.Int("leasehold.groups", len(s.groups)), attribute.StringSlice("leasehold.tasks", changed)))
	}
	for _, g := range s.groups {
		for _, task := range changed {
			s.rebuild(g, task)
		}
	}
	s.buildTime.Record(ctx, time.Since(decided).Seconds())
	if build != nil {
		build.End()
	}
	_ = buildCtx
	if !s.synced && s.haveNP && s.haveGen && s.tasks != nil {
		s.synced = true
		for _, task := range s.tasks {
			if _, ok := s.members[task]; !ok {
				s.synced = false
			}
		}
		if s.synced {
			s.log.Info("fleet read: serving", "tasks", len(s.tasks), "executors", len(all))
			for key, g := range s.groups { // waiting dispatchers get their first snapshot
				s.publish(ctx, key, g)
			}
		}
	}
	s.ready.Store(s.synced && !s.unreachable)
	s.publishDirty(ctx, true)
	s.publishView() // after the removals are in the cache
	s.batchLapse = time.Time{}
	if root != nil {
		root.End()
	}
}

// rebuild recomputes one task's load assignment for a group and marks the
// group dirty (urgent when an endpoint was removed or started draining).
func (s *Syncer) rebuild(g *group, task string) {
	old := g.loads[task]
	if _, ok := s.members[task]; !ok {
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
		b = &Builder{}
		g.builders[task] = b
	}
	r := b.BuildPrinted(task, s.byTask[task], s.printsBy[task], g.d, s.observed(task, g.d)...)
	cla, version := r.CLA, r.Version
	for _, o := range r.Observed {
		for _, x := range o.Exclusions {
			s.wouldExclude.Add(context.Background(), 1, metric.WithAttributes(attribute.String("rule", string(x.Reason)), attribute.String("task", task)))
			s.log.Info("rule in observe mode would exclude; routed", "rule", x.Reason, "detail", x.Detail, "instance_id", o.InstanceID, "session_id", o.SessionID, "task", task, "group", g.d.Key())
		}
	}
	if s.log.Enabled(context.Background(), slog.LevelDebug) {
		for _, d := range Decide(s.byTask[task], g.d, s.observed(task, g.d)...) {
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
		removes = removesOrDrains(old, cla)
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
				s.cache.clear(key)
				s.log.Info("constraint set unused: dropped", "group", key)
			}
		}
		return
	}
	if g != nil {
		g.refs++
		return
	}
	g = &group{d: sub.d, refs: 1, loads: map[string]*endpointv3.ClusterLoadAssignment{}, claVersion: map[string]string{}, builders: map[string]*Builder{}}
	s.groups[key] = g
	for task := range s.members {
		s.rebuild(g, task)
	}
	s.log.Info("constraint set added", "group", key, "groups", len(s.groups))
	if s.synced {
		s.publish(ctx, key, g)
	}
}

// publish builds the group's snapshot (listener, route and cluster per task,
// its load assignments) with content-hash versions per type.
func (s *Syncer) publish(ctx context.Context, key string, g *group) {
	tasks := sortedTasks(s.members)
	res := map[types.ResponseType][]types.Resource{}
	versions := map[string]map[string]string{ // type URL → name → content version
		resource.ListenerType: {}, resource.RouteType: {}, resource.ClusterType: {}, resource.EndpointType: {},
	}
	for _, task := range tasks {
		if !g.d.AllowsTask(task) {
			continue // not granted: as if it did not exist (same versions too)
		}
		l, r, c := Listener(task), Route(task), Cluster(task)
		res[types.Listener] = append(res[types.Listener], l)
		res[types.Route] = append(res[types.Route], r)
		res[types.Cluster] = append(res[types.Cluster], c)
		versions[resource.ListenerType][task] = StaticVersion(resource.ListenerType, task, l)
		versions[resource.RouteType][task] = StaticVersion(resource.RouteType, task, r)
		versions[resource.ClusterType][task] = StaticVersion(resource.ClusterType, task, c)
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
		snap.Resources[typ] = cache.NewResources(typeVersion(versions[url]), res[typ])
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
	err := s.cache.set(ctx, key, snap, versions)
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

// typeVersion hashes the names and content versions of a type's resources.
func typeVersion(each map[string]string) string {
	parts := make([]string, 0, len(each))
	for name, v := range each {
		parts = append(parts, name+"="+v)
	}
	sort.Strings(parts)
	sum := sha256.Sum256([]byte(strings.Join(parts, ";")))
	return hex.EncodeToString(sum[:8])
}

func sortedTasks(m map[string]*health.TaskMembers) []string {
	out := make([]string, 0, len(m))
	for t := range m {
		out = append(out, t)
	}
	sort.Strings(out)
	return out
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
	return Consistent(ls, rs, cs, es)
}

// Sessions remembered per instance after their registrations are gone, and
// how many absent instances may be remembered at most.
const (
	historyPerInstance = 8
	historyInstances   = 10000
)

// remember records every present session so that, once its registrations are
// gone, the fencing API still answers STALE or LAPSED for it.
func (s *Syncer) remember(all []health.Executor) {
	present := map[string]bool{}
	for _, e := range all {
		if e.Err != nil {
			continue
		}
		present[e.InstanceID] = true
		h := s.history[e.InstanceID]
		i := 0
		for i < len(h) && h[i].SessionID != e.SessionID {
			i++
		}
		lapsed := e.LapseObserved || e.Lease == health.StatusCritical || e.NodeFailed
		if i < len(h) && (h[i].Lapsed || !lapsed) && contains(h[i].Tasks, e.Task) {
			continue // nothing new about this session: the common case
		}
		s.historyGen++
		if i == len(h) { // newest seen first, whatever its generation (they restart after Consul loses its KV)
			h = append([]health.PastSession{{InstanceID: e.InstanceID, SessionID: e.SessionID, Generation: e.Generation, Version: e.Version}}, h...)
			i = 0
		}
		p := &h[i]
		if lapsed {
			p.Lapsed = true
		}
		if !contains(p.Tasks, e.Task) { // a new slice: Views hold the old one
			tasks := append(append([]string(nil), p.Tasks...), e.Task)
			sort.Strings(tasks)
			p.Tasks = tasks
		}
		if len(h) > historyPerInstance { // forget the session seen longest ago, a lapsed one last
			drop := len(h) - 1
			for j := len(h) - 1; j > 0; j-- {
				if !h[j].Lapsed {
					drop = j
					break
				}
			}
			h = slices.Delete(h, drop, drop+1)
		}
		s.history[e.InstanceID] = h
	}
	now := s.cfg.Clock.Now()
	for inst := range present {
		s.lastSeen[inst] = now
	}
	s.pruneHistory(now, len(present))
}

// pruneHistory forgets instances gone for longer than HistoryRetention (at
// most once a minute) and, past historyInstances absent instances, those gone
// longest first: a churning fleet does not grow leasehold's memory.
func (s *Syncer) pruneHistory(now time.Time, present int) {
	over := len(s.history) - present - historyInstances
	if over <= 0 && now.Sub(s.prunedAt) < time.Minute {
		return
	}
	s.prunedAt = now
	type gone struct {
		inst   string
		at     time.Time
		lapsed bool // holds a lapsed session: evicted by count only after all others
	}
	var absent []gone
	for inst, h := range s.history {
		if at := s.lastSeen[inst]; !at.Equal(now) {
			absent = append(absent, gone{inst, at, slices.ContainsFunc(h, func(p health.PastSession) bool { return p.Lapsed })})
		}
	}
	sort.Slice(absent, func(i, j int) bool {
		if absent[i].lapsed != absent[j].lapsed {
			return !absent[i].lapsed
		}
		return absent[i].at.Before(absent[j].at)
	})
	for i, g := range absent {
		if i >= over && now.Sub(g.at) < s.cfg.HistoryRetention {
			continue
		}
		delete(s.history, g.inst)
		delete(s.lastSeen, g.inst)
		s.historyGen++
	}
}

// lapsedBefore reports whether the history remembers e's session as lapsed:
// its registrations went away after the lapse and came back (e.g. its agent
// re-synced them after the catalog lost them).
func (s *Syncer) lapsedBefore(e health.Executor) bool {
	for _, p := range s.history[e.InstanceID] {
		if p.SessionID == e.SessionID {
			return p.Lapsed
		}
	}
	return false
}

// past lists every remembered session; the list is rebuilt only when the
// history changed.
func (s *Syncer) past() []health.PastSession {
	if s.pastGen == s.historyGen && s.pastList != nil {
		return s.pastList
	}
	out := []health.PastSession{}
	for _, h := range s.history {
		out = append(out, h...)
	}
	s.pastList, s.pastGen = out, s.historyGen
	return out
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}
