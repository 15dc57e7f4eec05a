package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
)

func TestTaskNames(t *testing.T) {
	if got := taskNames(1); !reflect.DeepEqual(got, []string{"work"}) {
		t.Fatalf("one task type = %v, want [work] (as before --tasks)", got)
	}
	if got := taskNames(3); !reflect.DeepEqual(got, []string{"work-0", "work-1", "work-2"}) {
		t.Fatalf("three = %v", got)
	}
}

// Executors spread evenly over the task types; only the chosen ones hold a
// short lease, and every one does without --bulk-lease.
func TestFleetSpreadAndLeases(t *testing.T) {
	short := func(i int) bool { return i < 2 || i == 9 }
	f := newFleet(nil, 10, taskNames(3), 10*time.Minute, short)
	if got := f.perTask(); !reflect.DeepEqual(got, map[string]int{"work-0": 4, "work-1": 3, "work-2": 3}) {
		t.Fatalf("per task = %v", got)
	}
	if f.taskOf(4) != "work-1" {
		t.Fatalf("executor 4 serves %s, want work-1", f.taskOf(4))
	}
	if f.shortCount() != 3 || f.leaseOf(1) != *lease || f.leaseOf(9) != *lease || f.leaseOf(5) != 10*time.Minute {
		t.Fatalf("short %d, leases %s %s %s", f.shortCount(), f.leaseOf(1), f.leaseOf(9), f.leaseOf(5))
	}
	all := newFleet(nil, 10, taskNames(1), 0, short)
	if all.shortCount() != 10 || all.leaseOf(5) != *lease {
		t.Fatalf("without --bulk-lease: %d short, lease %s", all.shortCount(), all.leaseOf(5))
	}
}

// Every executor is heartbeated once per interval, each at a phase of its
// own: executor k first at k·interval/n, so victims stopped apart expire apart.
func TestBeatsAreOwedOncePerIntervalEachAtItsPhase(t *testing.T) {
	const n, interval = 25, 3 * time.Second
	step := interval / n
	for _, c := range []struct {
		elapsed time.Duration
		want    int64
	}{
		{0, 1},                    // executor 0 at once
		{step - 1, 1},             // executor 1 not before its phase
		{step, 2},                 // executor 1 at its phase
		{24 * step, 25},           // every executor once
		{interval - 1, 25},        // nobody twice within the interval
		{interval, 26},            // executor 0 again, one interval after its first
		{10 * interval, 10*n + 1}, // n beats per interval, however long it runs
	} {
		if got := owedBeats(c.elapsed, n, interval); got != c.want {
			t.Errorf("owedBeats(%s) = %d, want %d", c.elapsed, got, c.want)
		}
	}
	for _, c := range []struct {
		n        int
		interval time.Duration
		want     time.Duration
	}{
		{25, 3 * time.Second, 100 * time.Millisecond}, // a tick per 120 ms phase, at most spreadTick
		{500, 3 * time.Second, 6 * time.Millisecond},
		{10000, 3 * time.Second, 5 * time.Millisecond},
		{0, 3 * time.Second, 100 * time.Millisecond},
	} {
		if got := phaseTick(c.n, c.interval); got != c.want {
			t.Errorf("phaseTick(%d, %s) = %s, want %s", c.n, c.interval, got, c.want)
		}
	}
}

// spreadBeats beats every executor, and each again, until its context ends.
func TestSpreadBeatsReachesEveryExecutor(t *testing.T) {
	const n = 10
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	beats := make([]int, n)
	all := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		spreadBeats(ctx, time.Now(), n, 50*time.Millisecond, 5*time.Millisecond, 4, func(k int) {
			mu.Lock()
			defer mu.Unlock()
			beats[k]++
			if slices.Min(beats) == 2 {
				select {
				case <-all:
				default:
					close(all)
				}
			}
		})
	}()
	select {
	case <-all:
	case <-time.After(10 * time.Second):
		mu.Lock()
		t.Fatalf("not every executor beaten twice within 10 s: %v", beats)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("spreadBeats did not return once its context ended")
	}
}

// Executors spread evenly over the agents, and every task type over every
// agent, even when there are as many task types as agents.
func TestAgentOfSpreadsTasks(t *testing.T) {
	const n, agents, tasks = 1000, 10, 10
	perAgent := map[int]int{}
	pairs := map[[2]int]bool{}
	for i := range n {
		a := agentOf(i, agents)
		perAgent[a]++
		pairs[[2]int{i % tasks, a}] = true
	}
	for a := range agents {
		if perAgent[a] != n/agents {
			t.Fatalf("agent %d holds %d executors, want %d", a, perAgent[a], n/agents)
		}
	}
	if len(pairs) != tasks*agents {
		t.Fatalf("%d (task, agent) pairs used, want all %d", len(pairs), tasks*agents)
	}
	if agentOf(5, 1) != 0 {
		t.Fatal("one agent: want it")
	}
}

