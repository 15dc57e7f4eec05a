package fleet

import (
	"iter"
	"maps"
	"sort"
	"sync"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// View is one decided state of the fleet: the executors (joined, fenced)
// that the current xDS resources come from, the constraint sets in use and
// the session index. A new View is published after every change, once the
// removals it implies are in the cache, so a session that a View calls STALE
// or LAPSED is in no snapshot.
type View struct {
	// ConsulIndex, Refreshed, NonPassingIndex and GenerationsIndex are
	// leasehold's own datacenter's (Local); Datacenter has any datacenter's.
	ConsulIndex uint64
	Groups      []health.Dispatcher // constraint sets with streams, plus the unconstrained set
	Synced      bool
	Control     *ControlState // rule modes and cordons in force
	// Refreshed is the latest refresh request (Watcher.Refresh) whose fresh
	// reads of Consul this view includes.
	Refreshed uint64
	// NonPassingIndex and GenerationsIndex are the Consul indexes of the two
	// answers that can make a session LAPSED or STALE: the view has seen every
	// such change up to the lower of them. (ConsulIndex is the highest index
	// of any answer, which one watch alone can push ahead of the others.)
	NonPassingIndex, GenerationsIndex uint64
	Local                             string // leasehold's own datacenter ("" with one, unnamed)
	dcs                               map[string]DCIndexes
	// The lapses this replica saw whose marks it has not read back
	// (LapseUnrecorded); shared with the syncer: never written.
	unrecorded map[health.SessionKey]struct{}

	byTask   []execList     // shared with the syncer's fleet state: never written
	shards   map[string]int // per task type: its shards for sets taking weighted clusters
	flatOnce sync.Once
	flat     []health.Executor
	// The gauges' values (telemetry.go), computed on first use.
	gaugesOnce  sync.Once
	gaugeValues *fleetGauges
	sessions    Sessions
	changed     chan struct{}
}

// NewView is a view of a fixed set of executors, decided by nothing (for
// tools that explain a given fleet).
func NewView(executors []health.Executor) *View {
	v := emptyView()
	v.byTask = []execList{execListOf(executors)}
	v.sessions = sessionsOf(executors)
	return v
}

// Executors are the view's registrations (joined, fenced), by task type,
// then as Consul listed them (node, service id). Built on first use: the
// syncer keeps them per task type, and most views are replaced before anyone
// asks. The slice is shared: do not modify it.
func (v *View) Executors() []health.Executor {
	v.flatOnce.Do(func() {
		if len(v.byTask) == 1 && len(v.byTask[0].chunks) == 1 {
			v.flat = v.byTask[0].chunks[0]
			return
		}
		n := 0
		for _, l := range v.byTask {
			n += l.len()
		}
		v.flat = make([]health.Executor, 0, n)
		for _, l := range v.byTask {
			v.flat = l.appendTo(v.flat)
		}
	})
	return v.flat
}

// All yields the view's registrations in the order of Executors, without
// building the flat list: at 10,000 executors that list is 4.4 MB, held as
// long as the view, and a view lasts only until the next change. Readers that
// walk the fleet once per view (load reporting's label sets) use this.
func (v *View) All() iter.Seq[*health.Executor] {
	return func(yield func(*health.Executor) bool) {
		for _, l := range v.byTask {
			for e := range l.all() {
				if !yield(e) {
					return
				}
			}
		}
	}
}

// Datacenter is what the view has reached in datacenter dc, and whether
// the datacenter answers; false for a datacenter not watched.
func (v *View) Datacenter(dc string) (DCIndexes, bool) {
	i, ok := v.dcs[dc]
	if !ok && dc == v.Local && v.dcs == nil { // a view not made by a syncer
		return DCIndexes{ConsulIndex: v.ConsulIndex, NonPassingIndex: v.NonPassingIndex,
			GenerationsIndex: v.GenerationsIndex, Refreshed: v.Refreshed}, true
	}
	return i, ok
}

// Datacenters are the watched datacenters, sorted.
func (v *View) Datacenters() []string {
	out := make([]string, 0, len(v.dcs))
	for dc := range v.dcs {
		out = append(out, dc)
	}
	sort.Strings(out)
	return out
}

// LapseUnrecorded reports whether this replica saw the session lapse and
// has not read back the lapse mark recording it yet (SyncConfig.OnLapse,
// with AwaitLapses): until then the view's indexes may be below the mark's
// — the index at which the lapse became final for every replica, which a
// LAPSED answer carries.
func (v *View) LapseUnrecorded(instanceID, sessionID string) bool {
	_, ok := v.unrecorded[health.SessionKey{Instance: instanceID, Session: sessionID}]
	return ok
}

// Sessions answers the fencing API for this view.
func (v *View) Sessions() Sessions { return v.sessions }

// Changed is closed when a newer View replaces this one.
func (v *View) Changed() <-chan struct{} { return v.changed }

// RulesVersion is the content version of the rules in force: the defaults'
// before the controls have been read.
func (v *View) RulesVersion() string {
	if v.Control == nil || v.Control.RulesVersion == "" {
		return defaultRulesVersion
	}
	return v.Control.RulesVersion
}

// defaultRulesVersion is the content version of no rules.
var defaultRulesVersion = (*health.Rollout)(nil).ContentVersion()

// View is the latest decided state (never nil).
func (s *Syncer) View() *View { return s.view.Load() }

func emptyView() *View {
	return &View{Groups: []health.Dispatcher{{}}, Control: &ControlState{},
		changed: make(chan struct{})}
}

// publishView replaces the view; called by Run only.
func (s *Syncer) publishView() {
	local := s.localDC()
	index := s.consulIndex(local)
	tasks := sortedKeys(s.members)
	byTask := make([]execList, 0, len(tasks))
	for _, task := range tasks {
		if ts := s.fleet[task]; ts != nil {
			byTask = append(byTask, ts.execs)
		}
	}
	groups := []health.Dispatcher{{}}
	keys := make([]string, 0, len(s.groups))
	for k := range s.groups {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if k != groups[0].Key() {
			groups = append(groups, s.groups[k].d)
		}
	}
	dcs := make(map[string]DCIndexes, len(s.dcs))
	for name, d := range s.dcs {
		dcs[name] = DCIndexes{
			ConsulIndex:      s.consulIndex(name),
			NonPassingIndex:  d.np.Index(),
			GenerationsIndex: d.genIndex,
			LapsesIndex:      d.marksIndex,
			Refreshed:        d.refreshed,
			Reach:            d.reach,
			ReachDetail:      d.reachDetail,
			ShortestLease:    s.shortestLease(name),
		}
	}
	if s.marks.awaitedView == nil && len(s.marks.awaited) > 0 {
		s.marks.awaitedView = maps.Clone(s.marks.awaited)
	}
	l := dcs[local]
	v := &View{
		ConsulIndex:      index,
		Groups:           groups,
		Synced:           s.synced,
		Control:          s.controlState(),
		Refreshed:        l.Refreshed,
		NonPassingIndex:  l.NonPassingIndex,
		GenerationsIndex: l.GenerationsIndex,
		Local:            local,
		dcs:              dcs,
		unrecorded:       s.marks.awaitedView,
		byTask:           byTask,
		sessions:         s.sessionIx.view(),
		shards:           s.shardCounts(),
		changed:          make(chan struct{}),
	}
	old := s.view.Swap(v)
	close(old.changed)
}

// shardCounts is each sharded task type's shard count (sharded ones only).
func (s *Syncer) shardCounts() map[string]int {
	var out map[string]int
	insts := map[string]int{} // per task type: its instances, per datacenter summed
	for k, ts := range s.fleet {
		insts[k.task] += ts.instances()
	}
	for task, count := range insts {
		if n := translator.ShardCount(count, s.cfg.ShardSize); n > 1 {
			if out == nil {
				out = map[string]int{}
			}
			out[task] = n
		}
	}
	return out
}

// ClusterOf is the cluster (and load assignment) e is sent in to dispatchers
// of constraint set d: its task type's, or the shard's when the task is
// sharded (translator.ShardName).
func (v *View) ClusterOf(e health.Executor, d health.Dispatcher) string {
	n := v.shards[e.Task]
	if d.SingleCluster {
		n = 1
	}
	return translator.ShardName(e.Task, translator.ShardOf(e.InstanceID, n), n)
}

// Decide is the verdict on e alone for constraint set d under the rule
// modes in force; DecideAll adds what depends on the other executors.
func (v *View) Decide(e health.Executor, d health.Dispatcher) health.Verdict {
	var observe []health.Reason
	if v.Control != nil && v.Control.Rollout != nil {
		observe = v.Control.Rollout.Observed(e.Task, d)
	}
	return health.EligibleObserving(e, d, observe)
}

// DecideAll is the verdict on every executor of the view (aligned with
// Executors) for constraint set d: what the xDS resources of this view were
// built with, duplicate-address exclusions included.
func (v *View) DecideAll(d health.Dispatcher) []health.Verdict {
	return v.decideEach(v.Executors(), d)
}

// decideEach is DecideAll over es, executors of this view.
func (v *View) decideEach(es []health.Executor, d health.Dispatcher) []health.Verdict {
	vs := make([]health.Verdict, len(es))
	for i, e := range es {
		vs[i] = v.Decide(e, d)
	}
	health.ExcludeDuplicates(es, vs)
	return vs
}
