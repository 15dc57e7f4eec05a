// Command executor is an example executor: a gRPC "work" service
// (examples/workpb) that registers itself through the local Consul agent with
// consul.Registrar, runs each task under the session it was accepted in,
// reports full / not full through its lease and its load to dispatchers over
// ORCA (adapters/loadreport), and drains on SIGTERM or SIGINT: no new tasks,
// in-flight ones finish, then it deregisters and exits.
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
	workpb.RegisterWorkServer(srv,
		&work{reg: reg, cfg: cfg, inFlight: &inFlight, draining: &draining, load: load, log: log})
	hs := grpchealth.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	go srv.Serve(lis)
	defer srv.Stop()

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
	log.Info(signalName(sig)+": draining", "in_flight", inFlight.Load())
	draining.Store(true)
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

// work is the Work service: each task runs under the session current when it
// was accepted, and is abandoned if that session ends under it.
type work struct {
	workpb.UnimplementedWorkServer
	reg      *consul.Registrar
	cfg      consul.Config
	inFlight *atomic.Int64
	draining *atomic.Bool
	load     *loadreport.Reporter
	log      *slog.Logger
}

func (w *work) Run(ctx context.Context, req *workpb.RunRequest) (*workpb.RunResult, error) {
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
			return nil, status.Error(codes.Unavailable, "no current lease")
		}
	}
	if w.draining.Load() {
		return nil, status.Error(codes.Unavailable, "draining: no new tasks")
	}
	defer w.load.Report(ctx) // runs last, so the trailer carries the load as the task ends
	if n := w.inFlight.Add(1); n > int64(w.cfg.Capacity) {
		w.inFlight.Add(-1)
		return nil, status.Error(codes.ResourceExhausted, "full")
	}
	w.reg.LoadChanged() // if it is full now, the Registrar says so at once
	defer w.load.Done()
	defer w.reg.LoadChanged() // free again
	defer w.inFlight.Add(-1)
	select { // the work, abandoned if the session ends under it
	case <-time.After(time.Duration(req.GetDurationMs()) * time.Millisecond):
	case <-s.Done():
		return nil, status.Errorf(codes.Aborted,
			"session %s ended under task %s: %v", s.ID, req.GetTaskId(), s.Err())
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
