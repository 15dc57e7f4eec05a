package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"runtime/trace"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

// bench is one run of the harness: what its phases share. The phases run in
// order, each measuring one part of BENCHMARKS.md's table:
//
//	leasehold: lapses, fan-out, Consul load at idle (Consul's xDS not asked)
//	floor:     leasehold's own pushes replayed by a bare ADS server
//	busy:      with --flapping, other lapses while unrelated services'
//	           checks flap, then as long flapping with leasehold stopped
//	           (flapping.go)
//	Consul:    other lapses of the same fleet through Consul's own xDS,
//	           leasehold and its dispatchers stopped
//
// The victims of leasehold's lapses are executors [0, n), Consul's [n, 2n),
// the busy phase's [2n, 3n) and the fan-out's the last --fanouts; only they
// hold a short lease when --bulk-lease is set.
type bench struct {
	ctx      context.Context
	agent    *consultest.Agent
	clients  []*api.Client
	pids     consulPIDs // the agents' processes, for their CPU
	fleet    *fleet
	flap     *flapper   // the flapping services, with --flapping
	quiet    *window    // leasehold's lapses, nothing flapping
	probe    *taskProbe // with --consul-probe or --flapping
	srv      *served
	ds       *dispatcherSet     // the light streams to leasehold
	stopDS   context.CancelFunc // ends them
	gc       *grpcClients
	n        int // lapses per phase
	res      results
	cleanups []func()      // guarded by cleanupMu: an interrupt runs them from another goroutine
	closed   chan struct{} // guarded by cleanupMu: nil until close, closed once it is done
}

func run() error {
	ctx, cancel := context.WithCancel(context.Background())
	b := &bench{ctx: ctx, n: lapsesPerPhase()}
	defer b.close()
	defer cancel() // runs first, so heartbeats and streams end before the processes do
	b.res = results{executors: *executors, dispatchers: *dispatchers, tasks: max(1, *tasks),
		lease: *lease, heartbeat: *heartbeat, bulkLease: *bulkLease, grpcN: *grpcN,
		loadStart: loadAverage()}
	if err := checkFlags(); err != nil {
		return err
	}
	for _, phase := range []func() error{
		b.startConsul, b.registerFleet,
		b.startLeasehold, b.connectDispatchers, b.leaseholdLapses, b.fanOut, b.idleLoad,
		b.floor, b.busyLapses,
		b.stopLeasehold, b.flapAlone, b.consulLapses,
	} {
		if err := phase(); err != nil {
			return err
		}
	}
	return b.report()
}

// lapsesPerPhase leaves room for every lapsing phase's victims and the
// fan-out's (the last executors) in one fleet.
func lapsesPerPhase() int {
	phases := 2 // leasehold's, Consul's xDS
	if *flapping > 0 {
		phases++
	}
	return max(0, min(*lapses, (*executors-*fanouts)/phases))
}

// checkFlags refuses sizes the phases cannot run with.
func checkFlags() error {
	switch {
	case *tasks < 1:
		return fmt.Errorf("--tasks %d: want at least 1", *tasks)
	case *executors < *tasks || *dispatchers < *tasks:
		return fmt.Errorf("--executors %d and --dispatchers %d: want at least "+
			"one per task type (--tasks %d)", *executors, *dispatchers, *tasks)
	case *bulkLease > 0 && *bulkLease < 3**heartbeat:
		return fmt.Errorf("--bulk-lease %s: want a long lease, at least 3 × --heartbeat",
			*bulkLease)
	case *flapping > 0 && *flapRate <= 0:
		return fmt.Errorf("--flap-rate %g: want a positive rate", *flapRate)
	}
	return nil
}

// shortLease says whether executor i is one the run lapses or deregisters.
func (b *bench) shortLease(i int) bool {
	phases := 2
	if *flapping > 0 {
		phases++
	}
	return i < phases*b.n || i >= *executors-*fanouts
}

func (b *bench) onClose(f func()) {
	cleanupMu.Lock()
	defer cleanupMu.Unlock()
	b.cleanups = append(b.cleanups, f)
	running[b] = struct{}{}
}

// close stops what the bench started, newest first, once. A second call,
// or one racing an interrupt's, waits for the first to have stopped it
// all: a run that failed because an interrupt was stopping its agents
// returned, and the harness exited, while the interrupt's close was
// still stopping them, leaving the rest running.
func (b *bench) close() {
	cleanupMu.Lock()
	if b.closed != nil {
		done := b.closed
		cleanupMu.Unlock()
		<-done
		return
	}
	done := make(chan struct{})
	b.closed = done
	fs := b.cleanups
	b.cleanups = nil
	delete(running, b)
	cleanupMu.Unlock()
	defer close(done)
	for i := len(fs) - 1; i >= 0; i-- {
		fs[i]()
	}
}

