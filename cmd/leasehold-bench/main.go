// Command leasehold-bench measures leasehold on loopback with real parts: a
// Consul server (not -dev unless --consul-dev: a dev agent indents every JSON
// answer) and client agents, real registrations with TTL checks
// heartbeated by the harness (fleet.go), `leasehold serve` as a separate
// process, lightweight ADS dispatchers that ACK like real clients, and a few
// real grpc-go dispatchers, child processes that check that the light ones
// measure what a real dispatcher sees (grpcclients.go). After leasehold's
// phase it replays leasehold's own responses from a bare ADS server to as
// many streams (the floor, floor.go); with --flapping it measures lapses
// while unrelated services' checks flap (flapping.go; usage.go reads CPU and
// leasehold's Consul queries); then it measures as many lapses through
// Consul's own xDS (consulxds.go). With --consul-probe (or --flapping) a
// blocking query of the harness's own splits each lapse into Consul's part
// and leasehold's (probe.go). phases.go runs the phases. With --churn it
// measures fleet churn instead (churn.go).
//
// It writes its results into --write (BENCHMARKS.md) between the bench:start
// and bench:end markers, and the churn results between churn:start and
// churn:end.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/anypb"

	syncfleet "github.com/leasehold/leasehold/snapshot/fleet"
	"github.com/leasehold/leasehold/snapshot/translator"
)

var (
	leaseholdBin = flag.String("leasehold", "bin/leasehold", "leasehold binary")
	shardSize    = flag.Int("shard-size", syncfleet.DefaultShardSize,
		"leasehold serve --shard-size (0: never shard); the light streams subscribe to "+
			"the shards it makes")
	executors = flag.Int("executors", 500,
		"registered executors, spread evenly over --tasks task types")
	dispatchers = flag.Int("dispatchers", 100,
		"ADS dispatcher streams, spread evenly over --tasks task types")
	tasks = flag.Int("tasks", 1,
		"task types the executors and streams are spread over (1: task type "+
			"\"work\"; more: work-0, work-1, …)")
	lapses = flag.Int("lapses", 50,
		"lapses to measure (in leasehold's phase, and as many in Consul's xDS phase)")
	settle = flag.Duration("settle", defaultSettle,
		"how long leasehold serves the connected streams before its lapses begin: with "+
			"--consul-xds the executors are Connect services, and Consul's setting up their "+
			"sidecars' proxy configurations after registering held the one agent's heartbeats "+
			"~150 ms at 500 executors, in leasehold's phase only (Consul's comes long after)")
	consulData = flag.String("consul-data", "",
		"the directory the Consul server's data dir (its raft log) is made in (default: the "+
			"system's temporary directory, on this box's disk); /dev/shm puts the log in "+
			"memory, so that its commits wait for no disk: on this virtual disk raft's log "+
			"writes took up to 1.3 s, which Consul's part of a lapse then waited for")
	consulSnapshot = flag.Bool("consul-snapshot", true,
		"have the Consul server take a raft snapshot before each phase's lapses, so that the one "+
			"registering the fleet made due does not fall among them (false: Consul's own timing)")
	lapseSpacing = flag.Duration("lapse-spacing", defaultLapseSpacing,
		"how far apart the victims of a phase stop heartbeating, and the floor's pushes are")
	fanouts = flag.Int("fanouts", 10, "single changes to measure fan-out with")
	lease   = flag.Duration("lease", 10*time.Second,
		"executor lease (TTL); with --bulk-lease, only of the executors "+
			"the run lapses or deregisters")
	heartbeat = flag.Duration("heartbeat", 3*time.Second,
		"heartbeat interval of the --lease executors")
	heartbeatRounds = flag.Bool("heartbeat-rounds", false,
		"heartbeat every --lease executor in one round each --heartbeat, as one clock would; "+
			"by default each has its own phase, as executors started at different moments do, "+
			"so victims stopped apart expire apart")
	bulkLease = flag.Duration("bulk-lease", 0,
		"lease of every executor the run never lapses nor deregisters, heartbeated a third of it "+
			"apart at an even pace (0: they hold --lease too); e.g. 10m for 10,000 executors, "+
			"whose short leases would saturate 2 cores")
	flapping = flag.Int("flapping", 0,
		"a busy datacenter: register this many other services (not leasehold's) whose TTL checks "+
			"flap, and measure lapse → stop, Consul and leasehold while they flap against "+
			"the same without (0: no such phase)")
	flapRate = flag.Float64("flap-rate", 100,
		"with --flapping: check status changes per second, over all flapping services")
	consulProbe = flag.Bool("consul-probe", false,
		"follow the critical checks with a blocking query of the harness's own "+
			"(/v1/health/state/critical; with --flapping, always on, one filtered "+
			"/v1/health/service/<task> per task type), to split lapse → stop into Consul's "+
			"part and leasehold's")
	idle = flag.Duration("idle", 20*time.Second,
		"idle period over which Consul load is measured")
	write = flag.String("write", "BENCHMARKS.md",
		"file to write the results into (empty: stdout only)")
	profile = flag.String("profile", "",
		"write a CPU profile of leasehold serve during the lapses to this file")
	victimsOneTask = flag.Bool("victims-one-task", false,
		"leasehold's lapse victims all serve the first task type, so stream 0, whose responses "+
			"the floor replays, gets a push for every lapse: a floor of as many pushes as lapses "+
			"rather than those of one task type's share (the other task types' streams stay idle)")
	serveEnv = flag.String("serve-env", "",
		"KEY=VALUE[,…] set for leasehold serve alone (e.g. GOGC=50 or GOMEMLIMIT=70MiB: the "+
			"collector's settings, measured without changing the harness's own)")
	consulDev = flag.Bool("consul-dev", false,
		"run the Consul server as a -dev agent, as the harness did before 2026-12-02: a dev agent "+
			"indents every JSON answer, so leasehold's reads cost it more than they cost a "+
			"production server (the default is a server that is not -dev, raft on disk)")
	samplesOut = flag.String("samples", "",
		"write the run's samples (each lapse, its parts, each floor push, each fan-out) to "+
			"this file as JSON, for --pool")
	pool = flag.Bool("pool", false,
		"run nothing: pool the samples files named as arguments (--samples, runs of one "+
			"invocation) and print each series' distribution over all of them, and leasehold's "+
			"part ÷ its floor pooled and per run")
	heapOut = flag.String("heap-profile", "",
		"write heap profiles of leasehold serve once the fleet is read (FILE.idle) and once "+
			"the streams hold it (FILE.streams), and after the lapses (FILE.lapses; "+
			"-diff_base FILE.streams -sample_index=alloc_space: what the lapses allocated)")
	traceOut = flag.String("trace", "",
		"write an execution trace of leasehold serve during the lapses to this file (and "+
			"during the fan-out to FILE.fanout) "+
			"(go tool trace; -pprof=net, sync or sched for where pushes wait)")
	traceHarness = flag.String("trace-harness", "",
		"write execution traces of this harness (its light streams) to PREFIX.lapses during "+
			"leasehold's lapses, PREFIX.floor during the floor's replay and PREFIX.floor.task "+
			"during its replay to the pushed task type's streams alone (go tool trace "+
			"-pprof=sched: how long its streams waited for a CPU)")
	compare = flag.Bool("consul-xds", true,
		"also measure as many lapses through Consul's own xDS (Connect sidecars), "+
			"in a phase after leasehold's")
	consulClients = flag.Int("consul-xds-clients", 0,
		"delta ADS clients following Consul's own xDS in its phase (0: as many as --dispatchers, "+
			"so that both paths push to the same number of clients)")
	agents = flag.Int("agents", 1,
		"Consul agents holding the executors (the server plus client agents joined to it): "+
			"one agent on 2 cores cannot keep ~10,000 TTL checks")
	grpcN = flag.Int("grpc-clients", 3,
		"real grpc-go xds:/// dispatchers (child processes) measured next to the light ones")
)

