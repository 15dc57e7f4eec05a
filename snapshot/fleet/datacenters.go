package fleet

import (
	"fmt"
	"sort"
	"time"

	"github.com/leasehold/leasehold/health"
)

// Several Consul datacenters: each is watched on its own (its indexes, its
// non-passing checks, its generation keys), and the fleet state keys a task
// type's registrations by datacenter and task. Instances are fenced across
// datacenters: an instance's newest session wins wherever it registered.

// fleetKey names one datacenter's registrations of one task type.
type fleetKey struct{ dc, task string }

// dcState is what the syncer knows of one datacenter.
type dcState struct {
	// np is its non-passing set, npJoined the one the fleet state was last
	// joined with (markNonPassing).
	np, npJoined *health.NonPassingSet
	haveNP       bool
	haveGen      bool
	tasks        []string // task types Consul lists; nil until first read
	// Per instance: its generation key in this datacenter's last listing
	// (listed), and its key read back by a task watch when newer than the
	// listing (keyReads).
	listed     map[string]health.GenerationRecord
	keyReads   map[string]health.GenerationRecord
	genIndex   uint64             // the index of the listing
	marks      []health.LapseMark // the lapse marks in this datacenter's KV
	haveMarks  bool               // they have been read
	marksIndex uint64             // the index of their listing
	failing    bool               // some watch of it failed and has not answered since
	failedAt   time.Time          // when the failures began
	// When each watch that answers at least every FastWait last did: the
	// non-passing checks, the generation keys, the task list.
	heardNP, heardGen, heardTasks time.Time
	refreshed                     uint64 // the latest refresh request its watch answered afresh
	progressNP                    uint64 // Progress seen in the current batch, published after it
	progressGen                   uint64
	progressLapses                uint64
	reach                         health.Reach // as last applied to its executors
	reachDetail                   string
	// answering is set while every watch answered within DatacenterQuiet and
	// none is failing (as of the last updateReach), without a break since
	// answeringSince.
	answering      bool
	answeringSince time.Time
}

// DCIndexes are the Consul indexes a view has reached in one datacenter.
type DCIndexes struct {
	// ConsulIndex is the highest index of any answer (the lapse marks'
	// listing included: a LAPSED answer carries an index at or above its
	// mark's); NonPassingIndex, GenerationsIndex and LapsesIndex those of
	// the answers that can make a session LAPSED or STALE (the view has seen
	// every such change up to the lowest; the lapse marks only count with
	// SyncConfig.AwaitLapses).
	ConsulIndex, NonPassingIndex, GenerationsIndex, LapsesIndex uint64
	// Refreshed is the latest refresh request (Watcher.Refresh) whose fresh
	// reads the view includes.
	Refreshed uint64
	// Reach is whether the datacenter answers (and ReachDetail why not).
	Reach       health.Reach
	ReachDetail string
	// ShortestLease is the shortest lease_ttl its registrations declare
	// (0: none does): a silence longer than that may hide a lapse.
	ShortestLease time.Duration
}

// Progress is how far the latest view of one datacenter is known current,
// per kind of answer that can make a session LAPSED or STALE: at least its
// own index, more when the watch answered again with the same content, or
// answered after another answer at a higher index (Consul made it later).
type Progress struct {
	NonPassing, Generations, Lapses uint64
	// ReadsLapses is set when the lapse marks count (SyncConfig.AwaitLapses:
	// they are read, and a lapse another replica saw is known only from them).
	ReadsLapses bool
}

// Current is the index up to which every change that can make a session
// LAPSED or STALE is known.
func (p Progress) Current() uint64 {
	c := min(p.NonPassing, p.Generations)
	if p.ReadsLapses {
		c = min(c, p.Lapses)
	}
	return c
}

