package consul

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/hashicorp/go-cleanhttp"
	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

// servicesIndexFake answers ServicesIndex on a fake clock: its first moves
// queries at once, each at a new index (a churning catalog), every later
// one after its whole wait at the same index (a pause).
type servicesIndexFake struct {
	clock clockwork.Clock
	moves int
	step  uint64      // how far each move takes the index (0: 1): raft entries between answers
	fail  atomic.Bool // every query fails
	mu    sync.Mutex
	calls int
}

func (f *servicesIndexFake) ServicesIndex(
	ctx context.Context, index uint64, wait time.Duration,
) (uint64, error) {
	f.mu.Lock()
	f.calls++
	n := f.calls
	f.mu.Unlock()
	if f.fail.Load() {
		return 0, errors.New("consul: 500 no leader")
	}
	step := max(f.step, 1)
	if n <= f.moves {
		return uint64(n) * step, nil
	}
	select {
	case <-f.clock.After(wait):
		return uint64(f.moves) * step, nil
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

func (f *servicesIndexFake) queries() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

// settling runs awaitSettling for a task watch after charges, with the
// quiet probe on a servicesIndexFake of moves, on a fake clock advanced 10
// ms at a time; it returns how long the wait took on that clock and the
// probe's queries.
func settling(t *testing.T, charges []int64, moves int) (time.Duration, int) {
	t.Helper()
	return settlingAt(t, charges, moves, 100)
}

// settlingAt is settling with each move taking the index step entries on
// (100 every 125 ms, 800 a second: a fleet registering; 1: a trickle).
func settlingAt(t *testing.T, charges []int64, moves int, step uint64) (time.Duration, int) {
	t.Helper()
	clock := clockwork.NewFakeClock()
	w := newWatcher(newFakeCatalog(), WatchConfig{Clock: clock, ReadRate: 1000, ReadBurst: 1000,
		Out: make(chan health.Observation, 1)})
	for _, n := range charges {
		w.budget.chargeRead("task work", n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	fake := &servicesIndexFake{clock: clock, moves: moves, step: step}
	w.quiet = newQuietProbe()
	probed := make(chan struct{})
	go func() { defer close(probed); w.probeQuiet(ctx, fake) }()
	defer func() { cancel(); <-probed }()
	start := clock.Now()
	done := make(chan bool, 1)
	go func() {
		_, ok := w.awaitSettling(ctx, w.budget)
		done <- ok
	}()
	for {
		// The clock moves when something waits on it, and after each step
		// this goroutine blocks a moment: a timer the watch no longer waits
		// on (it woke on a pause) still counts as a waiter until the watch
		// runs, which a loop that never blocked would keep from running
		// while the clock raced ahead.
		select {
		case ok := <-done:
			if !ok {
				t.Fatal("the wait ended with its context")
			}
			return clock.Since(start), fake.queries()
		case <-time.After(time.Millisecond):
		}
		bctx, bcancel := context.WithTimeout(ctx, 20*time.Millisecond)
		if clock.BlockUntilContext(bctx, 1) == nil {
			clock.Advance(10 * time.Millisecond)
		}
		bcancel()
		if ctx.Err() != nil {
			t.Fatal("awaitSettling never returned")
		}
	}
}

// A pause of the registrations while a task watch is in debt has it read
// then, on the budget's allowance (one round), not after the whole debt.
func TestAPauseIsReadBeforeTheDebtIsPaid(t *testing.T) {
	// 3,000 bytes against a burst of 1,000 at 1,000 B/s: 2 s of debt.
	took, queries := settling(t, []int64{3000}, 1)
	if took < settleQuiet || took > settleQuiet+probeEvery+50*time.Millisecond {
		t.Fatalf("a pause was read after %s (%d probe queries): want settleQuiet to "+
			"settleQuiet+probeEvery, not the 2 s debt", took, queries)
	}
}

// Registrations that go on have the watch read when the debt is paid, at a
// quarter of the rate while the catalog is being written (2,000 at 250 B/s:
// 8 s; ~7.6 s, as the probe's first answer is no write and the 125 ms to
// its second are paid at the whole rate), and the probe queries at most
// once per probeEvery meanwhile.
func TestChurnWaitsForTheWholeDebt(t *testing.T) {
	took, queries := settling(t, []int64{3000}, 1<<30)
	if took < 7500*time.Millisecond || took > 8*time.Second+50*time.Millisecond {
		t.Fatalf("a churning catalog: waited %s, want the 2,000 of debt at 250 B/s, ~7.6 s",
			took)
	}
	if queries > int(8*time.Second/probeEvery)+2 {
		t.Fatalf("%d probe queries in 8 s: more than one per probeEvery", queries)
	}
}

// A paused read borrows at most two rounds: deeper in debt, it waits until
// the debt is back within two rounds.
func TestAPauseBorrowsAtMostTwoRounds(t *testing.T) {
	// Three reads of 3,000 against a burst of 1,000: 8 s of debt; the round
	// is 3,000 (the watch's last read), so the allowance (6,000) reaches 2 s
	// from now.
	took, _ := settling(t, []int64{3000, 3000, 3000}, 1)
	if took < 2*time.Second || took > 2*time.Second+settleQuiet+50*time.Millisecond {
		t.Fatalf("a pause 8 s in debt was read after %s, want 2 s (back within two rounds)",
			took)
	}
	// 5 s in debt (tokens -5,000), within two rounds: read at the pause.
	took, _ = settling(t, []int64{3000, 3000}, 1)
	if took > settleQuiet+probeEvery+50*time.Millisecond {
		t.Fatalf("a pause 5 s in debt (within two rounds) was read after %s", took)
	}
}

// A trickle of writes (8 raft entries a second, other services of the
// datacenter) costs Consul little: the reads do not yield to it, and the
// debt is paid at the whole rate (2,000 at 1,000 B/s: 2 s).
func TestATrickleOfWritesIsNotYieldedTo(t *testing.T) {
	took, _ := settlingAt(t, []int64{3000}, 1<<30, 1)
	if took < 2*time.Second || took > 2*time.Second+50*time.Millisecond {
		t.Fatalf("a trickle of writes: waited %s, want the 2 s debt at the whole rate", took)
	}
}

// A churn's reads pay their debt at a quarter of the rate, and its pause
// may borrow what the yield withheld: the yield defers reads to the end of
// the churn, and does not deny them. Three reads of 3,000 against a burst
// of 1,000 at 1,000 B/s are 8,000 in debt; the allowance at a pause is two
// rounds (6,000). The catalog moves for 2 s (16 probe answers, 125 ms
// apart): 2.25 s at 250 B/s earn ~560 and withhold ~1,690, so the pause
// (~2.3 s) reads at once, as it would had the budget read at the whole rate
// throughout. Deeper in debt, past what was withheld, it waits at the whole
// rate.
func TestAChurnYieldsToTheCatalogAndItsPauseDoesNot(t *testing.T) {
	took, _ := settling(t, []int64{3000, 3000, 3000}, 17)
	if took > 2500*time.Millisecond {
		t.Fatalf("a pause after 2 s of churn, 8 s in debt, was read after %s: want at the "+
			"pause (~2.3 s), borrowing what the yield withheld", took)
	}
	// 11,000 in debt: 2.25 s earn ~560 and withhold ~1,690; the pause may
	// borrow to 7,690 and waits for the ~2,750 beyond it at the whole rate.
	took, _ = settling(t, []int64{3000, 3000, 3000, 3000}, 17)
	if took < 4800*time.Millisecond || took > 5400*time.Millisecond {
		t.Fatalf("a pause after 2 s of churn, 11 s in debt, was read after %s: want ~5 s",
			took)
	}
}

// probing runs a Watcher's quiet probe on a servicesIndexFake whose every
// query moves the index (a churning catalog), on a fake clock, until the test
// ends; fail, when set, has every query fail from the start.
func probing(
	t *testing.T, fail bool,
) (*Watcher, *servicesIndexFake, *clockwork.FakeClock, context.Context) {
	t.Helper()
	clock := clockwork.NewFakeClock()
	w := newWatcher(newFakeCatalog(), WatchConfig{Clock: clock, ReadRate: 1000, ReadBurst: 1000,
		Out: make(chan health.Observation, 1)})
	w.quiet = newQuietProbe()
	fake := &servicesIndexFake{clock: clock, moves: 1 << 30}
	fake.fail.Store(fail)
	ctx, cancel := context.WithCancel(context.Background())
	probed := make(chan struct{})
	go func() { defer close(probed); w.probeQuiet(ctx, fake) }()
	t.Cleanup(func() { cancel(); <-probed })
	return w, fake, clock, ctx
}

// The probe queries only while a task watch waits for the budget.
func TestTheQuietProbeQueriesOnlyForAWaitingWatch(t *testing.T) {
	w, fake, clock, ctx := probing(t, false)
	// Nobody waits: no query however long.
	clock.Advance(time.Hour)
	if n := fake.queries(); n != 0 {
		t.Fatalf("%d queries with no watch waiting", n)
	}
	quiet, leave := w.quiet.join()
	deadline := time.Now().Add(5 * time.Second)
	for fake.queries() < 3 {
		if time.Now().After(deadline) {
			t.Fatal("a waiting watch: the probe never queried")
		}
		bctx, bcancel := context.WithTimeout(ctx, 20*time.Millisecond)
		if clock.BlockUntilContext(bctx, 1) == nil {
			clock.Advance(settleQuiet)
		}
		bcancel()
	}
	select {
	case <-quiet:
		t.Fatal("a pause seen while every query moved")
	default:
	}
	leave()
	// The probe finishes the query it is in (and its pause), then sleeps
	// until a watch joins again: on no timer.
	for i := 0; i < 3; i++ {
		bctx, bcancel := context.WithTimeout(ctx, 20*time.Millisecond)
		if clock.BlockUntilContext(bctx, 1) == nil {
			clock.Advance(settleQuiet)
		}
		bcancel()
	}
	n := fake.queries()
	clock.Advance(time.Hour)
	if m := fake.queries(); m > n+1 {
		t.Fatalf("%d queries after the last watch left", m-n)
	}
}

// While Consul fails the probe's queries, it backs off to one every few
// seconds instead of 8 a second, and it is back at its pace once a query
// answers.
func TestTheQuietProbeBacksOffWhileConsulFails(t *testing.T) {
	w, fake, clock, ctx := probing(t, true)
	_, leave := w.quiet.join()
	defer leave()
	// run advances the fake clock by d, 50 ms at a time, each step once the
	// probe waits on it; it returns the queries made meanwhile.
	run := func(d time.Duration) int {
		t.Helper()
		before := fake.queries()
		deadline := time.Now().Add(20 * time.Second)
		for passed := time.Duration(0); passed < d; passed += 50 * time.Millisecond {
			if time.Now().After(deadline) {
				t.Fatalf("the probe stopped waiting on the clock after %s", passed)
			}
			bctx, bcancel := context.WithTimeout(ctx, time.Second)
			if err := clock.BlockUntilContext(bctx, 1); err != nil {
				bcancel()
				t.Fatalf("the probe never waited on the clock after %s", passed)
			}
			bcancel()
			clock.Advance(50 * time.Millisecond)
		}
		return fake.queries() - before
	}
	// 60 s at 8 a second would be 480 queries; backing off to 5 s, ~20.
	if n := run(60 * time.Second); n > 30 || n < 5 {
		t.Fatalf("%d failing queries in 60 s: want a backing-off few (5 to 30)", n)
	}
	fake.fail.Store(false)
	run(probeBackoffCap) // the wait in progress ends
	if n := run(5 * time.Second); n < 30 {
		t.Fatalf("%d queries in 5 s once Consul answers: want its pace back (~40)", n)
	}
}

// The round is each watch's last read, summed; a task type gone leaves it.
func TestTheRoundIsEachWatchsLastRead(t *testing.T) {
	clock := clockwork.NewFakeClock()
	b := newReadBudget(clock, 1000, 1000)
	b.chargeRead("task a", 3000)
	b.chargeRead("task a", 2000)
	b.chargeRead("task b", 4000)
	if b.round != 6000 {
		t.Fatalf("round %v, want 6000 (a's last 2,000 + b's 4,000)", b.round)
	}
	b.forget("task b")
	if b.round != 2000 {
		t.Fatalf("round %v after b left, want 2000", b.round)
	}
	// tokens 1000 - 9000 = -8000; the allowance reaches -4000: 4 s.
	if d := b.settledDelay(); d != 4*time.Second {
		t.Fatalf("settled delay %s, want 4s", d)
	}
	if d := b.delay(); d != 8*time.Second {
		t.Fatalf("delay %s, want 8s", d)
	}
	var nilBudget *readBudget
	nilBudget.chargeRead("x", 1)
	nilBudget.forget("x")
	if nilBudget.settledDelay() != 0 {
		t.Fatal("no budget: no delay")
	}
}

// transportFunc is an http.RoundTripper of a function.
type transportFunc func(*http.Request) (*http.Response, error)

func (f transportFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// TestConsulAChurnsLastChangeIsReadInDebt: on a real agent, with a read
// budget the first listing puts seconds in debt, a burst of registrations
// that then stops is read at the pause, while the budget is still in debt
// (a listing starts with the budget's delay above 0), rather than after the
// whole debt (without the quiet probe, a listing never starts in debt).
func TestConsulAChurnsLastChangeIsReadInDebt(t *testing.T) {
	const n, more = 100, 20
	a := consultest.Start(t)
	a.SettleSync()
	reg := a.Client()
	registerMany(t, reg, n)
	var w *Watcher
	var mu sync.Mutex
	var inDebt []time.Duration // the budget's delay as each listing started, when above 0
	base := cleanhttp.DefaultPooledTransport()
	cfg := a.Config()
	cfg.HttpClient = &http.Client{Transport: sizingTransport{next: transportFunc(
		func(r *http.Request) (*http.Response, error) {
			if strings.HasPrefix(r.URL.Path, "/v1/catalog/service/") &&
				r.URL.Query().Get("filter") == "" {
				if d := w.budget.delay(); d > 0 {
					mu.Lock()
					inDebt = append(inDebt, d)
					mu.Unlock()
				}
			}
			return base.RoundTrip(r)
		})}}
	client, err := api.NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan health.Observation, 64)
	// ~100 KB read at 5 KB/s: ~20 s of debt after the first read.
	w = NewWatcher(client, WatchConfig{Out: out, WaitTime: 200 * time.Millisecond,
		ContendedWait: 200 * time.Millisecond, ReadRate: 5000, ReadBurst: 5000})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)
	members := func(what string, want int) {
		t.Helper()
		deadline := time.After(15 * time.Second)
		for {
			select {
			case o := <-out:
				if o.Members() != nil && len(o.Members().Members) == want {
					return
				}
			case <-deadline:
				t.Fatalf("%s never observed (the budget's delay is %s)", what, w.budget.delay())
			}
		}
	}
	members("the first read", n)
	registerRange(t, reg, n, n+more)
	members("the burst's registrations", n+more)
	mu.Lock()
	defer mu.Unlock()
	if len(inDebt) == 0 {
		t.Fatal("no listing started in debt: the burst was read after the whole debt")
	}
}

// TestConsulACheckStatusDoesNotMoveTheServicesIndex: on a real agent, what
// the quiet probe waits on (the catalog services index) stays put while
// checks change status (a lease's TTL check failing, warning, passing again,
// with new output; a node-level check flipping), so a pause of the
// registrations is seen in a fleet whose checks flap, and moves when a
// service registers.
func TestConsulACheckStatusDoesNotMoveTheServicesIndex(t *testing.T) {
	a := consultest.Start(t)
	a.SettleSync()
	reg := a.Client()
	registerMany(t, reg, 2)
	if err := reg.Agent().CheckRegister(&api.AgentCheckRegistration{
		ID: "node-ttl", Name: "node-ttl",
		AgentServiceCheck: api.AgentServiceCheck{TTL: "1h", Status: "passing"},
	}); err != nil {
		t.Fatal(err)
	}
	cat := NewWatcher(reg, WatchConfig{Out: make(chan health.Observation, 1)}).cat.(apiCatalog)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// seen waits until the catalog holds check id at status.
	seen := func(id, status string) {
		t.Helper()
		var index uint64
		for {
			checks, meta, err := reg.Health().State(api.HealthAny,
				(&api.QueryOptions{WaitIndex: index, WaitTime: time.Second}).WithContext(ctx))
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range checks {
				if c.CheckID == id && c.Status == status {
					return
				}
			}
			index = meta.LastIndex
		}
	}
	seen("node-ttl", api.HealthPassing)
	before, err := cat.ServicesIndex(ctx, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	lease := health.CheckID("e0000", "s", "work")
	for i, status := range []string{api.HealthCritical, api.HealthWarning, api.HealthPassing,
		api.HealthCritical, api.HealthPassing} {
		for _, id := range []string{lease, "node-ttl"} {
			if err := reg.Agent().UpdateTTL(id, fmt.Sprintf("flip %d", i), status); err != nil {
				t.Fatal(err)
			}
			seen(id, status)
		}
	}
	if after, err := cat.ServicesIndex(ctx, before, 300*time.Millisecond); err != nil {
		t.Fatal(err)
	} else if after != before {
		t.Fatalf("checks changing status moved the catalog services index %d → %d", before, after)
	}
	registerRange(t, reg, 2, 3)
	if after, err := cat.ServicesIndex(ctx, before, 5*time.Second); err != nil {
		t.Fatal(err)
	} else if after == before {
		t.Fatal("a registration did not move the catalog services index")
	}
}

// scriptedIndexes answers each ServicesIndex query with the next index the
// test sends, at once.
type scriptedIndexes struct {
	next     chan uint64
	answered chan struct{}
}

func (s *scriptedIndexes) ServicesIndex(
	ctx context.Context, _ uint64, _ time.Duration,
) (uint64, error) {
	select {
	case i := <-s.next:
		defer func() { s.answered <- struct{}{} }()
		return i, nil
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// A move the probe sees is a write, at the raft entries a second it took:
// not its first answer, not an index that went back (a restored snapshot);
// what moved while no watch waited counts at its average over that time.
// The membership and generation budgets yield to it, the lapse marks' not.
func TestOnlyAMoveSeenIsAWrite(t *testing.T) {
	clock := clockwork.NewFakeClock()
	w := newWatcher(newFakeCatalog(), WatchConfig{Clock: clock, ReadRate: 1000, ReadBurst: 1000,
		Out: make(chan health.Observation, 1)})
	w.quiet = newQuietProbe()
	s := &scriptedIndexes{next: make(chan uint64), answered: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	probed := make(chan struct{})
	go func() { defer close(probed); w.probeQuiet(ctx, s) }()
	defer func() { cancel(); <-probed }()
	answer := func(i uint64, what string, wantRate float64) {
		t.Helper()
		select {
		case s.next <- i:
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: the probe never queried", what)
		}
		<-s.answered
		// The probe handles the answer before its next pause on the clock.
		bctx, bcancel := context.WithTimeout(ctx, 5*time.Second)
		defer bcancel()
		if err := clock.BlockUntilContext(bctx, 1); err != nil {
			t.Fatalf("%s: the probe never paced its next query", what)
		}
		if r := w.budget.rateNow(); r != wantRate {
			t.Fatalf("%s: rate %.0f, want %.0f", what, r, wantRate)
		}
	}
	_, leave := w.quiet.join()
	answer(1000, "a first answer", 1000)
	clock.Advance(probeEvery)
	answer(1100, "100 entries in 125 ms", 250)
	clock.Advance(time.Second) // the write's 250 ms are over, and the probe's pause
	answer(500, "an index that went back", 1000)
	// Nobody waits for a minute; the catalog moves meanwhile. Once a watch
	// joins again, the probe's first answer is no write.
	leave()
	clock.Advance(time.Minute)
	_, leave = w.quiet.join()
	defer leave()
	answer(600, "100 entries over the minute the probe slept", 1000)
	clock.Advance(probeEvery)
	answer(700, "100 entries in 125 ms after it", 250)
	if r := w.genBudget.rateNow(); r != w.genBudget.rate/4 {
		t.Fatalf("the generation keys' rate %.0f while written, want a quarter of %.0f",
			r, w.genBudget.rate)
	}
	if r := w.lapseBudget.rateNow(); r != w.lapseBudget.rate {
		t.Fatalf("the lapse marks' rate %.0f while written, want the whole %.0f",
			r, w.lapseBudget.rate)
	}
}