// The benches with something to stop, for an interrupt.
var (
	cleanupMu sync.Mutex
	running   = map[*bench]struct{}{}
)

// closeOnInterrupt stops every bench's agents and processes when the
// harness is interrupted (SIGINT, SIGTERM) and exits 130: without it, Go's
// default exit left the Consul agents running and their data dirs behind.
func closeOnInterrupt() {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sigs
		logf("interrupted: stopping the agents and processes the harness started")
		cleanupMu.Lock()
		var bs []*bench
		for b := range running {
			bs = append(bs, b)
		}
		cleanupMu.Unlock()
		for _, b := range bs {
			b.close()
		}
		os.Exit(130)
	}()
}

func (b *bench) startConsul() error {
	bin, err := consultest.Binary()
	if err != nil {
		return err
	}
	agent, err := consultest.Launch(bin, consultest.Options{NodeName: "bench", Server: !*consulDev,
		ExtraHCL: `limits { http_max_conns_per_client = 1000 }` + "\nenable_debug = true\n" +
			gossipHCL(), DataParent: *consulData})
	if agent != nil {
		b.onClose(agent.Close)
	}
	if err != nil {
		return err
	}
	agent.SettleSync()
	b.agent = agent
	client, err := consul.NewClient(agent.HTTPAddr(), 64)
	if err != nil {
		return err
	}
	b.clients = []*api.Client{client}
	if err := b.startClientAgents(bin); err != nil {
		return err
	}
	b.pids = findConsulPIDs(b.agent.PID())
	logf("Consul agents: server pid %d, client pids %v", b.pids.server, b.pids.clients)
	return nil
}

// gossipHCL makes failure detection among several agents tolerant. With
// ten agents, the harness and leasehold on 2 cores, an agent starved of CPU
// for a second or two was declared failed (seen at 10,000 executors: a
// client node's serfHealth rewritten during registration), and a node
// failure lapses every session on it for good — by design, and not what the
// harness measures. A real node has cores of its own.
func gossipHCL() string {
	if *agents <= 1 {
		return "" // no gossip between agents to tune
	}
	return "\ngossip_lan {\n  probe_interval = \"5s\"\n  probe_timeout = " +
		"\"3s\"\n  suspicion_mult = 8\n}\n"
}

// startClientAgents joins --agents - 1 client agents to the server.
func (b *bench) startClientAgents(bin string) error {
	for i := 1; i < *agents; i++ {
		ca, err := consultest.Launch(bin, consultest.Options{
			NodeName: fmt.Sprintf("bench-client-%d", i), JoinClientOf: b.agent,
			ExtraHCL: gossipHCL()})
		if ca != nil {
			b.onClose(ca.Close)
		}
		if err != nil {
			return fmt.Errorf("client agent %d: %w", i, err)
		}
		c, err := consul.NewClient(ca.HTTPAddr(), 64)
		if err != nil {
			return err
		}
		b.clients = append(b.clients, c)
	}
	if *agents > 1 {
		b.agent.SettleSync()
		logf("%d Consul agents (1 server, %d clients) hold the executors", *agents, *agents-1)
	}
	return nil
}

// registerFleet registers the executors (and the flapping services) before
// leasehold starts: every registration under a watching leasehold re-reads
// its whole task type, which at 10,000 executors would make the
// registering, not the phases, what is measured.
func (b *bench) registerFleet() error {
	b.fleet = newFleet(b.clients, *executors, taskNames(*tasks), *bulkLease, b.shortLease)
	b.fleet.victimRank = b.victimRank
	if *victimsOneTask {
		b.fleet.firstTask = b.n
	}
	b.res.shortLeases = b.fleet.shortCount()
	if *bulkLease > 0 {
		logf("registering %d executors over %d task types: %d on lease %s (heartbeat %s), the "+
			"rest on lease %s (heartbeats spread over %s)",
			*executors, len(b.fleet.tasks), b.res.shortLeases,
			*lease, *heartbeat, *bulkLease, *bulkLease/3)
	} else {
		logf("registering %d executors over %d task types (lease %s, heartbeat %s)",
			*executors, len(b.fleet.tasks), *lease, *heartbeat)
	}
	start := time.Now()
	done := make(chan struct{})
	defer close(done)
	go b.fleet.progress(done, 15*time.Second)
	// Heartbeats run from the start, because registering a large fleet takes
	// longer than a lease.
	go b.fleet.heartbeatAll(b.ctx)
	if err := b.fleet.registerAll(); err != nil {
		return err
	}
	if *flapping > 0 {
		b.flap = newFlapper(b.clients, *flapping, *flapRate)
		logf("registering %d flapping services (%q, no leasehold tag or meta)",
			*flapping, bystanderService)
		if err := b.flap.registerAll(); err != nil {
			return err
		}
	}
	b.res.registering = time.Since(start)
	logf("registered in %s", r(b.res.registering))
	return nil
}

