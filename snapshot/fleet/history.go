package fleet

import (
	"slices"
	"sort"
	"time"

	"github.com/leasehold/leasehold/health"
)

// Sessions remembered per instance after their registrations are gone, and
// how many absent instances may be remembered at most.
const (
	historyPerInstance = 8
	historyInstances   = 10000
)

// sessionHistory is, per instance, the sessions seen last (newest first),
// kept after their registrations are gone so that the fencing API still
// answers STALE or LAPSED for them. A list is never written once set: a
// change sets a new one, so the session indexes share the lists instead of
// holding copies (at 10,000 instances, ~1.4 MB).
type sessionHistory struct {
	m       map[string][]health.PastSession
	touched map[string]struct{} // instances changed since the last drain
}

func (h *sessionHistory) get(inst string) []health.PastSession { return h.m[inst] }

func (h *sessionHistory) set(inst string, ps []health.PastSession) {
	if h.m == nil {
		h.m, h.touched = map[string][]health.PastSession{}, map[string]struct{}{}
	}
	h.m[inst] = ps
	h.touched[inst] = struct{}{}
}

func (h *sessionHistory) forget(inst string) {
	if _, ok := h.m[inst]; ok {
		delete(h.m, inst)
		h.touched[inst] = struct{}{}
	}
}

func (h *sessionHistory) len() int { return len(h.m) }

// drain calls f with every instance whose history changed since the last call.
func (h *sessionHistory) drain(f func(inst string)) {
	for inst := range h.touched {
		f(inst)
		delete(h.touched, inst)
	}
}

// remember records a present session so that, once its registrations are
// gone, the fencing API still answers STALE or LAPSED for it.
func (s *Syncer) remember(e *health.Executor) {
	if e.Err != nil || e.Unconfirmed != "" {
		// Not a session leasehold answers for: it must neither name others
		// replaced nor crowd real ones out.
		return
	}
	h := s.history.get(e.InstanceID)
	i := 0
	for i < len(h) && h[i].SessionID != e.SessionID {
		i++
	}
	lapsed := e.LapseSeen || e.LeaseStatus == health.StatusCritical || e.NodeFailed
	if i < len(h) && (h[i].Lapsed || !lapsed) && slices.Contains(h[i].Tasks, e.Task) &&
		(e.LeaseCreateIndex == 0 || firstLeaseCheck(h[i], e) != 0) {
		return // nothing new about this session: the common case
	}
	// A session not remembered yet goes first: the newest seen first, whatever
	// its generation (generations start low again after Consul loses its KV).
	// Either way the list is a new one: the set one is shared.
	if i < len(h) {
		h = slices.Clone(h)
	} else {
		first := health.PastSession{InstanceID: e.InstanceID, SessionID: e.SessionID,
			Generation: e.Generation, Version: e.Version, Replaces: e.Replaces}
		h = append([]health.PastSession{first}, h...)
		i = 0
	}
	p := &h[i]
	if lapsed {
		p.Lapsed = true
	}
	if !slices.Contains(p.Tasks, e.Task) {
		tasks := append(append([]string(nil), p.Tasks...), e.Task)
		sort.Strings(tasks)
		p.Tasks = tasks
	}
	// The first seen is kept: LeaseCheckRecreated compares with it.
	if e.LeaseCreateIndex != 0 && firstLeaseCheck(*p, e) == 0 {
		c := health.LeaseCheck{Datacenter: e.Datacenter, Node: e.Node, Task: e.Task,
			CreateIndex: e.LeaseCreateIndex}
		p.LeaseChecks = append(slices.Clone(p.LeaseChecks), c)
	}
	// Forget the session seen longest ago, a lapsed one last, and never one
	// still registered: its lapse lives on only here once its registrations
	// go, and a syncer that remembers only what a batch touched would not
	// put it back (the instance may hold more sessions than that for a while).
	for len(h) > historyPerInstance {
		drop := -1
		for j := len(h) - 1; j >= 0; j-- {
			if s.sessions[health.SessionKey{Instance: e.InstanceID, Session: h[j].SessionID}] > 0 {
				continue
			}
			if !h[j].Lapsed {
				drop = j
				break
			}
			if drop < 0 {
				drop = j
			}
		}
		if drop < 0 {
			break
		}
		h = slices.Delete(h, drop, drop+1)
	}
	s.history.set(e.InstanceID, h)
}

// pruneHistory forgets instances gone for longer than HistoryRetention (at
// most once a minute) and, past historyInstances absent instances, those gone
// longest first: a churning fleet does not grow leasehold's memory.
func (s *Syncer) pruneHistory(now time.Time, present int) {
	over := s.history.len() - present - historyInstances
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
	for inst, h := range s.history.m {
		if s.instances[inst] == 0 {
			lapsed := slices.ContainsFunc(h, func(p health.PastSession) bool { return p.Lapsed })
			absent = append(absent, gone{inst, s.lastSeen[inst], lapsed})
		}
	}
	sort.Slice(absent, func(i, j int) bool {
		if absent[i].lapsed != absent[j].lapsed {
			return !absent[i].lapsed
		}
		if !absent[i].at.Equal(absent[j].at) {
			return absent[i].at.Before(absent[j].at)
		}
		return absent[i].inst < absent[j].inst
	})
	for i, g := range absent {
		if i >= over && now.Sub(g.at) < s.cfg.HistoryRetention {
			continue
		}
		s.history.forget(g.inst)
		delete(s.lastSeen, g.inst)
	}
}

// firstLeaseCheck is the CreateIndex of session p's lease check of e's
// task type, datacenter and node as first seen (0: none seen). One session
// may hold registrations in several datacenters (each its own index space)
// or on several nodes (each its own check).
func firstLeaseCheck(p health.PastSession, e *health.Executor) uint64 {
	for _, c := range p.LeaseChecks {
		if c.Task == e.Task && c.Datacenter == e.Datacenter && c.Node == e.Node {
			return c.CreateIndex
		}
	}
	return 0
}

// leaseCheckRecreated reports whether e's lease check is not the one first
// seen of its session and task type (health.LeaseCheckRecreated): the
// catalog lost it and an agent created it anew, which ends the session. The
// history remembers the first one also while the registration is gone (as
// while its agent restarts).
func (s *Syncer) leaseCheckRecreated(e *health.Executor) bool {
	for _, p := range s.history.get(e.InstanceID) {
		if p.SessionID == e.SessionID {
			return health.LeaseCheckRecreated(firstLeaseCheck(p, e), e.LeaseCreateIndex)
		}
	}
	return false
}

// lapsedBefore reports whether the history remembers e's session as lapsed:
// its registrations went away after the lapse and came back (e.g. its agent
// re-synced them after the catalog lost them).
func (s *Syncer) lapsedBefore(e health.Executor) bool {
	for _, p := range s.history.get(e.InstanceID) {
		if p.SessionID == e.SessionID {
			return p.Lapsed
		}
	}
	return false
}
