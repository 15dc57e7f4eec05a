package fleet

import (
	"context"
	"slices"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/translator"
	"github.com/leasehold/leasehold/snapshot/xdscache"
)

// Publishing: what Run decided is made visible to the xDS cache (one snapshot
// per group), to the listeners of publications, and to the other goroutines
// (the View, readiness, Progress).

// Publication describes one snapshot set in the cache, for the xDS server's
// push tracing and lapse-to-push latency.
type Publication struct {
	Group    string
	Snapshot *cache.Snapshot
	Ctx      context.Context // carries the span of the cache update, if traced
	// LapsedAt is when Consul reported the earliest lapse this publication
	// removes (zero: none).
	LapsedAt     time.Time
	RemovedTasks []string // task types whose endpoints lost or drained one
	// RemovedLoads are the load assignments of those task types that changed:
	// the task's, or the shards' of a sharded one (a stream waits for the
	// removal only if it follows one of them).
	RemovedLoads []string
}

// Notify registers f to be called (from Run; it must not block) for every
// publication, just before the snapshot is set, so it hears of it before any
// response the snapshot causes. Call before Run.
func (s *Syncer) Notify(f func(Publication)) { s.listeners = append(s.listeners, f) }

// publishBatch publishes what a batch decided: once the whole fleet has been
// read, every group's first snapshot; then readiness, the urgent groups (the
// others are scheduled: publishDirty) and, after the removals are in the
// cache, the view.
func (s *Syncer) publishBatch(ctx context.Context, present int) {
	if !s.synced && s.allRead() {
		s.synced = true
		s.log.Info("fleet read: serving", "tasks", len(taskNames(s.members)), "executors", present,
			"datacenters", len(s.dcs))
		for key, g := range s.groups { // waiting dispatchers get their first snapshot
			s.publish(ctx, key, g)
		}
	}
	s.storeReadiness()
	s.publishDirty(ctx, true)
	s.publishView() // after the removals are in the cache
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

// publish builds the group's snapshot (listener, route and cluster per task,
// its load assignments) with content-hash versions per type.
func (s *Syncer) publish(ctx context.Context, key string, g *group) {
	tasks := taskNames(s.members)
	res := map[types.ResponseType][]types.Resource{}
	// The load assignments the translator marshalled, by name.
	wires := map[string][]byte{}
	versions := map[string]map[string]string{ // type URL → name → content version
		resource.ListenerType: {}, resource.RouteType: {},
		resource.ClusterType: {}, resource.EndpointType: {},
	}
	for _, task := range tasks {
		if !g.d.AllowsTask(task) {
			continue // not granted: as if it did not exist (same versions too)
		}
		lb := s.ctl.rollout.LBPolicyOf(task, s.cfg.LBPolicy)
		pol := s.ctl.rollout.DispatchOf(task)
		polKey := pol.Key()
		l, lv := s.staticResource(resource.ListenerType, task,
			func() proto.Message { return translator.Listener(task) })
		res[types.Listener] = append(res[types.Listener], l)
		versions[resource.ListenerType][task] = lv
		shards := g.loads[task]
		r, rv := s.routeOf(g, task, shards, pol, polKey)
		res[types.Route] = append(res[types.Route], r)
		versions[resource.RouteType][task] = rv
		if len(shards) == 0 { // not read yet: the task's cluster, no endpoints
			shards = []translator.Shard{{Name: task}}
		}
		for _, sh := range shards {
			c, cv := s.staticResource(resource.ClusterType,
				sh.Name+"\x00"+string(lb)+"\x00"+polKey,
				func() proto.Message { return translator.Cluster(sh.Name, lb, pol) })
			res[types.Cluster] = append(res[types.Cluster], c)
			versions[resource.ClusterType][sh.Name] = cv
			if sh.CLA != nil {
				res[types.Endpoint] = append(res[types.Endpoint], sh.CLA)
				versions[resource.EndpointType][sh.Name] = sh.Version
				if sh.Wire != nil {
					wires[sh.Name] = sh.Wire
				}
			}
		}
	}
	// The delta cache takes our per-resource content versions instead of
	// marshalling and hashing every resource of the group on every change
	// while a delta client is connected (ConstructVersionMap keeps a map
	// that is already set).
	snap := &cache.Snapshot{VersionMap: versions}
	all := []types.ResponseType{types.Cluster, types.Endpoint, types.Listener, types.Route}
	for _, typ := range all {
		url, _ := cache.GetResponseTypeURL(typ)
		snap.Resources[typ] = cache.NewResources(xdscache.TypeVersion(versions[url]), res[typ])
	}
	// go-control-plane's own Snapshot.Consistent does not follow API
	// listeners to their routes; ours does.
	if err := consistentSet(res); err != nil {
		s.log.Error("inconsistent snapshot not published", "group", key, "err", err)
		return
	}
	// Linked to every change it carries but its parent: a publication
	// coalesced later (an addition) is a trace of its own, and
	// "why did my new executor take 6 s to be routed" is followed from the
	// change to it through the link.
	parent := trace.SpanContextFromContext(ctx)
	var links []trace.Link
	for _, c := range g.changes {
		if !c.Equal(parent) {
			links = append(links, trace.Link{SpanContext: c})
		}
	}
	ctx, span := s.tracer.Start(ctx, "leasehold.cache_update", trace.WithLinks(links...),
		trace.WithAttributes(
			attribute.String("leasehold.constraint_set", key),
			attribute.String("xds.version.endpoints", snap.Resources[types.Endpoint].Version),
			attribute.Int("xds.resources", len(res[types.Endpoint])+len(res[types.Listener])+
				len(res[types.Route])+len(res[types.Cluster])),
		))
	// Listeners hear of the publication before any response it causes.
	pub := Publication{Group: key, Snapshot: snap, Ctx: ctx, LapsedAt: g.lapsedAt,
		RemovedTasks: g.removedTasks, RemovedLoads: g.removedLoads}
	for _, f := range s.listeners {
		f(pub)
	}
	err := s.cache.SetWired(ctx, key, snap, versions, wires)
	span.End()
	if err != nil {
		s.log.Error("set snapshot", "group", key, "err", err)
		return
	}
	g.dirty, g.urgent, g.lapsedAt, g.removedTasks = false, false, time.Time{}, nil
	g.removedLoads = nil
	g.changes = g.changes[:0]
	if s.cfg.OnPublish != nil {
		s.cfg.OnPublish(key, snap)
	}
}

// shardedRoute is a sharded task's route for one group, kept while its
// shards' weights and its dispatch policy stay the same.
type shardedRoute struct {
	weights []uint32
	policy  string // health.TaskDispatch.Key
	route   *routev3.RouteConfiguration
	version string
}

// routeOf is task's route for group g under dispatch policy pol (whose Key
// is polKey) and its content version: the static route to the task's
// cluster, or, when the task is sharded, the route weighing its shards
// (rebuilt only when a weight or the policy changed).
func (s *Syncer) routeOf(g *group, task string, shards []translator.Shard,
	pol health.TaskDispatch, polKey string) (*routev3.RouteConfiguration, string) {
	if len(shards) <= 1 {
		delete(g.routes, task)
		r, v := s.staticResource(resource.RouteType, task+"\x00"+polKey,
			func() proto.Message { return translator.Route(task, pol) })
		return r.(*routev3.RouteConfiguration), v
	}
	weights := translator.ShardWeights(shards)
	if sr, ok := g.routes[task]; ok && slices.Equal(sr.weights, weights) && sr.policy == polKey {
		return sr.route, sr.version
	}
	r := translator.ShardedRoute(task, weights, pol)
	sr := shardedRoute{weights: weights, policy: polKey, route: r, version: translator.Version(r)}
	g.routes[task] = sr
	return sr.route, sr.version
}

// staticKept bounds the memo of static resources: every dispatch policy a
// rules change brings adds keys, so past this many the memo starts afresh
// (a resource is a pure function of its key, so nothing else changes).
const staticKept = 1 << 16

// staticResource is a listener, route or cluster and its translator.Version,
// made once per key (which names everything its content depends on: a
// cluster's load-balancing and dispatch policies, a route's dispatch policy
// too) and shared by every publication after: a publication of a sharded
// task made every shard's cluster afresh, at each lapse. Published
// resources are never written.
func (s *Syncer) staticResource(typeURL, key string,
	make func() proto.Message) (proto.Message, string) {
	k := typeURL + "/" + key
	if r, ok := s.statics[k]; ok {
		return r.message, r.version
	}
	m := make()
	r := staticMemo{message: m, version: translator.Version(m)}
	if s.statics == nil || len(s.statics) >= staticKept {
		s.statics = map[string]staticMemo{}
	}
	s.statics[k] = r
	return r.message, r.version
}

// staticMemo is one static resource made, and its version.
type staticMemo struct {
	message proto.Message
	version string
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

// publishProgress makes the indexes at which each datacenter's non-passing
// checks, generation keys and lapse marks are known current visible to
// Progress; called after the batch's view is published, so a reader that
// sees an index then loads a view that includes everything up to it.
func (s *Syncer) publishProgress() {
	p := make(map[string]Progress, len(s.dcs))
	for name, d := range s.dcs {
		p[name] = Progress{
			NonPassing:  max(d.progressNP, d.np.Index()),
			Generations: max(d.progressGen, d.genIndex),
			Lapses:      max(d.progressLapses, d.marksIndex),
			ReadsLapses: s.cfg.AwaitLapses,
		}
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