func (b *bench) startLeasehold() error {
	srv, err := startServe(b.agent.HTTPAddr())
	if err != nil {
		return err
	}
	b.srv = srv
	b.onClose(func() { b.stopLeasehold() })
	logf("leasehold serve pid %d ready (admin %s); RSS %s",
		srv.cmd.Process.Pid, srv.admin, kb(srv.rss()))
	b.res.rssIdle, b.res.heapIdle = srv.rss(), srv.heap()
	logf("memory of leasehold serve, no stream yet: %s", srv.memDetail())
	if *heapOut != "" {
		if err := srv.saveHeap(*heapOut + ".idle"); err != nil {
			return fmt.Errorf("heap profile: %w", err)
		}
	}
	return nil
}

// connectDispatchers opens the light streams (and the grpc-go children) and
// waits until every one holds the fleet.
func (b *bench) connectDispatchers() error {
	perTask := b.fleet.perTask()
	holdsFleet := func(task string, set map[string]bool) bool { return len(set) == perTask[task] }
	// One stream per task type first, closed once the others are measured:
	// the constraint set's xDS state (built once, for every stream of the
	// set) is then told apart from what each stream costs.
	firstCtx, closeFirst := context.WithCancel(b.ctx)
	defer closeFirst()
	first, err := startStreams(firstCtx, b.srv.xds, len(b.fleet.tasks), b.fleet.tasks,
		b.fleet.shards())
	if err != nil {
		return err
	}
	if err := first.awaitAll(holdsFleet,
		60*time.Second+time.Duration(*executors)*10*time.Millisecond); err != nil {
		return fmt.Errorf("the first streams never saw the fleet: %w", err)
	}
	b.res.rssSet, b.res.heapSet = b.srv.rss(), b.srv.heap()
	ctx, cancel := context.WithCancel(b.ctx)
	b.stopDS = cancel
	ds, err := startStreams(ctx, b.srv.xds, *dispatchers, b.fleet.tasks, b.fleet.shards())
	if err != nil {
		return err
	}
	b.ds = ds
	if err := ds.awaitAll(holdsFleet,
		60*time.Second+time.Duration(*executors)*10*time.Millisecond); err != nil {
		return fmt.Errorf("dispatchers never saw the fleet (%s): %w", ds.shortfall(perTask), err)
	}
	if *grpcN > 0 {
		if b.gc, err = startGRPCClients(b.srv.xds, *grpcN, b.fleet.tasks); err != nil {
			return err
		}
		if err := b.gc.awaitAll(holdsFleet, 120*time.Second); err != nil {
			return fmt.Errorf("grpc-go dispatchers never saw the fleet: %w", err)
		}
		logf("%d grpc-go xds:/// dispatchers hold the whole fleet", *grpcN)
	}
	b.res.rssStreams, b.res.heapStreams = b.srv.rss(), b.srv.heap()
	if *heapOut != "" {
		if err := b.srv.saveHeap(*heapOut + ".streams"); err != nil {
			return fmt.Errorf("heap profile: %w", err)
		}
	}
	logf("%d dispatcher streams connected; RSS %s, Go heap %s (idle: %s)",
		*dispatchers, kb(b.res.rssStreams), kb(b.res.heapStreams), kb(b.res.heapIdle))
	logf("memory of leasehold serve: %s", b.srv.memDetail())
	return nil
}

