package health

import (
	"fmt"
	"sort"
)

// SessionState is what a dispatcher may do with results of a session.
type SessionState string

const (
	SessionCurrent  SessionState = "CURRENT"  // confirm results
	SessionStale    SessionState = "STALE"    // a newer session of the instance exists
	SessionLapsed   SessionState = "LAPSED"   // its lease was seen lapsed (or its node failed)
	SessionDraining SessionState = "DRAINING" // in-flight work may finish, no new work
	SessionUnknown  SessionState = "UNKNOWN"  // never seen, or deregistered
)

// SessionStatus is the answer for one session.
type SessionStatus struct {
	InstanceID      string
	SessionID       string
	State           SessionState
	Detail          string
	NewerSessionID  string
	NewerGeneration uint64
	Generation      uint64
	Tasks           []string
	Version         string
	Datacenter      string // where its registrations are ("" unknown, or one datacenter unnamed)
}

// SessionIndex answers session questions from one decided view of the fleet
// (the same executors, fenced and joined, that the xDS resources come from).
type SessionIndex struct {
	sessions map[[2]string]SessionStatus
	newest   map[string]SessionStatus // per instance: its newest present session
	past     map[[2]string]PastSession
}

// PastSession is a session seen before whose registrations are gone (it was
// replaced on its agent, drained, or cleaned up by Consul).
type PastSession struct {
	InstanceID string
	SessionID  string
	Generation uint64
	Lapsed     bool
	Tasks      []string
	Version    string
}

// ValidateSessionQuery checks the ids of a session question.
func ValidateSessionQuery(instanceID, sessionID string) error {
	var errs FieldErrors
	errs = append(errs, validateID(MetaInstanceID, instanceID)...)
	errs = append(errs, validateID(MetaSessionID, sessionID)...)
	return errs.err()
}

// IndexSessions builds the index from executors that went through Join and
// Fence (with LapseObserved set). A session's state is the worst over its
// registrations: STALE, then LAPSED, then DRAINING, else CURRENT.
//
// past lists sessions seen before that have no registration any more, so a
// replaced session is still answered STALE (with its successor) rather than
// UNKNOWN.
func IndexSessions(es []Executor, past []PastSession) SessionIndex {
	ix := SessionIndex{sessions: map[[2]string]SessionStatus{}, newest: map[string]SessionStatus{}, past: map[[2]string]PastSession{}}
	for _, p := range past {
		ix.past[[2]string{p.InstanceID, p.SessionID}] = p
	}
	rank := map[SessionState]int{SessionCurrent: 0, SessionDraining: 1, SessionUnknown: 2, SessionLapsed: 3, SessionStale: 4}
	for _, e := range es {
		if e.Err != nil {
			if e.Orders() { // not answered for, but a newer generation still fences older ones
				if n, ok := ix.newest[e.InstanceID]; !ok || e.Generation > n.Generation {
					ix.newest[e.InstanceID] = SessionStatus{InstanceID: e.InstanceID, SessionID: e.SessionID, Generation: e.Generation, State: SessionUnknown}
				}
			}
			continue
		}
		key := [2]string{e.InstanceID, e.SessionID}
		st, seen := ix.sessions[key]
		if !seen {
			st = SessionStatus{InstanceID: e.InstanceID, SessionID: e.SessionID, State: SessionCurrent, Generation: e.Generation, Version: e.Version, Datacenter: e.Datacenter, Detail: "newest session of its instance, lease valid"}
		}
		st.Tasks = append(st.Tasks, e.Task)
		state, detail := SessionCurrent, ""
		switch {
		case e.Fenced:
			state, detail = SessionStale, fmt.Sprintf("session %s (generation %d) of this instance is newer", e.NewerSessionID, e.NewerGeneration)
			st.NewerSessionID, st.NewerGeneration = e.NewerSessionID, e.NewerGeneration
		case e.LapseObserved || e.Lease == StatusCritical || e.NodeFailed:
			state, detail = SessionLapsed, "lease lapsed (or its node failed) on task "+e.Task
		case e.Reach != Reached:
			// Not CURRENT: a lapse in a datacenter that does not answer
			// would go unseen (what is known to be final still is).
			state, detail = SessionUnknown, "its datacenter does not answer: "+e.ReachDetail
		case !e.LeaseFound:
			// Not LAPSED, which is final: a missing check is no proof the
			// lease ended (and only a broken contract brings it back).
			state, detail = SessionUnknown, "its lease check on task "+e.Task+" is missing: not routed, not vouched for"
		case e.State == StateDraining:
			state, detail = SessionDraining, "executor is draining"
		}
		if rank[state] > rank[st.State] {
			st.State, st.Detail = state, detail
		}
		ix.sessions[key] = st
	}
	for k, st := range ix.sessions {
		sort.Strings(st.Tasks)
		ix.sessions[k] = st
		if n, ok := ix.newest[st.InstanceID]; !ok || newerStatus(st, n) {
			ix.newest[st.InstanceID] = st
		}
	}
	return ix
}

// newerStatus orders two sessions of an instance the same on every replica,
// whatever the map order: by generation, then the one Fence kept over the
// other (equal generations only when the contract was broken), then by id.
func newerStatus(a, b SessionStatus) bool {
	if a.Generation != b.Generation {
		return a.Generation > b.Generation
	}
	if (a.State == SessionStale) != (b.State == SessionStale) {
		return b.State == SessionStale
	}
	return a.SessionID > b.SessionID
}

// Check answers for one session; ids must be valid (ValidateSessionQuery).
func (ix SessionIndex) Check(instanceID, sessionID string) SessionStatus {
	if st, ok := ix.sessions[[2]string{instanceID, sessionID}]; ok {
		return st
	}
	if p, ok := ix.past[[2]string{instanceID, sessionID}]; ok {
		st := SessionStatus{InstanceID: instanceID, SessionID: sessionID, Generation: p.Generation, Tasks: p.Tasks, Version: p.Version}
		switch n, has := ix.newest[instanceID]; {
		case has && n.Generation > p.Generation:
			st.State, st.NewerSessionID, st.NewerGeneration = SessionStale, n.SessionID, n.Generation
			st.Detail = fmt.Sprintf("replaced by session %s (generation %d)", n.SessionID, n.Generation)
		case p.Lapsed:
			st.State, st.Detail = SessionLapsed, "lease lapsed; its registration is gone"
		default:
			st.State, st.Detail = SessionUnknown, "deregistered"
		}
		return st
	}
	return SessionStatus{InstanceID: instanceID, SessionID: sessionID, State: SessionUnknown, Detail: "no registration of this session is known (never seen, or deregistered)"}
}
