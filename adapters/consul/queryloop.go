package consul

import (
	"context"
	"time"

	"github.com/jonboulle/clockwork"
)

// queryIndex holds the index rules of every blocking-query loop (each
// datacenter's watches, the operators' controls):
//   - after a failure the next query reads afresh (index 0): Consul may be a
//     new incarnation whose index is below ours, and waiting on ours would
//     block a whole wait;
//   - an answer whose index is below the one waited on is read afresh too;
//   - an index below the highest seen means Consul lost or restored its
//     state — except for a KV listing, whose index also goes back when
//     Consul reaps the tombstones of deleted keys.
type queryIndex struct {
	kvListing      bool
	index, highest uint64
}

// failed records a failed query.
func (q *queryIndex) failed() { q.index = 0 }

// fresh reports whether the next query reads afresh.
func (q *queryIndex) fresh() bool { return q.index == 0 }

// answered takes an answer's index; lostState reports that Consul's index
// went back (not for a KV listing).
func (q *queryIndex) answered(next uint64) (lostState bool) {
	if next < q.highest {
		lostState = !q.kvListing
		q.highest = 0
	}
	q.highest = max(q.highest, next)
	if next < q.index {
		next = 0
	}
	q.index = next
	return lostState
}

// queryLoop is the loop of every blocking query leasehold keeps open (each
// datacenter's watches, the operators' controls): query(index, wait) until
// ctx ends, the index kept by queryIndex's rules, a jittered exponential
// back-off after a failure, and at least interval between the starts of two
// queries (freshInterval after a fresh read), so an index of 0 never spins.
// Hooks (nil: none) hold what differs between watches.
type queryLoop struct {
	clock                   clockwork.Clock
	maxBackoff              time.Duration
	kvListing               bool
	interval, freshInterval time.Duration
	// before runs before each query and gives its blocking wait; false stops.
	before func(ctx context.Context) (wait time.Duration, ok bool)
	// after runs after each query with its outcome; false stops.
	after func(ctx context.Context, index, next uint64, err error) bool
	// failed says a query failed and when the next one goes.
	failed func(err error, retryIn time.Duration)
	// lostState says Consul's index went back (never for a KV listing).
	lostState func(ctx context.Context, from, to uint64)
	// wake is a channel a refresh closes and whether one is pending now
	// (a refresh waits for no pause).
	wake func() (<-chan struct{}, bool)
}

func (l queryLoop) run(
	ctx context.Context,
	query func(ctx context.Context, index uint64, wait time.Duration) (uint64, error),
) {
	bo := newBackoff(100*time.Millisecond, l.maxBackoff)
	q := queryIndex{kvListing: l.kvListing}
	for ctx.Err() == nil {
		var wait time.Duration
		if l.before != nil {
			var ok bool
			if wait, ok = l.before(ctx); !ok {
				return
			}
		}
		started := l.clock.Now()
		next, err := query(ctx, q.index, wait)
		if l.after != nil && !l.after(ctx, q.index, next, err) {
			return
		}
		var rest time.Duration
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			rest = bo.next()
			q.failed()
			if l.failed != nil {
				l.failed(err, rest)
			}
		} else {
			bo.reset()
			interval := l.interval
			if q.fresh() {
				// After a fresh read (the first, or after an error) a slow
				// pace would only delay what changed since.
				interval = min(interval, l.freshInterval)
			}
			from := q.highest
			if q.answered(next) && l.lostState != nil {
				l.lostState(ctx, from, next)
			}
			rest = interval - l.clock.Since(started)
		}
		var wake <-chan struct{}
		if l.wake != nil {
			var pending bool
			if wake, pending = l.wake(); pending && err == nil {
				rest = 0
			}
		}
		if !pause(ctx, l.clock, rest, wake) {
			return
		}
	}
}

// pause waits d on clock, or until wake is closed (nil: never); false when
// ctx ended.
func pause(ctx context.Context, clock clockwork.Clock, d time.Duration, wake <-chan struct{}) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := clock.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.Chan():
	case <-wake:
	}
	return true
}
