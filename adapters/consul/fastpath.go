package consul

import (
	"context"
	"errors"
	"reflect"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// The fast path: the non-passing checks of leasehold's services and of
// nodes, and every node's serfHealth (passing too: its indexes tell a node
// that failed and came back since a session registered).
//
// Three watches feed it. "non-passing" and "warning" block on Consul's checks
// in state critical and in state warning: such a query wakes only when a
// check enters, leaves or changes in that state — registrations of passing
// executors, however many, do not wake it — and each answer costs Consul
// those checks only. When one of them sees a change it reads the other state
// afresh before the set goes out, so a check moving between the two states is
// never missing from both; the set's index is the critical read's, exact for
// what matters most (a lapse). "serf" lists every node's serfHealth, a scan
// of every check in the datacenter that any check change wakes, so it is
// paced by SlowInterval; a serfHealth leaving the non-passing set (a node
// back) is read at once by node, so its new indexes never wait for that pace.
//
// (One filtered blocking query over every check would do all of it, but
// every registration would wake it and make Consul scan the whole
// datacenter: the largest share of Consul's CPU under churn, measured.)
type fastPath struct {
	// mu is held while an answer is taken and what it calls for is read,
	// never while a set is sent: a set is decided under mu and sent after,
	// in its turn (turns), so sets go out in the order they were decided
	// and a full observation channel holds no goroutine that needs mu.
	mu        sync.Mutex
	turns     sendTurns
	crit      []health.CheckState
	warn      []health.CheckState
	critIndex uint64 // the index of the newest critical read
	warnIndex uint64
	// The index the newest critical read is current at (its own, or a higher one that arrived
	// before: refresh.go).
	critAt uint64
	warnAt uint64
	serfAt uint64 // the same, of the serfHealth listing
	// The index of the other watch's last fresh read of the critical checks, until an answer as
	// new.
	critCross uint64
	warnCross uint64
	critRead  bool
	warnRead  bool
	serf      map[string]health.CheckState // node → its serfHealth
	// The index of the serfHealth listing serf holds (0: none yet).
	serfIndex uint64
	failing   map[string]bool // fast watches whose last query failed
	// A fast watch failed since the last serfHealth listing: claim no newer index until one is
	// read.
	gap      bool
	gapIndex uint64 // the index last sent when the gap began
	// A watch whose read of the other state failed after a change: its next
	// answer reads the other state whatever it says, and until then what
	// left its state stays in the set as it was (carry), so nothing is
	// missing from both states meanwhile.
	crossPending map[string]bool
	carry        []health.CheckState
	sentIndex    uint64              // the index last sent
	last         []health.CheckState // the last set sent
	sent         bool                // last is current: the next identical set is progress only
}

// isSerf reports whether c is a node's serfHealth check.
func isSerf(c health.CheckState) bool {
	return c.CheckID == health.SerfHealthCheckID && c.ServiceID == ""
}

// combined is the non-passing set with every node's serfHealth; of two
// states of one check, the one Consul modified later wins.
func (f *fastPath) combined() []health.CheckState {
	type key struct{ node, id string }
	m := make(map[key]health.CheckState, len(f.crit)+len(f.warn)+len(f.serf))
	for _, c := range f.serf {
		m[key{c.Node, c.CheckID}] = c
	}
	for _, set := range [][]health.CheckState{f.carry, f.warn, f.crit} {
		for _, c := range set {
			k := key{c.Node, c.CheckID}
			if old, ok := m[k]; !ok || c.ModifyIndex >= old.ModifyIndex {
				m[k] = c
			}
		}
	}
	out := make([]health.CheckState, 0, len(m))
	for _, c := range m {
		out = append(out, c)
	}
	sortChecks(out)
	return out
}

// publish decides what goes out once both states have been read (called
// with f.mu held): the whole set when it changed, else progress to its index
// (fencing's min_consul_index counts on it). It returns what sends it, to be
// called once f.mu is released: that waits for the turn taken here, so sets
// go out in the order they were decided. The index is the critical
// read's, but never above the serfHealth listing's: a node may have failed
// and come back after the listing (serfHealth critical between two critical
// reads, so neither saw it) and only a listing brings its new indexes, so the
// set vouches for nothing newer; lapses go out at once all the same, and the
// index moves on with the next listing (the serf watch wakes on any check
// change, at its pace) or a refresh (which lists serfHealth afresh). Until
// the first listing answers, a node's serfHealth comes from the membership
// reads (Join's fallback) and the set vouches for nothing (index 0). In a
// gap (a fast query failed and every serfHealth has not been listed since)
// lapses still go out at once, but at the index sent before the gap: a node
// may have failed and come back unseen, so nothing newer is vouched for (a
// fencing call asking for more reads Consul afresh, serfHealth included).
func (w *Watcher) publish(ctx context.Context) (deliver func()) {
	f := &w.fast
	if !f.critRead || !f.warnRead {
		return func() {}
	}
	// Never above the serfHealth listing: neither the set's index nor how
	// far it is known current.
	idx, at := min(f.critIndex, f.serfIndex), min(max(f.critAt, f.critIndex), f.serfAt)
	if f.gap {
		idx, at = min(idx, f.gapIndex), min(at, f.gapIndex)
	}
	warnAt, serfAt := f.warnAt, f.serfAt
	// The set's own index is the critical read's (Join compares the checks'
	// indexes with it); how far it is known current goes out as progress.
	var np *health.NonPassing // nil: the set is unchanged, progress only
	set := f.combined()
	if f.sent && reflect.DeepEqual(set, f.last) {
		f.sentIndex = idx
	} else {
		f.last, f.sent, f.sentIndex = set, true, idx
		np = &health.NonPassing{Index: idx, Checks: set}
	}
	turn := f.turns.take()
	return func() {
		defer turn.end()
		if !turn.await(w.stopping(ctx)) {
			return
		}
		if np != nil {
			w.send(ctx, health.Observation{Data: np})
			w.sendProgress(ctx, npProgress, at, idx)
		} else {
			w.sendProgress(ctx, npProgress, at, 0) // (none at 0: before the first listing)
		}
		// Refreshes count on what made the watches current having gone out.
		w.refresh.raise("warning", warnAt)
		w.refresh.raise("serf", serfAt)
	}
}

// fastStates reads checks in one state as sorted CheckStates, with the
// read's index and the index it is current at (Watcher.receipt).
func (w *Watcher) fastStates(
	ctx context.Context,
	state string,
	index uint64,
	wait time.Duration,
) ([]health.CheckState, uint64, uint64, error) {
	checks, idx, err := cutShort(
		w,
		ctx,
		wait,
		func(ctx context.Context, wait time.Duration) (api.HealthChecks, uint64, error) {
			return w.cat.ChecksInState(ctx, w.cfg.Tag, state, index, wait)
		},
	)
	if err != nil {
		return nil, 0, 0, err
	}
	at := w.receipt(idx)
	states := make([]health.CheckState, 0, len(checks))
	for _, c := range checks {
		states = append(states, checkState(c))
	}
	sortChecks(states)
	return states, idx, at, nil
}

// watchNonPassing follows the critical checks (the watch named "non-passing")
// or the warning ones ("warning").
func (w *Watcher) watchNonPassing(ctx context.Context, state string) {
	f := &w.fast
	name, pace := "non-passing", w.cfg.MinInterval
	if state == api.HealthWarning {
		// While no check is in state warning, Consul watches the nearest
		// existing part of its status index, which every registration
		// changes: the warning query then answers each one. Full and
		// draining executors are no lapse; 10× the pace of the critical
		// checks is soon enough for them.
		name, pace = "warning", 10*w.cfg.MinInterval
	}
	handle := func(
		ctx context.Context, states []health.CheckState, idx, at uint64, err error,
	) (uint64, error) {
		if errors.Is(err, context.Canceled) {
			return 0, err // leasehold stops: no answer, no failure
		}
		f.mu.Lock()
		if err == nil {
			err = w.applyFast(ctx, name, state, states, idx, at)
		}
		if err != nil {
			f.failing[name] = true
			if !f.gap {
				f.gap, f.gapIndex = true, f.sentIndex
			}
			f.sent = false // report the next answer whatever it is
			f.mu.Unlock()
			return 0, err
		}
		deliver := w.publish(ctx)
		f.mu.Unlock()
		deliver()
		return idx, nil
	}
	w.blockingLoop(
		ctx,
		watchSpec{name: name, minInterval: pace},
		func(ctx context.Context, index uint64, wait time.Duration) (uint64, handleFunc) {
			states, idx, at, err := w.fastStates(ctx, state, index, wait)
			return idx, func() (uint64, error) { return handle(ctx, states, idx, at, err) }
		},
	)
}

// applyFast takes one answer of the checks in state (called with f.mu held):
//   - an answer older than the other watch's fresh read of the same state
//     (taken meanwhile) is replaced by a fresh read: a late answer never
//     undoes a newer one;
//   - a change makes the other state be read afresh too, so a check moving
//     between the two states is never missing from both;
//   - a node's serfHealth that left both states came back: it is read by
//     node at once, so its new indexes (the node failed since any older
//     session) are in the set before the set stops saying it failed;
//   - after a failed query, the set claims no newer index until every
//     node's serfHealth has been listed again (a node may have failed and
//     come back unseen); what it says still goes out at once.
func (w *Watcher) applyFast(
	ctx context.Context,
	name, state string,
	states []health.CheckState,
	idx, at uint64,
) error {
	f := &w.fast
	before := append(append(slices.Clone(f.crit), f.warn...), f.carry...)
	mineBefore := slices.Clone(f.crit)
	otherRead := f.critRead
	if state == api.HealthWarning {
		mineBefore = slices.Clone(f.warn)
	} else {
		otherRead = f.warnRead
	}
	changed, err := w.takeFast(ctx, state, states, idx, at, false)
	if err != nil {
		return err
	}
	if (changed || f.crossPending[name]) && otherRead {
		// (until both were read once, no set goes out).
		if state == api.HealthCritical && !f.crossPending[name] && len(f.carry) == 0 &&
			!f.gap && containsAll(f.crit, mineBefore) {
			// Checks only entered the critical state (a lapse) or changed
			// within it: nothing is missing from both states, so the set
			// goes out now, not after the warning checks' fresh read — a
			// Consul round trip, long while Consul serves a large listing
			// (every check change wakes the task's catalog watch). The read
			// follows, and a set it changes goes out after it.
			deliver := w.publish(ctx)
			f.mu.Unlock()
			deliver()
			f.mu.Lock()
		}
		w.readOtherState(ctx, name, state, mineBefore)
	}
	w.readNodesBack(ctx, before)
	delete(f.failing, name)
	if f.gap && len(f.failing) == 0 && len(f.crossPending) == 0 && f.critRead && f.warnRead {
		checks, sidx, err := w.cat.SerfHealth(ctx, 0, 0)
		if err != nil {
			// The set goes out, at the index before the gap; listed again at the next answer.
			w.log.Warn(
				"consul query failed; the fast path vouches for nothing newer until serfHealth "+
					"is listed",
				"err", err)
			return nil
		}
		f.takeSerf(checks, sidx, w.receipt(sidx))
		f.gap = false
	}
	return nil
}

// takeFast stores a read of state's checks (at index idx, current at at);
// cross: it is the other watch's fresh read. changed reports a set that
// differs from the last one stored.
func (w *Watcher) takeFast(
	ctx context.Context,
	state string,
	states []health.CheckState,
	idx, at uint64,
	cross bool,
) (changed bool, err error) {
	f := &w.fast
	mine, read, index, current := &f.crit, &f.critRead, &f.critIndex, &f.critAt
	crossAt := &f.critCross
	if state == api.HealthWarning {
		mine, read, index, current = &f.warn, &f.warnRead, &f.warnIndex, &f.warnAt
		crossAt = &f.warnCross
	}
	switch {
	case cross:
		*crossAt = idx
	case idx < *crossAt:
		// The other watch read this state afresh after this answer was
		// read: read it again. (An index below an own earlier answer is a
		// Consul that restarted, and is taken as it is.)
		if states, idx, at, err = w.fastStates(ctx, state, 0, 0); err != nil {
			return false, err
		}
		*crossAt = 0
	default:
		*crossAt = 0
	}
	changed = !*read || !reflect.DeepEqual(states, *mine)
	*mine, *read, *index, *current = states, true, idx, at
	return changed, nil
}

// containsAll reports whether every check of sub is in set.
func containsAll(set, sub []health.CheckState) bool {
	for _, c := range sub {
		if !containsCheck(set, c) {
			return false
		}
	}
	return true
}

// readOtherState reads the other state's checks afresh after state's
// changed (a check moving from critical to warning leaves one and enters
// the other). When that read fails, what left state is carried as it was
// until the other is read.
func (w *Watcher) readOtherState(
	ctx context.Context,
	name, state string,
	mineBefore []health.CheckState,
) {
	f := &w.fast
	other := api.HealthCritical
	if state == api.HealthCritical {
		other = api.HealthWarning
	}
	o, oidx, oat, err := w.fastStates(ctx, other, 0, 0)
	if err == nil {
		_, err = w.takeFast(ctx, other, o, oidx, oat, true)
	}
	if err == nil { // both states read now: nothing carried, nothing pending
		f.carry, f.crossPending = nil, map[string]bool{}
		return
	}
	mineNow := f.crit
	if state == api.HealthWarning {
		mineNow = f.warn
	}
	for _, c := range mineBefore {
		if !containsCheck(mineNow, c) && !containsCheck(f.carry, c) {
			f.carry = append(f.carry, c)
		}
	}
	f.crossPending[name] = true
	if !f.gap && !errors.Is(err, context.Canceled) { // leasehold stopping is no failure
		f.gap, f.gapIndex = true, f.sentIndex
	}
	w.log.Warn(
		"consul query failed; what left the "+state+" checks stays as it was until the "+
			other+" ones are read",
		"err", err)
}

// readNodesBack reads the serfHealth of the nodes whose check left the
// non-passing sets (before: the sets as they were): they came back, and
// how (a node that failed meanwhile keeps its sessions lapsed) is in their
// serfHealth's index.
func (w *Watcher) readNodesBack(ctx context.Context, before []health.CheckState) {
	f := &w.fast
	after := append(append(slices.Clone(f.crit), f.warn...), f.carry...)
	var back []health.CheckState
	for _, c := range before {
		if isSerf(c) && !containsCheck(after, c) && !containsCheck(back, c) {
			back = append(back, c)
		}
	}
	if len(back) > 3 {
		// Many nodes are back at once (a partition healed): one listing
		// rather than a read per node under the lock.
		if checks, sidx, err := w.cat.SerfHealth(ctx, 0, 0); err == nil {
			f.takeSerf(checks, sidx, w.receipt(sidx))
			back = nil
		}
	}
	for _, c := range back {
		sc, err := w.cat.NodeSerf(ctx, c.Node)
		if err != nil {
			// Keep saying the node failed (its sessions stay lapsed) until
			// a listing says how it came back; lapses go out meanwhile.
			w.log.Warn("consul query failed; the node stays failed until serfHealth is listed",
				"node", c.Node, "err", err)
			f.serf[c.Node] = c
			if !f.gap {
				f.gap, f.gapIndex = true, f.sentIndex
			}
			continue
		}
		if sc != nil {
			if s := checkState(sc); s.ModifyIndex >= f.serf[c.Node].ModifyIndex {
				f.serf[c.Node] = s
			}
		}
	}
}

// takeSerf replaces the serfHealth of every node by a listing at index,
// current at at (called with f.mu held); a node's own read may be newer
// than the listing.
func (f *fastPath) takeSerf(checks api.HealthChecks, index, at uint64) {
	f.serfAt = at
	serf := make(map[string]health.CheckState, len(checks))
	for _, c := range checks {
		s := checkState(c)
		if !isSerf(s) {
			continue
		}
		if old, ok := f.serf[s.Node]; ok && old.ModifyIndex > s.ModifyIndex &&
			old.CreateIndex == s.CreateIndex {
			s = old
		}
		serf[s.Node] = s
	}
	f.serf, f.serfIndex = serf, index
}

// watchSerf follows every node's serfHealth, paced by SlowInterval.
func (w *Watcher) watchSerf(ctx context.Context) {
	f := &w.fast
	w.blockingLoop(
		ctx,
		watchSpec{name: "serf", minInterval: max(w.cfg.MinInterval*4, w.cfg.SlowInterval)},
		func(ctx context.Context, index uint64, wait time.Duration) (uint64, handleFunc) {
			checks, idx, err := cutShort(
				w,
				ctx,
				wait,
				func(ctx context.Context, wait time.Duration) (api.HealthChecks, uint64, error) {
					return w.cat.SerfHealth(ctx, index, wait)
				},
			)
			at := w.receipt(idx)
			return idx, func() (uint64, error) {
				if err != nil {
					return 0, err
				}
				f.mu.Lock()
				f.takeSerf(checks, idx, at)
				deliver := w.publish(ctx)
				f.mu.Unlock()
				deliver()
				return idx, nil
			}
		},
	)
}

func containsCheck(cs []health.CheckState, c health.CheckState) bool {
	for _, x := range cs {
		if x.Node == c.Node && x.CheckID == c.CheckID {
			return true
		}
	}
	return false
}

// serfOf is the serfHealth among a node's checks (nil if none).
func serfOf(checks api.HealthChecks) *api.HealthCheck {
	for _, c := range checks {
		if c.CheckID == health.SerfHealthCheckID && c.ServiceID == "" {
			return c
		}
	}
	return nil
}
