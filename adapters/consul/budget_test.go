package consul

import (
	"context"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jonboulle/clockwork"
	"github.com/leasehold/leasehold/health"
)

func TestReadBudgetDebtAndRefill(t *testing.T) {
	clock := clockwork.NewFakeClock()
	b := newReadBudget(clock, 1000, 2000)
	b.charge(1500)
	if d := b.delay(); d != 0 {
		t.Fatalf("within the burst: delay %s", d)
	}
	b.charge(1500) // 1000 in debt
	if d := b.delay(); d != time.Second {
		t.Fatalf("delay %s, want 1s", d)
	}
	clock.Advance(1500 * time.Millisecond)
	if d := b.delay(); d != 0 {
		t.Fatalf("after the debt is paid: delay %s", d)
	}
	clock.Advance(time.Hour)
	b.charge(3000) // the burst holds two of the largest reads (1,500)
	if d := b.delay(); d != 0 {
		t.Fatal("the refill is capped at the burst, which a quiet fleet may spend at once")
	}
	b.charge(1)
	if d := b.delay(); d <= 0 {
		t.Fatal("beyond the burst: no debt")
	}
	var nilBudget *readBudget
	nilBudget.charge(10)
	if nilBudget.delay() != 0 {
		t.Fatal("no budget: no delay")
	}
}

// While the catalog is being written a yielding budget pays at a share of
// its rate (writeVolume over Consul's raft entries a second, at least a
// quarter), until settleQuiet after the last write; what it earned before a
// write is not repriced, and a budget that does not yield (the lapse
// marks', the refreshes') ignores writes.
func TestAYieldingBudgetPaysLessWhileTheCatalogIsWritten(t *testing.T) {
	clock := clockwork.NewFakeClock()
	b := newReadBudget(clock, 1000, 1000)
	b.yields = true
	b.charge(3000) // 2,000 in debt
	b.writing(1000)
	// 250 ms at 250 B/s earn 62.5; the other 1,937.5 take 1.9375 s.
	if d, want := b.delay(), 2187500*time.Microsecond; d != want {
		t.Fatalf("a write just now: delay %s, want %s", d, want)
	}
	if r := b.rateNow(); r != 250 {
		t.Fatalf("rate while written %.0f, want 250", r)
	}
	for range 40 { // 4 s of writes, 100 ms apart
		clock.Advance(100 * time.Millisecond)
		b.writing(1000)
	}
	// 4 s at 250 B/s: 1,000 earned, 1,000 owed.
	if d, want := b.delay(), 250*time.Millisecond+937500*time.Microsecond; d != want {
		t.Fatalf("after 4 s of writes: delay %s, want %s", d, want)
	}
	clock.Advance(time.Second) // the writes stopped: 250 ms at 250 B/s, 750 ms at 1,000
	if d, want := b.delay(), 187500*time.Microsecond; d != want {
		t.Fatalf("1 s after the last write: delay %s, want %s", d, want)
	}
	if r := b.rateNow(); r != 1000 {
		t.Fatalf("rate after the writes %.0f, want the whole 1000", r)
	}
	clock.Advance(time.Hour)
	b.charge(int64(b.burst) + 50) // 50 in debt from a full bucket: within one write's
	// 250 ms at 250 B/s
	b.writing(1000)
	if d, want := b.delay(), 200*time.Millisecond; d != want {
		t.Fatalf("50 owed while written: delay %s, want %s", d, want)
	}
	b.writing(100) // 100 entries a second: half the rate
	if r := b.rateNow(); r != 500 {
		t.Fatalf("rate at 100 entries a second %.0f, want 500", r)
	}
	b.writing(10) // a trickle: the whole rate
	if r := b.rateNow(); r != 1000 {
		t.Fatalf("rate at 10 entries a second %.0f, want the whole 1000", r)
	}

	clock.Advance(time.Hour)
	b.charge(int64(b.burst) + 1000) // 1,000 in debt from a full bucket
	clock.Advance(500 * time.Millisecond)
	b.writing(1000) // the quiet 500 ms before it earned 500
	if d, want := b.delay(), 250*time.Millisecond+437500*time.Microsecond; d != want {
		t.Fatalf("a write after a quiet 500 ms: delay %s, want %s", d, want)
	}

	refresh := newReadBudget(clock, 1000, 1000)
	refresh.charge(2000)
	refresh.writing(1000)
	if d := refresh.delay(); d != time.Second || refresh.rateNow() != 1000 {
		t.Fatalf("a budget that does not yield: delay %s, rate %.0f", d, refresh.rateNow())
	}
	var none *readBudget
	none.writing(1000)
	if none.rateNow() != 0 {
		t.Fatal("no budget: rate 0")
	}
}

