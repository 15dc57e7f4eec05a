package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/metric"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/stats"

	"github.com/hashicorp/consul/api"
	"github.com/leasehold/leasehold/adapters/consul"
	lhotel "github.com/leasehold/leasehold/adapters/otel"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/server"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// serveConfig is `leasehold serve`'s configuration.
type serveConfig struct {
	consulAddr     string
	xdsAddr        string
	adminAddr      string
	tag            string
	logFormat      string
	logLevel       slog.Level
	consulMaxConns int
	consulReadRate int64 // bytes/s; -1: unpaced; 0: the default
	tls            server.TLSFiles
	authzPolicy    string
	adminTokenFile string
	rulesFile      string
	auditLog       string
	// requireACLApprovals counts only cordon approvals Consul attributed.
	requireACLApprovals bool
	adminTLS            server.TLSFiles
	staleAfter          time.Duration
	lbPolicy            health.LBPolicy
	shardSize           int // instances per shard; 0: never shard
	// memoryLimit is --memory-limit's size (0: auto, unless memoryLimitOff).
	memoryLimit    int64
	memoryLimitOff bool
	// gcPercent is --gc-percent's (0: auto).
	gcPercent int
	// gcPace, set by the command (not by tests, which run serve in their
	// own process), is the quiet percentage serve's pacer holds the
	// collector at (gcPacer; 0: no pacer).
	gcPace int
	// datacenters are in failover order, leasehold's own first; nil: the
	// agent's own only.
	datacenters []string
	// fromEnv maps each flag whose value came from a variable to it, so
	// errors found at start name the variable too (nil: none did).
	fromEnv map[string]string
}

// startupError is a problem with serve's configuration found before
// anything ran (a file missing or invalid): a usage error, exit 2, as a bad
// flag is. err names the flag.
func startupError(err error) error {
	return &exitError{code: 2, err: fmt.Errorf("invalid %w", err)}
}

// listenError names the flag of an address serve cannot listen on, and
// says why in an operator's words when the port is taken.
func listenError(flag, addr string, err error) error {
	if errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("%s: cannot listen on %s: the address is in use (by another "+
			"leasehold serve?)", flag, addr)
	}
	return fmt.Errorf("%s: cannot listen on %s: %w", flag, addr, err)
}

// listening reports where serve listens (for tests using port 0).
type listening struct{ xds, admin string }

