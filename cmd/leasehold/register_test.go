package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"google.golang.org/grpc"
	grpchealth "google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/adapters/loadreport"
	"github.com/leasehold/leasehold/health"
)

// The test binary doubles as the leasehold binary so signal handling is
// tested on a real process: LEASEHOLD_MAIN_ARGS holds the JSON argument list.
const mainArgsEnv = "LEASEHOLD_MAIN_ARGS"

func TestMain(m *testing.M) {
	if target := os.Getenv(dispatcherEnv); target != "" {
		os.Exit(runDispatcherChild(target))
	}
	if os.Getenv(callerEnv) != "" {
		os.Exit(runCallerChild())
	}
	if spec := os.Getenv(executorEnv); spec != "" {
		os.Exit(runExecutorChild(spec))
	}
	if raw := os.Getenv(mainArgsEnv); raw != "" {
		var args []string
		if err := json.Unmarshal([]byte(raw), &args); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		main2(args)
	}
	os.Exit(m.Run())
}

func main2(args []string) { os.Exit(run(args, os.Stdout, os.Stderr)) }

// fakeExecutor is an executor's HTTP health and load endpoints.
type fakeExecutor struct {
	healthy atomic.Bool
	load    atomic.Int64
	srv     *httptest.Server
}

func newFakeExecutor(t *testing.T) *fakeExecutor {
	f := &fakeExecutor{}
	f.healthy.Store(true)
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		if !f.healthy.Load() {
			http.Error(w, "down", http.StatusServiceUnavailable)
		}
	})
	mux.HandleFunc("/load", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, `{"load": %d}`, f.load.Load())
	})
	f.srv = httptest.NewServer(mux)
	t.Cleanup(f.srv.Close)
	return f
}

func sidecarArgs(a *consultest.Agent, probe string, extra ...string) []string {
	return append([]string{"register",
		"--consul-addr", a.HTTPAddr(), "--instance", "py-1", "--task", "transcode,thumbnail",
		"--address", "127.0.0.1:7000", "--version", "2.0.1", "--capacity", "2",
		"--label", "zone=eu-1", "--label", "lang=python",
		"--lease", "1s", "--heartbeat", "250ms", "--deregister-after", "1m",
		"--probe", probe}, extra...)
}

// leaseCheck returns the entry of task and its lease check, if registered.
func leaseCheck(es []*api.ServiceEntry) (*api.ServiceEntry, *api.HealthCheck) {
	for _, e := range es {
		for _, c := range e.Checks {
			if _, s, _, ok := health.ParseCheckID(c.CheckID); ok &&
				s == e.Service.Meta[health.MetaSessionID] {
				return e, c
			}
		}
	}
	return nil, nil
}

func waitStatus(
	t *testing.T, c *api.Client, task, status string, notSession string,
) *api.ServiceEntry {
	t.Helper()
	es := consultest.WaitService(t, c, task, 15*time.Second, task+" "+status,
		func(es []*api.ServiceEntry) bool {
			e, ch := leaseCheck(es)
			return ch != nil && ch.Status == status &&
				e.Service.Meta[health.MetaSessionID] != notSession
		})
	e, _ := leaseCheck(es)
	return e
}

// inProcess runs the sidecar in this process until the test ends.
func inProcess(t *testing.T, args []string) *syncBuffer {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out := &syncBuffer{}
	done := make(chan int, 1)
	go func() { done <- runRegister(ctx, args[1:], out, out) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			t.Error("sidecar did not stop")
		}
		if t.Failed() {
			t.Logf("sidecar output:\n%s", out.String())
		}
	})
	return out
}