// A pause may borrow what yielding withheld while the budget was in debt,
// up to one round, and nothing once the debt is paid.
func TestAPauseBorrowsWhatTheYieldWithheld(t *testing.T) {
	clock := clockwork.NewFakeClock()
	b := newReadBudget(clock, 1000, 1000)
	b.yields = true
	for range 3 {
		b.chargeRead("task work", 3000) // 8,000 in debt; a round is 3,000
	}
	for range 20 { // 2 s of writes: 500 earned, 1,500 withheld
		b.writing(1000)
		clock.Advance(100 * time.Millisecond)
	}
	clock.Advance(250 * time.Millisecond) // the last write's 250 ms: 62.5 and 187.5 more
	// -8,000 + 562.5 = -7,437.5, within two rounds and the 1,687.5 withheld.
	if d := b.settledDelay(); d != 0 {
		t.Fatalf("a pause after the writes waits %s: want none", d)
	}
	if d := b.delayPast(2); d == 0 {
		t.Fatal("beyond two rounds without what was withheld: want a wait")
	}
	for range 200 { // 20 s of writes: 15,000 more withheld, a round (3,000) counted
		b.writing(1000)
		clock.Advance(100 * time.Millisecond)
	}
	b.charge(8000) // ~10,400 in debt, past three rounds
	clock.Advance(250 * time.Millisecond)
	b.mu.Lock()
	b.refill(clock.Now())
	tokens := b.tokens
	b.mu.Unlock()
	if d, want := b.settledDelay(), seconds((-9000-tokens)/1000); d != want {
		t.Fatalf("deep in debt: settled delay %s, want %s (to three rounds at the whole rate)",
			d, want)
	}
	clock.Advance(time.Hour) // paid
	b.mu.Lock()
	b.refill(clock.Now())
	withheld := b.withheld
	b.mu.Unlock()
	if withheld != 0 {
		t.Fatalf("%.0f still withheld once the debt is paid", withheld)
	}
}

// A refill at a time before the last one (a caller's stale now) credits
// nothing and does not move the budget's time back, so no interval is
// earned twice.
func TestAStaleRefillEarnsNothingTwice(t *testing.T) {
	clock := clockwork.NewFakeClock()
	b := newReadBudget(clock, 1000, 1000)
	b.charge(2000) // 1,000 in debt
	stale := clock.Now()
	clock.Advance(500 * time.Millisecond)
	if d := b.delay(); d != 500*time.Millisecond {
		t.Fatalf("delay %s, want 500ms", d)
	}
	b.mu.Lock()
	b.refill(stale)
	b.mu.Unlock()
	if d := b.delay(); d != 500*time.Millisecond {
		t.Fatalf("after a stale refill: delay %s, want 500ms (the 500 ms not earned twice)", d)
	}
}

