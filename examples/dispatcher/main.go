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
	"google.golang.org/grpc/stats"
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
}

// retriesRemoved says where --retries went.
const retriesRemoved = "a task refused before it started (UNAVAILABLE, " +
	"RESOURCE_EXHAUSTED) is retried on another executor by the dispatch policy " +
	"leasehold sends this dispatcher's xDS client (the rules' dispatch section: " +
	"retry.num_retries, backoff), not by the dispatcher"

// removedFlag is a flag that is no longer: given, it is refused saying why,
// rather than ignored or answered "flag provided but not defined".
type removedFlag string

func (f removedFlag) String() string   { return "" }
func (f removedFlag) Set(string) error { return errors.New("removed: " + string(f)) }

func main() {
	var o options
	defineFlags(flag.CommandLine, &o)
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

// defineFlags defines the command line's flags on fs, into o.
func defineFlags(fs *flag.FlagSet, o *options) {
	fs.StringVar(&o.task, "task", "work", "task type: the dispatcher dials xds:///<task>")
	fs.StringVar(&o.bootstrap, "bootstrap", "",
		"gRPC xDS bootstrap file (from `leasehold bootstrap`; default $"+bootstrapEnv+")")
	fs.StringVar(&o.leasehold, "leasehold", "",
		"leasehold's gRPC address for the Fencing API (default: the bootstrap's xDS server)")
	fs.Float64Var(&o.rate, "rate", 5,
		"tasks started per second (open loop: a slow executor does not slow the rate)")
	fs.DurationVar(&o.work, "work", 300*time.Millisecond,
		"how long each task's simulated work takes")
	fs.IntVar(&o.count, "count", 0, "stop after this many tasks (0: until SIGINT/SIGTERM)")
	fs.DurationVar(&o.timeout, "timeout", 10*time.Second, "deadline of one task")
	fs.IntVar(&o.maxInFlight, "max-in-flight", 100,
		"tasks in flight at most; beyond, a tick is skipped and counted")
	fs.BoolVar(&o.failFast, "fail-fast", false,
		"fail a task at once while no executor is routable (default: it "+
			"waits, up to --timeout, for one)")
	fs.Var(removedFlag(retriesRemoved), "retries", "removed: "+retriesRemoved)
	fs.BoolVar(&o.jsonOut, "json", false, "print one JSON object per task instead of a table row")
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
	// Attempts is how many attempts the client made (the dispatch policy's
	// retries included; 0 when none was seen); Retried are the attempts
	// before the last, each failed, and where.
	Attempts int       `json:"attempts,omitempty"`
	Retried  []Attempt `json:"retried,omitempty"`
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
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithStatsHandler(attemptStats{}))
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
		if len(oc.Retried) > 0 {
			detail = strings.TrimSpace(detail + " " + retriedNote(oc.Retried))
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
	// One call: a refusal (full, draining, no lease: the executor did not
	// start the task) is retried on another executor by the client itself,
	// as the dispatch policy leasehold sent it says (which codes, how many
	// times, the backoff); anything else may have run and is never retried.
	// The attempts are recorded only to show them.
	tries := &attempts{}
	res, err := work.Run(withAttempts(tctx, tries),
		&workpb.RunRequest{TaskId: id, DurationMs: uint32(o.work.Milliseconds())},
		grpc.WaitForReady(!o.failFast))
	n, retried := tries.ended()
	if err != nil {
		st := status.Convert(err)
		return Outcome{At: time.Now(), TaskID: id, Result: "failed",
			Error:    st.Code().String() + ": " + st.Message() + failureHint(st.Code(), o.task),
			Latency:  time.Since(start),
			Attempts: n, Retried: retried}
	}
	oc := Outcome{TaskID: id, Instance: res.GetInstanceId(),
		Session: res.GetSessionId(), Version: res.GetVersion(), Attempts: n, Retried: retried}
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

// Attempt is one attempt of a task's call that failed: the executor's
// address it went to ("" when it never reached one) and the status.
type Attempt struct {
	Executor string `json:"executor,omitempty"`
	Code     string `json:"code"`
	Message  string `json:"message,omitempty"`
}

// attempts collects the attempts of one call, as the client's stats see
// them (grpc-go reports each attempt, the policy's retries included).
type attempts struct {
	mu   sync.Mutex
	list []*attempt
}

type attempt struct {
	executor string
	err      error
}

// ended is how many attempts were made and those before the last.
func (a *attempts) ended() (int, []Attempt) {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []Attempt
	for _, t := range a.list[:max(len(a.list)-1, 0)] {
		st := status.Convert(t.err)
		out = append(out, Attempt{Executor: t.executor, Code: st.Code().String(),
			Message: st.Message()})
	}
	return len(a.list), out
}

type attemptsKey struct{}
type attemptKey struct{}

func withAttempts(ctx context.Context, a *attempts) context.Context {
	return context.WithValue(ctx, attemptsKey{}, a)
}

// attemptStats is the client's stats handler that records attempts: each
// attempt's context derives from its call's, which carries the collector.
type attemptStats struct{}

func (attemptStats) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	a, _ := ctx.Value(attemptsKey{}).(*attempts)
	if a == nil {
		return ctx
	}
	t := &attempt{}
	a.mu.Lock()
	a.list = append(a.list, t)
	a.mu.Unlock()
	return context.WithValue(ctx, attemptKey{}, attemptRef{a, t})
}

type attemptRef struct {
	a *attempts
	t *attempt
}

func (attemptStats) HandleRPC(ctx context.Context, s stats.RPCStats) {
	r, ok := ctx.Value(attemptKey{}).(attemptRef)
	if !ok {
		return
	}
	r.a.mu.Lock()
	defer r.a.mu.Unlock()
	switch s := s.(type) {
	case *stats.OutHeader:
		if s.RemoteAddr != nil {
			r.t.executor = s.RemoteAddr.String()
		}
	case *stats.End:
		r.t.err = s.Error
	}
}

func (attemptStats) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}

func (attemptStats) HandleConn(context.Context, stats.ConnStats) {}

// retriedNote says, in a table row, which attempts failed before the last.
func retriedNote(rs []Attempt) string {
	var parts []string
	for _, r := range rs {
		p := r.Code
		if r.Message != "" {
			p += " (" + r.Message + ")"
		}
		if r.Executor != "" {
			p = r.Executor + " " + p
		}
		parts = append(parts, p)
	}
	n := "attempt"
	if len(rs) > 1 {
		n = "attempts"
	}
	return fmt.Sprintf("after %d failed %s, retried by the dispatch policy: %s", len(rs), n,
		strings.Join(parts, "; "))
}
