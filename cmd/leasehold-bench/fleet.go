package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// fleet is the simulated executors: real registrations, real TTL checks.
//
// Executor i serves task type tasks[i % len(tasks)] and registers through
// agents[agentOf(i, len(agents))]. The executors a run
// lapses or deregisters hold a short lease (--lease, heartbeats every
// --heartbeat); with --bulk-lease the others hold a long one, heartbeated a
// third of it apart at an even pace. 10,000 short leases heartbeated every
// few seconds saturate 2 cores (Consul's agents, not leasehold, become the
// bottleneck and leases lapse falsely); 10,000 long ones cost a trickle.
type fleet struct {
	agents []*api.Client
	ids    []string
	tasks  []string
	// firstTask executors [0, firstTask) all serve tasks[0] (--victims-one-task).
	firstTask int
	short     []bool // holds a short lease
	bulkLease time.Duration
	session   string
	lastAck   []atomic.Int64 // unix nanos when the last acknowledged heartbeat was sent
	lastRTT   []atomic.Int64 // its round trip in nanoseconds, within which the agent reset the TTL
	stopped   []atomic.Bool
	// beating is held across each heartbeat of an executor, so stop waits
	// for one in flight: the agent resets the TTL when that heartbeat
	// arrives, and the expiry must count from it.
	beating    []sync.Mutex
	registered []atomic.Bool
	gens       []atomic.Uint64 // the generation once --churn restarted it; 0 while on f.session
	done       atomic.Int64    // registrations answered so far
	// victimRank is executor i's place in the order its phase's lapses are
	// stopped in (-1: it is stopped by no lapseAll); nil: none is.
	victimRank func(i int) int
	// beatsFrom is when the short leases' heartbeat schedule began (unix
	// nanos; 0 before heartbeatAll): lapseAll stops victims in step with it.
	beatsFrom atomic.Int64
}

// newFleet is n executors over tasks; short(i) says whether executor i holds
// a short lease (every executor does when bulkLease is 0).
func newFleet(
	agents []*api.Client, n int, tasks []string, bulkLease time.Duration, short func(i int) bool,
) *fleet {
	f := &fleet{agents: agents, tasks: tasks, bulkLease: bulkLease, session: "bench",
		short: make([]bool, n), lastAck: make([]atomic.Int64, n), lastRTT: make([]atomic.Int64, n),
		stopped: make([]atomic.Bool, n), registered: make([]atomic.Bool, n),
		beating: make([]sync.Mutex, n),
		gens:    make([]atomic.Uint64, n)}
	for i := range n {
		f.ids = append(f.ids, fmt.Sprintf("x%05d", i))
		f.short[i] = bulkLease <= 0 || short(i)
	}
	return f
}

// taskNames is the n task types a run spreads its executors and streams
// over: "work" alone (--tasks 1), else work-0 … work-<n-1>.
func taskNames(n int) []string {
	if n <= 1 {
		return []string{"work"}
	}
	names := make([]string, n)
	for k := range names {
		names[k] = fmt.Sprintf("work-%d", k)
	}
	return names
}

// taskOf is the task type executor i serves.
func (f *fleet) taskOf(i int) string {
	if i < f.firstTask {
		return f.tasks[0]
	}
	return f.tasks[i%len(f.tasks)]
}

// perTask is how many executors serve each task type.
func (f *fleet) perTask() map[string]int {
	m := map[string]int{}
	for i := range f.ids {
		m[f.taskOf(i)]++
	}
	return m
}

// shards is how many shards leasehold (at --shard-size) splits each task
// type into: what the light streams subscribe to.
func (f *fleet) shards() map[string]int {
	m := map[string]int{}
	for task, n := range f.perTask() {
		m[task] = translator.ShardCount(n, *shardSize)
	}
	return m
}

// leaseOf is executor i's lease.
func (f *fleet) leaseOf(i int) time.Duration {
	if f.short[i] {
		return *lease
	}
	return f.bulkLease
}

// shortCount is how many executors hold a short lease.
func (f *fleet) shortCount() int {
	n := 0
	for _, s := range f.short {
		if s {
			n++
		}
	}
	return n
}