func main() {
	if target := os.Getenv(grpcChildEnv); target != "" {
		os.Exit(runGRPCChild(target))
	}
	if frames := os.Getenv(floorChildEnv); frames != "" {
		os.Exit(runFloorChild(frames))
	}
	flag.Parse()
	if *streamsPerConn < 1 {
		fmt.Fprintf(os.Stderr, "leasehold-bench: --streams-per-conn %d: want at least 1\n",
			*streamsPerConn)
		os.Exit(2)
	}
	if *pool {
		if err := runPool(flag.Args()); err != nil {
			fmt.Fprintln(os.Stderr, "leasehold-bench:", err)
			os.Exit(1)
		}
		return
	}
	closeOnInterrupt()
	runner := run
	if *churnMode {
		runner = runChurn
	}
	if err := runner(); err != nil {
		fmt.Fprintln(os.Stderr, "leasehold-bench:", err)
		os.Exit(1)
	}
}

func logf(format string, args ...any) {
	fmt.Printf(time.Now().Format("15:04:05 ")+format+"\n", args...)
}

// served is a running `leasehold serve`.
type served struct {
	cmd        *exec.Cmd
	xds, admin string
	stopped    sync.Once
}

func freePort() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

func startServe(consulAddr string) (*served, error) {
	xds, err := freePort()
	if err != nil {
		return nil, err
	}
	admin, err := freePort()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(*leaseholdBin, "serve", "--consul-addr", consulAddr,
		"--xds-addr", xds, "--admin-addr", admin, "--log-level", "warn",
		"--shard-size", strconv.Itoa(*shardSize))
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if *serveEnv != "" {
		cmd.Env = append(os.Environ(), strings.Split(*serveEnv, ",")...)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s (make bench builds it): %w", *leaseholdBin, err)
	}
	s := &served{cmd: cmd, xds: xds, admin: admin}
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get("http://" + admin + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return s, nil
			}
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, errors.New("leasehold never became ready")
		}
		time.Sleep(100 * time.Millisecond) // /readyz has no watch API
	}
}

func (s *served) stop() {
	s.stopped.Do(func() {
		s.cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { s.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			s.cmd.Process.Kill()
		}
	})
}

// cpu is the process's user+system CPU time so far.
func (s *served) cpu() time.Duration { return procCPU(s.cmd.Process.Pid) }

// heap is the Go heap in use after a forced GC, in KB (from the admin
// port's pprof endpoint).
func (s *served) heap() int64 {
	stats, _ := s.heapStats(true)
	return stats["HeapAlloc"] / 1024
}

// heapStats is the runtime's accounts at the head of serve's heap profile
// (debug=1), after a forced collection if gc.
func (s *served) heapStats(gc bool) (map[string]int64, error) {
	url := "http://" + s.admin + "/debug/pprof/heap?debug=1"
	if gc {
		url += "&gc=1"
	}
	resp, err := http.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("heap profile: %s", resp.Status)
	}
	return parseHeapStats(resp.Body)
}

// parseHeapStats reads the "# Name = n" (or "# Name = in use / from the
// system") lines of a heap profile in its text form.
func parseHeapStats(r io.Reader) (map[string]int64, error) {
	stats := map[string]int64{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		k, v, ok := strings.Cut(strings.TrimPrefix(sc.Text(), "# "), " = ")
		v, _, _ = strings.Cut(v, " /")
		if n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); ok && err == nil {
			stats[k] = n
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("heap profile: %w", err)
	}
	return stats, nil
}

// allocs is what serve has allocated in all (bytes) and how many collections
// it has run, read from its heap profile's statistics without a collection.
// The profile is written after they are read, so its own allocation counts
// in the next reading.
func (s *served) allocs() (total, gcs int64, err error) {
	stats, err := s.heapStats(false)
	if err != nil {
		return 0, 0, err
	}
	return allocsOf(stats)
}

