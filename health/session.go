package health

import (
	"fmt"
	"slices"
	"sort"
	"time"
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
	// LeaseTTL is the shortest lease its registrations declare (lease_ttl;
	// 0: none does): a view of Consul older than that may miss its lapse.
	LeaseTTL time.Duration
}

// SessionKey names one session: session ids are unique only per instance
// (the contract), so a session is known by its instance id and its own.
type SessionKey struct{ Instance, Session string }

// SessionIndex answers session questions from one decided view of the fleet
// (the same executors, fenced and joined, that the xDS resources come from).
//
// It is built for the sessions of one instance, as the fleet keeps them (an
// index per instance): its sessions, newest and past are short lists that
// lookups scan. Go maps allocate their slots eight at a time, so three small
// maps cost ~1.6 KB an instance at 10,000 instances (BenchmarkSyncerMemory);
// the lists cost what they hold. An index is never written once built.
type SessionIndex struct {
	sessions []*SessionStatus
	newest   []*SessionStatus // per instance: its newest present session
	past     []PastSession
	// replacedBy holds the sessions a present registration names in its
	// replaces meta, with the newest session naming each.
	replacedBy map[SessionKey]SessionStatus
	// ordersOnly holds the highest generation of sessions present only with bad
	// metadata (not answered for, but their generation is known): a claim
	// of replacing one is believed only from a namer above it.
	ordersOnly map[SessionKey]uint64
	// excluded holds the sessions present only in registrations leasehold does not
	// answer for (bad metadata, or not confirmed by their instance's
	// generation key), with why: known, but UNKNOWN.
	excluded map[SessionKey]SessionStatus
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
	Replaces   []string // the sessions its registration named as replaced
	// LeaseChecks are its lease checks as first seen: a check created anew
	// later ends the session (LeaseCheckRecreated).
	LeaseChecks []LeaseCheck
}

// LeaseCheck is one lease check of a session: the check of a task type on a
// node (Consul's identity of a check) in a datacenter (whose index space
// CreateIndex is in), and the index the catalog created it at.
type LeaseCheck struct {
	Datacenter, Node, Task string
	CreateIndex            uint64
}

// ValidateSessionQuery checks the ids of a session question.
func ValidateSessionQuery(instanceID, sessionID string) error {
	var errs FieldErrors
	errs = append(errs, validateID(MetaInstanceID, instanceID)...)
	errs = append(errs, validateID(MetaSessionID, sessionID)...)
	return errs.err()
}