// serve runs the pipeline — Consul watch → syncer → xDS — until ctx ends.
func serve(ctx context.Context, cfg *serveConfig, log *slog.Logger, bound chan<- listening) error {
	build := readBuild()
	tel, err := lhotel.Setup(ctx,
		lhotel.Config{ServiceName: "leasehold", ServiceVersion: build.Version, Logger: log})
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		tel.Shutdown(sctx)
	}()
	err = lhotel.BuildInfo(tel.Meter, build.Version, build.Revision, build.GoVersion)
	if err != nil {
		return err
	}
	p, err := newPipeline(cfg, log, tel)
	if err != nil {
		return err
	}
	defer p.closeAudit()
	sec, err := loadSecurity(cfg, log, tel.Meter)
	if err != nil {
		return startupError(err)
	}
	xdsLis, err := net.Listen("tcp", cfg.xdsAddr)
	if err != nil {
		return listenError("--xds-addr", cfg.xdsAddr, err)
	}
	adminLis, err := net.Listen("tcp", cfg.adminAddr)
	if err != nil {
		xdsLis.Close()
		return listenError("--admin-addr", cfg.adminAddr, err)
	}

	// Every long-running part runs in one group: the first to fail ends the
	// others, and serve's error names it.
	runCtx, cancel := context.WithCancel(context.Background())
	defer cancel()
	parts := newParts(runCtx)
	obs := p.obs
	parts.run("consul watches", p.watcher.Run)
	parts.run("syncer", func(ctx context.Context) error { return p.syncer.Run(ctx, obs) })
	parts.run(
		"control watch",
		consul.NewControlWatch(p.client, p.watchConfig(log.With("component", "control-watch"))).Run,
	)
	parts.run("lapse recorder", p.lapses.Run)
	if cfg.rulesFile != "" {
		obs <- health.Observation{Data: &health.RulesSource{Source: "file:" + cfg.rulesFile,
			Raw: p.rulesRaw}}
		parts.run("rules file", rulesFile{path: cfg.rulesFile, obs: obs, log: log}.Run)
	}
	if sec.policy != nil {
		parts.run("authorization policy", sec.policy.Run)
	}
	parts.run("systemd notifications", systemdNotify{readiness: p.syncer.Readiness, log: log}.Run)
	parts.run("startup memory", startupMemory{view: p.syncer.View}.Run)
	if cfg.gcPace > 0 {
		view := p.syncer.View
		busy := new(atomic.Bool)
		parts.run("collector pacing", gcPacer{quiet: cfg.gcPace, log: log, busy: busy,
			ready: func(ctx context.Context) error { return awaitWholeFleet(ctx, view) }}.Run)
		parts.run("idle collection", gcIdle{log: log, busy: busy.Load}.Run)
	}

	g := newGRPCServer(sec.creds, tel)
	xds := server.NewXDS(
		parts.ctx,
		p.syncer,
		log,
		server.XDSOptions{Tracer: tel.Tracer, Meter: tel.Meter, Policy: sec.policy},
	)
	xds.Register(g)
	fencing := server.NewFencing(
		p.syncer,
		p.watcher.FreshAsOf,
		server.FencingOptions{
			StaleAfter: cfg.staleAfter,
			Refresh:    p.watcher.Refresh,
			Meter:      tel.Meter,
		},
	)
	leaseholdv1.RegisterFencingServer(g, fencing)
	// Dispatchers whose clusters name lrs_server {self: {}} report their
	// calls' outcomes here (the Load Reporting Service).
	lrs := server.NewLRS(p.syncer, log,
		server.LRSOptions{Meter: tel.Meter, Policy: sec.policy})
	lrs.Register(g)
	parts.run("xDS and fencing server", func(context.Context) error { return g.Serve(xdsLis) })

	adminHandler := server.AdminHandler(server.AdminConfig{
		Ready: p.syncer, LastContact: p.watcher.LastContact, Syncer: p.syncer, XDS: xds,
		Fencing: fencing, LRS: lrs,
		Metrics: tel.MetricsHandler(),
	})
	if sec.adminToken != nil || cfg.adminTLS.ClientCA != "" {
		adminHandler = server.GuardAdmin(adminHandler, sec.adminToken, cfg.adminTLS.ClientCA != "")
	}
	if sec.adminTLS != nil {
		adminLis = tls.NewListener(adminLis, sec.adminTLS.Config())
	}
	admin := &http.Server{Handler: adminHandler, ReadHeaderTimeout: 5 * time.Second}
	parts.run("admin server", func(context.Context) error { return admin.Serve(adminLis) })

	log.Info("leasehold serving", "version", build.Version, "revision", build.Revision,
		"consul", cfg.consulAddr, "xds", xdsLis.Addr().String(), "admin", adminLis.Addr().String(),
		"tag", cfg.tag, "traces_exported", tel.TracesExported, "tls", cfg.tls.Cert != "",
		"mtls", cfg.tls.ClientCA != "", "authz_policy", cfg.authzPolicy != "",
		"admin_guarded", sec.adminToken != nil || cfg.adminTLS.ClientCA != "",
		"admin_tls", cfg.adminTLS.Cert != "")
	if grpcTraceLinked {
		log.Info("built without -tags grpcnotrace: gRPC's request tracing is linked in, and " +
			"with it every method of every type; the binary is ~15 MB larger and ~7 MB more of " +
			"it resident (README, Installing it)")
	}
	if bound != nil {
		bound <- listening{xds: xdsLis.Addr().String(), admin: adminLis.Addr().String()}
	}
	select {
	case <-ctx.Done():
	case <-parts.ctx.Done(): // a part failed
	}
	log.Info("shutting down")
	// The servers stop first, so no stream or fencing call outlives the
	// syncer and the watches it reads.
	parts.stopping()
	stopServers(g, admin)
	cancel()
	return parts.wait()
}

// parts runs serve's long-running parts, each a Run(ctx) error, in one
// errgroup. The first part to fail, or to end before serve stops them, ends
// the others (their context ends), and wait returns its error, named.
type parts struct {
	g    *errgroup.Group
	ctx  context.Context // the parts' context: ends when serve stops them or a part fails
	stop chan struct{}   // closed when serve stops them: what ends after is no failure
}

func newParts(ctx context.Context) *parts {
	g, gctx := errgroup.WithContext(ctx)
	return &parts{g: g, ctx: gctx, stop: make(chan struct{})}
}

