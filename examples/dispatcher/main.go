// Command dispatcher is an example dispatcher: a grpc-go client that dials
// xds:///<task> through leasehold, sends tasks open-loop at a steady rate,
// prints which executor (instance, session, version) served each, and
// confirms a result only after leasehold's Fencing API says the session that
// produced it is still CURRENT (or DRAINING, finishing what it accepted).
//
// Its constraints (version, labels) travel in the xDS bootstrap's node
// metadata, written by `leasehold bootstrap`:
//
//	leasehold bootstrap --xds-addr 127.0.0.1:18000 --node-id d1 \
//	    --version-constraint '>=1.0.0, <2.0.0' > d1.json
//	dispatcher --bootstrap d1.json --task work
//
// grpc-go reads its bootstrap once, when the process starts; --bootstrap
// re-executes the dispatcher with GRPC_XDS_BOOTSTRAP set.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	_ "google.golang.org/grpc/xds" // the xds:/// resolver and balancers

	"github.com/leasehold/leasehold/examples/workpb"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

const bootstrapEnv = "GRPC_XDS_BOOTSTRAP"

type options struct {
	task        string
	bootstrap   string
	leasehold   string
	rate        float64
	work        time.Duration
	count       int
	timeout     time.Duration
	maxInFlight int
	jsonOut     bool
	failFast    bool
	retries     int
}

func main() {
	var o options
	flag.StringVar(&o.task, "task", "work", "task type: the dispatcher dials xds:///<task>")
	flag.StringVar(&o.bootstrap, "bootstrap", "",
		"gRPC xDS bootstrap file (from `leasehold bootstrap`; default $"+bootstrapEnv+")")
	flag.StringVar(&o.leasehold, "leasehold", "",
		"leasehold's gRPC address for the Fencing API (default: the bootstrap's xDS server)")
	flag.Float64Var(&o.rate, "rate", 5,
		"tasks started per second (open loop: a slow executor does not slow the rate)")
	flag.DurationVar(&o.work, "work", 300*time.Millisecond,
		"how long each task's simulated work takes")
	flag.IntVar(&o.count, "count", 0, "stop after this many tasks (0: until SIGINT/SIGTERM)")
	flag.DurationVar(&o.timeout, "timeout", 10*time.Second, "deadline of one task")
	flag.IntVar(&o.maxInFlight, "max-in-flight", 100,
		"tasks in flight at most; beyond, a tick is skipped and counted")
	flag.BoolVar(&o.failFast, "fail-fast", false,
		"fail a task at once while no executor is routable (default: it "+
			"waits, up to --timeout, for one)")
	flag.IntVar(&o.retries, "retries", 3,
		"a task refused before it started (executor full, draining or without a lease) is "+
			"sent again up to this many times")
	flag.BoolVar(&o.jsonOut, "json", false, "print one JSON object per task instead of a table row")
	flag.Parse()
	if err := o.validate(); err != nil {
		fmt.Fprintln(os.Stderr, "dispatcher:", err)
		os.Exit(2)
	}
	if o.bootstrap != "" && os.Getenv(bootstrapEnv) != o.bootstrap {
		reexec(o.bootstrap) // returns only on failure
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "dispatcher:", err)
		os.Exit(1)
	}
}

func (o *options) validate() error {
	var errs []error
	if o.task == "" || strings.ContainsAny(o.task, "/ ") {
		errs = append(errs, fmt.Errorf("invalid --task %q: want a task type name", o.task))
	}
	if o.rate <= 0 || o.rate > 10_000 {
		errs = append(errs, fmt.Errorf("invalid --rate %v: want 0 < rate <= 10000", o.rate))
	}
	if o.work < 0 || o.work > 10*time.Minute {
		errs = append(errs, fmt.Errorf("invalid --work %v: want 0..10m", o.work))
	}
	if o.count < 0 {
		errs = append(errs, fmt.Errorf("invalid --count %d: want >= 0", o.count))
	}
	if o.timeout <= 0 {
		errs = append(errs, fmt.Errorf("invalid --timeout %v: want > 0", o.timeout))
	}
	if o.retries < 0 {
		errs = append(errs, fmt.Errorf("invalid --retries %d: want >= 0", o.retries))
	}
	if o.maxInFlight <= 0 {
		errs = append(errs, fmt.Errorf("invalid --max-in-flight %d: want > 0", o.maxInFlight))
	}
	if o.bootstrap == "" && os.Getenv(bootstrapEnv) == "" &&
		os.Getenv("GRPC_XDS_BOOTSTRAP_CONFIG") == "" {
		errs = append(errs,
			fmt.Errorf("--bootstrap: required (or set $%s): write one with `leasehold bootstrap`",
				bootstrapEnv))
	}
	return errors.Join(errs...)
}

func reexec(path string) {
	if _, err := os.Stat(path); err != nil {
		fmt.Fprintf(os.Stderr, "dispatcher: --bootstrap: %v\n", err)
		os.Exit(2)
	}
	self, err := os.Executable()
	if err == nil {
		err = syscall.Exec(self, os.Args, append(os.Environ(), bootstrapEnv+"="+path))
	}
	fmt.Fprintf(os.Stderr, "dispatcher: re-executing with %s set: %v\n", bootstrapEnv, err)
	os.Exit(1)
}