// IndexSessions builds the index from executors that went through Join and
// Fence (with LapseSeen set). A session's state is the worst over its
// registrations: STALE, then LAPSED, then DRAINING, else CURRENT.
//
// past lists sessions seen before that have no registration any more, so a
// replaced session is still answered STALE (with its successor) rather than
// UNKNOWN. Sessions a present registration names in its replaces meta are
// older than it: they answer STALE too, though this index never saw them
// (after a restart, on a new replica). The index keeps past: the caller
// must not write to it afterwards.
func IndexSessions(es []Executor, past []PastSession) SessionIndex {
	ix := SessionIndex{past: past} // shared: the caller never writes a list it handed over
	for _, p := range past {
		for _, t := range p.Tasks { // a namer gone is still newer than what it named
			ix.named(p.InstanceID, p.Replaces,
				SessionStatus{SessionID: p.SessionID, Generation: p.Generation}, t)
		}
	}
	rank := map[SessionState]int{SessionCurrent: 0, SessionDraining: 1, SessionUnknown: 2,
		SessionLapsed: 3, SessionStale: 4}
	for _, e := range es {
		if e.Unconfirmed != "" {
			ix.exclude(e,
				"not confirmed by its instance's generation key: not vouched for, it fences and "+
					"replaces nothing; "+e.Unconfirmed)
			continue
		}
		if e.Err != nil {
			ix.exclude(e, "registered with bad metadata: excluded from routing, not vouched for: "+
				e.Err.Error())
			if e.Orders() { // not answered for, but a newer generation still fences older ones
				if n, ok := ix.newestOf(e.InstanceID); !ok || e.Generation > n.Generation {
					ix.setNewest(&SessionStatus{InstanceID: e.InstanceID,
						SessionID: e.SessionID, Generation: e.Generation, State: SessionUnknown})
				}
				if ix.ordersOnly == nil {
					ix.ordersOnly = map[SessionKey]uint64{}
				}
				k := SessionKey{e.InstanceID, e.SessionID}
				ix.ordersOnly[k] = max(ix.ordersOnly[k], e.Generation)
			}
			continue
		}
		ix.named(e.InstanceID, e.Replaces,
			SessionStatus{SessionID: e.SessionID, Generation: e.Generation,
				Datacenter: e.Datacenter}, e.Task)
		key := SessionKey{e.InstanceID, e.SessionID}
		st, seen := ix.session(key)
		if !seen {
			st = &SessionStatus{InstanceID: e.InstanceID, SessionID: e.SessionID,
				State: SessionCurrent, Generation: e.Generation, Version: e.Version,
				Datacenter: e.Datacenter, Detail: "newest session of its instance, lease valid"}
			ix.sessions = append(ix.sessions, st)
		}
		st.Tasks = append(st.Tasks, e.Task)
		if e.LeaseTTL > 0 && (st.LeaseTTL == 0 || e.LeaseTTL < st.LeaseTTL) {
			st.LeaseTTL = e.LeaseTTL
		}
		state, detail := SessionCurrent, ""
		switch {
		case e.Fenced:
			state, detail = SessionStale, fmt.Sprintf("session %s (generation %d) of this "+
				"instance is newer", e.NewerSessionID, e.NewerGeneration)
			st.NewerSessionID, st.NewerGeneration = e.NewerSessionID, e.NewerGeneration
		case e.LapseSeen || e.LeaseStatus == StatusCritical || e.NodeFailed:
			state, detail = SessionLapsed, "lease lapsed (or its node failed) on task "+e.Task
		case e.Reach != Reached:
			// Not CURRENT: a lapse in a datacenter that does not answer
			// would go unseen (what is known to be final still is).
			state, detail = SessionUnknown, "its datacenter does not answer: "+e.ReachDetail
		case !e.LeaseFound:
			// Not LAPSED, which is final: a missing check is no proof the
			// lease ended (and only a broken contract brings it back).
			state, detail = SessionUnknown, "its lease check on task "+e.Task+" is missing: not "+
				"routed (no-lease-check), not vouched for"
		case e.State == StateDraining:
			state, detail = SessionDraining, "executor is draining"
		}
		if rank[state] > rank[st.State] {
			st.State, st.Detail = state, detail
		}
	}
	for k, by := range ix.replacedBy {
		sort.Strings(by.Tasks)
		ix.replacedBy[k] = by
	}
	for _, st := range ix.sessions {
		sort.Strings(st.Tasks)
		if n, ok := ix.newestOf(st.InstanceID); !ok || newerStatus(*st, *n) {
			ix.setNewest(st)
		}
	}
	return ix
}

// session is the present session key (false: none).
func (ix SessionIndex) session(key SessionKey) (*SessionStatus, bool) {
	for _, st := range ix.sessions {
		if st.InstanceID == key.Instance && st.SessionID == key.Session {
			return st, true
		}
	}
	return nil, false
}

// newestOf is instance's newest present session (false: none).
func (ix SessionIndex) newestOf(instance string) (*SessionStatus, bool) {
	for _, st := range ix.newest {
		if st.InstanceID == instance {
			return st, true
		}
	}
	return nil, false
}

// setNewest makes st its instance's newest present session.
func (ix *SessionIndex) setNewest(st *SessionStatus) {
	for i, n := range ix.newest {
		if n.InstanceID == st.InstanceID {
			ix.newest[i] = st
			return
		}
	}
	ix.newest = append(ix.newest, st)
}

// pastSession is the remembered session key (false: none).
func (ix SessionIndex) pastSession(key SessionKey) (PastSession, bool) {
	for _, p := range ix.past {
		if p.InstanceID == key.Instance && p.SessionID == key.Session {
			return p, true
		}
	}
	return PastSession{}, false
}

// exclude records a registration of a session leasehold does not answer
// for; the session is answered UNKNOWN with why, unless a registration it
// answers for exists (or its history says more: Check).
func (ix *SessionIndex) exclude(e Executor, why string) {
	if ix.excluded == nil {
		ix.excluded = map[SessionKey]SessionStatus{}
	}
	k := SessionKey{e.InstanceID, e.SessionID}
	st, ok := ix.excluded[k]
	if !ok {
		st = SessionStatus{InstanceID: e.InstanceID, SessionID: e.SessionID, State: SessionUnknown,
			Detail: why, Datacenter: e.Datacenter}
	}
	if !slices.Contains(st.Tasks, e.Task) && ValidateTask(e.Task) == nil {
		st.Tasks = append(st.Tasks, e.Task)
		sort.Strings(st.Tasks)
	}
	ix.excluded[k] = st
}