// registerAll registers every executor, several per agent at once.
func (f *fleet) registerAll() error {
	return parallel(len(f.ids), registerWorkers(len(f.agents)), func(i int) error {
		defer f.done.Add(1)
		task := f.taskOf(i)
		r := health.Registration{InstanceID: f.ids[i], SessionID: f.session, Generation: 1,
			Task: task, Address: "127.0.0.1", Port: 20000 + i, Version: "1.0.0", Capacity: 8,
			State: health.StateActive}
		sent := time.Now()
		reg := &api.AgentServiceRegistration{
			ID: health.ServiceID(r.InstanceID, task), Name: task, Tags: []string{health.DefaultTag},
			Address: r.Address, Port: r.Port, Meta: r.Meta(),
			Checks: api.AgentServiceChecks{{CheckID: health.CheckID(r.InstanceID, f.session, task),
				TTL: f.leaseOf(i).String(), Status: "passing",
				DeregisterCriticalServiceAfter: "10m"}},
		}
		if *compare {
			reg.Connect = connectFor(reg.ID, i)
		}
		err := f.agent(i).ServiceRegisterOpts(reg,
			api.ServiceRegisterOpts{ReplaceExistingChecks: true})
		f.lastAck[i].Store(sent.UnixNano())
		f.registered[i].Store(err == nil)
		if err != nil {
			return fmt.Errorf("register %s: %w", reg.ID, err)
		}
		// The first heartbeat writes the load into the check's output, which
		// is a catalog write (every later one repeats it and is not). It is
		// sent now, before leasehold starts, for the short leases too: their
		// first round otherwise fell on leasehold's lapses, 500 catalog writes
		// through one agent that held the victims' last heartbeats ~200 ms
		// (their round trips p50 122–224 ms in leasehold's phase against
		// 1.6–2.7 ms in Consul's, which came later).
		f.beat(i)
		return nil
	})
}

// registerWorkers is how many registrations are in flight at once: 8 per
// agent, within the 64 connections each agent's client allows. Each is a
// Raft write the agent forwards, so concurrency batches them.
func registerWorkers(agents int) int { return min(64, max(16, 8*agents)) }

// heartbeatAll keeps every lease alive until ctx ends: the short ones every
// --heartbeat, each at its own phase (real executors start at different
// moments), or all in one round with --heartbeat-rounds; the long ones spread.
func (f *fleet) heartbeatAll(ctx context.Context) {
	var short, bulk []int
	for i := range f.ids {
		if f.short[i] {
			short = append(short, i)
		} else {
			bulk = append(bulk, i)
		}
	}
	if len(bulk) > 0 {
		go spreadBeats(ctx, time.Now(), len(bulk), f.bulkLease/3, spreadTick, 4,
			func(k int) { f.beat(bulk[k]) })
	}
	if *heartbeatRounds {
		f.heartbeatRounds(ctx, short, *heartbeat)
		return
	}
	if f.victimRank != nil {
		short = phaseOrder(short, f.victimRank, *lapseSpacing, *heartbeat)
	}
	start := time.Now()
	f.beatsFrom.Store(start.UnixNano())
	spreadBeats(ctx, start, len(short), *heartbeat, phaseTick(len(short), *heartbeat), 32,
		func(k int) { f.beat(short[k]) })
}

// phaseOrder orders the short leases into spreadBeats' slots (slot j beats
// at phase j·interval/n) so that a victim stopped k-th of its phase, k·spacing
// after the first, holds the slot at or just before phase k·spacing (mod
// interval): lapseAll stops each one right after that heartbeat, and their
// leases expire spacing apart. Victims in slots by executor order instead
// (the first n executors in the first n slots, interval/n apart) expired
// interval/n apart whatever the spacing: 23 ms at 130 short leases on a
// 3 s heartbeat, bursts of 15 lapses in 350 ms where 200 ms was meant. The
// other short leases fill the slots left, in order.
func phaseOrder(ids []int, rank func(i int) int, spacing, interval time.Duration) []int {
	n := len(ids)
	slots := make([]int, n)
	for j := range slots {
		slots[j] = -1
	}
	var rest []int
	for _, i := range ids {
		k := rank(i)
		if k < 0 || spacing <= 0 {
			rest = append(rest, i)
			continue
		}
		phase := (time.Duration(k) * spacing) % interval
		want := int(int64(phase) * int64(n) / int64(interval)) // the slot at or before it
		// The nearest free slot at or before want, so the heartbeat always
		// comes before the stop (one after it would not count, and the
		// lease would expire an interval early).
		for d := range n {
			if j := (want - d + n) % n; slots[j] < 0 {
				slots[j] = i
				break
			}
		}
	}
	for j := range slots {
		if slots[j] < 0 {
			slots[j], rest = rest[0], rest[1:]
		}
	}
	return slots
}

// heartbeatRounds heartbeats every executor of ids each interval, together.
// Victims stopped within one round then share their last heartbeat, so their
// leases expire at the same instant: a burst of lapses, one push after
// another (--heartbeat-rounds keeps it for measuring that case).
func (f *fleet) heartbeatRounds(ctx context.Context, ids []int, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		parallel(len(ids), 32, func(k int) error { f.beat(ids[k]); return nil })
	}
}

// spreadTick is how often the long leases' heartbeats are handed out.
const spreadTick = 100 * time.Millisecond

// phaseTick is the tick that gives each of n short leases heartbeated every
// interval a phase of its own where it can: interval/n, between 5 ms (finer
// ticks cost the harness more than they spread) and spreadTick.
func phaseTick(n int, interval time.Duration) time.Duration {
	return min(spreadTick, max(5*time.Millisecond, interval/time.Duration(max(1, n))))
}