// xdsServer is the first xDS server of the bootstrap grpc-go is using, and
// the credentials to reach it with (its channel_creds: insecure, or "tls"
// with CA, certificate and key files), which the fencing API shares.
func xdsServer() (string, credentials.TransportCredentials, error) {
	raw := []byte(os.Getenv("GRPC_XDS_BOOTSTRAP_CONFIG"))
	if path := os.Getenv(bootstrapEnv); path != "" {
		var err error
		if raw, err = os.ReadFile(path); err != nil {
			return "", nil, fmt.Errorf("%s: %w", bootstrapEnv, err)
		}
	}
	var b struct {
		XDSServers []struct {
			ServerURI    string `json:"server_uri"`
			ChannelCreds []struct {
				Type   string `json:"type"`
				Config struct {
					CA   string `json:"ca_certificate_file"`
					Cert string `json:"certificate_file"`
					Key  string `json:"private_key_file"`
				} `json:"config"`
			} `json:"channel_creds"`
		} `json:"xds_servers"`
	}
	if err := json.Unmarshal(raw, &b); err != nil {
		return "", nil, fmt.Errorf("bootstrap: %w", err)
	}
	if len(b.XDSServers) == 0 || b.XDSServers[0].ServerURI == "" {
		return "", nil, errors.New("bootstrap: no xds_servers[0].server_uri")
	}
	srv := b.XDSServers[0]
	if len(srv.ChannelCreds) == 0 || srv.ChannelCreds[0].Type != "tls" {
		return srv.ServerURI, insecure.NewCredentials(), nil
	}
	c := srv.ChannelCreds[0].Config
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if c.CA != "" {
		pem, err := os.ReadFile(c.CA)
		if err != nil {
			return "", nil, fmt.Errorf("bootstrap ca_certificate_file: %w", err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return "", nil, fmt.Errorf("bootstrap ca_certificate_file %s: no PEM certificate", c.CA)
		}
	}
	if c.Cert != "" {
		// The files are re-read on every handshake, so rotated ones are
		// picked up.
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			pair, err := tls.LoadX509KeyPair(c.Cert, c.Key)
			return &pair, err
		}
	}
	return srv.ServerURI, credentials.NewTLS(cfg), nil
}

// Outcome of one task, printed as a row or a JSON line.
type Outcome struct {
	At       time.Time `json:"at"`
	TaskID   string    `json:"task_id"`
	Instance string    `json:"instance_id,omitempty"`
	Session  string    `json:"session_id,omitempty"`
	Version  string    `json:"version,omitempty"`
	// Result is confirmed when the session was CURRENT (or DRAINING) when
	// the result came back; refused when it was not (State says why) and the
	// result is discarded; failed when the task did not complete (Error says
	// why); skipped when too many tasks were in flight at the tick.
	Result  string        `json:"result"`
	State   string        `json:"session_state,omitempty"`
	Error   string        `json:"error,omitempty"`
	Latency time.Duration `json:"latency_ns"`
}

func run(ctx context.Context, o options) error {
	xdsAddr, creds, err := xdsServer()
	if err != nil {
		return err
	}
	fencingAddr := o.leasehold
	if fencingAddr == "" {
		fencingAddr = xdsAddr
	}
	conn, err := grpc.NewClient("xds:///"+o.task,
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("dial xds:///%s: %w", o.task, err)
	}
	defer conn.Close()
	fconn, err := grpc.NewClient(fencingAddr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return fmt.Errorf("dial leasehold %s: %w", fencingAddr, err)
	}
	defer fconn.Close()
	work := workpb.NewWorkClient(conn)
	fencing := leaseholdv1.NewFencingClient(fconn)

	var (
		mu       sync.Mutex
		counts   = map[string]int{}
		byExec   = map[string]int{}
		wg       sync.WaitGroup
		inFlight atomic.Int64
	)
	out := json.NewEncoder(os.Stdout)
	report := func(oc Outcome) {
		mu.Lock()
		defer mu.Unlock()
		counts[oc.Result]++
		if oc.Result == "confirmed" {
			byExec[oc.Instance+" "+oc.Version]++
		}
		if o.jsonOut {
			out.Encode(oc)
			return
		}
		who := "-"
		if oc.Instance != "" {
			who = fmt.Sprintf("%s session %s v%s", oc.Instance, short(oc.Session), oc.Version)
		}
		detail := oc.State
		if oc.Error != "" {
			detail = oc.Error
		}
		fmt.Printf("%s  %-8s %-10s %-40s %s\n",
			oc.At.Format("15:04:05.000"), oc.TaskID, oc.Result, who, detail)
	}
	if !o.jsonOut {
		fmt.Printf("dispatching %g tasks/s to xds:///%s; results confirmed through "+
			"leasehold's Fencing API at %s\n", o.rate, o.task, fencingAddr)
	}
	tick := time.NewTicker(time.Duration(float64(time.Second) / o.rate))
	defer tick.Stop()
loop:
	for n := 1; o.count == 0 || n <= o.count; n++ {
		select {
		case <-ctx.Done():
			break loop
		case <-tick.C:
		}
		id := fmt.Sprintf("t%d", n)
		if inFlight.Load() >= int64(o.maxInFlight) {
			report(Outcome{At: time.Now(), TaskID: id,
				Result: "skipped", Error: "too many tasks in flight"})
			continue
		}
		inFlight.Add(1)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer inFlight.Add(-1)
			report(dispatch(ctx, work, fencing, id, o))
		}()
	}
	wg.Wait()
	summary(counts, byExec, o.jsonOut)
	return outcomeError(counts, o.task)
}