// leaseholdLapses lets executors [0, n) lapse and measures lease expiry →
// last stream without it; stream 0's responses are kept for the floor.
func (b *bench) leaseholdLapses() error {
	victims := span(0, b.n)
	if err := b.snapshotRaft(); err != nil {
		return err
	}
	if err := b.startProbe(); err != nil {
		return err
	}
	if *settle > 0 {
		settling := b.usage()
		time.Sleep(*settle) // a quiet spell before the drill, not a wait for a result
		logf("settling %s", b.closeWindow(settling))
	}
	b.ds.startCapture()
	profiled := b.profile(time.Duration(b.n)**lapseSpacing + *lease + 2*time.Second)
	defer traceSelf("lapses")()
	before := b.usage()
	raft := startRaftWatch(b.ctx, b.agent.HTTPAddr(), 3*time.Second)
	alloc0, gcs0, err0 := b.srv.allocs()
	expiries := b.fleet.lapseAll(victims)
	var err error
	b.res.lapse, err = b.fleet.lapseLatencies(b.ds, victims, expiries)
	alloc1, gcs1, err1 := b.srv.allocs()
	b.res.allocLapses, b.res.gcLapses = alloc1-alloc0, gcs1-gcs0
	b.res.allocErr = errors.Join(err0, err1)
	b.res.raft = raft.end()
	if err != nil {
		return err
	}
	logf("Consul's server during the lapses: %s", b.res.raft)
	quiet := b.closeWindow(before)
	b.quiet = &quiet
	logf("during the lapses %s", quiet)
	b.res.consulPart = b.probe.consulPart(b.fleet, victims, expiries)
	b.res.afterConsul = b.probe.afterConsul(b.fleet, b.ds, victims)
	if b.gc != nil {
		if b.res.grpcLapse, err = b.fleet.lapseLatencies(b.gc, victims, expiries); err != nil {
			return fmt.Errorf("at the grpc-go dispatchers: %w", err)
		}
		logf("the same lapses at %d grpc-go dispatchers (their xDS client's EDS, via CSDS): %s",
			*grpcN, dist(b.res.grpcLapse))
	}
	<-profiled
	logf("lapse → stop over %d lapses: %s", len(b.res.lapse), dist(b.res.lapse))
	logf("leasehold serve during the lapses: %s", b.res.lapseAllocs())
	for _, line := range slowestLapses(b.fleet, b.ds, b.probe, victims, expiries, 5) {
		logf("  %s", line)
	}
	b.res.rssAfter, b.res.rssPeak = b.srv.rss(), b.srv.status("VmHWM")
	if *heapOut != "" {
		if err := b.srv.saveHeap(*heapOut + ".lapses"); err != nil {
			return fmt.Errorf("heap profile: %w", err)
		}
	}
	logf("RSS of leasehold serve after the lapses and fan-outs %s, its peak %s",
		kb(b.res.rssAfter), kb(b.res.rssPeak))
	logf("memory of leasehold serve after the lapses: %s", b.srv.memDetail())
	b.res.lastBeat = b.fleet.heartbeatRTTs(victims)
	logf("the victims' last heartbeat round trips (the expiry instant's uncertainty): %s",
		dist(b.res.lastBeat))
	if len(b.res.consulPart) > 0 {
		logf("of which lease expiry → the harness's probe sees it critical: %s",
			dist(b.res.consulPart))
	}
	var count float64
	b.res.inLeasehold, count = b.srv.lapseToPushMean()
	logf("of which from Consul reporting the lapse to the last ACK (leasehold's own "+
		"histogram): mean %s over %.0f", r(b.res.inLeasehold), count)
	return nil
}

// slowestLapses describes the n slowest of the victims' lapses: when each
// lease expired, and how its lapse → stop splits into Consul's part and
// leasehold's when the probe saw it (so that a tail can be told from the
// machine's hiccups at that moment).
func slowestLapses(f *fleet, w hostWatcher, p *taskProbe, victims []int,
	expiries []time.Time, n int) []string {
	type lapse struct {
		k     int
		total time.Duration
	}
	var all []lapse
	for k, i := range victims {
		if gone := w.goneFromAll(f.ids[i]); !gone.IsZero() {
			all = append(all, lapse{k, gone.Sub(expiries[k])})
		}
	}
	slices.SortFunc(all, func(a, b lapse) int { return cmp.Compare(b.total, a.total) })
	var out []string
	for _, l := range all[:min(n, len(all))] {
		i := victims[l.k]
		line := fmt.Sprintf("lapse %d (%s) expired %s: lapse → stop %s", l.k, f.ids[i],
			expiries[l.k].Format("15:04:05.000"), r(l.total))
		if p != nil {
			p.mu.Lock()
			at, ok := p.critical[f.ids[i]]
			p.mu.Unlock()
			if ok {
				line += fmt.Sprintf(" = Consul %s + leasehold %s", r(at.Sub(expiries[l.k])),
					r(w.goneFromAll(f.ids[i]).Sub(at)))
			}
		}
		out = append(out, line)
	}
	return out
}

