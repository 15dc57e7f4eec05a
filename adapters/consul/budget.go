package consul

import (
	"context"
	"sync"
	"time"

	"github.com/jonboulle/clockwork"
	"go.opentelemetry.io/otel/metric"
)

// readBudget paces the reads whose answers grow with the fleet (task
// memberships, generation keys): Consul 1.13 has no delta reads, so each
// change costs a whole listing, and a fleet that registers thousands of
// executors would otherwise have leasehold re-read whole task types as fast
// as Consul answers (a load that made healthy leases lapse, measured under
// churn). Reads are charged after the fact with the bytes they
// decoded; a watch in debt waits before its next query, so the changes of
// that wait coalesce into one read. A quiet fleet holds a full bucket: one
// change is read at once.
type readBudget struct {
	clock clockwork.Clock
	rate  float64 // bytes per second
	burst float64

	mu     sync.Mutex
	tokens float64
	at     time.Time
}

func newReadBudget(clock clockwork.Clock, rate, burst int64) *readBudget {
	return &readBudget{
		clock:  clock,
		rate:   float64(rate),
		burst:  float64(burst),
		tokens: float64(burst),
		at:     clock.Now(),
	}
}

func (b *readBudget) refill(now time.Time) {
	if dt := now.Sub(b.at).Seconds(); dt > 0 {
		b.tokens = min(b.burst, b.tokens+dt*b.rate)
	}
	b.at = now
}

// charge spends n bytes; the balance may go negative (a debt). The burst
// grows to hold two reads of the largest size charged: a quiet fleet must
// read one change at once whatever its size, and a task type of 10,000
// executors lists ~12 MB, more than the configured burst, so each lone
// deregistration waited 3 s for the debt of the one before
// (TestALoneChangeIsReadAtOnceWhateverTheListingSize). Sustained reads are
// still paced at the rate. The growth stops at maxGrownBurst, so that one
// huge read (an incident's) cannot loosen the pacing for good.
func (b *readBudget) charge(n int64) {
	if b == nil || n <= 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refill(b.clock.Now())
	b.burst = max(b.burst, min(2*float64(n), maxGrownBurst))
	b.tokens -= float64(n)
}

// maxGrownBurst bounds how far reads grow the burst: two listings of a task
// type of ~50,000 executors.
const maxGrownBurst = 128 << 20

// delay is how long until the balance is back to zero (0: not in debt).
func (b *readBudget) delay() time.Duration {
	if b == nil {
		return 0
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refill(b.clock.Now())
	if b.tokens >= 0 {
		return 0
	}
	return time.Duration(-b.tokens / b.rate * float64(time.Second))
}

// wait blocks while the budget is in debt, until ctx ends or wake fires (a
// refresh request: fencing does not wait for the budget). It reports how
// long it waited and whether ctx is still live.
func (b *readBudget) wait(ctx context.Context, wake <-chan struct{}) (time.Duration, bool) {
	start := b.clock.Now()
	for {
		d := b.delay()
		if d <= 0 {
			return b.clock.Since(start), true
		}
		t := b.clock.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return b.clock.Since(start), false
		case <-wake:
			t.Stop()
			return b.clock.Since(start), true
		case <-t.Chan():
		}
	}
}

// awaitBudget waits while the watch's read budget is in debt; a refresh
// request (fencing) ends the wait of a watch it reads afresh. False when ctx
// ended.
func (w *Watcher) awaitBudget(
	ctx context.Context,
	spec watchSpec,
	kind metric.MeasurementOption,
) bool {
	wake := w.refreshWakeOf(spec.name)
	if kick := w.refreshC[spec.name]; len(kick) > 0 {
		return ctx.Err() == nil // a refresh is pending: answer it now
	}
	waited, ok := spec.budget.wait(ctx, wake)
	if waited > 0 {
		w.budgetWait.Add(ctx, waited.Seconds(), kind)
	}
	return ok
}
