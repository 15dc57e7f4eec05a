package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/stats"

	"github.com/leasehold/leasehold/adapters/consul"
	lhotel "github.com/leasehold/leasehold/adapters/otel"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/server"
	"github.com/leasehold/leasehold/snapshot"
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
	adminTLS       server.TLSFiles
	staleAfter     time.Duration
	lbPolicy       health.LBPolicy
	datacenters    []string // in failover order, leasehold's own first; nil: the agent's own only
}

// serveFlag is one flag with its environment variable.
type serveFlag struct {
	name, env, def, usage string
	dst                   *string
}

func parseServeFlags(args []string, stderr io.Writer) (*serveConfig, error) {
	var (
		cfg                                serveConfig
		logLevel, maxConns, tag, logFormat string
		staleAfter, lbPolicy, readRate     string
		datacenters                        string
	)
	flags := []serveFlag{
		{"consul-addr", "LEASEHOLD_CONSUL_ADDR", "", "Consul agent HTTP address (default $CONSUL_HTTP_ADDR or 127.0.0.1:8500; token and TLS from the standard CONSUL_* variables)", &cfg.consulAddr},
		{"xds-addr", "LEASEHOLD_XDS_ADDR", "127.0.0.1:18000", "gRPC listen address for xDS", &cfg.xdsAddr},
		{"admin-addr", "LEASEHOLD_ADMIN_ADDR", "127.0.0.1:19000", "HTTP listen address for /healthz and /readyz", &cfg.adminAddr},
		{"service-tag", "LEASEHOLD_SERVICE_TAG", health.DefaultTag, "Consul tag marking task types", &tag},
		{"log-format", "LEASEHOLD_LOG_FORMAT", "text", "text or json", &logFormat},
		{"log-level", "LEASEHOLD_LOG_LEVEL", "info", "debug, info, warn or error", &logLevel},
		{"tls-cert", "LEASEHOLD_TLS_CERT", "", "PEM certificate of the gRPC port (xDS and fencing); re-read when the file changes", &cfg.tls.Cert},
		{"tls-key", "LEASEHOLD_TLS_KEY", "", "PEM private key of --tls-cert", &cfg.tls.Key},
		{"tls-client-ca", "LEASEHOLD_TLS_CLIENT_CA", "", "PEM CA bundle: client certificates are then required and verified (mTLS)", &cfg.tls.ClientCA},
		{"authz-policy", "LEASEHOLD_AUTHZ_POLICY", "", "YAML/JSON file granting client identities (certificate URI/DNS SANs) task types and fencing calls; needs --tls-client-ca; followed live", &cfg.authzPolicy},
		{"admin-token-file", "LEASEHOLD_ADMIN_TOKEN_FILE", "", "file holding a bearer token that /debug/* and /v1/* on the admin port then require (re-read when it changes); required when --admin-addr is not loopback", &cfg.adminTokenFile},
		{"admin-tls-cert", "LEASEHOLD_ADMIN_TLS_CERT", "", "PEM certificate: serve the admin port over HTTPS (re-read when it changes)", &cfg.adminTLS.Cert},
		{"admin-tls-key", "LEASEHOLD_ADMIN_TLS_KEY", "", "PEM private key of --admin-tls-cert", &cfg.adminTLS.Key},
		{"admin-client-ca", "LEASEHOLD_ADMIN_CLIENT_CA", "", "PEM CA: a client certificate it signed opens /debug/* and /v1/* (like the token); probes need none", &cfg.adminTLS.ClientCA},
		{"rules", "LEASEHOLD_RULES", "", "rollout rules file (YAML or JSON: enforce/observe modes, safety limit, approvals, load balancing per task type); followed live; Consul KV " + consul.RulesKey + " overrides it", &cfg.rulesFile},
		{"audit-log", "LEASEHOLD_AUDIT_LOG", "-", "where configuration changes this replica applies or refuses are written, one JSON object per line (- : standard output)", &cfg.auditLog},
		{"fencing-stale-after", "LEASEHOLD_FENCING_STALE_AFTER", health.DefaultLeaseTTL.String(), "once leasehold's view of Consul is older than this, the fencing API answers UNKNOWN (routing keeps the last known snapshot)", &staleAfter},
		{"lb-policy", "LEASEHOLD_LB_POLICY", string(health.DefaultLBPolicy), "load-balancing policy of every task type the rules' load_balancing does not choose one for: weighted_round_robin (ORCA load reports; round_robin for clients without it), round_robin or least_request", &lbPolicy},
		{"consul-max-conns", "LEASEHOLD_CONSUL_MAX_CONNS", "32", "most concurrent per-task blocking queries (2 more are always open); Consul refuses more than 200 connections per client IP", &maxConns},
		{"datacenters", "LEASEHOLD_DATACENTERS", "", "Consul datacenters to watch through the agent, comma-separated in failover order, leasehold's own first (the datacenter of dispatchers that name none); a dispatcher's own datacenter gets priority 0, the others follow in this order (default: the agent's own only)", &datacenters},
		{"consul-read-rate", "LEASEHOLD_CONSUL_READ_RATE", "4MiB", "JSON per second the listings that grow with the fleet (task members, generation keys) may read from Consul, all together, per datacenter (e.g. 512KiB, 4MiB, 8MB; off: unpaced); a quiet fleet reads 2 s of it at once, under churn the changes coalesce", &readRate},
	}
	fs := flag.NewFlagSet("leasehold serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	for _, f := range flags {
		def := f.def
		if v, ok := os.LookupEnv(f.env); ok {
			def = v
		}
		fs.StringVar(f.dst, f.name, def, f.usage+" [$"+f.env+"]")
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	var errs []string
	bad := func(flag, msg string) { errs = append(errs, fmt.Sprintf("invalid --%s: %s", flag, msg)) }
	for _, a := range []struct{ flag, v string }{{"xds-addr", cfg.xdsAddr}, {"admin-addr", cfg.adminAddr}} {
		if _, port, err := net.SplitHostPort(a.v); err != nil {
			bad(a.flag, fmt.Sprintf("want HOST:PORT: %v", err))
		} else if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
			bad(a.flag, fmt.Sprintf("port %q", port))
		}
	}
	if fe := health.ValidateTag(tag); fe != nil {
		bad("service-tag", fe.Error())
	}
	cfg.tag = tag
	if logFormat != "text" && logFormat != "json" {
		bad("log-format", fmt.Sprintf("%q: want text or json", logFormat))
	}
	cfg.logFormat = logFormat
	if err := cfg.logLevel.UnmarshalText([]byte(logLevel)); err != nil {
		bad("log-level", err.Error())
	}
	if n, err := strconv.Atoi(maxConns); err != nil || n < 1 || n > 190 {
		bad("consul-max-conns", fmt.Sprintf("%q: want 1..190", maxConns))
	} else {
		cfg.consulMaxConns = n
	}
	if n, err := parseByteRate(readRate); err != nil {
		bad("consul-read-rate", err.Error())
	} else {
		cfg.consulReadRate = n
	}
	if datacenters != "" {
		seen := map[string]bool{}
		for _, dc := range strings.Split(datacenters, ",") {
			dc = health.NormalizeDatacenter(dc) // Consul spells datacenters in lowercase
			if err := health.ValidateDatacenter("datacenters", dc); err != nil {
				bad("datacenters", fmt.Sprintf("%q: a datacenter name is 1 to 64 letters (lowercase), digits, '-' or '_'", dc))
				continue
			}
			if seen[dc] {
				bad("datacenters", fmt.Sprintf("%q listed twice", dc))
				continue
			}
			seen[dc] = true
			cfg.datacenters = append(cfg.datacenters, dc)
		}
	}
	if p, err := health.ParseLBPolicy("--lb-policy", lbPolicy); err != nil {
		bad("lb-policy", err.Error())
	} else {
		cfg.lbPolicy = p
	}
	if d, err := time.ParseDuration(staleAfter); err != nil || d < 3*time.Second {
		bad("fencing-stale-after", fmt.Sprintf("%q: want a duration of at least 3s, e.g. 35s", staleAfter))
	} else {
		cfg.staleAfter = d
	}
	if (cfg.tls.Cert == "") != (cfg.tls.Key == "") {
		bad("tls-cert", "--tls-cert and --tls-key go together")
	}
	if cfg.tls.ClientCA != "" && cfg.tls.Cert == "" {
		bad("tls-client-ca", "needs --tls-cert and --tls-key")
	}
	if cfg.authzPolicy != "" && cfg.tls.ClientCA == "" {
		bad("authz-policy", "identities come from verified client certificates: needs --tls-client-ca")
	}
	if (cfg.adminTLS.Cert == "") != (cfg.adminTLS.Key == "") {
		bad("admin-tls-cert", "--admin-tls-cert and --admin-tls-key go together")
	}
	if cfg.adminTLS.ClientCA != "" && cfg.adminTLS.Cert == "" {
		bad("admin-client-ca", "needs --admin-tls-cert and --admin-tls-key")
	}
	cfg.adminTLS.ClientCertOptional, cfg.adminTLS.HTTP, cfg.adminTLS.Flags = true, true, "--admin-tls"
	if cfg.adminTokenFile == "" && cfg.adminTLS.ClientCA == "" && !server.IsLoopback(cfg.adminAddr) {
		bad("admin-addr", fmt.Sprintf("%s is not a loopback address: set --admin-token-file or --admin-client-ca to guard /debug/* and /v1/*", cfg.adminAddr))
	}
	if len(errs) > 0 {
		return nil, errors.New(strings.Join(errs, "\n"))
	}
	return &cfg, nil
}

