// Command executor is an example executor: a gRPC "work" service
// (examples/workpb) that registers itself through the local Consul agent with
// consul.Registrar, runs each task under the session it was accepted in,
// reports full / not full through its lease and its load to dispatchers over
// ORCA (adapters/loadreport), and drains on SIGTERM or SIGINT: no new tasks,
// in-flight ones finish, then it deregisters and exits.
//
// It keeps the executor contract: UNAVAILABLE (draining, no lease, refusing)
// and RESOURCE_EXHAUSTED (full) answer only a task it did not start, the
// only codes the rules' dispatch policy retries elsewhere. A task it starts
// is committed at once (its response headers are sent), so a call whose
// connection breaks later is never retried by the dispatcher's own client,
// and one still running when the executor stops is answered ABORTED.
//
// It also serves the standard gRPC health service.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/consul/api"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	grpchealth "google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/loadreport"
	"github.com/leasehold/leasehold/examples/workpb"
	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/flagx"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "executor:", err)
		os.Exit(1)
	}
}

// options are the command line's.
type options struct {
	cfg          consul.Config
	listen       string
	consulAddr   string
	drainTimeout time.Duration
}

func parseFlags() options {
	var (
		o      options
		cfg    = &o.cfg
		tasks  flagx.List
		labels = flagx.Labels{}
	)
	flag.StringVar(&cfg.InstanceID, "instance", "", "stable instance id (required)")
	flag.Var(&tasks, "task", "task type(s), comma-separated or repeated (required)")
	flag.StringVar(&o.listen, "listen", "127.0.0.1:0",
		"gRPC listen address; the registered address is the one bound")
	flag.StringVar(&cfg.Version, "version", "1.0.0", "semantic version")
	flag.IntVar(&cfg.Capacity, "capacity", 2, "concurrent tasks")
	flag.Var(labels, "label", "label key=value (repeatable)")
	flag.DurationVar(&cfg.Lease.TTL, "lease", health.DefaultLeaseTTL, "lease")
	flag.DurationVar(&cfg.Lease.Heartbeat, "heartbeat", health.DefaultHeartbeat,
		"heartbeat interval")
	flag.DurationVar(&o.drainTimeout, "drain-timeout", time.Minute,
		"on SIGTERM or SIGINT, how long to wait for in-flight tasks")
	flag.StringVar(&o.consulAddr, "consul", "",
		"Consul agent HTTP address (default $CONSUL_HTTP_ADDR or 127.0.0.1:8500)")
	flag.Parse()
	cfg.Tasks, cfg.Labels = tasks, labels
	return o
}

func run() error {
	o := parseFlags()
	cfg := o.cfg
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	cfg.Logger = log

	lis, err := net.Listen("tcp", o.listen)
	if err != nil {
		return fmt.Errorf("--listen: %w", err)
	}
	addr := lis.Addr().(*net.TCPAddr)
	cfg.Address, cfg.Port = addr.IP.String(), addr.Port

	var inFlight atomic.Int64
	var draining atomic.Bool
	cfg.Load = func() int { return int(inFlight.Load()) }
	cfg.OnLeaseLost = func(l consul.LeaseLoss) {
		log.Warn("lease lost: tasks claimed under the session are abandoned",
			"session_id", l.SessionID, "reason", l.Reason, "superseded", l.Superseded)
	}

	acfg := api.DefaultConfig()
	if o.consulAddr != "" {
		acfg.Address = o.consulAddr
	}
	client, err := api.NewClient(acfg)
	if err != nil {
		return err
	}
	reg, err := consul.NewRegistrar(consul.NewAPIAgent(client), cfg)
	if err != nil {
		return err
	}

	// Load reports (ORCA) go straight to each dispatcher in every result's
	// trailer, and weighted round robin weighs this executor by them.
	other := busyOnSIGUSR1(cfg.Capacity, log)
	load, err := loadreport.New(cfg.Capacity, func() int {
		return int(inFlight.Load() + other.Load())
	})
	if err != nil {
		return fmt.Errorf("--capacity: %w", err)
	}
	srv := grpc.NewServer(load.ServerOption())
	if err := load.Register(srv); err != nil {
		return err
	}
	go load.Run(context.Background(), time.Second)
	// stopping ends the tasks still running when the executor stops, which
	// then answer ABORTED: a broken connection would reach the dispatcher as
	// UNAVAILABLE, a code that says "not started".
	stopping, abandon := context.WithCancel(context.Background())
	defer abandon()
	w := &work{reg: reg, cfg: cfg, inFlight: &inFlight, draining: &draining, load: load,
		log: log, stopping: stopping, refusing: refuseOnSIGUSR2(log)}
	workpb.RegisterWorkServer(srv, w)
	hs := grpchealth.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	go srv.Serve(lis)
	defer stop(srv, w, abandon)

	runCtx, cancelRun := context.WithCancel(context.Background())
	defer cancelRun()
	runErr := make(chan error, 1)
	go func() { runErr <- reg.Run(runCtx) }()

	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(sigs)
	var sig os.Signal
	select {
	case err := <-runErr:
		return fmt.Errorf("registration ended: %w", err)
	case sig = <-sigs:
	}
	draining.Store(true) // first: the log line below says new tasks are refused
	log.Info(signalName(sig)+": draining", "in_flight", inFlight.Load())
	hs.Shutdown() // health NOT_SERVING
	dctx, cancel := context.WithTimeout(context.Background(), o.drainTimeout)
	defer cancel()
	derr := reg.Drain(dctx)
	cancelRun()
	<-reg.Done()
	if derr != nil {
		return derr
	}
	log.Info("drained and deregistered")
	return nil
}