// spreadBeats calls beat(k) for each k < n once per interval, executor k at
// phase k·interval/n, checked every tick, so that heartbeats never come in
// bursts: the long leases' would hold up the short ones', and short ones
// beaten together would expire together. At most workers beats are in
// flight; a slow one delays the next rather than piling up.
func spreadBeats(
	ctx context.Context, start time.Time, n int, interval, tick time.Duration, workers int,
	beat func(k int),
) {
	if n == 0 {
		<-ctx.Done()
		return
	}
	sem := make(chan struct{}, workers)
	t := time.NewTicker(tick)
	defer t.Stop()
	var sent int64 // beats handed out since start
	for {
		for owed := owedBeats(time.Since(start), n, interval); sent < owed; sent++ {
			select {
			case <-ctx.Done():
				return
			case sem <- struct{}{}:
			}
			go func(k int) {
				defer func() { <-sem }()
				beat(k)
			}(int(sent % int64(n)))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// owedBeats is how many beats are due elapsed after the start when each of n
// executors beats once per interval, executor k's m-th at (m·n + k)·interval/n:
// beat j goes to executor j mod n.
func owedBeats(elapsed time.Duration, n int, interval time.Duration) int64 {
	return int64(elapsed)*int64(n)/int64(interval) + 1
}

// beat heartbeats executor i unless it was stopped or never registered. A
// heartbeat stop catches in flight still counts: the agent reset the TTL
// when it arrived. (Not counting it put the expiry one heartbeat interval
// early and added that interval to the lapse measured: the 3 s tails of
// leasehold's and Consul's lapses at --heartbeat 3s.)
func (f *fleet) beat(i int) {
	f.beating[i].Lock()
	defer f.beating[i].Unlock()
	if f.stopped[i].Load() || !f.registered[i].Load() {
		return
	}
	sent := time.Now()
	if err := f.agent(i).UpdateTTL(health.CheckID(f.ids[i], f.sessionOf(i), f.taskOf(i)),
		"load=1", "pass"); err == nil {
		f.lastAck[i].Store(sent.UnixNano())
		f.lastRTT[i].Store(int64(time.Since(sent)))
	}
}

// sessionOf is executor i's current session.
func (f *fleet) sessionOf(i int) string {
	if g := f.gens[i].Load(); g > 0 {
		return fmt.Sprintf("s%d", g)
	}
	return f.session
}

// heartbeatRTTs is the round trip of each victim's last acknowledged
// heartbeat: how uncertain its expiry instant is (lease expiry is counted
// from when that heartbeat was sent, as the contract tells executors to).
func (f *fleet) heartbeatRTTs(victims []int) []time.Duration {
	out := make([]time.Duration, 0, len(victims))
	for _, i := range victims {
		out = append(out, time.Duration(f.lastRTT[i].Load()))
	}
	return out
}

// agent is the agent executor i registered through.
func (f *fleet) agent(i int) *api.Agent { return f.agents[agentOf(i, len(f.agents))].Agent() }

// agentOf places executor i on one of n agents: evenly, and shifted by one
// every n executors so that a task type (i % tasks) is spread over every
// agent even when tasks and agents share a divisor — else one agent's node
// failure (final for its sessions, by design) takes a whole task type.
func agentOf(i, n int) int { return (i + i/n) % n }

// stop ends executor i's heartbeats and returns its lease's expiry instant:
// a lease after the last heartbeat the agent took, one in flight included.
func (f *fleet) stop(i int) time.Time {
	f.stopHeartbeat(i)
	return time.Unix(0, f.lastAck[i].Load()).Add(f.leaseOf(i))
}

// stopHeartbeat ends executor i's heartbeats once the one in flight, if
// any, is answered.
func (f *fleet) stopHeartbeat(i int) {
	f.beating[i].Lock()
	f.stopped[i].Store(true)
	f.beating[i].Unlock()
}

// live is the executors still heartbeating.
func (f *fleet) live() []int {
	var out []int
	for i := range f.ids {
		if !f.stopped[i].Load() {
			out = append(out, i)
		}
	}
	return out
}

// progress logs how many registrations were answered every period until
// done closes (a 10,000-executor fleet takes minutes).
func (f *fleet) progress(done <-chan struct{}, period time.Duration) {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
			logf("… %d of %d executors registered", f.done.Load(), len(f.ids))
		}
	}
}

func parallel(n, workers int, fn func(int) error) error {
	var wg sync.WaitGroup
	var firstErr atomic.Value
	next := atomic.Int64{}
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				if err := fn(i); err != nil {
					firstErr.CompareAndSwap(nil, err)
				}
			}
		}()
	}
	wg.Wait()
	if err, ok := firstErr.Load().(error); ok {
		return err
	}
	return nil
}
