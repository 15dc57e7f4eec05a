package main

// End to end on real parts: a Consul dev agent, `leasehold serve`, executor
// gRPC servers registered with the Registrar, and grpc-go clients dialling
// xds:///work in child processes (grpc-go reads its xDS bootstrap from the
// environment when the process starts).

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	grpchealth "google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	_ "google.golang.org/grpc/xds" // registers the xds:/// resolver in the dispatcher child

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/adapters/loadreport"
	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/testproc"
)

const dispatcherEnv = "LEASEHOLD_TEST_DISPATCHER" // child mode: dial this target and report calls

// callResult is one call made by a dispatcher child.
type callResult struct {
	At       time.Time `json:"at"`
	Instance string    `json:"instance,omitempty"`
	Session  string    `json:"session,omitempty"`
	Err      string    `json:"err,omitempty"`
}

// runDispatcherChild calls target every 5 ms until stdin closes, printing
// which executor served each call.
func runDispatcherChild(target string) int {
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer conn.Close()
	stop := make(chan struct{})
	go func() { testproc.WaitForExit(); close(stop) }() // the parent closes stdin
	enc := json.NewEncoder(os.Stdout)
	client := healthpb.NewHealthClient(conn)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return 0
		case <-tick.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		var md metadata.MD
		_, err := client.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Header(&md))
		cancel()
		r := callResult{At: time.Now()}
		if err != nil {
			r.Err = err.Error()
		} else {
			r.Instance, r.Session = first(md["x-instance"]), first(md["x-session"])
		}
		enc.Encode(r)
	}
}

func first(v []string) string {
	if len(v) == 0 {
		return ""
	}
	return v[0]
}

// dispatcher is a running child and the calls it reported.
type dispatcher struct {
	mu    sync.Mutex
	calls []callResult
	more  chan struct{}
}

func startDispatcher(
	t *testing.T, xdsAddr, nodeID string, meta map[string]any, tlsFiles ...bootstrapTLS,
) *dispatcher {
	t.Helper()
	// the dispatcher's bootstrap comes from `leasehold bootstrap`
	var vc string
	labels := map[string]string{}
	if v, ok := meta["version_constraint"].(string); ok {
		vc = v
	}
	if ls, ok := meta["labels"].(map[string]any); ok {
		for k, v := range ls {
			labels[k], _ = v.(string)
		}
	}
	form, _ := meta["endpoint_metadata"].(string)
	dc, _ := meta["datacenter"].(string)
	bootstrap, err := newBootstrap(xdsAddr, nodeID, vc, labels, form, dc, tlsFiles...)
	if err != nil {
		t.Fatal(err)
	}
	child := testproc.Start(t, nodeID, dispatcherEnv+"=xds:///work",
		"GRPC_XDS_BOOTSTRAP_CONFIG="+string(bootstrap))
	d := &dispatcher{more: make(chan struct{}, 1)}
	go func() {
		for line := range child.Lines {
			var r callResult
			if json.Unmarshal(line, &r) == nil {
				d.mu.Lock()
				d.calls = append(d.calls, r)
				d.mu.Unlock()
				select {
				case d.more <- struct{}{}:
				default:
				}
			}
		}
	}()
	return d
}

// since returns the calls made at or after t.
func (d *dispatcher) since(t time.Time) []callResult {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []callResult
	for _, c := range d.calls {
		if !c.At.Before(t) {
			out = append(out, c)
		}
	}
	return out
}

// await waits until cond holds for the calls made since t.
func (d *dispatcher) await(
	t *testing.T, since time.Time, timeout time.Duration, what string, cond func([]callResult) bool,
) {
	t.Helper()
	deadline := time.After(timeout)
	for !cond(d.since(since)) {
		select {
		case <-d.more:
		case <-deadline:
			t.Fatalf("dispatcher: %s not seen within %s (last calls: %v)",
				what, timeout, tail(d.since(since), 5))
		}
	}
}

func tail(cs []callResult, n int) []callResult {
	if len(cs) > n {
		return cs[len(cs)-n:]
	}
	return cs
}

func servedBy(cs []callResult) map[string]int {
	m := map[string]int{}
	for _, c := range cs {
		if c.Err == "" {
			m[c.Instance]++
		}
	}
	return m
}

// executor is a gRPC server registered with the Registrar; every answer
// carries its instance and session in headers.
type e2eExecutor struct {
	instance string
	addr     string // host:port it serves on
	reg      *consul.Registrar
	load     atomic.Int64
	silent   atomic.Bool // probe fails: no heartbeats
	stop     context.CancelFunc
	// reported is the tasks in flight it tells dispatchers over ORCA (of
	// orcaCapacity), whatever it serves: weighted round robin's input.
	reported atomic.Int64
}