// allocsOf is TotalAlloc and NumGC of a heap profile's statistics.
func allocsOf(stats map[string]int64) (total, gcs int64, err error) {
	for _, name := range []string{"TotalAlloc", "NumGC"} {
		if _, ok := stats[name]; !ok {
			return 0, 0, fmt.Errorf("heap profile: no %s", name)
		}
	}
	return stats["TotalAlloc"], stats["NumGC"], nil
}

// memDetail is where the process's memory is, for the log: the runtime's
// own accounts (after a forced GC) and its goroutines, whose stacks are in
// the RSS but not in the heap.
func (s *served) memDetail() string {
	stats, _ := s.heapStats(true)
	goroutines := "?"
	if resp, err := http.Get("http://" + s.admin + "/debug/pprof/goroutine?debug=1"); err == nil {
		sc := bufio.NewScanner(resp.Body)
		if sc.Scan() {
			goroutines = strings.TrimPrefix(sc.Text(), "goroutine profile: total ")
		}
		resp.Body.Close()
	}
	rss := map[string]int64{}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", s.cmd.Process.Pid)); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.HasPrefix(k, "Rss") {
				n, _ := strconv.ParseInt(strings.Fields(v + " 0")[0], 10, 64)
				rss[k] = n
			}
		}
	}
	mb := func(k string) string { return kb(stats[k] / 1024) }
	return fmt.Sprintf("heap in use %s, idle %s (released %s), stacks %s, the collector's %s; "+
		"%s goroutines; RSS anonymous %s, of files (the binary) %s", mb("HeapInuse"),
		mb("HeapIdle"), mb("HeapReleased"), mb("Stack"), mb("GCSys"), goroutines,
		kb(rss["RssAnon"]), kb(rss["RssFile"]))
}

// saveHeap writes the heap profile after a forced GC to path (go tool pprof
// -sample_index=inuse_space: what the bytes measured are).
func (s *served) saveHeap(path string) error {
	resp, err := http.Get("http://" + s.admin + "/debug/pprof/heap?gc=1")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	_, err = io.Copy(f, resp.Body)
	return errors.Join(err, f.Close())
}

// rss reads the process's resident set size in KB.
func (s *served) rss() int64 { return s.status("VmRSS") }

// status reads a size in KB from the process's /proc status (VmRSS, VmHWM:
// the peak resident set size).
func (s *served) status(field string) int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", s.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			n, _ := strconv.ParseInt(strings.Fields(v)[0], 10, 64)
			return n
		}
	}
	return 0
}

// metric sums every sample of a metric family line prefix from /metrics.
func (s *served) metric(prefix string) (float64, error) {
	resp, err := http.Get("http://" + s.admin + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var total float64
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, prefix+" ") || strings.HasPrefix(line, prefix+"{") {
			f := strings.Fields(line)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			total += v
		}
	}
	return total, nil
}

// lapseToPushMean is the mean of leasehold's own lapse → last ACK histogram,
// and its count.
func (s *served) lapseToPushMean() (time.Duration, float64) {
	sum, _ := s.metric("leasehold_lapse_to_push_duration_seconds_sum")
	count, _ := s.metric("leasehold_lapse_to_push_duration_seconds_count")
	if count == 0 {
		return 0, 0
	}
	return time.Duration(sum / count * float64(time.Second)), count
}

// consulRequests sums leasehold_consul_requests_total from /metrics.
func (s *served) consulRequests() (float64, error) {
	return s.metric("leasehold_consul_requests_total")
}

// dispatcherSet is M lightweight ADS clients that ACK every response;
// client i follows task type tasks[i % len(tasks)], subscribing to its load
// assignments by name (the task's, or its shards'). A state-of-the-world
// response of load assignments may carry only those that changed (a lapse
// resends one shard), so each client keeps its endpoints per resource.
type dispatcherSet struct {
	mu     sync.Mutex
	tasks  []string                     // the task type each client follows
	byRes  []map[string]map[string]bool // per client: each resource's endpoints
	sets   []map[string]bool            // latest endpoints per client, all resources
	held   []map[string]int             // per client: how many resources hold each endpoint
	gone   []map[string]time.Time       // per client: when each endpoint left its set
	moved  []time.Time                  // per client: when its set last changed
	ignore map[string]bool              // endpoints whose coming and going is no move
	notify chan struct{}

	// Client 0's responses, kept for the floor to replay: the latest of each
	// resource until startCapture, then every response until stopCapture.
	latest    map[string]*anypb.Any
	captured  []*discovery.DiscoveryResponse
	capturing bool
	// others is, per task type other than client 0's, the latest of each
	// resource the first client following it holds: the state the floor
	// serves to the streams its pushes do not go to, so that it holds as
	// many streams, as much state, as leasehold did.
	ntasks int // clients [0, ntasks) each follow a different task type
	others map[string]map[string]*anypb.Any
}

// edsNames is the load assignments a client following task subscribes to:
// its shards' when leasehold splits it (shards > 1), else the task's own.
func edsNames(task string, shards int) []string {
	names := make([]string, 0, shards)
	for i := range max(shards, 1) {
		names = append(names, translator.ShardName(task, i, shards))
	}
	return names
}

// newDispatcherSet is the state of m clients, client i following
// tasks[i % len(tasks)].
func newDispatcherSet(m int, tasks []string) *dispatcherSet {
	ds := &dispatcherSet{tasks: make([]string, m), sets: make([]map[string]bool, m),
		byRes: make([]map[string]map[string]bool, m),
		held:  make([]map[string]int, m), gone: make([]map[string]time.Time, m),
		moved:  make([]time.Time, m),
		notify: make(chan struct{}, 1), latest: map[string]*anypb.Any{},
		ntasks: min(m, len(tasks)), others: map[string]map[string]*anypb.Any{}}
	for i := range ds.gone {
		ds.gone[i] = map[string]time.Time{}
		ds.byRes[i] = map[string]map[string]bool{}
		ds.tasks[i] = tasks[i%len(tasks)]
	}
	return ds
}