// A read larger than the configured burst (a whole task type of 10,000)
// is made at once when the fleet has been quiet, however large it is, and
// reads in a row are still paced at the rate.
func TestALoneChangeIsReadAtOnceWhateverTheListingSize(t *testing.T) {
	clock := clockwork.NewFakeClock()
	const rate, listing = 4 << 20, 12 << 20
	b := newReadBudget(clock, rate, 2*rate)
	b.charge(listing)
	if d := b.delay(); d != time.Second {
		t.Fatalf("the first whole listing: delay %s, want 1s (its 4 MiB over the burst)", d)
	}
	clock.Advance(time.Minute) // quiet
	b.charge(listing)
	if d := b.delay(); d != 0 {
		t.Fatalf("a lone change after a quiet minute waits %s: want none", d)
	}
	b.charge(listing)
	b.charge(listing)
	if d := b.delay(); d != 3*time.Second {
		t.Fatalf("reads in a row: delay %s, want 3s (the rate paces them)", d)
	}
	// One huge read grows the burst only to maxGrownBurst.
	b.charge(1 << 30)
	clock.Advance(time.Hour)
	b.charge(maxGrownBurst + 1)
	if d := b.delay(); d <= 0 {
		t.Fatal("a read past maxGrownBurst after a quiet hour: no debt (the burst grew unbounded)")
	}
}

// TestWatcherReadBudgetPacesMembershipReads: a task watch whose reads put the
// budget in debt waits before its next catalog query (the changes of the wait
// coalesce into one read); the fast path does not wait; a refresh request
// ends the generations watch's wait.
func TestWatcherReadBudgetPacesMembershipReads(t *testing.T) {
	h := startWatcher(
		t,
		WatchConfig{
			MinInterval:  time.Millisecond,
			ReadRate:     1000,
			ReadBurst:    1000,
			SlowInterval: time.Hour,
		},
	)
	h.cat.call(t, "services")
	h.cat.push("services", scripted{index: 5, services: map[string][]string{"work": {"leasehold"}}})
	h.cat.call(t, "nodes")
	h.cat.push(
		"nodes/work",
		scripted{
			index: 8,
			nodes: []*api.CatalogService{catalogEntry("n1", "a", "s1", 7)},
			bytes: 1000,
		},
	)
	h.cat.push(
		"health/work",
		scripted{
			index:   8,
			entries: []*api.ServiceEntry{entry("work", "n1", "a", "s1", 1, "passing")},
			bytes:   2000,
		},
	)
	for o := h.observe(); o.Members() == nil; o = h.observe() {
	}
	// 3000 bytes read against a burst of 1000: 2 s of debt (charged just
	// after the observation goes out)
	for deadline := time.Now().Add(5 * time.Second); h.w.budget.delay() != 2*time.Second; {
		if time.Now().After(deadline) {
			t.Fatalf("debt %s, want 2s", h.w.budget.delay())
		}
		// Polling a counter the watch goroutine sets; no event to wait on.
		time.Sleep(time.Millisecond)
	}
	var mark int64 // calls up to it were made before the step under test
	expectNo := func(method string) {
		t.Helper()
		for quiet := time.After(50 * time.Millisecond); ; { // absence check only
			select {
			case c := <-h.cat.calls:
				if c.method == method && c.seq > mark {
					t.Fatalf("%s queried while the budget is in debt: %+v", method, c)
				}
				continue
			case <-quiet:
			}
			return
		}
	}
	expectNo("nodes")
	// the fast path is not paced
	h.cat.push("nonpassing", scripted{index: 9})
	for o := h.observe(); o.NonPassing() == nil; o = h.observe() {
	}
	h.clock.Advance(1900 * time.Millisecond)
	expectNo("nodes")
	h.clock.Advance(200 * time.Millisecond)
	if c := h.cat.call(t, "nodes"); c.index != 8 {
		t.Fatalf("next catalog query at index %d, want 8", c.index)
	}
	// generations: in debt too (its own budget), but a refresh (fencing) is
	// answered at once
	h.cat.push("generations", scripted{index: 3, bytes: 5000}) // answers its first query
	for o := h.observe(); o.Generations() == nil; o = h.observe() {
	}
	// the observation goes out before the watch charges the read
	for deadline := time.Now().Add(5 * time.Second); h.w.genBudget.delay() < 4*time.Second; {
		if time.Now().After(deadline) {
			t.Fatalf("the generations read was not charged: debt %s", h.w.genBudget.delay())
		}
		// Polling a counter the watch goroutine sets; no event to wait on.
		time.Sleep(time.Millisecond)
	}
	mark = h.cat.seq.Load()
	expectNo("generations")
	h.waiters = 1 // every other watch is in a blocking query now
	// Past the generations watch's pause: now it waits for the budget.
	h.advance(10 * time.Millisecond)
	expectNo("generations")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := h.clock.BlockUntilContext(ctx, 1); err != nil {
		t.Fatal("the generations watch does not wait for the budget")
	}
	if _, err := h.w.Refresh(context.Background(), everything); err != nil {
		t.Fatal(err)
	}
	// the blocking query it was about to make is ended by the refresh, which
	// reads afresh (index 0)
	for c := h.cat.call(t, "generations"); c.index != 0 || c.seq <= mark; {
		c = h.cat.call(t, "generations")
	}
}