// answered notes when the watches that always answer last did.
func (d *dcState) answered(o health.Observation, now time.Time) {
	at := o.At
	if at.IsZero() {
		at = now
	}
	switch x := o.Data.(type) {
	case *health.NonPassing:
		d.heardNP = at
	case *health.Generations:
		d.heardGen = at
	case *health.Progress:
		if x.NonPassing > 0 {
			d.heardNP = at
		} else if x.Generations > 0 {
			d.heardGen = at
		}
	case *health.TaskList:
		d.heardTasks = at
	case *health.Refreshed: // fresh reads of the checks and the keys
		d.heardNP, d.heardGen = at, at
	}
}

// heard is when every always-answering watch of the datacenter had answered
// (zero until each has once): a datacenter is heard from only as much as
// its least recent watch — one watch answering says nothing of a lapse
// another would bring.
func (d *dcState) heard() time.Time {
	if d.heardNP.IsZero() || d.heardGen.IsZero() || d.heardTasks.IsZero() {
		return time.Time{}
	}
	h := d.heardNP
	if d.heardGen.Before(h) {
		h = d.heardGen
	}
	if d.heardTasks.Before(h) {
		h = d.heardTasks
	}
	return h
}

// dc is the state of datacenter name, created on first use.
func (s *Syncer) dc(name string) *dcState {
	d := s.dcs[name]
	if d == nil {
		d = &dcState{}
		s.dcs[name] = d
	}
	return d
}

// dcNames are the datacenters known, in order.
func (s *Syncer) dcNames() []string {
	names := make([]string, 0, len(s.dcs))
	for n := range s.dcs {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// sortedKeys are the fleet keys of m by task type, then datacenter.
func sortedKeys(m map[fleetKey]*health.TaskMembers) []fleetKey {
	out := make([]fleetKey, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].task != out[j].task {
			return out[i].task < out[j].task
		}
		return out[i].dc < out[j].dc
	})
	return out
}

// taskNames are the task types of any datacenter, sorted.
func taskNames(m map[fleetKey]*health.TaskMembers) []string {
	var out []string
	for _, k := range sortedKeys(m) {
		if len(out) == 0 || out[len(out)-1] != k.task {
			out = append(out, k.task)
		}
	}
	return out
}

// silentSince is when the datacenter was last heard from (its watches all
// answered), or when the syncer started if never.
func (s *Syncer) silentSince(d *dcState) time.Time {
	if h := d.heard(); !h.IsZero() {
		return h
	}
	return s.started
}

// answering reports whether every watch of the datacenter answered within
// DatacenterQuiet and none is failing.
func (s *Syncer) answering(name string, d *dcState, now time.Time) bool {
	return !d.failing && now.Sub(s.silentSince(d)) <= s.quietAfter(name)
}

// quietAfter is how long datacenter name may go without an answer before it
// counts as not answering: DatacenterQuiet, or less when its registrations
// declare shorter leases (lostAfter: it must not stay "answering" past the
// point where it is lost).
func (s *Syncer) quietAfter(name string) time.Duration {
	return min(s.cfg.DatacenterQuiet, s.lostAfter(name))
}

// reachOf decides a datacenter's reach: Reached while answering;
// Unanswered once quiet (or failing); Lost once it has not answered for
// DatacenterLost while another datacenter kept answering all along — a
// silence every datacenter shared (leasehold's own agent away) is no
// partition, so the bound counts from when another began answering again —
// and Lost until it answers itself.
func (s *Syncer) reachOf(name string, d *dcState,
	now, othersSince time.Time) (health.Reach, string) {
	since := s.silentSince(d)
	at := since.UTC().Format(time.RFC3339)
	switch {
	case d.answering:
		return health.Reached, ""
	case d.reach == health.Lost:
		// The others going silent too brings no news of it, and the
		// snapshot last served without it stays.
		return health.Lost, d.reachDetail
	case !othersSince.IsZero() && now.Sub(later(since, othersSince)) > s.lostAfter(name):
		return health.Lost, fmt.Sprintf("no answer since %s (longer than %s) while other "+
			"datacenters answer: not routed until it answers", at, s.lostBound(name))
	default:
		return health.Unanswered, fmt.Sprintf("no answer since %s", at)
	}
}

