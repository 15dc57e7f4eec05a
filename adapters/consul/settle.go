package consul

import (
	"context"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Settled changes. Under churn (thousands of executors registering) every
// task watch is in debt to the read budget, and all of them wait for it
// together: the reads come in rounds, one whole listing of every task type
// per round (~12 MB at 10,000 executors, 3 s at the default rate). The
// changes after which the churn stopped waited up to a round's debt, so the
// view caught up with Consul 3.7–5.5 s after the last registration.
//
// So while task watches wait for the budget, one index-only blocking query
// on the datacenter's catalog services (which every registration,
// deregistration or change of a service moves, and a check's status does
// not) looks for a pause: an index that stays put for settleQuiet. Once it
// sees one, the waiting watches go on, borrowing up to two rounds (a round
// is the last read of every watch) ahead of the rate, and what yielding to
// the catalog's writes withheld, up to a round more
// (readBudget.settledDelay). The reads after them pay the loan back first,
// so over time the rate still bounds what leasehold reads; what moves is
// when: the reads the end of a churn needs come right after it, not a round
// later.

// settleQuiet is how long the catalog's services index must stay put for
// the registrations to count as paused. A registering fleet moves it every
// few milliseconds; a pause of this length is the end of a burst (or a
// slow trickle, which the allowance bounds).
const settleQuiet = 250 * time.Millisecond

// servicesIndexCatalog is a catalog that can wait on the datacenter's
// catalog services index; the task watches settle with it.
type servicesIndexCatalog interface {
	// ServicesIndex blocks until the catalog services index passes index,
	// or wait ends, and answers the index.
	ServicesIndex(ctx context.Context, index uint64, wait time.Duration) (uint64, error)
}

// quietProbe is the pause the task watches in debt wait for.
type quietProbe struct {
	mu      sync.Mutex
	waiters int
	quiet   chan struct{} // closed at the next pause seen, then replaced
	joined  chan struct{} // closed when a watch joins, then replaced (wakes the probe)
}

func newQuietProbe() *quietProbe {
	return &quietProbe{quiet: make(chan struct{}), joined: make(chan struct{})}
}

// join counts a waiting watch in; the channel closes at the next pause the
// probe sees; leave must follow.
func (p *quietProbe) join() (quiet <-chan struct{}, leave func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.waiters++
	close(p.joined)
	p.joined = make(chan struct{})
	return p.quiet, func() {
		p.mu.Lock()
		p.waiters--
		p.mu.Unlock()
	}
}

// await blocks while no watch waits; false when ctx ended.
func (p *quietProbe) await(ctx context.Context) bool {
	for {
		p.mu.Lock()
		n, joined := p.waiters, p.joined
		p.mu.Unlock()
		if n > 0 {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-joined:
		}
	}
}

// paused releases the watches waiting for a pause.
func (p *quietProbe) paused() {
	p.mu.Lock()
	defer p.mu.Unlock()
	close(p.quiet)
	p.quiet = make(chan struct{})
}

// probeQuiet runs the quiet probe while any task watch waits for the
// budget: a query every probeEvery, each waiting on the index last
// answered until settleQuiet has passed since that answer; the same index
// then is a pause (nothing registered, deregistered or changed since).
// Each query holds one of the per-task query slots, so the Watcher's
// connections stay within MaxConcurrent+2; with none free it tries again a
// probeEvery later (the watches wait for the debt meanwhile, as without
// it).
func (w *Watcher) probeQuiet(ctx context.Context, cat servicesIndexCatalog) {
	kind := metric.WithAttributes(w.attrs(attribute.String("watch", "quiet"))...)
	w.requests.Add(ctx, 0, kind)
	w.errs.Add(ctx, 0, kind)
	clock := w.cfg.Clock
	var index uint64
	var at time.Time       // when Consul answered index
	var answered time.Time // when the last query was answered
	var volume float64     // Consul's raft entries a second while its catalog moves
	// Failing queries are retried at a backing-off pace, not 8 a second
	// for as long as Consul fails.
	bo := newBackoff(probeEvery, probeBackoffCap)
	for w.quiet.await(ctx) {
		start := clock.Now()
		every := probeEvery
		select {
		case w.slots <- struct{}{}:
			wait := max(settleQuiet-clock.Since(at), time.Millisecond)
			// Its answers (the datacenter's whole services listing) are
			// counted in the read bytes, not charged to the budget.
			qctx, sizes := withReadSizes(ctx)
			next, err := cat.ServicesIndex(qctx, index, wait)
			<-w.slots
			w.countRead(ctx, watchSpec{name: "quiet"}, sizes, nil)
			w.requests.Add(ctx, 1, kind)
			switch {
			case err != nil:
				if ctx.Err() != nil {
					return
				}
				w.errs.Add(ctx, 1, kind)
				next = 0 // the next query answers at once: no pause
				every = bo.next()
			case index != 0 && next == index:
				if clock.Since(at) >= settleQuiet {
					w.quiet.paused()
				}
			default: // moved, or a first answer
				at = clock.Now()
				// A move is the catalog being written: the membership and
				// generation reads yield to it, as much as Consul's raft
				// log grew since the last answer, until the pause. What
				// moved while the probe slept (no watch waited) counts at
				// its average over that time. A first answer and an index
				// that went back (a restored snapshot) are no writes.
				if index != 0 && next > index {
					gap := at.Sub(answered)
					sample := float64(next-index) / max(gap.Seconds(), 1e-3)
					if volume == 0 || gap > settleQuiet+2*probeEvery {
						volume = sample // not the answer after one just before
					} else {
						volume += (sample - volume) / 2
					}
					w.budget.writing(volume)
					w.genBudget.writing(volume)
				} else {
					volume = 0
				}
			}
			if err == nil {
				answered = clock.Now()
				bo.reset()
			}
			index = next
		default:
		}
		if !pause(ctx, clock, every-clock.Since(start), nil) {
			return
		}
	}
}

// probeEvery paces the quiet probe: a churning catalog answers each query
// at once, so this is its rate then (8 a second), and a pause is seen
// settleQuiet to settleQuiet+probeEvery after the last change.
const probeEvery = settleQuiet / 2

// probeBackoffCap is the longest wait between failing probe queries: a
// pause is not seen while Consul fails, and the watches then read at the
// budget's pace, as they would without the probe.
const probeBackoffCap = 5 * time.Second

// awaitSettling is readBudget.wait for a task watch while the quiet probe
// runs: it ends when the debt is paid, or at a pause of the datacenter's
// registrations once the budget's allowance holds the read.
func (w *Watcher) awaitSettling(ctx context.Context, b *readBudget) (time.Duration, bool) {
	clock := w.cfg.Clock
	start := clock.Now()
	since := func() time.Duration { return clock.Since(start) }
	for {
		d := b.delay()
		if d <= 0 {
			return since(), true
		}
		quiet, leave := w.quiet.join()
		t := clock.NewTimer(d)
		var paused bool
		select {
		case <-ctx.Done():
		case <-t.Chan():
		case <-quiet:
			paused = true
		}
		t.Stop()
		leave()
		if ctx.Err() != nil {
			return since(), false
		}
		if !paused {
			continue
		}
		if s := b.settledDelay(); s <= 0 {
			return since(), true
		} else if !pause(ctx, clock, min(b.delay(), s), nil) {
			return since(), false
		}
		// Past the allowance's wait the churn may have resumed: the next
		// pause is waited for again (or the whole debt).
	}
}