// The defaults of --lapse-spacing and --settle, which a run's invocation
// leaves out.
const (
	defaultLapseSpacing = 200 * time.Millisecond
	defaultSettle       = 10 * time.Second
)

// streamsPerConn is how many light streams share a connection (at least 1,
// checked when the flags are parsed).
var streamsPerConn = flag.Int("streams-per-conn", defaultStreamsPerConn,
	"light streams per gRPC connection (1: a connection per stream, as real dispatchers "+
		"each dial leasehold, with the server's buffers and goroutines per connection)")

const defaultStreamsPerConn = 100

// startDispatchers starts m light streams following tasks, each subscribing
// to edsNames(task, shards[task]) (nil shards: one per task), perConn to a
// connection.
func startDispatchers(
	ctx context.Context, addr string, m int, tasks []string, shards map[string]int, perConn int,
) (*dispatcherSet, error) {
	ds := newDispatcherSet(m, tasks)
	var conn *grpc.ClientConn
	for i := range m {
		if i%perConn == 0 {
			var err error
			conn, err = grpc.NewClient(addr,
				grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				return nil, err
			}
		}
		s, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
		if err != nil {
			return nil, err
		}
		req := &discovery.DiscoveryRequest{Node: &corev3.Node{Id: fmt.Sprintf("bench-%d", i)},
			TypeUrl:       resource.EndpointType,
			ResourceNames: edsNames(ds.tasks[i], shards[ds.tasks[i]])}
		if err := s.Send(req); err != nil {
			return nil, err
		}
		go ds.client(i, s, req)
	}
	return ds, nil
}

func (ds *dispatcherSet) client(
	i int, s discovery.AggregatedDiscoveryService_StreamAggregatedResourcesClient,
	req *discovery.DiscoveryRequest,
) {
	for {
		r, err := s.Recv()
		if err != nil {
			return
		}
		at := time.Now()
		// ACK first, as a lightweight client would, so that the latency
		// measured is leasehold's, not this harness's parsing.
		req.VersionInfo, req.ResponseNonce = r.VersionInfo, r.Nonce
		s.Send(req)
		updates := make(map[string]map[string]bool, len(r.GetResources()))
		for _, res := range r.GetResources() {
			hosts := map[string]bool{}
			healthyHosts(res.GetValue(), hosts)
			updates[resourceName(res.GetValue())] = hosts
		}
		ds.apply(i, at, updates, nil, r)
	}
}

// apply takes client i's response received at: the endpoints of each
// resource in updates, the resources removed (delta only); r is what client
// 0 keeps for the floor.
func (ds *dispatcherSet) apply(
	i int, at time.Time, updates map[string]map[string]bool, removed []string,
	r *discovery.DiscoveryResponse,
) {
	ds.mu.Lock()
	// Only the resources in the response are compared: a shard's update
	// costs its own endpoints, not every endpoint the client holds (at
	// 10,000 endpoints, rebuilding the whole set per response took this
	// harness ~9 ms of CPU per stream and response, under mu, and the
	// streams' own flow-control window updates waited for it).
	if ds.sets[i] == nil {
		ds.sets[i], ds.held[i] = map[string]bool{}, map[string]int{}
	}
	set, held := ds.sets[i], ds.held[i]
	replace := func(name string, hosts map[string]bool) {
		old := ds.byRes[i][name]
		for h := range hosts {
			if !old[h] {
				if held[h]++; held[h] == 1 {
					set[h] = true
					ds.moved[i] = moveAt(ds.moved[i], at, ds.ignore[h])
				}
			}
		}
		for h := range old {
			if !hosts[h] {
				if held[h]--; held[h] == 0 {
					delete(held, h)
					delete(set, h)
					ds.moved[i] = moveAt(ds.moved[i], at, ds.ignore[h])
					if _, seen := ds.gone[i][h]; !seen {
						ds.gone[i][h] = at
					}
				}
			}
		}
		if hosts == nil {
			delete(ds.byRes[i], name)
		} else {
			ds.byRes[i][name] = hosts
		}
	}
	for name, hosts := range updates {
		replace(name, hosts)
	}
	for _, name := range removed {
		replace(name, nil)
	}
	switch {
	case i == 0:
		ds.record(r)
	case i < ds.ntasks:
		ds.recordOther(ds.tasks[i], r, removed)
	}
	ds.mu.Unlock()
	select {
	case ds.notify <- struct{}{}:
	default:
	}
}

// record keeps client 0's response r (called under mu).
func (ds *dispatcherSet) record(r *discovery.DiscoveryResponse) {
	if ds.capturing {
		ds.captured = append(ds.captured, r)
		return
	}
	for _, res := range r.GetResources() {
		ds.latest[resourceName(res.GetValue())] = res
	}
}

// recordOther keeps, for task, the resources of r and forgets those removed
// (called under mu).
func (ds *dispatcherSet) recordOther(
	task string, r *discovery.DiscoveryResponse, removed []string,
) {
	held := ds.others[task]
	if held == nil {
		held = map[string]*anypb.Any{}
		ds.others[task] = held
	}
	for _, res := range r.GetResources() {
		held[resourceName(res.GetValue())] = res
	}
	for _, name := range removed {
		delete(held, name)
	}
}

// otherState is, per task type other than client 0's, what its first client
// holds, as one response carrying each resource's latest.
func (ds *dispatcherSet) otherState() map[string]*discovery.DiscoveryResponse {
	ds.mu.Lock()
	defer ds.mu.Unlock()
	state := make(map[string]*discovery.DiscoveryResponse, len(ds.others))
	for task, held := range ds.others {
		resp := &discovery.DiscoveryResponse{VersionInfo: "idle", Nonce: "idle",
			TypeUrl: resource.EndpointType}
		for _, name := range slices.Sorted(maps.Keys(held)) {
			resp.Resources = append(resp.Resources, held[name])
		}
		state[task] = resp
	}
	return state
}

