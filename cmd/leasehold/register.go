package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul"
	lhotel "github.com/leasehold/leasehold/adapters/otel"
	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/flagx"
)

// registerFlags are the sidecar's flags, parsed and checked.
type registerFlags struct {
	cfg          consul.Config
	probe        string
	loadURL      string
	consulAddr   string
	drainTimeout time.Duration
	logLevel     slog.Level
	metricsAddr  string
}

// fieldFlags maps contract field names to the flags that set them, so a
// validation error names what the user typed.
var fieldFlags = map[string]string{
	"instance_id": "--instance", "task": "--task", "address": "--address", "port": "--address",
	"version": "--version", "capacity": "--capacity", "labels": "--label", "lease": "--lease",
	"heartbeat": "--heartbeat", "deregister_after": "--deregister-after", "tag": "--tag",
}

func parseRegisterFlags(args []string, stderr io.Writer) (*registerFlags, error) {
	fs := flag.NewFlagSet("leasehold register", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		rf       registerFlags
		tasks    flagx.List
		labels   = flagx.Labels{}
		address  string
		capacity string
		logLevel string
	)
	fs.StringVar(&rf.cfg.InstanceID, "instance", "", "stable instance id of the executor (required)")
	fs.Var(&tasks, "task", "task type(s) served, comma-separated or repeated (required)")
	fs.StringVar(&address, "address", "", "HOST:PORT where dispatchers reach the executor (required)")
	fs.StringVar(&rf.cfg.Version, "version", "", "semantic version of the executor (required)")
	fs.StringVar(&capacity, "capacity", "", "concurrent tasks the executor accepts, a positive integer (required)")
	fs.Var(labels, "label", "label key=value (repeatable)")
	fs.StringVar(&rf.probe, "probe", "", "grpc://HOST:PORT[/service] (gRPC health check) or http(s)://HOST:PORT/path (2xx): heartbeats are sent only while it passes (required)")
	fs.StringVar(&rf.loadURL, "load-url", "", "http(s) URL answering the current load: a plain integer or JSON {\"load\": N} (default: a gRPC --probe's executor's own ORCA report, if it sends one)")
	fs.DurationVar(&rf.cfg.Lease.TTL, "lease", health.DefaultLeaseTTL, "lease: no acknowledged heartbeat for this long ends the session")
	fs.DurationVar(&rf.cfg.Lease.Heartbeat, "heartbeat", health.DefaultHeartbeat, "heartbeat interval")
	fs.DurationVar(&rf.cfg.Lease.DeregisterAfter, "deregister-after", health.DefaultDeregisterAfter, "Consul removes a registration critical for this long (≥ 1m)")
	fs.StringVar(&rf.cfg.Tag, "tag", health.DefaultTag, "Consul tag that marks task types")
	fs.DurationVar(&rf.drainTimeout, "drain-timeout", 5*time.Minute, "on SIGTERM, how long to wait for in-flight work before deregistering")
	fs.StringVar(&rf.consulAddr, "consul", "", "HTTP address of the local Consul agent (default $CONSUL_HTTP_ADDR or 127.0.0.1:8500; other CONSUL_* settings apply)")
	fs.StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&rf.metricsAddr, "metrics-addr", "", "HOST:PORT to serve Prometheus /metrics on (off when empty); traces go where OTEL_* says")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	var errs []string
	failed := map[string]bool{} // flags already reported
	addErr := func(flag, msg string) {
		if !failed[flag] {
			failed[flag] = true
			errs = append(errs, fmt.Sprintf("invalid %s: %s", flag, msg))
		}
	}

	rf.cfg.Tasks = tasks
	rf.cfg.Labels = labels
	if address == "" {
		addErr("--address", "required (HOST:PORT)")
	} else if host, port, err := net.SplitHostPort(address); err != nil {
		addErr("--address", fmt.Sprintf("want HOST:PORT: %v", err))
	} else if p, err := strconv.Atoi(port); err != nil {
		addErr("--address", fmt.Sprintf("port %q is not a number", port))
	} else {
		rf.cfg.Address, rf.cfg.Port = host, p
	}
	if capacity == "" {
		addErr("--capacity", "required (a positive integer)")
	} else if n, err := strconv.Atoi(capacity); err != nil {
		addErr("--capacity", fmt.Sprintf("%q is not an integer", capacity))
	} else {
		rf.cfg.Capacity = n
	}
	if err := rf.logLevel.UnmarshalText([]byte(logLevel)); err != nil {
		addErr("--log-level", err.Error())
	}
	if rf.metricsAddr != "" {
		if _, _, err := net.SplitHostPort(rf.metricsAddr); err != nil {
			addErr("--metrics-addr", fmt.Sprintf("want HOST:PORT: %v", err))
		}
	}
	if rf.drainTimeout <= 0 {
		addErr("--drain-timeout", "must be positive")
	}
	if rf.probe == "" {
		addErr("--probe", "required: a heartbeat must prove the executor is alive (grpc://HOST:PORT or http://HOST:PORT/path)")
	} else if _, err := newProber(rf.probe); err != nil {
		addErr("--probe", err.Error())
	}
	if rf.loadURL != "" {
		if _, err := newLoadReader(rf.loadURL); err != nil {
			addErr("--load-url", err.Error())
		}
	}
	// The contract's own rules, reported under the flag that set the field.
	var fes health.FieldErrors
	if err := rf.cfg.Validate(); errors.As(err, &fes) {
		for _, fe := range fes {
			addErr(flagFor(fe.Field), fe.Error())
		}
	} else if err != nil {
		errs = append(errs, err.Error())
	}
	if len(errs) > 0 {
		return nil, errors.New(strings.Join(errs, "\n"))
	}
	return &rf, nil
}