// Bounds of stop: how long the abandoned tasks have to return, and then
// how long their answers have to leave before the connections close.
const (
	stopGrace = 2 * time.Second
	stopFlush = 250 * time.Millisecond
)

// stop ends the gRPC server. Tasks still running (the drain timed out, or
// registration ended) are abandoned first, and the server stops gracefully
// while they answer, so that each call ends ABORTED rather than on a broken
// connection (which its dispatcher would see as UNAVAILABLE; the response
// headers sent when the task started keep its client from retrying even
// then). Once no handler runs, and the last returned stopFlush ago, it
// stops at once: a graceful stop would wait for the dispatchers'
// load-report streams, which never end.
func stop(srv *grpc.Server, w *work, abandon context.CancelFunc) {
	if n := w.inFlight.Load(); n > 0 {
		w.log.Warn("stopping with tasks in flight: they are abandoned (ABORTED)",
			"in_flight", n)
	}
	abandon()
	stopped := make(chan struct{})
	go func() {
		srv.GracefulStop() // no new calls; what is written is sent
		close(stopped)
	}()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	grace := time.After(stopGrace)
	for w.handlers.Load() > 0 {
		select {
		case <-tick.C:
		case <-stopped:
			return
		case <-grace:
			srv.Stop()
			return
		}
	}
	if flush := stopFlush - time.Since(time.Unix(0, w.lastReturn.Load())); flush > 0 {
		select {
		case <-stopped:
		case <-time.After(flush):
		}
	}
	srv.Stop()
}

// signalName is how a person writes sig (SIGINT, SIGTERM).
func signalName(sig os.Signal) string {
	switch sig {
	case syscall.SIGINT:
		return "SIGINT"
	case syscall.SIGTERM:
		return "SIGTERM"
	}
	return sig.String()
}

// busyOnSIGUSR1 counts the slots taken by other work. SIGUSR1 toggles it
// between none and half the capacity, which only the load reports show; it
// is the demo's way to make one executor busier.
func busyOnSIGUSR1(capacity int, log *slog.Logger) *atomic.Int64 {
	var other atomic.Int64
	usr1 := make(chan os.Signal, 1)
	signal.Notify(usr1, syscall.SIGUSR1)
	go func() {
		for range usr1 {
			if other.Load() == 0 {
				other.Store(int64(max(capacity/2, 1)))
			} else {
				other.Store(0)
			}
			log.Info("SIGUSR1: busy with other work", "slots", other.Load())
		}
	}()
	return &other
}

// refuseOnSIGUSR2 says whether the executor refuses every task. SIGUSR2
// toggles it: the executor keeps its lease and stays routed, but answers
// UNAVAILABLE without starting anything, as one that cannot take work for a
// moment would; it is the demo's way to show the dispatch policy retrying
// such a refusal on another executor.
func refuseOnSIGUSR2(log *slog.Logger) *atomic.Bool {
	var refusing atomic.Bool
	usr2 := make(chan os.Signal, 1)
	signal.Notify(usr2, syscall.SIGUSR2)
	go func() {
		for range usr2 {
			refusing.Store(!refusing.Load())
			log.Info("SIGUSR2: refusing every task (UNAVAILABLE, not started)",
				"refusing", refusing.Load())
		}
	}()
	return &refusing
}