func newLogger(w io.Writer, format string, level slog.Level) *slog.Logger {
	opts := &slog.HandlerOptions{Level: level}
	if format == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg, err := parseServeFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "leasehold serve: %v\n", err)
		return 2
	}
	log := newLogger(stderr, cfg.logFormat, cfg.logLevel)
	if err := serve(ctx, cfg, log, nil); err != nil {
		log.Error("serve", "err", err)
		return 1
	}
	return 0
}

// listening reports where serve listens (for tests using port 0).
type listening struct{ xds, admin string }

// serve runs the pipeline — Consul watch → syncer → xDS — until ctx ends.
func serve(ctx context.Context, cfg *serveConfig, log *slog.Logger, bound chan<- listening) error {
	tel, err := lhotel.Setup(ctx, lhotel.Config{ServiceName: "leasehold", ServiceVersion: version})
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		tel.Shutdown(sctx)
	}()
	client, err := consul.NewClient(cfg.consulAddr, cfg.consulMaxConns+4)
	if err != nil {
		return err
	}
	// The watches that always answer must do so well inside the staleness
	// bound, or an idle fleet would read as a stale view.
	fastWait := min(10*time.Second, cfg.staleAfter/3)
	watcher, err := consul.NewWatchers(client, consul.WatchConfig{Tag: cfg.tag, MaxConcurrent: cfg.consulMaxConns, FastWait: fastWait, ReadRate: cfg.consulReadRate, Logger: log, Meter: tel.Meter}, cfg.datacenters)
	if err != nil {
		return fmt.Errorf("--datacenters: %w", err)
	}
	audit, closeAudit, err := openAudit(cfg.auditLog, tel.Tracer)
	if err != nil {
		return err
	}
	defer closeAudit()
	var rulesRaw []byte
	if cfg.rulesFile != "" {
		if rulesRaw, err = rulesJSON(cfg.rulesFile); err != nil {
			return fmt.Errorf("--rules: %w", err)
		}
	}
	// Several datacenters: one whose watches have not answered for two of
	// their waits is answered UNKNOWN; after the staleness bound (a lease by
	// default) while another answers, its executors leave the assignments.
	syncer := snapshot.NewSyncer(snapshot.SyncConfig{Logger: log, Tracer: tel.Tracer, Meter: tel.Meter, Audit: audit, LBPolicy: cfg.lbPolicy,
		Datacenters: cfg.datacenters, DatacenterQuiet: 2*fastWait + time.Second, DatacenterLost: cfg.staleAfter})

	var creds []grpc.ServerOption
	if cfg.tls.Enabled() {
		st, err := server.NewServerTLS(cfg.tls, log)
		if err != nil {
			return err
		}
		creds = append(creds, grpc.Creds(st.Credentials()))
	}
	var adminTLS *server.ServerTLS
	if cfg.adminTLS.Cert != "" {
		if adminTLS, err = server.NewServerTLS(cfg.adminTLS, log); err != nil {
			return fmt.Errorf("admin port: %w", err)
		}
	}
	var policy *server.PolicyStore
	if cfg.authzPolicy != "" {
		if policy, err = server.LoadPolicy(cfg.authzPolicy, log); err != nil {
			return err
		}
	}
	var adminToken *server.AdminToken
	if cfg.adminTokenFile != "" {
		if adminToken, err = server.NewAdminToken(cfg.adminTokenFile); err != nil {
			return err
		}
	}
	fencingAuthz := server.NewFencingAuthorizer(policy, tel.Meter)
	if fencingAuthz != nil {
		creds = append(creds, grpc.ChainUnaryInterceptor(fencingAuthz.UnaryInterceptor()), grpc.ChainStreamInterceptor(fencingAuthz.StreamInterceptor()))
	}

	xdsLis, err := net.Listen("tcp", cfg.xdsAddr)
	if err != nil {
		return fmt.Errorf("--xds-addr: %w", err)
	}
	adminLis, err := net.Listen("tcp", cfg.adminAddr)
	if err != nil {
		xdsLis.Close()
		return fmt.Errorf("--admin-addr: %w", err)
	}

	runCtx, cancel := context.WithCancel(context.Background())
	defer cancel()
	obs := make(chan health.Observation, 256)
	done := make(chan struct{}, 2)
	go func() { watcher.Run(runCtx, obs); done <- struct{}{} }()
	go func() { syncer.Run(runCtx, obs); done <- struct{}{} }()
	go consul.WatchControl(runCtx, client, obs, log.With("component", "control-watch"))
	if cfg.rulesFile != "" {
		obs <- health.Observation{Rules: &health.RulesSource{Source: "file:" + cfg.rulesFile, Raw: rulesRaw}}
		go followRules(runCtx, cfg.rulesFile, obs, log)
	}
	if policy != nil {
		go policy.Follow(runCtx, time.Second)
	}

	g := grpc.NewServer(append(creds,
		server.ServerOption(), // responses reference the cache's bytes (no copy per stream)
		// Dispatcher connections idle between pushes: their 32 KB write
		// buffers go back to a shared pool after each flush.
		grpc.SharedWriteBuffer(true),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}),
		// A dispatcher's trace continues into the fencing API; xDS streams
		// (hours long) are traced per push instead.
		grpc.StatsHandler(otelgrpc.NewServerHandler(
			otelgrpc.WithTracerProvider(tel.Tracer), otelgrpc.WithMeterProvider(tel.Meter),
			otelgrpc.WithFilter(func(info *stats.RPCTagInfo) bool { return strings.HasPrefix(info.FullMethodName, "/leasehold.v1.") }),
		)),
	)...)
	xds := server.NewXDS(runCtx, syncer, log, server.XDSOptions{Tracer: tel.Tracer, Meter: tel.Meter, Policy: policy})
	xds.Register(g)
	fencing := server.NewFencing(syncer, watcher.FreshAsOf, server.FencingOptions{StaleAfter: cfg.staleAfter, Refresh: watcher.Refresh, Meter: tel.Meter})
	leaseholdv1.RegisterFencingServer(g, fencing)
	go g.Serve(xdsLis)

	adminHandler := server.AdminHandler(server.AdminConfig{
		Ready: syncer, LastContact: watcher.LastContact, Syncer: syncer, XDS: xds, Fencing: fencing, Metrics: tel.MetricsHandler(),
	})
	if adminToken != nil || cfg.adminTLS.ClientCA != "" {
		adminHandler = server.GuardAdmin(adminHandler, adminToken, cfg.adminTLS.ClientCA != "")
	}
	if adminTLS != nil {
		adminLis = tls.NewListener(adminLis, adminTLS.Config())
	}
	admin := &http.Server{Handler: adminHandler, ReadHeaderTimeout: 5 * time.Second}
	go admin.Serve(adminLis)

	log.Info("leasehold serving", "xds", xdsLis.Addr().String(), "admin", adminLis.Addr().String(), "tag", cfg.tag, "traces_exported", tel.TracesExported,
		"tls", cfg.tls.Cert != "", "mtls", cfg.tls.ClientCA != "", "authz_policy", cfg.authzPolicy != "", "admin_guarded", adminToken != nil || cfg.adminTLS.ClientCA != "", "admin_tls", cfg.adminTLS.Cert != "")
	if bound != nil {
		bound <- listening{xds: xdsLis.Addr().String(), admin: adminLis.Addr().String()}
	}
	<-ctx.Done()
	log.Info("shutting down")
	stopped := make(chan struct{})
	go func() { g.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		g.Stop() // xDS streams never end on their own
	}
	sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer scancel()
	admin.Shutdown(sctx)
	cancel()
	<-done
	<-done
	return nil
}

// parseByteRate reads a rate in bytes per second: a count with an optional
// unit (B, KB, MB, KiB, MiB) or "off" (-1: unpaced).
func parseByteRate(s string) (int64, error) {
	if s == "off" {
		return -1, nil
	}
	num := strings.TrimRightFunc(s, func(r rune) bool { return r < '0' || r > '9' })
	units := map[string]int64{"": 1, "B": 1, "KB": 1000, "MB": 1000 * 1000, "KiB": 1 << 10, "MiB": 1 << 20}
	unit, ok := units[s[len(num):]]
	n, err := strconv.ParseInt(num, 10, 64)
	if !ok || err != nil || n <= 0 || n > (1<<40)/unit {
		return 0, fmt.Errorf("%q: want a positive size per second such as 512KiB, 4MiB or 8MB, or off", s)
	}
	return n * unit, nil
}
