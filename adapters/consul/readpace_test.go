package consul

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/health"
)

// TestTheReadPaceFollowsConsulsLoad: the rate's factor is the quiet
// baseline's cost over the cost now, within [minPaceFactor, 1]; small
// answers are not samples; the baseline survives a quiet window and rises
// only after a window of dearer reads.
func TestTheReadPaceFollowsConsulsLoad(t *testing.T) {
	clock := clockwork.NewFakeClock()
	p := newReadPace(clock)
	const mb = 1 << 20
	near := func(what string, want float64) {
		t.Helper()
		if got := p.factor(); math.Abs(got-want) > 0.02 {
			t.Fatalf("%s: factor %.3f, want %.3f", what, got, want)
		}
	}
	near("no sample yet", 1)
	p.observe(mb, 20*time.Millisecond) // quiet: 20 ms a MiB
	near("at the baseline", 1)
	p.observe(minPaceSample-1, time.Second)
	near("an answer too small to be a sample", 1)
	for range 20 {
		p.observe(mb, 80*time.Millisecond) // busy: 4× the quiet cost
	}
	near("Consul answering 4× slower", 0.25)
	for range 20 {
		p.observe(mb, time.Second)
	}
	near("50× slower: the floor", minPaceFactor)
	p.quieted()
	near("a pause of the registrations", 1)
	for range 20 {
		p.observe(mb, time.Second)
	}
	near("slow again after the pause", minPaceFactor)
	for range 40 {
		p.observe(mb, 20*time.Millisecond)
	}
	near("quiet again", 1)

	clock.Advance(3 * paceMinutes * time.Minute) // nothing read for long
	for range 30 {
		p.observe(mb, 80*time.Millisecond)
	}
	near("busy after a long quiet: the quiet cost is remembered", 0.25)
	for range paceMinutes + 1 {
		clock.Advance(time.Minute)
		p.observe(mb, 80*time.Millisecond)
	}
	near("a whole window at the dearer cost: the new baseline", 1)

	var none *readPace
	none.observe(mb, time.Second)
	none.quieted()
	if none.factor() != 1 {
		t.Fatal("no pace: factor 1")
	}
}

// TestABusyConsulSlowsTheReadBudget: the budget's debt is paid at its rate
// scaled by the pace, so a Consul answering 4× slower than when quiet has
// leasehold wait 4× as long between listings.
func TestABusyConsulSlowsTheReadBudget(t *testing.T) {
	clock := clockwork.NewFakeClock()
	b := newReadBudget(clock, 1000, 1000)
	b.pace = newReadPace(clock)
	b.charge(2000) // 1000 in debt
	if d := b.delay(); d != time.Second {
		t.Fatalf("before any sample: delay %s, want 1s", d)
	}
	b.pace.observe(1<<20, 20*time.Millisecond)
	for range 30 {
		b.pace.observe(1<<20, 80*time.Millisecond)
	}
	if d := b.delay(); d < 3900*time.Millisecond || d > 4100*time.Millisecond {
		t.Fatalf("Consul 4× slower: delay %s, want ~4s", d)
	}
	if r := b.rateNow(); r < 240 || r > 260 {
		t.Fatalf("rate now %.0f B/s, want ~250", r)
	}
}

// TestTheWatchersListingsSetItsReadPace: a watcher's timed listings set the
// pace of its membership and generation budgets, not of fencing's refresh
// budget (a fencing call waits for it).
func TestTheWatchersListingsSetItsReadPace(t *testing.T) {
	w := newWatcher(newFakeCatalog(), WatchConfig{ReadRate: 4 << 20, Out: make(chan health.Observation)})
	timed := func(bytes int64, took time.Duration) *readSizes {
		s := new(readSizes)
		s.decoded.Store(bytes)
		s.timedBytes.Store(bytes)
		s.timedNanos.Store(int64(took))
		return s
	}
	spec := watchSpec{name: "task work"}
	w.countRead(context.Background(), spec, timed(1<<20, 20*time.Millisecond), w.budget)
	for range 30 {
		w.countRead(context.Background(), spec, timed(1<<20, 80*time.Millisecond), w.budget)
	}
	for name, b := range map[string]*readBudget{"membership": w.budget, "generation": w.genBudget} {
		if got, want := b.rateNow(), b.rate/4; got < want*0.95 || got > want*1.05 {
			t.Errorf("%s budget: rate %.0f B/s with Consul 4× slower, want ~%.0f", name, got, want)
		}
	}
	if got := w.refreshBudget.rateNow(); got != w.refreshBudget.rate {
		t.Errorf("refresh budget: rate %.0f B/s, want its whole %.0f", got, w.refreshBudget.rate)
	}
}
