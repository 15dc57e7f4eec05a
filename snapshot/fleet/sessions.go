package fleet

import (
	"hash/maphash"
	"maps"
	"slices"

	"github.com/leasehold/leasehold/health"
)

// Sessions answers the fencing API's questions from one View. A session's
// answer depends only on its instance (every registration of it, fenced and
// joined, and the sessions remembered of it), so the syncer keeps one small
// index per instance and, on each change, indexes again only the instances
// the change concerns; Views share the index by shard, copied on write.
type Sessions struct {
	shards *[sessionShards]map[string]*health.SessionIndex
}

const sessionShards = 64

var sessionSeed = maphash.MakeSeed()

func sessionShard(inst string) int { return int(maphash.String(sessionSeed, inst) % sessionShards) }

// Check answers for one session; ids must be valid (health.ValidateSessionQuery).
func (x Sessions) Check(instanceID, sessionID string) health.SessionStatus {
	if x.shards != nil {
		if ix, ok := x.shards[sessionShard(instanceID)][instanceID]; ok {
			return ix.Check(instanceID, sessionID)
		}
	}
	return health.SessionIndex{}.Check(instanceID, sessionID)
}

// sessionIndex is the syncer's side of Sessions.
type sessionIndex struct {
	// Pointers, not values: a shard map keeps the slots of its largest size
	// (deletions do not shrink it) until it is next copied, and an index
	// is several slices and maps wide.
	shards [sessionShards]map[string]*health.SessionIndex
	owned  [sessionShards]bool // copied since the last View took the shards
}

// update indexes inst again from its registrations and remembered sessions.
func (x *sessionIndex) update(inst string, regs []health.Executor, past []health.PastSession) {
	i := sessionShard(inst)
	if !x.owned[i] {
		x.shards[i] = maps.Clone(x.shards[i])
		if x.shards[i] == nil {
			x.shards[i] = map[string]*health.SessionIndex{}
		}
		x.owned[i] = true
	}
	if len(regs) == 0 && len(past) == 0 {
		delete(x.shards[i], inst)
		return
	}
	ix := health.IndexSessions(regs, past)
	x.shards[i][inst] = &ix
}

// view hands the current shards to a View: later updates copy them first.
func (x *sessionIndex) view() Sessions {
	shards := x.shards
	x.owned = [sessionShards]bool{}
	return Sessions{&shards}
}

// indexSessions indexes again the instances a batch concerned and those
// whose history changed.
func (s *Syncer) indexSessions(tasks []fleetKey, instances map[string]struct{}) {
	s.history.drain(func(inst string) { instances[inst] = struct{}{} })
	for inst := range instances {
		// In View order: by task type and datacenter, then as Consul listed them.
		var regs []health.Executor
		for _, task := range tasks {
			ts := s.fleet[task]
			if ts == nil {
				continue
			}
			for i := range ts.insts.of(inst) {
				regs = append(regs, *ts.execs.at(int(i)))
			}
		}
		s.sessionIx.update(inst, regs, s.pastOf(inst))
	}
}

// pastOf is an instance's remembered sessions and, for those it does not
// remember (a restart, another replica's view), its lapse marks.
func (s *Syncer) pastOf(inst string) []health.PastSession {
	past := s.history.get(inst)
	marks := s.marks.byInstance[inst]
	if len(marks) == 0 {
		return past
	}
	out := slices.Clone(past)
	for _, m := range marks {
		same := func(p health.PastSession) bool { return p.SessionID == m.SessionID }
		if i := slices.IndexFunc(out, same); i >= 0 {
			out[i].Lapsed = true
		} else {
			out = append(out, health.PastSession{InstanceID: inst, SessionID: m.SessionID,
				Generation: m.Generation, Lapsed: true, Tasks: m.Tasks})
		}
	}
	return out
}

// sessionsOf indexes a fixed set of executors (NewView).
func sessionsOf(es []health.Executor) Sessions {
	byInst := map[string][]health.Executor{}
	for _, e := range es {
		byInst[e.InstanceID] = append(byInst[e.InstanceID], e)
	}
	var x sessionIndex
	for inst, regs := range byInst {
		x.update(inst, regs, nil)
	}
	return x.view()
}