// A heartbeat in flight when an executor is stopped still reset its TTL at
// the agent: stop waits for it and counts the expiry from it, not from the
// heartbeat before (which made every such lapse one heartbeat interval
// longer than it was).
func TestStopCountsTheHeartbeatInFlight(t *testing.T) {
	arrived, release := make(chan struct{}), make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(arrived)
		<-release
	}))
	defer srv.Close()
	c, err := api.NewClient(&api.Config{Address: srv.Listener.Addr().String()})
	if err != nil {
		t.Fatal(err)
	}
	f := newFleet([]*api.Client{c}, 1, taskNames(1), 0, func(int) bool { return true })
	f.registered[0].Store(true)
	f.lastAck[0].Store(time.Now().Add(-time.Hour).UnixNano()) // an old heartbeat
	beaten := make(chan struct{})
	before := time.Now()
	go func() { f.beat(0); close(beaten) }()
	<-arrived // the heartbeat is at the agent
	stopped := make(chan time.Time, 1)
	go func() { stopped <- f.stop(0) }()
	select {
	case <-stopped:
		t.Fatal("stop returned while a heartbeat was in flight")
	case <-time.After(50 * time.Millisecond): // stop is waiting, as it must
	}
	close(release)
	<-beaten
	expiry := <-stopped
	if expiry.Before(before.Add(*lease)) {
		t.Fatalf("expiry %s counts from the heartbeat before the one in flight (sent after %s)",
			expiry, before)
	}
	f.beat(0) // stopped: sends nothing (the handler would panic closing arrived twice)
}

// With --victims-one-task, leasehold's victims [0, n) all serve the first
// task type; the others spread as before.
func TestVictimsOfOneTask(t *testing.T) {
	f := newFleet(nil, 10, taskNames(3), 10*time.Minute, func(i int) bool { return i < 3 })
	f.firstTask = 3
	for i := range 3 {
		if f.taskOf(i) != "work-0" {
			t.Fatalf("victim %d serves %s, want work-0", i, f.taskOf(i))
		}
	}
	if f.taskOf(4) != "work-1" || f.taskOf(5) != "work-2" {
		t.Fatalf("the others: %s, %s", f.taskOf(4), f.taskOf(5))
	}
}

// Victims stopped spacing apart, each just after its slot's heartbeat
// (phaseOrder, lapseAll), expire spacing apart: by executor order their
// slots were interval/n apart and their lapses came in bursts (15 in 350 ms at
// 130 short leases on a 3 s heartbeat, for a 200 ms spacing). Simulated
// with every heartbeat handed out as late as a tick allows: each still comes
// before its victim's stop, and the expiries keep the spacing within two
// slots.
func TestVictimsExpireLapseSpacingApart(t *testing.T) {
	const (
		n        = 130 // short leases: two phases of 60 victims and 10 fan-outs
		victims  = 60
		interval = 3 * time.Second
		spacing  = 200 * time.Millisecond
		lease    = 10 * time.Second
	)
	ids := make([]int, n)
	for i := range ids {
		ids[i] = i
	}
	rank := func(i int) int {
		if i < 2*victims {
			return i % victims
		}
		return -1
	}
	slots := phaseOrder(ids, rank, spacing, interval)
	if got := slices.Sorted(slices.Values(slots)); !slices.Equal(got, ids) {
		t.Fatalf("phaseOrder lost or repeated executors: %v", got)
	}
	slotOf := map[int]int{}
	for j, i := range slots {
		slotOf[i] = j
	}
	tick := phaseTick(n, interval)
	slot := interval / n
	after := 2*tick + 30*time.Millisecond // awaitPhaseZero's
	for phase := range 2 {
		from := 5*interval + after // a stop schedule in step with the beats (awaitPhaseZero)
		var last time.Duration
		for k := range victims {
			i := phase*victims + k
			stop := from + time.Duration(k)*spacing
			beatPhase := time.Duration(slotOf[i])*slot + tick // as late as a tick allows
			beat := stop - (stop-beatPhase)%interval          // the last one at or before the stop
			if stop-beat > interval-tick {
				t.Fatalf("victim %d of phase %d: its heartbeat comes %s after its stop",
					k, phase, interval-(stop-beat))
			}
			expiry := beat + lease
			if k > 0 {
				if gap := expiry - last; gap < spacing-2*slot || gap > spacing+2*slot {
					t.Fatalf("victims %d and %d of phase %d expire %s apart, want %s ± %s",
						k-1, k, phase, gap, spacing, 2*slot)
				}
			}
			last = expiry
		}
	}
}