// work is the Work service: each task runs under the session current when it
// was accepted, and is abandoned if that session ends under it or the
// executor stops.
type work struct {
	workpb.UnimplementedWorkServer
	reg      *consul.Registrar
	cfg      consul.Config
	inFlight *atomic.Int64 // tasks accepted and not yet ended
	draining *atomic.Bool
	refusing *atomic.Bool
	load     *loadreport.Reporter
	log      *slog.Logger
	stopping context.Context // done: running tasks are abandoned
	// handlers counts Run calls under way and lastReturn is when one last
	// returned (unix nanoseconds), for stop.
	handlers   atomic.Int64
	lastReturn atomic.Int64
}

// refuse answers a task the executor did not start: code is UNAVAILABLE or
// RESOURCE_EXHAUSTED, which the dispatch policy may retry elsewhere. The
// response carries no headers (gRPC's trailers-only answer), which is what
// lets the dispatcher's client retry it.
func (w *work) refuse(req *workpb.RunRequest, code codes.Code, why string) error {
	w.log.Info("refused a task, not started", "task_id", req.GetTaskId(), "code", code.String(),
		"reason", why)
	return status.Error(code, why)
}

func (w *work) Run(ctx context.Context, req *workpb.RunRequest) (*workpb.RunResult, error) {
	w.handlers.Add(1)
	defer func() {
		w.lastReturn.Store(time.Now().UnixNano())
		w.handlers.Add(-1)
	}()
	if req.GetDurationMs() > 600_000 {
		return nil, status.Error(codes.InvalidArgument, "duration_ms: at most 600000")
	}
	s := w.reg.Session()
	if s == nil || s.Err() != nil {
		// Consul may show a registration a moment before Run has published
		// its session; wait briefly rather than refuse.
		wctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		var err error
		s, err = w.reg.WaitSession(wctx, s)
		cancel()
		if err != nil {
			return nil, w.refuse(req, codes.Unavailable, "no current lease")
		}
	}
	if w.refusing.Load() {
		return nil, w.refuse(req, codes.Unavailable, "refusing every task (SIGUSR2)")
	}
	defer w.load.Report(ctx) // runs last, so the trailer carries the load as the task ends
	// Counted before draining is checked: a drain that begins in between
	// then waits for this task, which it would otherwise miss.
	if n := w.inFlight.Add(1); n > int64(w.cfg.Capacity) {
		w.inFlight.Add(-1)
		return nil, w.refuse(req, codes.ResourceExhausted, "full")
	}
	if w.draining.Load() || w.stopping.Err() != nil {
		w.inFlight.Add(-1)
		why := "draining: no new tasks"
		if !w.draining.Load() {
			why = "stopping: no new tasks"
		}
		return nil, w.refuse(req, codes.Unavailable, why)
	}
	w.reg.LoadChanged() // if it is full now, the Registrar says so at once
	defer w.load.Done()
	defer w.reg.LoadChanged() // free again
	defer w.inFlight.Add(-1)
	// Started: the response headers commit the call, so that no client
	// retries it whatever happens next (a client retries only a call
	// answered without headers; gRFC A6, Envoy likewise).
	if err := grpc.SendHeader(ctx, metadata.Pairs("accepted-by",
		w.cfg.InstanceID+" "+s.ID)); err != nil {
		return nil, status.Errorf(codes.Canceled, "task %s not started: %v", req.GetTaskId(), err)
	}
	select { // the work, abandoned if the session ends under it
	case <-time.After(time.Duration(req.GetDurationMs()) * time.Millisecond):
	case <-s.Done():
		return nil, status.Errorf(codes.Aborted,
			"session %s ended under task %s: %v", s.ID, req.GetTaskId(), s.Err())
	case <-w.stopping.Done():
		return nil, status.Errorf(codes.Aborted,
			"executor stopping: task %s abandoned under session %s", req.GetTaskId(), s.ID)
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	if s.Err() != nil { // the lease was lost as the task finished
		return nil, status.Errorf(codes.Aborted,
			"session %s ended as task %s finished: %v", s.ID, req.GetTaskId(), s.Err())
	}
	return &workpb.RunResult{
		TaskId: req.GetTaskId(), InstanceId: w.cfg.InstanceID,
		SessionId: s.ID, Version: w.cfg.Version,
		Load: uint32(max(w.inFlight.Load()-1, 0)),
	}, nil
}