// startCapture keeps every later response of client 0.
func (ds *dispatcherSet) startCapture() {
	ds.mu.Lock()
	defer ds.mu.Unlock()
	ds.capturing, ds.captured = true, nil
}

// stopCapture returns what client 0 held when the capture started, as one
// response carrying each resource's latest (nil: nothing), and every
// response it received since.
func (ds *dispatcherSet) stopCapture() (
	base *discovery.DiscoveryResponse, since []*discovery.DiscoveryResponse,
) {
	ds.mu.Lock()
	defer ds.mu.Unlock()
	ds.capturing = false
	if len(ds.latest) == 0 {
		return nil, ds.captured
	}
	base = &discovery.DiscoveryResponse{VersionInfo: "base", Nonce: "base",
		TypeUrl: resource.EndpointType}
	for _, name := range slices.Sorted(maps.Keys(ds.latest)) {
		base.Resources = append(base.Resources, ds.latest[name])
	}
	return base, ds.captured
}

// awaitAll waits until every client's latest set satisfies cond (given the
// task type the client follows).
func (ds *dispatcherSet) awaitAll(
	cond func(task string, set map[string]bool) bool, timeout time.Duration,
) error {
	return awaitNotified(&ds.mu, ds.notify, timeout, func() bool {
		for i, s := range ds.sets {
			if s == nil || !cond(ds.tasks[i], s) {
				return false
			}
		}
		return true
	})
}

// moveAt is when a set last moved after an endpoint came or went at: then,
// unless the endpoint is one whose moves are ignored.
func moveAt(last, at time.Time, ignored bool) time.Time {
	if ignored {
		return last
	}
	return at
}

// ignoreMoves has the coming and going of hosts not count as moves of the
// sets (lastMoved), nor in converge's comparison: the churn's canaries,
// whose lapses are measured on their own.
func (ds *dispatcherSet) ignoreMoves(hosts []string) {
	ds.mu.Lock()
	defer ds.mu.Unlock()
	ds.ignore = map[string]bool{}
	for _, h := range hosts {
		ds.ignore[h] = true
	}
}

// lastMoved is when the last of the clients' sets changed.
func (ds *dispatcherSet) lastMoved() time.Time {
	ds.mu.Lock()
	defer ds.mu.Unlock()
	var last time.Time
	for _, t := range ds.moved {
		if t.After(last) {
			last = t
		}
	}
	return last
}

// shortfall says, per task type whose streams do not all hold want[task]
// endpoints, the fewest one holds (a node failure lapses a whole agent's
// sessions, for good).
func (ds *dispatcherSet) shortfall(want map[string]int) string {
	ds.mu.Lock()
	defer ds.mu.Unlock()
	fewest := map[string]int{}
	for i, set := range ds.sets {
		if n, ok := fewest[ds.tasks[i]]; !ok || len(set) < n {
			fewest[ds.tasks[i]] = len(set)
		}
	}
	var short []string
	for task, n := range fewest {
		if n != want[task] {
			short = append(short, fmt.Sprintf("%s: a stream holds %d of %d", task, n, want[task]))
		}
	}
	sort.Strings(short)
	return strings.Join(short, "; ")
}

// awaitNotified re-checks check (under mu) each time notify fires, until it
// holds or timeout passes; also every 50 ms, since waiters running at once
// share notify's one pending signal (the times measured are stamped by the
// clients, not by the waiters).
func awaitNotified(
	mu *sync.Mutex, notify <-chan struct{}, timeout time.Duration, check func() bool,
) error {
	deadline := time.After(timeout)
	recheck := time.NewTicker(50 * time.Millisecond)
	defer recheck.Stop()
	for {
		mu.Lock()
		ok := check()
		mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-notify:
		case <-recheck.C:
		case <-deadline:
			return errors.New("timed out")
		}
	}
}

// goneFromAll is when the last client dropped host.
func (ds *dispatcherSet) goneFromAll(host string) time.Time {
	ds.mu.Lock()
	defer ds.mu.Unlock()
	var last time.Time
	for _, g := range ds.gone {
		if t := g[host]; t.After(last) {
			last = t
		}
	}
	return last
}

// results is what a run measured, for BENCHMARKS.md's table. registering is
// how long registering the fleet (and the flapping services) took, before
// leasehold started; consulPart is, per lapse, lease expiry → the harness's
// probe saw it critical (--consul-probe); floor is, per push of the
// floor's replay of leasehold's responses, push → last stream.
type results struct {
	executors, dispatchers int
	tasks                  int
	lease, heartbeat       time.Duration
	bulkLease              time.Duration
	shortLeases            int // executors holding --lease
	registering            time.Duration
	lapse, fanout          []time.Duration
	consulPart             []time.Duration
	afterConsul            []time.Duration // per lapse, the probe saw it → the last stream dropped it
	lastBeat               []time.Duration // round trip of each victim's last heartbeat
	raft                   string          // the Consul server's raft timers during the lapses
	loadStart              string          // the machine's load average when the run began
	floor                  []time.Duration // to as many streams as leasehold's, in its layout
	floorStreams           int
	floorTask              []time.Duration // to the pushed task type's streams alone
	floorTaskStreams       int
	busy                   *busyResults // with --flapping
	consulLapse            []time.Duration
	consulLastBeat         []time.Duration // the round trip of each of Consul's phase's victims' last heartbeat
	grpcLapse              []time.Duration
	grpcN                  int
	inLeasehold            time.Duration
	// allocLapses is what serve allocated during the lapses (bytes), and
	// gcLapses how many collections it ran meanwhile; allocErr why they are
	// not known.
	allocLapses, gcLapses int64
	allocErr              error
	cpuPerStream          time.Duration
	reqPerChange          float64
	rssIdle, rssStreams   int64
	// rssAfter is the RSS after the lapses and fan-outs, rssPeak the
	// highest since the start (VmHWM: the fleet's first read included).
	rssAfter, rssPeak     int64
	heapIdle, heapStreams int64
	// rssSet and heapSet are measured with one stream per task type: the
	// constraint set's xDS state built, before the other streams connect.
	rssSet, heapSet int64
	idleRate        float64
}