func TestSidecarHTTPProbeGatesHeartbeats(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	ex := newFakeExecutor(t)
	inProcess(t, sidecarArgs(a, ex.srv.URL+"/healthz", "--load-url", ex.srv.URL+"/load"))

	e := waitStatus(t, c, "transcode", api.HealthPassing, "")
	s1 := e.Service.Meta[health.MetaSessionID]
	for k, v := range map[string]string{"instance_id": "py-1", "version": "2.0.1",
		"capacity": "2", "state": "active", "label_zone": "eu-1", "label_lang": "python"} {
		if e.Service.Meta[k] != v {
			t.Errorf("meta %s = %q, want %q", k, e.Service.Meta[k], v)
		}
	}
	if e.Service.Address != "127.0.0.1" || e.Service.Port != 7000 {
		t.Errorf("address %s:%d", e.Service.Address, e.Service.Port)
	}
	waitStatus(t, c, "thumbnail", api.HealthPassing, "")

	ex.load.Store(2) // full: warning, read from --load-url
	waitStatus(t, c, "transcode", api.HealthWarning, "")
	ex.load.Store(0)
	waitStatus(t, c, "transcode", api.HealthPassing, "")

	ex.healthy.Store(false) // the executor stops serving: no more heartbeats
	waitStatus(t, c, "transcode", api.HealthCritical, "")
	ex.healthy.Store(true) // recovers: a new session
	e = waitStatus(t, c, "transcode", api.HealthPassing, s1)
	if e.Service.Meta[health.MetaSessionID] == s1 {
		t.Fatal("old session came back")
	}
}

func TestSidecarGRPCProbe(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	hs := grpchealth.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	hs.SetServingStatus("work", healthpb.HealthCheckResponse_SERVING)

	inProcess(t, sidecarArgs(a, "grpc://"+lis.Addr().String()+"/work"))
	s1 := waitStatus(t, c, "transcode", api.HealthPassing, "").Service.Meta[health.MetaSessionID]
	hs.SetServingStatus("work", healthpb.HealthCheckResponse_NOT_SERVING)
	waitStatus(t, c, "transcode", api.HealthCritical, "")
	hs.SetServingStatus("work", healthpb.HealthCheckResponse_SERVING)
	waitStatus(t, c, "transcode", api.HealthPassing, s1)
}

// A gRPC executor that reports ORCA (adapters/loadreport) tells the sidecar
// its load itself: in flight = capacity turns the lease full (warning), free
// again passing — no --load-url.
func TestSidecarGRPCProbeReadsORCALoad(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var inFlight atomic.Int64
	load, err := loadreport.New(2, func() int { return int(inFlight.Load()) })
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(load.ServerOption())
	healthpb.RegisterHealthServer(srv, grpchealth.NewServer())
	if err := load.Register(srv); err != nil {
		t.Fatal(err)
	}
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go load.Run(ctx, 50*time.Millisecond)

	inProcess(t, sidecarArgs(a, "grpc://"+lis.Addr().String()))
	waitStatus(t, c, "transcode", api.HealthPassing, "")
	inFlight.Store(2) // --capacity 2
	waitStatus(t, c, "transcode", api.HealthWarning, "")
	inFlight.Store(0)
	waitStatus(t, c, "transcode", api.HealthPassing, "")
}

func TestSidecarSIGTERMDrainsThenDeregisters(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	ex := newFakeExecutor(t)
	ex.load.Store(1) // a task in flight
	args, _ := json.Marshal(sidecarArgs(a, ex.srv.URL+"/healthz",
		"--load-url", ex.srv.URL+"/load", "--drain-timeout", "30s"))
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), mainArgsEnv+"="+string(args))
	out := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		if t.Failed() {
			t.Logf("sidecar output:\n%s", out.String())
		}
	})
	waitStatus(t, c, "transcode", api.HealthPassing, "")
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	consultest.WaitService(t, c, "transcode", 10*time.Second, "draining",
		func(es []*api.ServiceEntry) bool {
			e, ch := leaseCheck(es)
			return e != nil && e.Service.Meta[health.MetaState] == "draining" &&
				ch.Status == api.HealthPassing
		})
	select {
	case err := <-exited:
		t.Fatalf("exited with work in flight: %v", err)
	default:
	}
	ex.load.Store(0) // the task finished
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("exit: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("sidecar did not exit after the drain")
	}
	for _, task := range []string{"transcode", "thumbnail"} {
		es, _, err := c.Health().Service(task, "", false, nil)
		if err != nil || len(es) != 0 {
			t.Fatalf("%s still registered: %v %s", task, err, consultest.Describe(es))
		}
	}
}

