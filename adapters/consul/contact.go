package consul

import (
	"context"
	"errors"
	"slices"
	"strings"
	"time"

	"github.com/leasehold/leasehold/health"
)

// LastContact is when Consul last answered a query (zero before the first).
func (w *Watcher) LastContact() time.Time {
	n := w.lastContact.Load()
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

// Watches whose answers come at least every FastWait whatever happens: the
// age of their last answer bounds how old the whole view may be.
var alwaysAnswering = []string{"non-passing", "warning", "serf", "services", "generations"}

// FreshAsOf is when leasehold's view of Consul was last known current (zero
// before every watch answered once): the oldest last answer among the watches
// that answer at least every FastWait, and the first error of each per-task
// watch failing now. A per-task watch is otherwise in a blocking query, which
// Consul answers as soon as the task changes: it was current until its query
// failed (a silent Consul shows in the watches that always answer).
func (w *Watcher) FreshAsOf() time.Time {
	w.contactMu.Lock()
	defer w.contactMu.Unlock()
	var oldest time.Time
	consider := func(name string) bool {
		t, ok := w.lastOK[name]
		if !ok {
			return false
		}
		if oldest.IsZero() || t.Before(oldest) {
			oldest = t
		}
		return true
	}
	for _, name := range alwaysAnswering {
		if !consider(name) {
			return time.Time{}
		}
	}
	for name := range w.failingWatches {
		if slices.Contains(alwaysAnswering, name) {
			continue // counted above
		}
		if t := w.failedAt[name]; oldest.IsZero() || t.Before(oldest) {
			oldest = t
		}
	}
	return oldest
}

// contact records the outcome of one query of watch name and reports a
// change of state: Consul counts as unreachable while the last query of any
// watch failed, so one answer that was in flight when Consul went away does
// not flip the state back.
func (w *Watcher) contact(ctx context.Context, name string, err error) {
	now := w.cfg.Clock.Now()
	if err == nil {
		w.lastContact.Store(now.UnixNano())
	}
	if errors.Is(err, context.Canceled) && ctx.Err() != nil {
		return
	}
	w.contactMu.Lock()
	if w.failingWatches == nil {
		w.failingWatches, w.watchErr = map[string]bool{}, map[string]error{}
		w.lastOK, w.failedAt = map[string]time.Time{}, map[string]time.Time{}
	}
	if err != nil {
		if !w.failingWatches[name] {
			w.failedAt[name] = now
		}
		w.failingWatches[name] = true
		w.watchErr[name] = err
	} else {
		delete(w.failingWatches, name)
		delete(w.failedAt, name)
		delete(w.watchErr, name)
		w.lastOK[name] = now
	}
	failing := len(w.failingWatches) > 0
	changed := w.failing != failing
	w.failing = failing
	// A failure is reported again when its kind changes (a missing right
	// or a certificate problem tells more than an unreachable Consul; an
	// unreachable one is not reported again for each new error text).
	var c *health.Contact
	if failing {
		prob, detail, perr := w.worstErrLocked()
		if changed || prob != w.problem ||
			(prob != health.ProblemUnreachable && detail != w.problemDetail) {
			c = &health.Contact{Err: perr, Problem: prob, Detail: detail}
		}
		w.problem, w.problemDetail = prob, detail
	} else if changed {
		c = &health.Contact{OK: true}
		w.problem, w.problemDetail = "", ""
	}
	w.contactMu.Unlock()
	if c != nil {
		w.send(ctx, health.Observation{Data: c})
	}
}

// worstErrLocked is the failing watches' error that tells most: a missing
// right, then a certificate problem, then the first failing watch's by name.
// A missing right's detail is every right the failing watches lack.
func (w *Watcher) worstErrLocked() (health.ContactProblem, string, error) {
	rank := map[health.ContactProblem]int{health.ProblemACL: 3, health.ProblemTLS: 2}
	var (
		best     error
		bestName string
		prob     health.ContactProblem
		detail   string
		rights   []string
	)
	for name, err := range w.watchErr {
		p, d := classify(err)
		var ae *ACLError
		if errors.As(err, &ae) {
			rights = append(rights, ae.Rights...)
		}
		if best == nil || rank[p] > rank[prob] || (rank[p] == rank[prob] && name < bestName) {
			best, bestName, prob, detail = err, name, p, d
		}
	}
	if prob == health.ProblemACL && len(rights) > 0 {
		slices.Sort(rights)
		detail = strings.Join(slices.Compact(rights), " and ")
	}
	return prob, detail, best
}

// forgetWatch drops a stopped watch from the contact state, so a task type
// that went away while failing does not keep Consul "unreachable".
func (w *Watcher) forgetWatch(name string) {
	w.contactMu.Lock()
	delete(w.failingWatches, name)
	delete(w.lastOK, name)
	delete(w.failedAt, name)
	delete(w.watchErr, name)
	w.contactMu.Unlock()
}