// named records that namer, a session of inst on task, names olds as
// sessions it replaced; the newest namer of each is kept.
func (ix *SessionIndex) named(inst string, olds []string, namer SessionStatus, task string) {
	for _, old := range olds {
		k := SessionKey{inst, old}
		if ix.replacedBy == nil {
			ix.replacedBy = map[SessionKey]SessionStatus{}
		}
		n, ok := ix.replacedBy[k]
		if !ok || namer.Generation > n.Generation {
			n.SessionID, n.Generation = namer.SessionID, namer.Generation
			n.Datacenter = namer.Datacenter
		}
		// Its task types, as far as known: those of the sessions of its
		// instance naming it (the fencing API grants by task type).
		if !slices.Contains(n.Tasks, task) {
			n.Tasks = append(slices.Clip(n.Tasks), task)
		}
		ix.replacedBy[k] = n
	}
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
	key := SessionKey{instanceID, sessionID}
	if st, ok := ix.session(key); ok {
		return *st
	}
	// A session present with bad metadata is answered UNKNOWN, but its
	// generation is known and orders the instance: a claim of replacing it
	// from a namer not above it is not believed (the namer breaks the
	// contract; the session may be the instance's newest, and Fence itself
	// may have found the namer older than it).
	by, named := ix.replacedBy[key]
	if g, ok := ix.ordersOnly[key]; ok && named && g >= by.Generation {
		named = false
	}
	if x, ok := ix.excluded[key]; ok && !named {
		p, seen := ix.pastSession(key)
		switch n, has := ix.newestOf(instanceID); {
		case seen && p.Lapsed:
			// Once lapsed, always lapsed.
			x.State, x.Detail = SessionLapsed, "lease lapsed (seen before); "+x.Detail
			return x
		case seen && has && n.Generation > p.Generation:
			// Seen before and replaced since: a registration of its id that
			// leasehold does not answer for (a copy anyone may write)
			// changes nothing of that.
		default:
			return x
		}
	}
	if p, ok := ix.pastSession(key); ok {
		st := SessionStatus{InstanceID: instanceID, SessionID: sessionID, Generation: p.Generation,
			Tasks: p.Tasks, Version: p.Version}
		switch n, has := ix.newestOf(instanceID); {
		case has && n.Generation > p.Generation:
			st.State = SessionStale
			st.NewerSessionID, st.NewerGeneration = n.SessionID, n.Generation
			st.Detail = fmt.Sprintf("replaced by session %s (generation %d)", n.SessionID,
				n.Generation)
		// A namer not above it breaks the contract: the generation wins.
		case named && by.Generation > p.Generation:
			ix.replacedState(&st, by)
		case p.Lapsed:
			st.State, st.Detail = SessionLapsed, "lease lapsed; its registration is gone"
		default:
			st.State, st.Detail = SessionUnknown, "deregistered"
		}
		return st
	}
	if named {
		st := SessionStatus{InstanceID: instanceID, SessionID: sessionID}
		ix.replacedState(&st, by)
		return st
	}
	return SessionStatus{InstanceID: instanceID, SessionID: sessionID, State: SessionUnknown,
		Detail: "no registration of this session is known (never seen, or deregistered)"}
}

// replacedState answers STALE for a session that by, a present (or
// remembered) session of its instance, names as one it replaced; the newer
// session reported is the instance's newest (by or one newer still).
func (ix SessionIndex) replacedState(st *SessionStatus, by SessionStatus) {
	n := by
	if newest, ok := ix.newestOf(st.InstanceID); ok && newest.Generation > n.Generation {
		n = *newest
	}
	st.State, st.NewerSessionID, st.NewerGeneration = SessionStale, n.SessionID, n.Generation
	if len(st.Tasks) == 0 {
		st.Tasks = slices.Clone(by.Tasks)
	}
	if st.Datacenter == "" {
		st.Datacenter = by.Datacenter
	}
	st.Detail = fmt.Sprintf("replaced: session %s (generation %d) of this instance names it in "+
		"its registration", by.SessionID, by.Generation)
}