// TestGenerationRaiseNeverWaitsForAnotherTaskTypesDebt: the generation keys
// have a read budget of their own. One task type's listing (40 MiB of JSON, a
// large fleet's churn) puts the memberships' budget 8 s in debt at the default
// 4 MiB/s; a new session's generation raised meanwhile (a few bytes) is still
// read at once, so the session it replaces is fenced (STALE, out of the xDS
// assignments) without waiting for that debt to be paid.
func TestGenerationRaiseNeverWaitsForAnotherTaskTypesDebt(t *testing.T) {
	h := startWatcher(t, WatchConfig{MinInterval: time.Millisecond, SlowInterval: time.Hour})
	h.cat.push(
		"generations",
		scripted{
			index: 3,
			kv:    api.KVPairs{{Key: health.GenerationKeyPrefix + "a", Value: []byte("1")}},
		},
	)
	for o := h.observe(); o.Generations() == nil; o = h.observe() {
	}
	// a big task type's listing, read while the generations watch pauses
	h.cat.call(t, "services")
	h.cat.push(
		"services",
		scripted{index: 5, services: map[string][]string{"work": {"leasehold"}, "consul": nil}},
	)
	h.cat.call(t, "nodes")
	h.cat.push(
		"nodes/work",
		scripted{
			index: 8,
			nodes: []*api.CatalogService{catalogEntry("n1", "b", "s1", 7)},
			bytes: 40 << 20,
		},
	)
	h.cat.push(
		"health/work",
		scripted{
			index:   8,
			entries: []*api.ServiceEntry{entry("work", "n1", "b", "s1", 1, "passing")},
		},
	)
	for o := h.observe(); o.Members() == nil; o = h.observe() {
	}
	for deadline := time.Now().Add(5 * time.Second); h.w.budget.delay() < 7*time.Second; {
		if time.Now().After(deadline) {
			t.Fatalf("debt %s", h.w.budget.delay())
		}
		time.Sleep(time.Millisecond) // polling a counter the task watch sets
	}
	// instance a restarts: generation 2 is raised before its new session registers
	h.cat.push(
		"generations",
		scripted{
			index: 9,
			kv:    api.KVPairs{{Key: health.GenerationKeyPrefix + "a", Value: []byte("2")}},
		},
	)
	for step := 0; step < 100; step++ { // 1 s of fake time in 10 ms steps
		h.clock.Advance(10 * time.Millisecond)
		select {
		case o := <-h.out:
			if o.Generations() != nil && o.Generations().Keys["a"].Generation == 2 {
				return
			}
		case <-time.After(5 * time.Millisecond):
		}
	}
	t.Fatalf(
		"a's generation 2 (a replaced session fenced) not read after 1 s: the generations watch "+
			"waits for the %s debt of another task type's listing",
		h.w.budget.delay().Round(time.Second),
	)
}