// run starts part name.
func (ps *parts) run(name string, run func(context.Context) error) {
	ps.g.Go(func() error {
		err := run(ps.ctx)
		select {
		case <-ps.stop:
			return nil // serve stops the parts: ending is what is asked
		default:
		}
		if ps.ctx.Err() != nil {
			return nil // another part failed first: its error is serve's
		}
		if err == nil {
			err = errors.New("ended before serve stopped")
		}
		return fmt.Errorf("%s: %w", name, err)
	})
}

// stopping says that the parts are being stopped: what ends from now on is
// no failure. Call it before stopping the parts that ignore the context
// (the servers).
func (ps *parts) stopping() { close(ps.stop) }

// wait waits for every part and returns the first failure (nil: none).
func (ps *parts) wait() error { return ps.g.Wait() }

// pipeline is what serve runs between Consul and the xDS cache: the
// watches of every datacenter, the lapse recorder and the syncer.
type pipeline struct {
	client     *api.Client
	watcher    *consul.Watchers
	lapses     *consul.LapseRecorder
	syncer     *fleet.Syncer
	watch      consul.WatchConfig      // the watches' rules, the control watch's too
	obs        chan health.Observation // the watches' observations: the syncer's input
	rulesRaw   []byte                  // the --rules file, read at start
	closeAudit func()
}

// watchConfig is the watches' configuration with another logger.
func (p *pipeline) watchConfig(log *slog.Logger) consul.WatchConfig {
	c := p.watch
	c.Logger = log
	return c
}

func newPipeline(cfg *serveConfig, log *slog.Logger, tel *lhotel.Telemetry) (*pipeline, error) {
	p := &pipeline{obs: make(chan health.Observation, 256)}
	var err error
	conns := consul.Connections(cfg.consulMaxConns, len(cfg.datacenters))
	if p.client, err = consul.NewClient(cfg.consulAddr, conns); err != nil {
		return nil, err
	}
	// The watches that always answer must do so well inside the staleness
	// bound, or an idle fleet would read as a stale view.
	fastWait := min(10*time.Second, cfg.staleAfter/3)
	// (Shorter still under shorter leases: the watcher reads the lease_ttl
	// of the registrations.)
	p.watch = consul.WatchConfig{
		Out:           p.obs,
		Tag:           cfg.tag,
		MaxConcurrent: cfg.consulMaxConns,
		FastWait:      fastWait,
		ReadRate:      cfg.consulReadRate,
		Logger:        log,
		Meter:         tel.Meter,
	}
	if p.watcher, err = consul.NewWatchers(p.client, p.watch, cfg.datacenters); err != nil {
		return nil, fmt.Errorf("--datacenters: %w", err)
	}
	audit, closeAudit, err := openAudit(cfg.auditLog, log, tel.Tracer)
	if err != nil {
		return nil, startupError(err)
	}
	if cfg.rulesFile != "" {
		if p.rulesRaw, err = rulesJSON(cfg.rulesFile); err != nil {
			closeAudit()
			return nil, startupError(fmt.Errorf("--rules: %w", err))
		}
	}
	p.closeAudit = closeAudit
	// Several datacenters: one whose watches have not answered for two of
	// their waits is answered UNKNOWN; after the staleness bound (a lease by
	// default) while another answers, its executors leave the assignments.
	// A lapse is final across restarts and replicas: each one seen is
	// recorded in Consul KV (leasehold/lapsed/), which every replica reads,
	// and kept while its session has a registration in any datacenter's
	// catalog, and for the syncer's history after.
	p.lapses = consul.NewLapseRecorder(
		p.client,
		consul.LapseRecorderConfig{
			Retention:   fleet.DefaultHistoryRetention,
			Datacenters: cfg.datacenters,
			Logger:      log,
			Meter:       tel.Meter,
		},
	)
	p.syncer = fleet.NewSyncer(
		fleet.SyncConfig{
			Logger:          log,
			Tracer:          tel.Tracer,
			Meter:           tel.Meter,
			Audit:           audit,
			LBPolicy:        cfg.lbPolicy,
			ShardSize:       syncShardSize(cfg.shardSize),
			Datacenters:     cfg.datacenters,
			DatacenterQuiet: 2*fastWait + time.Second,
			DatacenterLost:  cfg.staleAfter,
			OnLapse:         p.lapses.Record,
			// serve runs the control watch: nothing is served before the cordons are read.
			AwaitControl: true,
			// Nor before the lapse marks are (a session lapsed before a restart is never routed).
			AwaitLapses:         true,
			RequireACLApprovals: cfg.requireACLApprovals,
		},
	)

	return p, nil
}