// quantile is the p-quantile of ds (0 for none).
func quantile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[min(len(s)-1, int(p*float64(len(s))))]
}

func dist(ds []time.Duration) string {
	if len(ds) == 0 {
		return "-"
	}
	return fmt.Sprintf("min %s, p50 %s, p99 %s, max %s", r(quantile(ds, 0)),
		r(quantile(ds, 0.5)), r(quantile(ds, 0.99)), r(quantile(ds, 1)))
}

func mean(ds []time.Duration) time.Duration {
	var sum time.Duration
	for _, d := range ds {
		sum += d
	}
	return sum / time.Duration(max(1, len(ds)))
}

// ratios is a's p50 and p99 as multiples of b's.
func ratios(a, b []time.Duration) string {
	if len(a) == 0 || len(b) == 0 {
		return "-"
	}
	x := func(p float64) float64 {
		return float64(quantile(a, p)) / float64(max(quantile(b, p), 1))
	}
	return fmt.Sprintf("p50 %.1f×, p99 %.1f×", x(0.5), x(0.99))
}

func r(d time.Duration) time.Duration { return d.Round(100 * time.Microsecond) }

func kb(n int64) string { return fmt.Sprintf("%.1f MB", float64(n)/1024) }

func (res results) markdown() string {
	var b strings.Builder
	phases := "leasehold (lapses, fan-out, idle), then the floor"
	if res.busy != nil {
		phases += ", then lapses while other services flap"
	}
	if len(res.consulLapse) > 0 {
		phases += ", then Consul's own xDS"
	}
	fmt.Fprintf(&b,
		"Run: %s, %s, %s, %d cores, load average %s at the start, %s at the end. Phases: %s.\n\n",
		res.invocation(), time.Now().UTC().Format("2006-01-02"), runtime.Version(),
		runtime.NumCPU(), res.loadStart, loadAverage(), phases)
	b.WriteString("| figure | measured | target |\n|---|---|---|\n")
	res.latencyRows(&b)
	if res.busy != nil {
		res.busy.rows(&b, res)
	}
	res.costRows(&b)
	return b.String()
}

// setupFlags are --streams-per-conn and --consul-dev as given (each with a
// leading space), or "" for the defaults: every reported command line names
// them, as both change what leasehold and Consul pay.
func setupFlags() string {
	var f string
	if *streamsPerConn != defaultStreamsPerConn {
		f += fmt.Sprintf(" --streams-per-conn %d", *streamsPerConn)
	}
	if *consulDev {
		f += " --consul-dev"
	}
	return f
}

// invocation is the command line of the run, labelled `make bench`'s only
// when its flags are the ones make bench passes.
func (res results) invocation() string {
	cmd := fmt.Sprintf("leasehold-bench --executors %d --agents %d --dispatchers %d "+
		"--grpc-clients %d --lapses %d --fanouts %d --lease %s --heartbeat %s",
		res.executors, *agents, res.dispatchers, res.grpcN,
		len(res.lapse), len(res.fanout), res.lease, res.heartbeat)
	// make bench's own sizes (the defaults): any other is the harness's run.
	extended := *executors != 500 || *agents != 1 || *dispatchers != 100 || *grpcN != 3 ||
		*lapses != 50 || *fanouts != 10 || *lease != 10*time.Second ||
		*heartbeat != 3*time.Second
	if res.tasks > 1 {
		cmd, extended = cmd+fmt.Sprintf(" --tasks %d", res.tasks), true
	}
	if res.bulkLease > 0 {
		cmd, extended = cmd+" --bulk-lease "+res.bulkLease.String(), true
	}
	if *shardSize != syncfleet.DefaultShardSize {
		cmd, extended = cmd+fmt.Sprintf(" --shard-size %d", *shardSize), true
	}
	if *lapseSpacing != defaultLapseSpacing {
		cmd, extended = cmd+" --lapse-spacing "+lapseSpacing.String(), true
	}
	if *heartbeatRounds {
		cmd, extended = cmd+" --heartbeat-rounds", true
	}
	if *settle != defaultSettle {
		cmd, extended = cmd+" --settle "+settle.String(), true
	}
	if f := setupFlags(); f != "" {
		cmd, extended = cmd+f, true
	}
	if res.busy != nil {
		cmd, extended = cmd+fmt.Sprintf(" --flapping %d --flap-rate %g",
			res.busy.services, res.busy.rate), true
	}
	if *consulProbe && res.busy == nil {
		cmd, extended = cmd+" --consul-probe", true
	}
	if *victimsOneTask {
		cmd, extended = cmd+" --victims-one-task", true
	}
	if !*consulSnapshot {
		cmd, extended = cmd+" --consul-snapshot=false", true
	}
	if *consulData != "" {
		cmd, extended = cmd+" --consul-data "+*consulData, true
	}
	if *deltaStreams {
		cmd += " --delta"
	} else {
		// make bench runs --delta: its clients are then of the kind Consul's
		// own xDS has (delta), as many on each path.
		extended = true
	}
	if !*compare {
		cmd, extended = cmd+" --consul-xds=false", true
	} else if *consulClients > 0 {
		cmd, extended = cmd+fmt.Sprintf(" --consul-xds-clients %d", *consulClients), true
	}
	if extended {
		return "`" + cmd + "`"
	}
	return "`make bench` → `" + cmd + "`"
}

// streamsOf says which streams a lapse or removal is measured at.
func (res results) streamsOf() string {
	kind := "state-of-the-world"
	if *deltaStreams {
		kind = "delta"
	}
	if res.tasks <= 1 {
		return fmt.Sprintf("%d %s streams", res.dispatchers, kind)
	}
	return fmt.Sprintf("the ~%d streams of its task type (%d %s streams over %d task types)",
		res.dispatchers/res.tasks, res.dispatchers, kind, res.tasks)
}

