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