// traceSelf traces this process into --trace-harness's PREFIX.name until
// the returned function is called (nothing without the flag).
func traceSelf(name string) (stop func()) {
	if *traceHarness == "" {
		return func() {}
	}
	f, err := os.Create(*traceHarness + "." + name)
	if err != nil {
		logf("trace-harness: %v", err)
		return func() {}
	}
	if err := trace.Start(f); err != nil {
		logf("trace-harness: %v", err)
		f.Close()
		return func() {}
	}
	return func() { trace.Stop(); f.Close() }
}

// profile writes a CPU profile (--profile) and an execution trace (--trace)
// of leasehold serve over d, if asked; the channel closes when both are
// written.
func (b *bench) profile(d time.Duration) <-chan struct{} {
	cpu := b.fetch("profile", *profile, d)
	tr := b.fetch("trace", *traceOut, d)
	done := make(chan struct{})
	go func() { <-cpu; <-tr; close(done) }()
	return done
}

// suffixed is file with suffix, or empty if file is.
func suffixed(file, suffix string) string {
	if file == "" {
		return ""
	}
	return file + suffix
}

// fetch writes leasehold serve's pprof endpoint kind (profile or trace)
// over d into file (nothing when file is empty); the channel closes when it
// is written.
func (b *bench) fetch(kind, file string, d time.Duration) <-chan struct{} {
	done := make(chan struct{})
	if file == "" {
		close(done)
		return done
	}
	go func() {
		defer close(done)
		resp, err := http.Get(fmt.Sprintf("http://%s/debug/pprof/%s?seconds=%d",
			b.srv.admin, kind, int(d.Seconds())+1))
		if err != nil {
			logf("%s: %v", kind, err)
			return
		}
		defer resp.Body.Close()
		out, err := os.Create(file)
		if err == nil {
			io.Copy(out, resp.Body)
			out.Close()
		}
	}()
	return done
}

// fanOut deregisters healthy executors (removals, pushed at once) one at a
// time and measures deregistration → last stream without it.
func (b *bench) fanOut() error {
	cpuBefore := b.srv.cpu()
	reqBefore, _ := b.srv.consulRequests()
	traced := b.fetch("trace", suffixed(*traceOut, ".fanout"), time.Duration(*fanouts)*5*time.Second)
	defer func() { <-traced }()
	for i := range *fanouts {
		d, err := b.deregister(*executors - 1 - i)
		if err != nil {
			return fmt.Errorf("fan-out %d: %w", i, err)
		}
		b.res.fanout = append(b.res.fanout, d)
	}
	b.res.cpuPerStream = (b.srv.cpu() - cpuBefore) / time.Duration(max(1, *fanouts**dispatchers))
	reqAfter, _ := b.srv.consulRequests()
	b.res.reqPerChange = (reqAfter - reqBefore) / float64(max(1, *fanouts))
	logf("fan-out to %d streams over %d changes: %s; server CPU per stream per update %s; "+
		"Consul requests per change %.1f", *dispatchers, len(b.res.fanout),
		dist(b.res.fanout), b.res.cpuPerStream, b.res.reqPerChange)
	return nil
}

// deregister removes executor i and returns how long until the last stream
// no longer had it.
func (b *bench) deregister(i int) (time.Duration, error) {
	victim := b.fleet.ids[i]
	b.fleet.stopHeartbeat(i)
	start := time.Now()
	if err := b.fleet.agent(i).ServiceDeregister(
		health.ServiceID(victim, b.fleet.taskOf(i))); err != nil {
		return 0, err
	}
	if err := b.ds.awaitAll(func(_ string, set map[string]bool) bool {
		return !set[victim]
	}, 30*time.Second); err != nil {
		return 0, err
	}
	return b.ds.goneFromAll(victim).Sub(start), nil
}

// idleLoad measures leasehold's Consul requests per second while nothing
// changes.
func (b *bench) idleLoad() error {
	before, err := b.srv.consulRequests()
	if err != nil {
		return err
	}
	time.Sleep(*idle) // the measurement window itself
	after, _ := b.srv.consulRequests()
	b.res.idleRate = (after - before) / idle.Seconds()
	logf("Consul requests at idle: %.2f/s", b.res.idleRate)
	return nil
}