// lapseAllocs says what serve allocated during the lapses, in all and per
// lapse, and how many collections ran meanwhile.
func (res results) lapseAllocs() string {
	if res.allocErr != nil {
		return fmt.Sprintf("unknown (%v)", res.allocErr)
	}
	return fmt.Sprintf("%.1f MB allocated (%.0f KB a lapse), %d collections",
		float64(res.allocLapses)/(1<<20),
		float64(res.allocLapses)/1024/float64(max(1, len(res.lapse))), res.gcLapses)
}

// floorLayout says how the floor's streams were laid out.
func (res results) floorLayout() string {
	layout := fmt.Sprintf("%d to a connection", *streamsPerConn)
	if others := min(res.tasks, res.dispatchers) - 1; others > 0 {
		layout += fmt.Sprintf("; those of the %d other task types hold their state and get "+
			"no push", others)
	}
	return layout
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

func (res results) latencyRows(b *strings.Builder) {
	fmt.Fprintf(b,
		"| lapse → stop (lease expiry → last of %s has endpoints without it), %d lapses at "+
			"%d executors | %s | p99 ≤ 50 ms at 10,000 executors and 1,000 streams |\n",
		res.streamsOf(), len(res.lapse), res.executors, dist(res.lapse))
	if len(res.grpcLapse) > 0 {
		fmt.Fprintf(b,
			"| the same lapses at %d real grpc-go `xds:///` dispatchers (EDS in their "+
				"xDS client, read via CSDS; %d lapses of the task types they dial) | "+
				"%s | as the light clients |\n", res.grpcN, len(res.grpcLapse), dist(res.grpcLapse))
	}
	inside := r(res.inLeasehold).String()
	if len(res.floor) > 0 {
		fm := mean(res.floor)
		inside += fmt.Sprintf(" — the floor's mean %s, %.1f×",
			r(fm), float64(res.inLeasehold)/float64(max(fm, 1)))
	}
	if len(res.consulPart) > 0 {
		fmt.Fprintf(b,
			"| of which Consul: lease expiry → a blocking query of the harness's own "+
				"(`/v1/health/state/critical`) has the lease critical | %s | |\n",
			dist(res.consulPart))
		fmt.Fprintf(b,
			"| the lapsed executors' last heartbeat round trip (expiry counts from its sending; "+
				"the agent reset the TTL within it) | %s | |\n", dist(res.lastBeat))
		if res.raft != "" {
			fmt.Fprintf(b, "| Consul's server during the lapses (its `/v1/agent/metrics`): a lease's "+
				"critical status is a catalog write committed through raft | %s | |\n", res.raft)
		}
		floorCmp := ""
		if len(res.floor) > 0 {
			floorCmp = " — ÷ floor: " + ratios(res.afterConsul, res.floor)
		}
		fmt.Fprintf(b,
			"| of which leasehold on the harness's clock: that query has it critical → the "+
				"last stream without it (as the floor's push → last stream) | %s%s | |\n",
			dist(res.afterConsul), floorCmp)
	}
	fmt.Fprintf(b,
		"| of which inside leasehold: Consul reporting the lapse → last ACK (mean, "+
			"`leasehold_lapse_to_push_duration_seconds`) | %s | |\n", inside)
	fmt.Fprintf(b, "| fan-out: one removal until all of %s have it | %s | 1k streams ≤ 50 ms |\n",
		res.streamsOf(), dist(res.fanout))
	if len(res.floor) > 0 {
		fmt.Fprintf(b,
			"| floor: the %d responses stream 0 got for those lapses and fan-outs, "+
				"byte-identical, pushed by a bare ADS server (pre-marshalled, no Consul, "+
				"no decisions) to %d light streams with the same client code, in leasehold's "+
				"layout (%s): push → last stream has it | %s | |\n",
			len(res.floor), res.floorStreams, res.floorLayout(), dist(res.floor))
		if len(res.floorTask) > 0 {
			fmt.Fprintf(b,
				"| the same floor to the %d streams of the pushed task type alone (no "+
					"other task type's streams held) | %s | |\n",
				res.floorTaskStreams, dist(res.floorTask))
		}
		fmt.Fprintf(b,
			"| lapse → stop ÷ floor (leasehold's includes Consul noticing "+
				"the lapse) | %s | ≤ 1.5× |\n", ratios(res.lapse, res.floor))
		fmt.Fprintf(b,
			"| fan-out ÷ floor (leasehold's includes the deregistration) | %s | ≤ 1.5× |\n",
			ratios(res.fanout, res.floor))
	}
	if len(res.consulLapse) > 0 {
		fmt.Fprintf(b,
			"| %d other lapses of the same fleet through Consul's own xDS, in a phase of "+
				"their own (leasehold stopped; Connect sidecars; lease expiry → the last "+
				"of %d delta ADS clients on Consul's gRPC port without it) | %s | |\n",
			len(res.consulLapse), consulClientCount(), dist(res.consulLapse))
		fmt.Fprintf(b, "| Consul's own xDS ÷ leasehold's lapse → stop | %s | ≥ 10× |\n",
			ratios(res.consulLapse, res.lapse))
		fmt.Fprintf(b,
			"| the victims' last heartbeat round trip, leasehold's phase / Consul's (either "+
				"path's lapse → stop holds its victims' uncertainty) | %s / %s | |\n",
			dist(res.lastBeat), dist(res.consulLastBeat))
	}
}

// fleetText says what the registered fleet holds.
func (res results) fleetText() string {
	t := fmt.Sprintf("%d executors", res.executors)
	if res.tasks > 1 {
		t += fmt.Sprintf(" (%d task types)", res.tasks)
	}
	if res.bulkLease > 0 {
		t += fmt.Sprintf(", %d of them (those lapsed or deregistered) on a %s lease heartbeated "+
			"every %s, the rest on a %s lease heartbeated every %s at an even pace",
			res.shortLeases, res.lease, res.heartbeat, res.bulkLease, res.bulkLease/3)
	} else {
		t += fmt.Sprintf(" on a %s lease heartbeated every %s", res.lease, res.heartbeat)
	}
	if res.busy != nil {
		t += fmt.Sprintf(", and %d flapping services' registrations", res.busy.services)
	}
	return t
}

func (res results) costRows(b *strings.Builder) {
	streams := res.dispatchers + res.grpcN // the grpc-go dispatchers hold a stream each too
	fmt.Fprintf(b,
		"| registering the fleet before `leasehold serve` starts: %s over %d Consul %s | %s | |\n",
		res.fleetText(), *agents, plural(*agents, "agent", "agents"), r(res.registering))
	// Per stream: from one stream per task type (the constraint set built)
	// to all of them; the set's own state is told apart.
	perStream := func(set, all int64) float64 {
		return float64(all-set) / float64(max(1, streams))
	}
	fmt.Fprintf(b,
		"| RSS of `leasehold serve`: %d executors, no streams → one stream per task type → "+
			"%d more streams | %s → %s → %s (%.1f KB per stream) | ≤ 48 KB per stream; "+
			"≤ 100 MB total at 1,000 streams + 10,000 executors |\n",
		res.executors, streams, kb(res.rssIdle), kb(res.rssSet), kb(res.rssStreams),
		perStream(res.rssSet, res.rssStreams))
	if res.rssPeak > 0 {
		fmt.Fprintf(b, "| RSS of `leasehold serve` after the lapses and fan-outs; its peak since it "+
			"started (VmHWM, the first read of the fleet included) | %s; %s | ≤ 100 MB |\n",
			kb(res.rssAfter), kb(res.rssPeak))
	}
	fmt.Fprintf(b,
		"| Go heap after GC: the same three | %s → %s → %s (%.2f KB per executor with no "+
			"stream, the process's base included; the constraint set's xDS state %.2f KB per "+
			"executor; %.1f KB per stream) | ≤ 48 KB per stream |\n",
		kb(res.heapIdle), kb(res.heapSet), kb(res.heapStreams),
		float64(res.heapIdle)/float64(max(1, res.executors)),
		float64(res.heapSet-res.heapIdle)/float64(max(1, res.executors)),
		perStream(res.heapSet, res.heapStreams))
	fmt.Fprintf(b, "| server CPU per stream per update (fan-out phase, user+system) | %s | |\n",
		res.cpuPerStream)
	if len(res.lapse) > 0 {
		fmt.Fprintf(b, "| what `leasehold serve` allocated during the lapses (its TotalAlloc) and "+
			"the collections it ran meanwhile | %s | |\n", res.lapseAllocs())
	}
	fmt.Fprintf(b,
		"| Consul requests at idle (%d task %s) | %.2f/s | ≤ services/300 + 1 req/s |\n",
		res.tasks, plural(res.tasks, "type", "types"), res.idleRate)
	fmt.Fprintf(b,
		"| Consul requests per changed service (a deregistration) | %.1f | exactly 1 |\n",
		res.reqPerChange)
}

const startMarker, endMarker = "<!-- bench:start -->", "<!-- bench:end -->"

// writeInto replaces the text between the markers in path (appending a
// section if they are missing).
func writeInto(path, table string) error {
	return writeSection(path, startMarker, endMarker, "## End to end (leasehold-bench)", table)
}

// writeSection replaces what lies between the markers in path with table,
// or appends heading and the markers with table.
func writeSection(path, start, end, heading, table string) error {
	b, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		return err
	}
	s := string(b)
	section := start + "\n" + table + end
	i, j := strings.Index(s, start), strings.Index(s, end)
	if i >= 0 && j > i {
		s = s[:i] + section + s[j+len(end):]
	} else {
		s = strings.TrimRight(s, "\n") + "\n\n" + heading + "\n\n" + section + "\n"
	}
	return os.WriteFile(path, []byte(s), 0o644)
}

