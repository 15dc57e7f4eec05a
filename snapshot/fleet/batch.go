package fleet

import (
	"context"
	"slices"
	"sort"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// The fleet as last joined, fenced and fingerprinted, per task type, with
// the indexes that let a change touch only the registrations it concerns: a
// lapse re-joins the registrations holding that check, re-fences their
// instance and re-prints them, whatever the size of the fleet. A task's
// membership read replaces the task's state as a whole (the read is as large).

// checkRef is a check as the non-passing set keys it.
type checkRef struct{ node, id string }

// taskState is one task type's registrations as Consul listed them, decided.
type taskState struct {
	tm *health.TaskMembers
	// execs are the members decided, aligned with tm.Members. Views share
	// them: a batch writes through mut, which copies a chunk before its
	// first write.
	execs  execList
	prints []uint64 // executorPrint of execs
	print  taskPrint
	// The members by the checks of their read (service and node checks), by
	// instance id, by node, and by checkRef{node, service id}.
	checks   places[checkRef]
	insts    places[string]
	nodes    map[string][]int32 // a few nodes, each with many members
	services places[checkRef]
	// Members whose read saw a check non-passing: their join follows the
	// non-passing set's index even when the set has no entry for it.
	nonPassing []int32
	// shortestLease is the shortest lease_ttl its registrations declare
	// (0: none does).
	shortestLease time.Duration
	// bad are the bad registrations (service id@node) and their errors,
	// logged once; was are a fresh read's predecessor's prints by
	// registration (for the change span).
	bad map[string]string
	was map[string]uint64

	// Per batch.
	ownChunks []bool // the chunks of execs this batch copied (nil: none, nor the list)
	all       bool   // every member is to be decided again
	fresh     bool   // replaced by a membership read in this batch
	dirty     map[int32]struct{}
	touched   bool
}

func newTaskState(tm *health.TaskMembers) *taskState {
	n := len(tm.Members)
	ts := &taskState{
		tm:     tm,
		execs:  newExecList(n),
		prints: make([]uint64, n),
		// A member's own lease check and its node's checks, which its
		// node's other members share: about one entry per member.
		checks:   newPlaces[checkRef](n),
		insts:    newPlaces[string](n),
		nodes:    map[string][]int32{},
		services: newPlaces[checkRef](n),
		bad:      map[string]string{},
		all:      true, fresh: true, touched: true,
	}
	ts.ownChunks = make([]bool, len(ts.execs.chunks)) // a new list: every chunk its own
	for c := range ts.ownChunks {
		ts.ownChunks[c] = true
	}
	for i := range tm.Members {
		m := &tm.Members[i]
		np := false
		for _, c := range m.Checks {
			k := checkRef{c.Node, c.CheckID}
			ts.checks.add(k, int32(i))
			np = np || c.Status != health.StatusPassing
		}
		if np {
			ts.nonPassing = append(ts.nonPassing, int32(i))
		}
		if l := m.LeaseTTL; l > 0 && m.Err == nil &&
			(ts.shortestLease == 0 || l < ts.shortestLease) {
			ts.shortestLease = l
		}
		ts.insts.add(m.InstanceID, int32(i))
		ts.nodes[m.Node] = append(ts.nodes[m.Node], int32(i))
		k := checkRef{m.Node, m.ServiceID}
		ts.services.add(k, int32(i))
		*ts.execs.at(i) = m.Executor()
	}
	return ts
}

// instances is how many instances the task state's registrations name
// (bad registrations' ids too): what its shards are counted from.
func (ts *taskState) instances() int { return len(ts.insts.first) }

func (ts *taskState) mark(i int32) {
	ts.touched = true
	if ts.all {
		return
	}
	if ts.dirty == nil {
		ts.dirty = map[int32]struct{}{}
	}
	ts.dirty[i] = struct{}{}
}

func (ts *taskState) markAll() { ts.touched, ts.all, ts.dirty = true, true, nil }

// each calls f with every member marked in this batch, in order.
func (ts *taskState) each(f func(i int32)) {
	if ts.all {
		for i := range ts.execs.len() {
			f(int32(i))
		}
		return
	}
	idx := make([]int32, 0, len(ts.dirty))
	for i := range ts.dirty {
		idx = append(idx, i)
	}
	slices.Sort(idx)
	for _, i := range idx {
		f(i)
	}
}

func (ts *taskState) endBatch() {
	ts.ownChunks, ts.all, ts.fresh, ts.dirty, ts.touched, ts.was = nil, false, false, nil, false, nil
}

// regKey names a registration across reads.
func regKey(e *health.Executor) string { return e.Node + "/" + e.ServiceID }

// batchResult is what one batch of observations changed.
type batchResult struct {
	changed []string          // task types whose executors changed (or appeared, or went)
	lapses  []health.Executor // sessions that lapsed in this batch
	diff    execDiff          // registrations added, changed, removed
	present int               // registrations
}

// decideChanges brings the fleet state up to the observations applied since
// the last batch, touching only what they concern (everything when the rule
// modes or cordons changed).
func (s *Syncer) decideChanges(ctx context.Context) batchResult {
	var r batchResult
	instances := map[string]struct{}{} // to fence again (and mark lapses seen elsewhere)
	tasks := sortedKeys(s.members)
	s.replaceMemberships(tasks, instances, &r)
	// Each datacenter's non-passing set: only the registrations of that
	// datacenter holding a check that changed, and those whose read saw a
	// check non-passing when the index moved.
	for name, d := range s.dcs {
		s.markNonPassing(name, d)
	}
	s.markKeyChanges(instances)
	s.markLapseMarks(instances)
	if s.ctl.dirty || s.fullBatches {
		for _, ts := range s.fleet {
			ts.markAll()
		}
	}

	// Join what is marked; note lapses.
	for _, task := range tasks {
		ts := s.fleet[task]
		if ts == nil || !ts.touched {
			continue
		}
		s.joinMarked(ctx, task.dc, ts, instances, &r)
	}
	s.fenceInstances(ctx, instances, &r)
	s.applyControl()
	s.rememberChanges(tasks, &r)
	s.ctl.dirty = false
	s.pruneHistory(s.cfg.Clock.Now(), len(s.instances))
	s.indexSessions(tasks, instances)
	sort.Strings(r.changed)
	r.changed = slices.Compact(r.changed)
	return r
}

// replaceMemberships gives each task whose membership was read anew a new
// state, and drops the tasks gone; the instances whose sessions came or
// went are to be fenced again.
func (s *Syncer) replaceMemberships(tasks []fleetKey, instances map[string]struct{},
	r *batchResult) {
	var replaced []*taskState // old states
	for _, task := range tasks {
		tm := s.members[task]
		old := s.fleet[task]
		if old != nil && old.tm == tm {
			continue
		}
		ts := newTaskState(tm)
		if old != nil {
			ts.bad = old.bad // to log only new errors; rebuilt in the join pass
			ts.was = make(map[string]uint64, old.execs.len())
			for i := range old.execs.len() {
				ts.was[regKey(old.execs.at(i))] = old.prints[i]
			}
			replaced = append(replaced, old)
		}
		s.fleet[task] = ts
		s.countPresence(ts, 1, instances)
	}
	for task, old := range s.fleet {
		if _, ok := s.members[task]; !ok {
			delete(s.fleet, task)
			replaced = append(replaced, old)
			r.changed = append(r.changed, task.task)
			r.diff.removed += old.execs.len()
		}
	}
	// After counting the new reads: a session still listed stays present.
	for _, old := range replaced {
		s.countPresence(old, -1, instances)
	}
}

// rememberChanges remembers the sessions and fingerprints what changed.
func (s *Syncer) rememberChanges(tasks []fleetKey, r *batchResult) {
	for _, task := range tasks {
		ts := s.fleet[task]
		if ts == nil {
			continue
		}
		r.present += ts.execs.len()
		if !ts.touched {
			continue
		}
		s.printChanges(task, ts, r)
	}
	for task := range s.printOf {
		if _, ok := s.fleet[task]; !ok {
			delete(s.printOf, task)
		}
	}
}

// markNonPassing marks the registrations of datacenter name that its
// non-passing set changed since they were joined.
func (s *Syncer) markNonPassing(name string, d *dcState) {
	if d.np == d.npJoined {
		return
	}
	fleet := make([]*taskState, 0, len(s.fleet))
	for k, ts := range s.fleet {
		if k.dc == name {
			fleet = append(fleet, ts)
		}
	}
	{
		moved := d.np.EachChange(d.npJoined, func(c health.CheckState) {
			for _, ts := range fleet {
				for i := range ts.checks.of(checkRef{c.Node, c.CheckID}) {
					ts.mark(i)
				}
				// a check the members' reads lack counts too (health.Join)
				if c.ServiceID == "" {
					for _, i := range ts.nodes[c.Node] {
						ts.mark(i)
					}
				} else {
					for i := range ts.services.of(checkRef{c.Node, c.ServiceID}) {
						ts.mark(i)
					}
				}
			}
		})
		if moved {
			for _, ts := range fleet {
				for _, i := range ts.nonPassing {
					ts.mark(i)
				}
			}
		}
		d.npJoined = d.np
	}
}

// joinMarked joins the marked registrations of one datacenter's task state
// with that datacenter's non-passing set and reach, and notes lapses.
func (s *Syncer) joinMarked(ctx context.Context, dc string, ts *taskState,
	instances map[string]struct{}, r *batchResult) {
	d := s.dc(dc)
	{
		bad := map[string]string(nil)
		if ts.fresh {
			bad = map[string]string{}
		}
		ts.each(func(i int32) {
			e := health.Join(ts.tm.Members[i], d.np)
			e.Datacenter = dc
			e.Reach, e.ReachDetail = d.reach, ""
			if d.reach != health.Reached {
				e.ReachDetail = dc + ": " + d.reachDetail
			}
			*ts.mut(i) = e
			instances[e.InstanceID] = struct{}{}
			if e.Err != nil {
				if bad != nil {
					key := e.ServiceID + "@" + e.Node
					bad[key] = e.Err.Error()
					if ts.bad[key] != e.Err.Error() {
						s.badMeta.Add(ctx, 1)
						s.log.Warn("bad registration metadata: excluded", "service_id", e.ServiceID,
							"node", e.Node, "err", e.Err)
					}
				}
				return
			}
		})
		if bad != nil {
			ts.bad = bad
		}
	}
}

// fenceInstances fences every instance concerned, across task types and
// datacenters, then notes its lapses: a lapse seen in one task type is seen
// in the others of the session at once. Fencing comes first so that a
// registration its instance's generation key does not confirm (a copy of a
// session, or a forged one) never makes a session lapsed.
func (s *Syncer) fenceInstances(ctx context.Context, instances map[string]struct{},
	r *batchResult) {
	var group []*health.Executor
	for inst := range instances {
		group = group[:0]
		for _, ts := range s.fleet {
			if _, ok := ts.insts.first[inst]; !ok {
				continue
			}
			for i := range ts.insts.of(inst) {
				ts.mark(i)
				group = append(group, ts.mut(i))
			}
		}
		health.FenceInstance(group, s.keys[inst])
		for _, e := range group {
			if e.Err == nil && e.Unconfirmed == "" {
				s.noteLapse(ctx, e, r)
			}
		}
		for _, e := range group {
			if e.Err == nil {
				e.LapseSeen = e.Unconfirmed == "" &&
					s.lapsed[health.SessionKey{Instance: e.InstanceID, Session: e.SessionID}]
			}
		}
	}
}

// noteLapse notes a confirmed registration's session as lapsed when its
// lease or node says so, or when it was seen lapsed before (by this replica
// before a restart, or by another one: a lapse mark).
func (s *Syncer) noteLapse(ctx context.Context, e *health.Executor, r *batchResult) {
	// Session ids are only unique per instance by contract.
	sk := health.SessionKey{Instance: e.InstanceID, Session: e.SessionID}
	if marked := s.marks.marked(sk); !s.lapsed[sk] && (marked || s.lapsedBefore(*e)) {
		// It reappeared, or another replica (or this one before a restart)
		// saw it lapse: once lapsed, always lapsed.
		s.lapsed[sk] = true
	}
	// A re-created lease check ends the session as a lapse does (and is
	// recorded as one: replicas started later learn it from the lapse
	// marks, as they cannot from Consul).
	recreated := !s.lapsed[sk] && s.leaseCheckRecreated(e)
	ended := e.LeaseStatus == health.StatusCritical || e.NodeFailed || recreated
	if ended && !s.lapsed[sk] {
		s.lapsed[sk] = true
		r.lapses = append(r.lapses, *e)
		s.lapseCount.Add(ctx, 1, metric.WithAttributes(attribute.String("task", e.Task)))
		s.log.Info("lease lapsed", "instance_id", e.InstanceID, "session_id", e.SessionID,
			"task", e.Task, "node_failed", e.NodeFailed, "lease_check_recreated", recreated)
	}
}

// printChanges remembers the sessions of a task state's marked registrations
// and fingerprints them, counting what changed.
func (s *Syncer) printChanges(task fleetKey, ts *taskState, r *batchResult) {
	{
		before, stayed := ts.print, 0
		if ts.fresh {
			before = s.printOf[task]
		}
		ts.each(func(i int32) {
			e := ts.execs.at(int(i))
			s.remember(e)
			x := translator.ExecutorPrint(e)
			if ts.fresh {
				ts.print.add(x)
				if was, ok := ts.was[regKey(e)]; !ok {
					r.diff.added++
				} else {
					stayed++
					if was != x {
						r.diff.changed++
					}
				}
			} else if x != ts.prints[i] {
				ts.print.sub(ts.prints[i])
				ts.print.add(x)
				r.diff.changed++
			}
			ts.prints[i] = x
		})
		r.diff.removed += max(0, len(ts.was)-stayed)
		if _, known := s.printOf[task]; !known || ts.print != before || s.ctl.dirty {
			r.changed = append(r.changed, task.task)
		}
		s.printOf[task] = ts.print
		ts.endBatch()
	}
}

// countPresence adds (sign 1) or removes (-1) a task state's valid
// registrations from the sessions and instances present; a session no longer
// present is no longer held in lapsed (the history remembers it), an
// instance no longer present starts its history retention.
func (s *Syncer) countPresence(ts *taskState, sign int, instances map[string]struct{}) {
	now := s.cfg.Clock.Now()
	for i := range ts.tm.Members {
		e := &ts.tm.Members[i].Observed
		instances[e.InstanceID] = struct{}{}
		if e.Err != nil {
			continue
		}
		sk := health.SessionKey{Instance: e.InstanceID, Session: e.SessionID}
		if s.sessions[sk] += sign; s.sessions[sk] <= 0 {
			delete(s.sessions, sk)
			delete(s.lapsed, sk)
		}
		if s.instances[e.InstanceID] += sign; s.instances[e.InstanceID] <= 0 {
			delete(s.instances, e.InstanceID)
			s.lastSeen[e.InstanceID] = now
		} else {
			delete(s.lastSeen, e.InstanceID)
		}
	}
}
