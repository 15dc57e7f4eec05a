package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

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
	"heartbeat": "--heartbeat", "deregister_after": "--deregister-after", "tag": "--service-tag",
}

// registerCLI is the sidecar's flags before validation.
type registerCLI struct {
	fs       *pflag.FlagSet
	rf       registerFlags
	tasks    flagx.List
	labels   flagx.Labels
	address  string
	capacity int
	logLevel string
}

func (c *registerCLI) register(fs *pflag.FlagSet) {
	c.fs = fs
	c.labels = flagx.Labels{}
	rf := &c.rf
	fs.SortFlags = false
	fs.StringVar(&rf.cfg.InstanceID, "instance", "",
		"stable instance id of the executor (required)")
	fs.Var(&c.tasks, "task", "task type(s) served, comma-separated or repeated (required)")
	fs.StringVar(&c.address, "address", "",
		"HOST:PORT where dispatchers reach the executor: an IP address (required)")
	fs.StringVar(&rf.cfg.Version, "version", "",
		"semantic version of the executor, e.g. 1.4.2 (required)")
	fs.IntVar(&c.capacity, "capacity", 0,
		"concurrent tasks the executor accepts, a positive integer (required)")
	fs.Var(c.labels, "label", "label key=value (repeatable)")
	fs.StringVar(&rf.probe, "probe", "",
		"grpc://HOST:PORT[/service] (gRPC health check) or http(s)://HOST:PORT/path (2xx): "+
			"heartbeats are sent only while it passes (required)")
	fs.StringVar(&rf.loadURL, "load-url", "",
		"http(s) URL answering the current load: a plain integer or JSON {\"load\": N} (default: "+
			"a gRPC --probe's executor's own ORCA report, if it sends one)")
	fs.DurationVar(&rf.cfg.Lease.TTL, "lease", health.DefaultLeaseTTL,
		"lease: no acknowledged heartbeat for this long ends the session")
	fs.DurationVar(&rf.cfg.Lease.Heartbeat, "heartbeat", health.DefaultHeartbeat,
		"heartbeat interval (at most half the lease)")
	fs.DurationVar(&rf.cfg.Lease.DeregisterAfter, "deregister-after", health.DefaultDeregisterAfter,
		"Consul removes a registration critical for this long (at least 1m)")
	fs.DurationVar(&rf.drainTimeout, "drain-timeout", 5*time.Minute,
		"on SIGTERM or SIGINT, how long to wait for in-flight work before deregistering")
	serviceTagFlag(fs, &rf.cfg.Tag,
		"Consul tag that marks task types (as leasehold serve --service-tag)")
	consulAddrFlag(fs, &rf.consulAddr)
	fs.StringVar(&c.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&rf.metricsAddr, "metrics-addr", "",
		"HOST:PORT (or http://HOST:PORT) to serve Prometheus /metrics on (off when empty); "+
			"traces go where OTEL_* says")
	emptyOK(fs, "metrics-addr") // an empty value turns it off
}

// flags validates the flags; errors name each bad flag.
func (c *registerCLI) flags() (*registerFlags, error) {
	rf := c.rf
	var errs []string
	failed := map[string]bool{} // flags already reported
	addErr := func(flag, msg string) {
		if !failed[flag] {
			failed[flag] = true
			errs = append(errs, fmt.Sprintf("invalid %s: %s", flag, msg))
		}
	}

	rf.cfg.Tasks = c.tasks
	rf.cfg.Labels = c.labels
	if c.address == "" {
		addErr("--address", "required (HOST:PORT)")
	} else if host, port, err := net.SplitHostPort(c.address); err != nil {
		// What to write, not Go's "too many colons in address".
		if _, _, ferr := flagx.HostPort(c.address, 1); ferr != nil {
			err = ferr
		} else {
			err = errors.New("the executor's address is HOST:PORT, no scheme")
		}
		addErr("--address", fmt.Sprintf("%q: %v", c.address, err))
	} else if p, err := strconv.Atoi(port); err != nil {
		addErr("--address", fmt.Sprintf("port %q is not a number", port))
	} else {
		rf.cfg.Address, rf.cfg.Port = host, p
	}
	if !c.fs.Changed("capacity") {
		addErr("--capacity", "required (a positive integer)")
	}
	rf.cfg.Capacity = c.capacity
	if l, err := parseLogLevel(c.logLevel); err != nil {
		addErr("--log-level", fmt.Sprintf("%q: %v", c.logLevel, err))
	} else {
		rf.logLevel = l
	}
	if rf.metricsAddr != "" {
		if scheme, hp, err := flagx.HostPort(rf.metricsAddr, 0); err != nil {
			addErr("--metrics-addr", fmt.Sprintf("%q: %v", rf.metricsAddr, err))
		} else if scheme == "https" {
			addErr("--metrics-addr", fmt.Sprintf("%q: /metrics is served over plain HTTP: "+
				"write HOST:PORT or http://HOST:PORT", rf.metricsAddr))
		} else {
			rf.metricsAddr = hp // the URL form, as serve's --admin-addr takes it
		}
	}
	if rf.drainTimeout <= 0 {
		addErr("--drain-timeout", "must be positive")
	}
	if rf.probe == "" {
		addErr("--probe",
			"required: a heartbeat must prove the executor is alive "+
				"(grpc://HOST:PORT or http://HOST:PORT/path)")
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
			f := flagFor(fe.Field)
			if f == "--service-tag" {
				f = flagRef(c.fs, "service-tag")
			}
			addErr(f, fe.Error())
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
// with --consul-addr overriding the address.
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

func newRegisterCmd() *cobra.Command {
	var c registerCLI
	cmd := &cobra.Command{
		Use: "register --instance ID --task T --address HOST:PORT --version V " +
			"--capacity N --probe URL [flags]",
		Short: "register an executor through the local Consul agent and keep its lease alive " +
			"while a probe of the executor passes (sidecar)",
		Long: `The sidecar of an executor not written in Go: it registers the executor with the
local Consul agent under the registration contract and heartbeats its lease
while --probe passes. SIGTERM or SIGINT drains: state=draining, wait for the
load to reach 0 (up to --drain-timeout), deregister, exit (0 when drained).`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			rf, err := c.flags()
			if err != nil {
				return usagef("%v", err)
			}
			// SIGTERM/SIGINT start a drain; the command exits when it is done.
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			if code := sidecar(ctx, rf, cmd.ErrOrStderr()); code != 0 {
				return quiet(code)
			}
			return nil
		},
	}
	c.register(cmd.Flags())
	completeWords(cmd, "log-level", "debug", "info", "warn", "error")
	return cmd
}

// sidecar runs the sidecar: it registers, heartbeats while the probe passes,
// drains when ctx ends (SIGTERM) and then returns the exit code, having told
// any error on stderr.
func sidecar(ctx context.Context, rf *registerFlags, stderr io.Writer) int {
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
	tel, err := lhotel.Setup(context.Background(),
		lhotel.Config{ServiceName: "leasehold-register", ServiceVersion: version,
			Logger: log})
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
		// load itself; read at each probe, the load turns the lease full or
		// free.
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
	// The Registrar itself logs "drained and deregistered" when both
	// happened; this only says what else did.
	switch {
	case errors.Is(derr, consul.ErrStopped):
		log.Info("the registration had already ended: nothing to drain")
	case derr != nil:
		log.Warn("drain incomplete", "err", derr)
		return 1
	}
	return 0
}