// healthyHosts adds the hostnames of the HEALTHY endpoints of a serialized
// ClusterLoadAssignment to set, scanning the wire format for just those two
// fields, because a full unmarshal per response per stream would make the
// harness, not leasehold, the bottleneck on 2 cores.
func healthyHosts(b []byte, set map[string]bool) {
	fields(b, func(num protowire.Number, v []byte) { // ClusterLoadAssignment
		if num != 2 { // endpoints
			return
		}
		fields(v, func(num protowire.Number, v []byte) { // LocalityLbEndpoints
			if num != 2 { // lb_endpoints
				return
			}
			var host string
			// HEALTHY is 1; an absent status is UNKNOWN (0), which is treated as
			// routable.
			healthy := true
			fields(v, func(num protowire.Number, v []byte) { // LbEndpoint
				if num == 1 { // endpoint
					fields(v, func(num protowire.Number, v []byte) {
						if num == 3 { // hostname
							host = string(v)
						}
					})
				}
			}, func(num protowire.Number, x uint64) {
				if num == 2 { // health_status
					healthy = x == uint64(corev3.HealthStatus_HEALTHY) || x == 0
				}
			})
			if healthy && host != "" {
				set[host] = true
			}
		})
	})
}

// resourceName is a serialized ClusterLoadAssignment's cluster_name (field 1).
func resourceName(b []byte) string {
	var name string
	fields(b, func(num protowire.Number, v []byte) {
		if num == 1 {
			name = string(v)
		}
	})
	return name
}

// fields calls bytesFn for each length-delimited field and varintFn (if
// given) for each varint field of a message.
func fields(
	b []byte, bytesFn func(protowire.Number, []byte), varintFn ...func(protowire.Number, uint64),
) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return
		}
		b = b[n:]
		switch typ {
		case protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return
			}
			bytesFn(num, v)
			b = b[n:]
		case protowire.VarintType:
			x, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return
			}
			if len(varintFn) > 0 {
				varintFn[0](num, x)
			}
			b = b[n:]
		default:
			n := protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return
			}
			b = b[n:]
		}
	}
}
