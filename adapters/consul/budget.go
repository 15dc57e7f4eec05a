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
	// yields: the budget pays at a share of its rate while the
	// datacenter's catalog is being written (writing).
	yields bool

	mu     sync.Mutex
	tokens float64
	at     time.Time
	// The catalog counts as being written until busyUntil, and the budget
	// pays at busyShare of its rate until then; withheld is what yielding
	// kept from the budget while it was in debt, which a pause may borrow
	// too (settledDelay).
	busyUntil time.Time
	busyShare float64
	withheld  float64
	// last is each watch's latest read and round their sum: what one read
	// of every watch costs, two of which the reads at a pause may borrow
	// (settledDelay).
	last  map[string]float64
	round float64
}

// While the catalog is being written, a yielding budget pays its debt at
// writeVolume over Consul's raft entries a second, at least writingShare
// and at most the whole rate. Consul 1.13 has no delta reads, so each
// round of a fleet registering by the thousand re-reads every task type
// whole, and Consul encodes those listings with the CPU its registrations
// need (measured at 10,000 executors over 10 task types on 2 cores: see
// BENCHMARKS.md, "Reads that yield to a catalog being written"). A fleet
// registering ~160 executors a second grows the log by ~460 entries a
// second and reads at a quarter of the rate; a trickle of a few writes a
// second (other services of the datacenter) costs Consul little, and the
// reads do not yield to it.
const (
	writingShare = 0.25
	writeVolume  = 50.0 // raft entries a second
)

func newReadBudget(clock clockwork.Clock, rate, burst int64) *readBudget {
	return &readBudget{
		clock:  clock,
		rate:   float64(rate),
		burst:  float64(burst),
		tokens: float64(burst),
		at:     clock.Now(),
	}
}

// refill adds what the budget earned since it last did: at the writing
// share of the rate up to busyUntil, at the rate after it. Exact: writing
// refills before it moves busyUntil or the share, and time never runs
// back (a now before the last refill adds nothing and moves nothing).
func (b *readBudget) refill(now time.Time) {
	if !now.After(b.at) {
		return
	}
	end := now
	if b.busyUntil.Before(now) {
		end = b.busyUntil
	}
	busy := max(end.Sub(b.at), 0).Seconds()
	whole := now.Sub(b.at).Seconds() - busy
	b.tokens = min(b.burst, b.tokens+busy*b.writingRate()+whole*b.rate)
	b.withheld = min(b.withheld+busy*(b.rate-b.writingRate()), maxGrownBurst)
	if b.tokens >= 0 {
		b.withheld = 0 // the debt is paid: nothing deferred is owed a read
	}
	b.at = now
}

// writingRate is the rate while the catalog is being written.
func (b *readBudget) writingRate() float64 {
	if !b.yields || b.busyShare <= 0 {
		return b.rate
	}
	return b.rate * b.busyShare
}

// writing: the datacenter's catalog moved just now (a registration,
// deregistration or change of a service) while its raft log grew by volume
// entries a second; a yielding budget counts it as being written until
// settleQuiet after now, the pause the quiet probe waits for. Nil or not
// yielding: nothing.
func (b *readBudget) writing(volume float64) {
	if b == nil || !b.yields {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.clock.Now()
	b.refill(now)
	if !now.After(b.at) {
		now = b.at
	}
	share := 1.0
	if volume > 0 {
		share = min(max(writeVolume/volume, writingShare), 1)
	}
	b.busyUntil, b.busyShare = now.Add(settleQuiet), share
}

// rateNow is the rate the budget pays at now, in bytes per second (0: a
// nil budget, unpaced).
func (b *readBudget) rateNow() float64 {
	if b == nil {
		return 0
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.clock.Now().Before(b.busyUntil) {
		return b.writingRate()
	}
	return b.rate
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

// chargeRead is charge for one read of the watch named key, which it also
// remembers as that watch's share of a round.
func (b *readBudget) chargeRead(key string, n int64) {
	if b == nil || n <= 0 {
		return
	}
	b.charge(n)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.last == nil {
		b.last = map[string]float64{}
	}
	b.round += float64(n) - b.last[key]
	b.last[key] = float64(n)
}

// forget drops the watch named key from the round (its task type is gone).
func (b *readBudget) forget(key string) {
	if b == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.round -= b.last[key]
	delete(b.last, key)
}

// settledDelay is delay for a read at a pause of the registrations
// (settle.go): it may borrow up to two rounds (a round is one read of every
// watch, at most maxGrownBurst) ahead of the rate: one for the reads the
// pause needs, and one for a pause that was not the end (registrations that
// stalled for a moment mid-churn), after which the real end would otherwise
// wait a round's debt again. It may also borrow what yielding to the
// catalog's writes withheld while the budget was in debt, up to one round
// more: the yield defers reads to the churn's end, when Consul has the
// time, and does not deny them (with yielding and no such allowance, the
// view caught up 2.2 s after two churn steps in six; in the one run with
// it, after two in three as well: BENCHMARKS.md, "Reads that yield to a
// catalog being written"). The borrowed bytes are paid back at the rate
// before any other read, and the debt never goes past four rounds, so over
// time reads stay paced at the rate; what the allowance moves is when: a
// fleet whose churn just ended is read at once rather than after the debt
// of its last round.
func (b *readBudget) settledDelay() time.Duration {
	if b == nil {
		return 0
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refill(b.clock.Now())
	round := min(b.round, maxGrownBurst)
	return b.delayTo(-2*round - min(b.withheld, round))
}

// maxGrownBurst bounds how far reads grow the burst: two listings of a task
// type of ~50,000 executors.
const maxGrownBurst = 128 << 20

// delay is how long until the balance is back to zero (0: not in debt).
func (b *readBudget) delay() time.Duration { return b.delayPast(0) }

// delayPast is how long until the debt is within rounds rounds (0: it is).
func (b *readBudget) delayPast(rounds float64) time.Duration {
	if b == nil {
		return 0
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refill(b.clock.Now())
	return b.delayTo(-rounds * min(b.round, maxGrownBurst))
}

// delayTo is how long until the balance, just refilled, is back to floor
// (0: it is); b.mu is held.
func (b *readBudget) delayTo(floor float64) time.Duration {
	if b.tokens >= floor {
		return 0
	}
	owed := floor - b.tokens
	busy := max(b.busyUntil.Sub(b.at), 0).Seconds() // b.at is now: just refilled
	if earned := busy * b.writingRate(); owed > earned {
		return seconds(busy + (owed-earned)/b.rate)
	}
	return seconds(owed / b.writingRate())
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

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
	var waited time.Duration
	var ok bool
	if spec.settles && w.quiet != nil && wake == nil {
		waited, ok = w.awaitSettling(ctx, spec.budget)
	} else {
		waited, ok = spec.budget.wait(ctx, wake)
	}
	if waited > 0 {
		w.budgetWait.Add(ctx, waited.Seconds(), kind)
	}
	return ok
}
