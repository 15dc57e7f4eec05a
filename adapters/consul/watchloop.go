package consul

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/leasehold/leasehold/health"
)

// blockingLoop runs one watch: query(index, wait) until ctx ends, following
// Consul's blocking-query rules (queryIndex), never below MinInterval
// between queries (so index 0 never spins), and a
// jittered exponential back-off after errors.
func (w *Watcher) blockingLoop(ctx context.Context, spec watchSpec, read readFunc) {
	name := spec.name
	kind := metric.WithAttributes(w.attrs(attribute.String("watch", watchKind(name)))...)
	// Every counter of this watch is exported from its start, so that a rate
	// of errors answers 0 rather than "no data" until the first one.
	w.requests.Add(ctx, 0, kind)
	w.errs.Add(ctx, 0, kind)
	w.wakeups.Add(ctx, 0, kind)
	var sizes, fresh *readSizes // of the query in flight, and of a refresh's fresh read in it
	queryLoop{
		clock: w.cfg.Clock, maxBackoff: w.cfg.MaxBackoff, kvListing: spec.kvListing,
		// After a fresh read (the first, or after an error) the slow pace
		// would only delay what changed since, e.g. the first task type
		// registering just after leasehold started.
		interval: spec.minInterval, freshInterval: w.cfg.MinInterval * 4,
		before: func(ctx context.Context) (time.Duration, bool) {
			if spec.budget != nil && !w.awaitBudget(ctx, spec, kind) {
				return 0, false
			}
			if !spec.useSlot {
				return w.fastWait(), true
			}
			if !w.acquire(ctx) {
				return 0, false
			}
			if w.waiting.Load() > 0 {
				return w.cfg.ContendedWait, true
			}
			return w.cfg.WaitTime, true
		},
		after: func(ctx context.Context, index, next uint64, err error) bool {
			if spec.useSlot {
				<-w.slots
			}
			w.countRead(ctx, spec, sizes, spec.budget)
			w.requests.Add(ctx, 1, kind)
			if fresh != nil { // a refresh's read: charged to the refreshes' budget
				w.countRead(ctx, spec, fresh, w.refreshBudget)
				w.requests.Add(ctx, 1, kind)
			}
			if err != nil && ctx.Err() == nil {
				w.errs.Add(ctx, 1, kind)
			} else if err == nil && next != index {
				w.wakeups.Add(ctx, 1, kind)
			}
			if err == nil {
				w.noteReached(next)
			}
			w.contact(ctx, name, err)
			return true
		},
		failed: func(err error, retryIn time.Duration) {
			w.log.Warn("consul query failed; backing off", "watch", name, "err", err,
				"retry_in", retryIn)
		},
		lostState: func(ctx context.Context, from, to uint64) {
			w.log.Warn("consul index went backwards: Consul lost or restored its state; resetting",
				"watch", name, "from", from, "to", to)
			turn := w.forgetIndexes()
			defer turn.end()
			if turn.await(w.stopping(ctx)) {
				w.send(
					ctx,
					health.Observation{Data: &health.Contact{OK: true, IndexWentBack: true}},
				)
			}
		},
		// The wake channel is taken before looking for a pending request: a
		// Refresh queues its request, then closes the channel, so one that
		// comes after the look still ends the pause.
		wake: func() (<-chan struct{}, bool) {
			wake := w.refreshWakeOf(name)
			return wake, len(w.refreshC[name]) > 0
		},
	}.run(ctx, func(ctx context.Context, index uint64, wait time.Duration) (uint64, error) {
		var qctx context.Context
		qctx, sizes = withReadSizes(ctx)
		next, f, err := w.runQuery(qctx, name, index, wait, read)
		fresh = f
		return next, err
	})
}

// refreshWakeOf is the channel a Refresh closes if watch name is one it
// reads afresh (nil, never ready, for the others).
func (w *Watcher) refreshWakeOf(name string) <-chan struct{} {
	if w.refreshC[name] == nil {
		return nil
	}
	w.wakeMu.Lock()
	defer w.wakeMu.Unlock()
	return w.refreshWake
}

// watchSpec names a watch and its pacing.
type watchSpec struct {
	name        string
	minInterval time.Duration // least time between two of its queries
	useSlot     bool          // holds a per-task query slot while querying
	// Answers grow with the fleet: paced by this read budget (nil: not paced).
	budget *readBudget
	// settles: the watch waits for the budget until a pause of the
	// registrations, then reads on the budget's allowance (settle.go).
	settles   bool
	kvListing bool // a KV listing: its index also goes back when Consul reaps tombstones
}

func (w *Watcher) acquire(ctx context.Context) bool {
	select {
	case w.slots <- struct{}{}:
		return true
	default:
	}
	w.waiting.Add(1)
	defer w.waiting.Add(-1)
	select {
	case w.slots <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}