func flagFor(field string) string {
	if f, ok := fieldFlags[field]; ok {
		return f
	}
	if strings.HasPrefix(field, health.MetaLabelPrefix) {
		return "--label"
	}
	return field
}

// consulClient builds an API client from the standard CONSUL_* environment,
// with --consul overriding the address.
func consulClient(addr string) (*api.Client, error) {
	cfg := api.DefaultConfig()
	if addr != "" {
		cfg.Address = addr
	}
	c, err := api.NewClient(cfg)
	if err != nil {
		return nil, fmt.Errorf("consul client: %w", err)
	}
	return c, nil
}

// runRegister is the sidecar: register, heartbeat while the probe passes,
// drain on ctx's end (SIGTERM), then exit.
func runRegister(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	rf, err := parseRegisterFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "leasehold register: %v\n", err)
		return 2
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: rf.logLevel}))
	client, err := consulClient(rf.consulAddr)
	if err != nil {
		fmt.Fprintf(stderr, "leasehold register: %v\n", err)
		return 2
	}
	prober, _ := newProber(rf.probe)
	defer prober.Close()
	rf.cfg.Probe = prober.Probe
	rf.cfg.Logger = log
	tel, err := lhotel.Setup(context.Background(), lhotel.Config{ServiceName: "leasehold-register", ServiceVersion: version})
	if err != nil {
		fmt.Fprintf(stderr, "leasehold register: %v\n", err)
		return 2
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		tel.Shutdown(sctx)
	}()
	rf.cfg.Tracer, rf.cfg.Meter = tel.Tracer, tel.Meter
	if rf.metricsAddr != "" {
		lis, err := net.Listen("tcp", rf.metricsAddr)
		if err != nil {
			fmt.Fprintf(stderr, "leasehold register: --metrics-addr: %v\n", err)
			return 2
		}
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", tel.MetricsHandler())
		msrv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go msrv.Serve(lis)
		defer msrv.Close()
	}

	runCtx, cancelRun := context.WithCancel(context.Background())
	defer cancelRun()
	if rf.loadURL != "" {
		lr, _ := newLoadReader(rf.loadURL)
		go lr.poll(runCtx, min(rf.cfg.Lease.Heartbeat, time.Second), log)
		rf.cfg.Load = lr.Load
	} else if gp, ok := prober.(*grpcProber); ok {
		// A gRPC executor reporting ORCA (adapters/loadreport) tells its
		// load itself: read at each probe, it turns the lease full or free.
		rf.cfg.Load = func() int { n, _ := gp.Load(); return n }
	}
	reg, err := consul.NewRegistrar(consul.NewAPIAgent(client), rf.cfg)
	if err != nil {
		fmt.Fprintf(stderr, "leasehold register: %v\n", err)
		return 2
	}
	runErr := make(chan error, 1)
	go func() { runErr <- reg.Run(runCtx) }()

	select {
	case err := <-runErr:
		log.Error("registration ended", "err", err)
		return 1
	case <-ctx.Done():
	}
	log.Info("signal received: draining", "timeout", rf.drainTimeout)
	dctx, cancel := context.WithTimeout(context.Background(), rf.drainTimeout)
	defer cancel()
	derr := reg.Drain(dctx)
	cancelRun()
	<-reg.Done()
	if derr != nil && !errors.Is(derr, consul.ErrStopped) {
		log.Warn("drain incomplete", "err", derr)
		return 1
	}
	log.Info("drained and deregistered")
	return 0
}