const orcaCapacity = 4

func startExecutor(
	t *testing.T, a *consultest.Agent, instance, version string, labels ...string,
) *e2eExecutor {
	t.Helper()
	return startExecutorVia(t, consul.NewAPIAgent(a.Client()), instance, version, labels...)
}

// startExecutorVia is startExecutor through agent (a token of its own, a
// wrapper that observes the Registrar's calls).
func startExecutorVia(
	t *testing.T, agent consul.Agent, instance, version string, labels ...string,
) *e2eExecutor {
	t.Helper()
	e := &e2eExecutor{instance: instance}
	e.reported.Store(1)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e.addr = lis.Addr().String()
	load, err := loadreport.New(orcaCapacity, func() int { return int(e.reported.Load()) })
	if err != nil {
		t.Fatal(err)
	}
	// Chained after the ORCA option: its interceptor puts the per-call
	// recorder in the context this one reports into.
	g := grpc.NewServer(load.ServerOption(), grpc.ChainUnaryInterceptor(func(
		ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler,
	) (any, error) {
		sess := ""
		if s := e.reg.Session(); s != nil {
			sess = s.ID
		}
		grpc.SetHeader(ctx, metadata.Pairs("x-instance", instance, "x-session", sess))
		defer load.Report(ctx)
		defer load.Done()
		return h(ctx, req)
	}))
	healthpb.RegisterHealthServer(g, grpchealth.NewServer())
	go g.Serve(lis)
	reg, err := consul.NewRegistrar(agent, consul.Config{
		InstanceID: instance, Tasks: []string{"work"},
		Address: "127.0.0.1", Port: lis.Addr().(*net.TCPAddr).Port,
		Version: version, Capacity: 2, Labels: labelMap(labels),
		// 2 s: short for the drills, long enough that a loaded CI machine
		// (race detector, packages in parallel) never loses a lease by accident.
		Lease: health.Lease{TTL: 2 * time.Second,
			Heartbeat: 500 * time.Millisecond, DeregisterAfter: time.Minute},
		Load: func() int { return int(e.load.Load()) },
		Probe: func(context.Context) error {
			if e.silent.Load() {
				return fmt.Errorf("silenced")
			}
			return nil
		},
		Logger: slog.New(slog.NewTextHandler(testWriter{t, instance}, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	e.reg = reg
	ctx, cancel := context.WithCancel(context.Background())
	e.stop = cancel
	go reg.Run(ctx)
	t.Cleanup(func() {
		cancel()
		<-reg.Done()
		g.Stop()
	})
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	if _, err := reg.WaitSession(wctx, nil); err != nil {
		t.Fatalf("%s never registered: %v", instance, err)
	}
	return e
}

// endpoint is how dispatchers should see e under its current session (no
// session: "").
func (e *e2eExecutor) endpoint() endpoint {
	ep := endpoint{instance: e.instance, addr: e.addr}
	if s := e.reg.Session(); s != nil {
		ep.session = s.ID
	}
	return ep
}

// labelMap turns "k=v" pairs into labels.
func labelMap(pairs []string) map[string]string {
	m := map[string]string{}
	for _, p := range pairs {
		k, v, _ := strings.Cut(p, "=")
		m[k] = v
	}
	return m
}

// awaitCheck waits (blocking queries) until instance's lease check has status.
func awaitCheck(t *testing.T, c *api.Client, instance, status string) time.Time {
	t.Helper()
	consultest.WaitService(t, c, "work", 10*time.Second, instance+" "+status,
		func(es []*api.ServiceEntry) bool {
			for _, e := range es {
				if e.Service.Meta[health.MetaInstanceID] != instance {
					continue
				}
				for _, ch := range e.Checks {
					if _, s, _, ok := health.ParseCheckID(ch.CheckID); ok &&
						s == e.Service.Meta[health.MetaSessionID] && ch.Status == status {
						return true
					}
				}
			}
			return false
		})
	return time.Now()
}

type testWriter struct {
	t    *testing.T
	name string
}

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Logf("[%s] %s", w.name, p)
	return len(p), nil
}

func TestServeEndToEnd(t *testing.T) {
	a := consultest.Start(t)
	a.SettleSync()
	c := a.Client()
	e1 := startExecutor(t, a, "e1", "1.0.0")
	e2 := startExecutor(t, a, "e2", "1.0.0")
	e3 := startExecutor(t, a, "e3", "1.0.0")
	startExecutor(t, a, "e4", "2.0.0") // incompatible with the constrained dispatcher

	addrs := startServe(t, a)

	readyz := func() int { return readyzStatus(addrs.admin) }

	start := time.Now()
	anyD := startDispatcher(t, addrs.xds, "dispatcher-any", map[string]any{})
	v1 := startDispatcher(t, addrs.xds, "dispatcher-v1",
		map[string]any{"version_constraint": "<2.0.0"})
	all4 := func(cs []callResult) bool {
		m := servedBy(cs)
		return m["e1"] > 0 && m["e2"] > 0 && m["e3"] > 0 && m["e4"] > 0
	}
	anyD.await(t, start, 20*time.Second, "calls spread over e1..e4", all4)
	v1.await(t, start, 20*time.Second, "calls spread over e1..e3", func(cs []callResult) bool {
		m := servedBy(cs)
		return m["e1"] > 0 && m["e2"] > 0 && m["e3"] > 0
	})
	if code := readyz(); code != http.StatusOK {
		t.Fatalf("/readyz = %d", code)
	}

	// A lapse: e1's heartbeats stop; once Consul says critical, no more calls.
	e1.silent.Store(true)
	lapsed := awaitCheck(t, c, "e1", api.HealthCritical)
	margin := lapsed.Add(300 * time.Millisecond)
	after := time.Now().Add(time.Second)
	anyD.await(t, after, 10*time.Second, "calls after the lapse", func(cs []callResult) bool {
		return len(cs) > 50
	})
	for _, d := range []*dispatcher{anyD, v1} {
		if n := servedBy(d.since(margin))["e1"]; n > 0 {
			t.Fatalf("%d calls reached e1 more than 300ms after its lease lapsed", n)
		}
	}
	t.Logf("lapse: last call to e1 %v before Consul reported critical+300ms",
		lastCallTo(anyD, "e1").Sub(margin))

	// Full: e2 reports load = capacity → warning → no calls; then free again.
	e2.load.Store(2)
	full := awaitCheck(t, c, "e2", api.HealthWarning)
	check := time.Now().Add(time.Second)
	anyD.await(t, check, 10*time.Second, "calls while e2 is full", func(cs []callResult) bool {
		return len(cs) > 50
	})
	if n := servedBy(anyD.since(full.Add(300 * time.Millisecond)))["e2"]; n > 0 {
		t.Fatalf("%d calls reached e2 while full", n)
	}
	e2.load.Store(0)
	freed := awaitCheck(t, c, "e2", api.HealthPassing)
	anyD.await(t, freed, 10*time.Second, "calls to e2 again", func(cs []callResult) bool {
		return servedBy(cs)["e2"] > 0
	})

	// Draining: e3 gets no new calls.
	drained := make(chan error, 1)
	e3.load.Store(1)
	go func() { drained <- e3.reg.Drain(context.Background()) }()
	consultest.WaitService(t, c, "work", 10*time.Second, "e3 draining",
		func(es []*api.ServiceEntry) bool {
			for _, e := range es {
				if e.Service.Meta[health.MetaInstanceID] == "e3" &&
					e.Service.Meta[health.MetaState] == "draining" {
					return true
				}
			}
			return false
		})
	marked := time.Now()
	anyD.await(t, marked.Add(time.Second), 10*time.Second, "calls after draining",
		func(cs []callResult) bool { return len(cs) > 50 })
	if n := servedBy(anyD.since(marked.Add(300 * time.Millisecond)))["e3"]; n > 0 {
		t.Fatalf("%d calls reached draining e3", n)
	}
	e3.load.Store(0)
	if err := <-drained; err != nil {
		t.Fatal(err)
	}

	// A newer session of e2's instance fences the old one.
	old := e2.reg.Session()
	e2b := startExecutor(t, a, "e2", "1.0.0")
	newer := e2b.reg.Session()
	anyD.await(t, time.Now(), 10*time.Second, "calls to the new e2 session",
		func(cs []callResult) bool {
			for _, c := range cs {
				if c.Instance == "e2" && c.Session == newer.ID {
					return true
				}
			}
			return false
		})
	fencedAt := time.Now()
	anyD.await(t, fencedAt.Add(time.Second), 10*time.Second,
		"calls after fencing", func(cs []callResult) bool { return len(cs) > 50 })
	for _, c := range anyD.since(fencedAt.Add(300 * time.Millisecond)) {
		if c.Instance == "e2" && c.Session == old.ID {
			t.Fatalf("call served by the fenced session %s", old.ID)
		}
	}

	// The constrained dispatcher never reached the incompatible executor.
	if n := servedBy(v1.since(start))["e4"]; n > 0 {
		t.Fatalf("constrained dispatcher reached e4 %d times", n)
	}
}

func lastCallTo(d *dispatcher, instance string) time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	var last time.Time
	for _, c := range d.calls {
		if c.Instance == instance && c.At.After(last) {
			last = c.At
		}
	}
	return last
}