// lostAfter is how long datacenter name may be silent, while others
// answer, before its executors are Lost: DatacenterLost (the staleness
// bound), or the shortest lease its registrations declare when shorter —
// past a lease a lapse there may go unseen — but never under
// health.MinStaleBound (any registration may declare any lease).
func (s *Syncer) lostAfter(name string) time.Duration {
	if l := health.DatacenterLeaseBound(s.shortestLease(name)); l > 0 && l < s.cfg.DatacenterLost {
		return l
	}
	return s.cfg.DatacenterLost
}

// lostBound says lostAfter and which bound it is, for details.
func (s *Syncer) lostBound(name string) string {
	if b := s.lostAfter(name); b != s.cfg.DatacenterLost {
		if b != s.shortestLease(name) {
			return b.String() + ", the shortest lease_ttl there (" +
				s.shortestLease(name).String() + ") raised to the least bound"
		}
		return b.String() + ", the shortest lease_ttl there"
	}
	return s.cfg.DatacenterLost.String()
}

// shortestLease is the shortest lease_ttl of datacenter name's
// registrations (0: none declares one).
func (s *Syncer) shortestLease(name string) time.Duration {
	var shortest time.Duration
	for k, ts := range s.fleet {
		if k.dc == name && ts.shortestLease > 0 && (shortest == 0 || ts.shortestLease < shortest) {
			shortest = ts.shortestLease
		}
	}
	return shortest
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// othersAnsweringSince is since when some datacenter other than d has
// answered without a break (zero: none answers now).
func (s *Syncer) othersAnsweringSince(d *dcState) time.Time {
	var since time.Time
	for _, o := range s.dcs {
		if o != d && o.answering && (since.IsZero() || o.answeringSince.Before(since)) {
			since = o.answeringSince
		}
	}
	return since
}

// updateReach decides every datacenter's reach at now and marks the
// registrations of those whose reach changed; it reports whether any did.
func (s *Syncer) updateReach(now time.Time) (changed bool) {
	if !s.cfg.multi() {
		// One datacenter: Consul's reachability is readiness and the fencing bound, as ever.
		return false
	}
	for name, d := range s.dcs {
		ans := s.answering(name, d, now)
		if ans && !d.answering {
			d.answeringSince = now
			if h := d.heard(); h.IsZero() { // answering since the start, as far as anyone knows
				d.answeringSince = s.started
			}
		}
		d.answering = ans
	}
	for name, d := range s.dcs {
		r, detail := s.reachOf(name, d, now, s.othersAnsweringSince(d))
		if r == d.reach {
			continue
		}
		s.log.Warn("datacenter reach changed", "datacenter", name, "from", d.reach.String(),
			"to", r.String(), "detail", detail)
		changed = true
		for k, ts := range s.fleet {
			if k.dc == name {
				ts.markAll()
			}
		}
		d.reach, d.reachDetail = r, detail
	}
	return changed
}

// nextReachChange is the next time a datacenter's reach could change from
// time passing alone (zero: none).
func (s *Syncer) nextReachChange(now time.Time) (next time.Time) {
	if !s.cfg.multi() {
		return time.Time{}
	}
	for name, d := range s.dcs {
		since, lost := s.silentSince(d), s.lostAfter(name)
		for _, at := range []time.Time{since.Add(s.quietAfter(name)), since.Add(lost),
			d.answeringSince.Add(lost)} {
			at = at.Add(time.Millisecond) // past the bound, not on it
			if at.After(now) && (next.IsZero() || at.Before(next)) {
				next = at
			}
		}
	}
	return next
}

// consulIndex is the highest index of any answer from datacenter dc.
func (s *Syncer) consulIndex(dc string) uint64 {
	d := s.dc(dc)
	index := max(d.np.Index(), d.genIndex, d.marksIndex)
	for k, m := range s.members {
		if k.dc == dc {
			index = max(index, m.Index)
		}
	}
	return index
}