// outcomeError is run's error when tasks failed or their results were
// refused, so that the exit status says so (a script running the dispatcher
// sees it), pointing at the command that says why.
func outcomeError(counts map[string]int, task string) error {
	failed, refused := counts["failed"], counts["refused"]
	if failed == 0 && refused == 0 {
		return nil
	}
	return fmt.Errorf("%d tasks failed and %d results were refused: `leasehold explain "+
		"--task %s` says which executors are routed and why not the others", failed, refused,
		task)
}

// failureHint points a failed task's error at leasehold explain when the
// failure is about routing (no executor, none with room, none in time),
// which explain answers.
func failureHint(c codes.Code, task string) string {
	switch c {
	case codes.Unavailable, codes.ResourceExhausted, codes.DeadlineExceeded:
		return " (`leasehold explain --task " + task + "` says why no executor took it)"
	}
	return ""
}

// seenIndex is the highest consul_index of any fencing answer this
// dispatcher acted on. It is passed back as min_consul_index, so an answer
// from another (or a restarted) leasehold replica is never older than one
// already seen: STALE here is never followed by CURRENT there.
var seenIndex atomic.Uint64

// dispatch runs one task and confirms its result only if the session that
// produced it is still CURRENT (or DRAINING, finishing accepted work),
// because a result from a session that lapsed or was replaced meanwhile may
// race with the same work done again elsewhere.
func dispatch(
	ctx context.Context, work workpb.WorkClient,
	fencing leaseholdv1.FencingClient, id string, o options,
) Outcome {
	start := time.Now()
	tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), o.timeout)
	defer cancel()
	var res *workpb.RunResult
	var err error
	for attempt := 0; ; attempt++ {
		res, err = work.Run(tctx,
			&workpb.RunRequest{TaskId: id, DurationMs: uint32(o.work.Milliseconds())},
			grpc.WaitForReady(!o.failFast))
		// Full, or without a current lease, or draining: the executor did not
		// accept the task, so trying another one is safe. Anything else (a
		// deadline, ABORTED) may have run, so it is not retried.
		c := status.Code(err)
		if (c != codes.ResourceExhausted && c != codes.Unavailable) ||
			attempt >= o.retries || tctx.Err() != nil {
			break
		}
		time.Sleep(time.Duration(attempt+1) * 20 * time.Millisecond)
	}
	if err != nil {
		st := status.Convert(err)
		return Outcome{At: time.Now(), TaskID: id, Result: "failed",
			Error:   st.Code().String() + ": " + st.Message() + failureHint(st.Code(), o.task),
			Latency: time.Since(start)}
	}
	oc := Outcome{TaskID: id, Instance: res.GetInstanceId(),
		Session: res.GetSessionId(), Version: res.GetVersion()}
	chk, err := fencing.CheckSession(tctx, &leaseholdv1.CheckSessionRequest{
		InstanceId: res.GetInstanceId(), SessionId: res.GetSessionId(),
		MinConsulIndex: seenIndex.Load()})
	oc.At, oc.Latency = time.Now(), time.Since(start)
	for seen := seenIndex.Load(); err == nil && chk.GetConsulIndex() > seen &&
		!seenIndex.CompareAndSwap(seen, chk.GetConsulIndex()); seen = seenIndex.Load() {
	}
	switch {
	case err != nil:
		oc.Result, oc.Error = "refused", "fencing check failed, not confirmed: "+
			status.Convert(err).Message()
	case chk.GetState() == leaseholdv1.SessionState_CURRENT,
		chk.GetState() == leaseholdv1.SessionState_DRAINING:
		// A draining session is still its instance's newest with a valid
		// lease: it takes no new work, but what it accepted stands.
		oc.Result, oc.State = "confirmed", chk.GetState().String()
	default:
		oc.Result, oc.State = "refused", chk.GetState().String()+": "+chk.GetDetail()
	}
	return oc
}

func summary(counts, byExec map[string]int, jsonOut bool) {
	if jsonOut {
		json.NewEncoder(os.Stdout).Encode(map[string]any{"summary": counts,
			"confirmed_by_executor": byExec})
		return
	}
	var keys []string
	for k := range byExec {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	fmt.Printf("\nconfirmed %d, refused %d, failed %d, skipped %d\n",
		counts["confirmed"], counts["refused"], counts["failed"], counts["skipped"])
	for _, k := range keys {
		fmt.Printf("  %-40s %d\n", k, byExec[k])
	}
}

func short(s string) string {
	if len(s) > 8 {
		return s[:8]
	}
	return s
}