// security is what serve's TLS, authorization and admin flags load.
type security struct {
	// The gRPC port's credentials and the fencing API's authorization.
	creds      []grpc.ServerOption
	adminTLS   *server.ServerTLS
	policy     *server.PolicyStore
	adminToken *server.AdminToken
}

func loadSecurity(
	cfg *serveConfig,
	log *slog.Logger,
	meter metric.MeterProvider,
) (security, error) {
	var sec security
	if cfg.tls.Enabled() {
		st, err := server.NewServerTLS(cfg.tls, log)
		if err != nil {
			return sec, err
		}
		sec.creds = append(sec.creds, grpc.Creds(st.Credentials()))
	}
	var err error
	if cfg.adminTLS.Cert != "" {
		// Its errors name the --admin-tls-* flags at fault.
		if sec.adminTLS, err = server.NewServerTLS(cfg.adminTLS, log); err != nil {
			return sec, err
		}
	}
	if cfg.authzPolicy != "" {
		if sec.policy, err = server.LoadPolicy(cfg.authzPolicy, log); err != nil {
			return sec, err
		}
	}
	if cfg.adminTokenFile != "" {
		if sec.adminToken, err = server.NewAdminToken(cfg.adminTokenFile); err != nil {
			return sec, err
		}
	}
	if authz := server.NewFencingAuthorizer(sec.policy, meter); authz != nil {
		sec.creds = append(
			sec.creds,
			grpc.ChainUnaryInterceptor(authz.UnaryInterceptor()),
			grpc.ChainStreamInterceptor(authz.StreamInterceptor()),
		)
	}
	return sec, nil
}

// newGRPCServer is the server of the xDS, fencing and load reporting APIs.
func newGRPCServer(creds []grpc.ServerOption, tel *lhotel.Telemetry) *grpc.Server {
	return grpc.NewServer(append(
		creds,
		server.ServerOption(), // responses reference the cache's bytes (no copy per stream)
		grpc.KeepaliveEnforcementPolicy(
			keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true},
		),
		grpc.KeepaliveParams(
			keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 10 * time.Second},
		),
		// A dispatcher's trace continues into the fencing API; xDS streams
		// (hours long) are traced per push instead.
		grpc.StatsHandler(otelgrpc.NewServerHandler(
			otelgrpc.WithTracerProvider(tel.Tracer),
			otelgrpc.WithMeterProvider(tel.Meter),
			otelgrpc.WithFilter(
				func(info *stats.RPCTagInfo) bool {
					return strings.HasPrefix(info.FullMethodName,
						"/leasehold.v1.")
				},
			),
		)),
	)...)
}

// stopServers stops the gRPC server (xDS streams never end on their own:
// cut after 5 s) and the admin server.
func stopServers(g *grpc.Server, admin *http.Server) {
	stopped := make(chan struct{})
	go func() { g.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		g.Stop()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	admin.Shutdown(ctx)
}

// parseByteRate reads a rate in bytes per second: a count with an optional
// unit (B, KB, MB, KiB, MiB) or "off" (-1: unpaced).
func parseByteRate(s string) (int64, error) {
	if s == "off" {
		return -1, nil
	}
	n, err := parseByteSize(s)
	if err != nil {
		return 0, fmt.Errorf(
			"%q: want a positive size per second such as 512KiB, 4MiB or 8MB, or off",
			s,
		)
	}
	return n, nil
}

// errNoSize is what parseByteSize says of what is not a size.
var errNoSize = errors.New("want a positive size such as 512MiB, 1GiB or 800MB")

// parseByteSize reads a positive size of at most 1 TiB: a number and a unit
// (B, KB, MB, GB, KiB, MiB, GiB; none: bytes).
func parseByteSize(s string) (int64, error) {
	num := strings.TrimRightFunc(s, func(r rune) bool { return r < '0' || r > '9' })
	units := map[string]int64{
		"":    1,
		"B":   1,
		"KB":  1000,
		"MB":  1000 * 1000,
		"GB":  1000 * 1000 * 1000,
		"KiB": 1 << 10,
		"MiB": 1 << 20,
		"GiB": 1 << 30,
	}
	unit, ok := units[s[len(num):]]
	n, err := strconv.ParseInt(num, 10, 64)
	if !ok || err != nil || n <= 0 || n > (1<<40)/unit {
		return 0, fmt.Errorf("%q: %w", s, errNoSize)
	}
	return n * unit, nil
}

// syncShardSize is --shard-size as fleet.SyncConfig takes it, where 0 means
// the default and a negative size never shards.
func syncShardSize(flag int) int {
	if flag == 0 {
		return -1
	}
	return flag
}