// stopLeasehold ends leasehold's side — grpc-go children, light streams,
// `leasehold serve` — so Consul's phase runs without it. Safe to repeat.
func (b *bench) stopLeasehold() error {
	b.stopProbe()
	if b.gc != nil {
		b.gc.stop()
		b.gc = nil
	}
	if b.stopDS != nil {
		b.stopDS()
		b.stopDS = nil
	}
	if b.srv != nil {
		b.srv.stop()
	}
	return nil
}

func (b *bench) report() error {
	table := b.res.markdown()
	fmt.Println(table)
	if *samplesOut != "" {
		if err := writeSamples(*samplesOut, b.res); err != nil {
			return err
		}
	}
	if *write != "" {
		return writeInto(*write, table)
	}
	return nil
}

// victimRank is executor i's place among its phase's victims (leasehold's
// [0, n), Consul's [n, 2n), the busy phase's [2n, 3n)), -1 for the others.
func (b *bench) victimRank(i int) int {
	phases := 2
	if *flapping > 0 {
		phases++
	}
	if b.n == 0 || i >= phases*b.n {
		return -1
	}
	return i % b.n
}

// hostWatcher is a set of dispatchers whose endpoints are followed: the
// light ADS streams or the grpc-go children.
type hostWatcher interface {
	awaitAll(cond func(task string, set map[string]bool) bool, timeout time.Duration) error
	goneFromAll(host string) time.Time
}

// lapseAll stops the victims' heartbeats lapseSpacing apart and returns each
// lease's expiry (when its last acknowledged heartbeat was sent + the lease).
// Each victim heartbeats at its own phase, in step with its stop
// (phaseOrder), so their leases expire lapseSpacing apart too;
// with --heartbeat-rounds victims stopped within one round share that
// heartbeat, their leases expire at the same moment and their pushes queue
// one behind another.
func (f *fleet) lapseAll(victims []int) []time.Time {
	expiries := make([]time.Time, len(victims))
	f.awaitPhaseZero()
	from := time.Now()
	for k, i := range victims {
		// The drill's schedule, not a wait for a result: victim k stops
		// k·spacing after the first, on the clock rather than after the
		// stops before it, so its stop stays just after its slot's heartbeat.
		time.Sleep(time.Until(from.Add(time.Duration(k) * *lapseSpacing)))
		if f.lastRTT[i].Load() == 0 {
			// Never heartbeated: its expiry would count from its registration,
			// whose processing (the agent persists the service and its check
			// before the TTL timer runs) is no part of a lapse.
			f.beat(i)
		}
		expiries[k] = f.stop(i)
	}
	time.Sleep(*lapseSpacing)
	return expiries
}

// awaitPhaseZero waits until just after the short leases' heartbeat
// schedule passes phase 0 (phaseOrder put the victims' slots in step with
// their stops from there): late enough that a slot's heartbeat, handed out
// up to a tick late, is answered before its victim stops.
func (f *fleet) awaitPhaseZero() {
	from := f.beatsFrom.Load()
	if from == 0 || f.victimRank == nil || *heartbeatRounds {
		return
	}
	after := 2*phaseTick(f.shortCount(), *heartbeat) + 30*time.Millisecond
	since := time.Since(time.Unix(0, from)) - after
	wait := (*heartbeat - since%*heartbeat) % *heartbeat
	time.Sleep(wait) // the drill's schedule, not a wait for a result
}

// lapseLatencies waits until every dispatcher of w has dropped each victim
// and returns, per victim, lease expiry → the last one without it (none for
// a victim no dispatcher of w follows: a grpc-go child per task type is not
// given).
func (f *fleet) lapseLatencies(
	w hostWatcher, victims []int, expiries []time.Time,
) ([]time.Duration, error) {
	var lat []time.Duration
	for k, i := range victims {
		victim := f.ids[i]
		if err := w.awaitAll(func(_ string, set map[string]bool) bool {
			return !set[victim]
		}, 4**lease+30*time.Second); err != nil {
			return lat, fmt.Errorf("lapse %d (%s): %w", k, victim, err)
		}
		if gone := w.goneFromAll(victim); !gone.IsZero() {
			lat = append(lat, gone.Sub(expiries[k]))
		}
	}
	return lat, nil
}

// span is the indices [from, to).
func span(from, to int) []int {
	out := make([]int, 0, max(0, to-from))
	for i := from; i < to; i++ {
		out = append(out, i)
	}
	return out
}