func TestSidecarBadFlagsNameTheFlag(t *testing.T) {
	a := consultest.Start(t)
	ok := sidecarArgs(a, "http://127.0.0.1:1/healthz")
	set := func(flag, value string) []string {
		out := append([]string(nil), ok...)
		for i := range out {
			if out[i] == flag {
				out[i+1] = value
				return out
			}
		}
		return append(out, flag, value)
	}
	without := func(flag string) []string {
		var out []string
		for i := 0; i < len(ok); i++ {
			if ok[i] == flag {
				i++
				continue
			}
			out = append(out, ok[i])
		}
		return out
	}
	tests := []struct {
		name string
		args []string
		flag string
	}{
		{"no instance", without("--instance"), "--instance"},
		{"bad instance", set("--instance", "a/b"), "--instance"},
		{"no task", without("--task"), "--task"},
		{"bad task", set("--task", "trans code"), "--task"},
		{"no address", without("--address"), "--address"},
		{"address without port", set("--address", "127.0.0.1"),
			`invalid --address: "127.0.0.1": no port: write HOST:PORT`},
		{"address as a URL", set("--address", "http://127.0.0.1:7000"),
			"the executor's address is HOST:PORT, no scheme"},
		{"port out of range", set("--address", "127.0.0.1:70000"), "--address"},
		{"unspecified host", set("--address", "0.0.0.0:7000"), "--address"},
		{"host name", set("--address", "exec-7.internal:7000"), "--address"},
		{"bad version", set("--version", "2.0"), "--version"},
		{"capacity not a number", set("--capacity", "many"), "--capacity"},
		{"capacity zero", set("--capacity", "0"), "--capacity"},
		{"label without =", set("--label", "zone"), "-label"},
		{"label bad key", set("--label", "a.b=c"), "--label"},
		{"label value too long", set("--label", "k="+strings.Repeat("v", 600)), "--label"},
		{"lease too short", set("--lease", "400ms"), "--lease"},
		{"deregister too soon", set("--deregister-after", "30s"), "--deregister-after"},
		{"no probe", without("--probe"), "--probe"},
		{"probe scheme", set("--probe", "tcp://127.0.0.1:80"), "--probe"},
		{"probe without port", set("--probe", "http://127.0.0.1/healthz"), "--probe"},
		{"load url", append(append([]string(nil), ok...), "--load-url", "ftp://x"), "--load-url"},
		{"duration garbage", set("--heartbeat", "soon"), "-heartbeat"},
		{"log level", set("--log-level", "verbose"),
			`invalid --log-level: "verbose": not a level: want debug, info, warn or error`},
		{"metrics without port", set("--metrics-addr", "127.0.0.1"),
			`invalid --metrics-addr: "127.0.0.1": no port: write HOST:PORT`},
		{"metrics over https", set("--metrics-addr", "https://127.0.0.1:0"),
			"/metrics is served over plain HTTP"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out bytes.Buffer
			code := runRegister(context.Background(), tt.args[1:], &out, &out)
			if code != 2 {
				t.Fatalf("exit %d, want 2; output:\n%s", code, out.String())
			}
			if !strings.Contains(out.String(), tt.flag) {
				t.Fatalf("output does not name %s:\n%s", tt.flag, out.String())
			}
		})
	}
	if svcs, err := a.Client().Agent().Services(); err != nil || len(svcs) != 0 {
		t.Fatalf("bad input registered something: %v %v", svcs, err)
	}
}

func TestParseLoad(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want int
		ok   bool
	}{{"3", 3, true}, {" 0\n", 0, true}, {`{"load": 7}`, 7, true}, {`{"load": -1}`, 0, false},
		{"-2", 0, false}, {"lots", 0, false}, {`{"busy": 1}`, 0, false}} {
		n, err := parseLoad([]byte(tt.in))
		if (err == nil) != tt.ok || n != tt.want {
			t.Errorf("parseLoad(%q) = %d, %v", tt.in, n, err)
		}
	}
}

func TestUnknownCommand(t *testing.T) {
	var out bytes.Buffer
	if code := run([]string{"frobnicate"}, &out, &out); code != 2 ||
		!strings.Contains(out.String(), "unknown command") {
		t.Fatalf("exit %d: %s", code, out.String())
	}
	if code := run(nil, &out, &out); code != 2 {
		t.Fatalf("no command: exit %d", code)
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
