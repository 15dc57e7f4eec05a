package fleet

import (
	"context"
	"slices"
	"time"

	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// The recomputation of one batch: the fleet state brought up to date
// (batch.go), then every group's load assignments rebuilt for the task types
// that changed. Publishing what it decided is publish.go's; tracing it,
// telemetry.go's.

// recompute brings the fleet state and every group up to the observations
// applied since the last batch, then publishes: it joins, fences and decides
// (decideChanges), records the lapses seen, rebuilds only the task types whose
// executors changed and publishes only changed load assignments. A batch that
// changes something is traced (telemetry.go).
func (s *Syncer) recompute(ctx context.Context) {
	started := time.Now()
	r := s.decideChanges(ctx)
	s.recordLapses(r.lapses)
	decided := time.Now()
	ctx, tr := s.traceChange(ctx, r, started, decided)
	s.ctl.applied = ""                                // told by this batch's trace, if any
	s.batchChange = trace.SpanContextFromContext(ctx) // invalid when not traced
	if len(r.lapses) > 0 {
		s.batchLapse = s.batchStart
	}
	s.zeroTasks(r.changed)
	tr.startBuild(ctx, len(s.groups), r.changed)
	s.rebuildGroups(r.changed)
	s.built(ctx, &tr, decided)
	s.publishBatch(ctx, r.present)
	s.batchLapse, s.batchChange = time.Time{}, trace.SpanContext{}
	tr.end()
}

// rebuildGroups rebuilds the changed task types' load assignments in every
// group; after a rules change every group's clusters are published again (the
// load-balancing policies may have changed).
func (s *Syncer) rebuildGroups(changed []string) {
	if s.fullBatches {
		// Tests: the syncer compared with the incremental one builds every
		// task type afresh, with builders, routes and static resources that
		// remember nothing of earlier batches.
		s.statics = map[string]staticMemo{}
		for _, g := range s.groups {
			g.builders, g.routes = map[string]*translator.Builder{}, map[string]shardedRoute{}
		}
	}
	for _, g := range s.groups {
		for _, task := range changed {
			s.rebuild(g, task)
		}
		if s.ctl.clusters {
			s.markDirty(g)
		}
	}
	s.ctl.clusters = false
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

// anyReachable reports whether Consul answers in some datacenter (with one,
// in it).
func (s *Syncer) anyReachable() bool {
	for _, d := range s.dcs {
		if !d.failing {
			return true
		}
	}
	return false
}

// taskExecutors are task's registrations in every datacenter, in
// datacenter order, as the chunks they are kept in (one list's chunks after
// another's), with their prints (nil, nil: the task is nowhere).
func (s *Syncer) taskExecutors(task string) ([][]health.Executor, []uint64) {
	if len(s.dcs) == 1 { // the common case: no names to sort, no copy
		for name := range s.dcs {
			if ts := s.fleet[fleetKey{name, task}]; ts != nil {
				return ts.execs.chunks, ts.prints
			}
		}
		return nil, nil
	}
	var one *taskState
	n, parts := 0, 0
	for _, name := range s.dcNames() {
		if ts := s.fleet[fleetKey{name, task}]; ts != nil {
			one, n, parts = ts, n+ts.execs.len(), parts+1
		}
	}
	switch parts {
	case 0:
		return nil, nil
	case 1:
		return one.execs.chunks, one.prints // the common case: no copy
	}
	var chunks [][]health.Executor
	prints := make([]uint64, 0, n)
	for _, name := range s.dcNames() {
		if ts := s.fleet[fleetKey{name, task}]; ts != nil {
			chunks, prints = append(chunks, ts.execs.chunks...), append(prints, ts.prints...)
		}
	}
	return chunks, prints
}

// changesCarried bounds the changes one publication links to (OpenTelemetry's
// default span limit is 128 links): a flood of them is one span, not a
// growing list.
const changesCarried = 64

// markDirty marks g changed by the current batch and remembers the batch's
// consul_change span, so that a publication coalesced later links to every
// change it carries (publish).
func (s *Syncer) markDirty(g *group) {
	g.dirty = true
	c := s.batchChange
	if !c.IsValid() || len(g.changes) >= changesCarried ||
		(len(g.changes) > 0 && g.changes[len(g.changes)-1].Equal(c)) {
		return
	}
	g.changes = append(g.changes, c)
}

// rebuild recomputes one task's load assignments (one per shard) for a group
// and marks the group dirty (urgent when an endpoint was removed or started
// draining).
func (s *Syncer) rebuild(g *group, task string) {
	old := g.loads[task]
	execs, prints := s.taskExecutors(task)
	if execs == nil {
		delete(g.builders, task)
		if old != nil {
			delete(g.loads, task)
			delete(g.routes, task)
			s.markDirty(g)
			g.urgent = true
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
	b.Shards = s.shardCount(g.d, s.taskInstances(task))
	r := b.BuildParts(task, execs, prints, g.d, s.observed(task, g.d)...)
	s.explainBuild(g, task, execs, r.Observed)
	if old != nil && sameShards(old, r.Shards) {
		return // same content
	}
	g.loads[task] = r.Shards
	s.markDirty(g)
	removes := r.RemovesOrDrains
	if r.Restarted { // e.g. a rule went from observe to enforce: compare whole
		removes = translator.RemovesOrDrainsAcross(loadsOf(old), loadsOf(r.Shards))
	}
	if old != nil && removes {
		g.urgent = true
		g.removedTasks = append(g.removedTasks, task)
		g.removedLoads = append(g.removedLoads, changedLoads(old, r.Shards)...)
		if !s.batchLapse.IsZero() && (g.lapsedAt.IsZero() || s.batchLapse.Before(g.lapsedAt)) {
			g.lapsedAt = s.batchLapse
		}
	}
}

// shardCount is how many shards a task of n instances has for dispatchers
// of constraint set d: the same for every set, except one that cannot take
// weighted clusters.
func (s *Syncer) shardCount(d health.Dispatcher, n int) int {
	if d.SingleCluster {
		return 1
	}
	return translator.ShardCount(n, s.cfg.ShardSize)
}

// taskInstances is how many instances task's registrations name, per
// datacenter summed: what its shard count follows. Not its registrations:
// an instance whose new session starts on another node (a surge deployment
// moving it) holds two until its old registration goes, and a task of
// exactly a multiple of the shard size would then be re-sharded, every
// shard resent, at each step of such a rollout.
func (s *Syncer) taskInstances(task string) int {
	n := 0
	for name := range s.dcs {
		if ts := s.fleet[fleetKey{name, task}]; ts != nil {
			n += ts.instances()
		}
	}
	return n
}

// changedLoads are the names of the shards of next that old did not have
// with the same content.
func changedLoads(old, next []translator.Shard) []string {
	was := make(map[string]string, len(old))
	for _, sh := range old {
		was[sh.Name] = sh.Version
	}
	var out []string
	for _, sh := range next {
		if v, ok := was[sh.Name]; !ok || v != sh.Version {
			out = append(out, sh.Name)
		}
	}
	return out
}

// sameShards reports whether two builds' shards have the same names and
// contents.
func sameShards(a, b []translator.Shard) bool {
	return slices.EqualFunc(a, b, func(x, y translator.Shard) bool {
		return x.Name == y.Name && x.Version == y.Version
	})
}

func loadsOf(shards []translator.Shard) []*endpointv3.ClusterLoadAssignment {
	out := make([]*endpointv3.ClusterLoadAssignment, len(shards))
	for i, sh := range shards {
		out[i] = sh.CLA
	}
	return out
}
