package main

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/flagx"
	"github.com/leasehold/leasehold/server"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// defaultConsulAddr is the Consul agent every command talks to when neither
// --consul-addr nor a variable says otherwise (Consul's own default).
const defaultConsulAddr = "127.0.0.1:8500"

// consulAddrFlag adds --consul-addr (and the old --consul, hidden), read
// from LEASEHOLD_CONSUL_ADDR, then CONSUL_HTTP_ADDR: the one spelling of
// the Consul agent's address in every command.
//
// The address is checked as it is given (flagx.ConsulAddr): another scheme
// (ftp://x) would otherwise fail only at the first request, in words that
// name no flag.
func consulAddrFlag(fs *pflag.FlagSet, dst *string) {
	fs.Var(flagx.NewChecked(dst, defaultConsulAddr, flagx.ConsulAddr), "consul-addr",
		"Consul agent HTTP address (http://, https:// or unix://; token and TLS "+
			"from the standard CONSUL_HTTP_TOKEN, CONSUL_CACERT, "+
			"CONSUL_CLIENT_CERT, CONSUL_CLIENT_KEY, ...)")
	bindEnv(fs, "consul-addr", "LEASEHOLD_CONSUL_ADDR", "CONSUL_HTTP_ADDR")
	alias(fs, "consul", "consul-addr")
}

// serviceTagFlag adds --service-tag (and the old --tag, hidden), read from
// LEASEHOLD_SERVICE_TAG: the one spelling of the tag marking task types in
// serve and register, which share the old one too.
func serviceTagFlag(fs *pflag.FlagSet, dst *string, usage string) {
	fs.StringVar(dst, "service-tag", health.DefaultTag, usage)
	bindEnv(fs, "service-tag", "LEASEHOLD_SERVICE_TAG")
	alias(fs, "tag", "service-tag")
}

// minShardSize is the smallest --shard-size taken: below it a large task
// type would become thousands of clusters behind one route.
const minShardSize = 100

// serveFlags are leasehold serve's flags before validation.
type serveFlags struct {
	fs                       *pflag.FlagSet
	cfg                      serveConfig
	logLevel, tag, logFormat string
	lbPolicy, readRate, dcs  string
	memoryLimit              string
	gcPercent                string
	maxConns                 int
	staleAfter               time.Duration
}

func (f *serveFlags) register(fs *pflag.FlagSet) {
	f.fs = fs
	cfg := &f.cfg
	fs.SortFlags = false
	env := func(name, v string) { bindEnv(fs, name, v) }
	consulAddrFlag(fs, &cfg.consulAddr)
	fs.StringVar(&cfg.xdsAddr, "xds-addr", "127.0.0.1:18000",
		"gRPC listen address for xDS, the fencing API and load reports (LRS)")
	env("xds-addr", "LEASEHOLD_XDS_ADDR")
	fs.StringVar(&cfg.adminAddr, "admin-addr", "127.0.0.1:19000",
		"HTTP listen address of the admin port, HOST:PORT or http(s)://HOST:PORT: "+
			"/healthz, /readyz, /metrics, /debug/*, /v1/session")
	env("admin-addr", "LEASEHOLD_ADMIN_ADDR")
	serviceTagFlag(fs, &f.tag, "Consul tag marking task types")
	fs.StringVar(&f.logFormat, "log-format", "text", "text or json")
	env("log-format", "LEASEHOLD_LOG_FORMAT")
	fs.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	env("log-level", "LEASEHOLD_LOG_LEVEL")
	fs.IntVar(&f.maxConns, "consul-max-conns", 32,
		"most concurrent per-task blocking queries, 1 to 190, shared out between the datacenters "+
			"(each datacenter's fleet-wide watches hold 7 connections more, leasehold 2 more); "+
			"Consul refuses more than 200 connections per client IP")
	env("consul-max-conns", "LEASEHOLD_CONSUL_MAX_CONNS")
	fs.StringVar(&f.readRate, "consul-read-rate", "4MiB",
		"JSON per second the listings that grow with the fleet (task members, generation keys) "+
			"may read from Consul, all together, per datacenter (e.g. 512KiB, 4MiB, 8MB; off: "+
			"unpaced); a quiet fleet reads 2 s of it (or two of its largest listings) at once, "+
			"under churn the changes coalesce")
	env("consul-read-rate", "LEASEHOLD_CONSUL_READ_RATE")
	fs.StringVar(&f.memoryLimit, "memory-limit", "auto",
		"the Go runtime's soft memory limit (e.g. 96MiB, 1GiB; off: none): the collector runs "+
			"more often as the process nears it, trading CPU for memory; auto: GOMEMLIMIT when "+
			"set, else 90% of the cgroup's memory limit, else none")
	env("memory-limit", "LEASEHOLD_MEMORY_LIMIT")
	fs.StringVar(&f.gcPercent, "gc-percent", "auto",
		"how far the heap may grow past what is live (and the stacks) before the collector "+
			"runs, in percent (1 to 10000): lower trades CPU for memory; auto: GOGC when set, "+
			"else 25 while serve allocates little (more on a small heap: at least 10 MiB of "+
			"headroom) and 100 while it allocates fast (a fleet registering), collecting in the "+
			"pauses between changes once a third of the headroom is used")
	env("gc-percent", "LEASEHOLD_GC_PERCENT")
	fs.StringVar(&f.dcs, "datacenters", "",
		"Consul datacenters to watch through the agent, comma-separated in failover order, "+
			"leasehold's own first (the datacenter of dispatchers that name none); a "+
			"dispatcher's own datacenter gets priority 0, the others follow in this order "+
			"(default: the agent's own only)")
	env("datacenters", "LEASEHOLD_DATACENTERS")
	emptyOK(fs, "datacenters") // an empty value means the agent's own datacenter only
	fs.StringVar(&f.lbPolicy, "lb-policy", string(health.DefaultLBPolicy),
		"load-balancing policy of every task type the rules' load_balancing does not choose one "+
			"for: weighted_round_robin (ORCA load reports; round_robin for clients without "+
			"it), round_robin or least_request")
	env("lb-policy", "LEASEHOLD_LB_POLICY")
	fs.IntVar(&cfg.shardSize, "shard-size", fleet.DefaultShardSize,
		"most instances in one cluster: a task type whose registrations name more is split "+
			"into shards of at most this many, behind one route weighing them (dispatchers "+
			"whose bootstrap says weighted_clusters: false keep one cluster); 0: never shard")
	env("shard-size", "LEASEHOLD_SHARD_SIZE")
	fs.DurationVar(&f.staleAfter, "fencing-stale-after", health.DefaultLeaseTTL,
		"once leasehold's view of Consul is older than this (at least 3s), or than a "+
			"session's own lease_ttl when shorter, the fencing API answers UNKNOWN "+
			"(routing keeps the last known snapshot)")
	env("fencing-stale-after", "LEASEHOLD_FENCING_STALE_AFTER")
	fs.StringVar(&cfg.tls.Cert, "tls-cert", "",
		"PEM certificate of the gRPC port (xDS and fencing); re-read when the file changes")
	env("tls-cert", "LEASEHOLD_TLS_CERT")
	fs.StringVar(&cfg.tls.Key, "tls-key", "", "PEM private key of --tls-cert")
	env("tls-key", "LEASEHOLD_TLS_KEY")
	fs.StringVar(&cfg.tls.ClientCA, "tls-client-ca", "",
		"PEM CA bundle: client certificates are then required and verified (mTLS)")
	env("tls-client-ca", "LEASEHOLD_TLS_CLIENT_CA")
	fs.StringVar(&cfg.authzPolicy, "authz-policy", "",
		"YAML/JSON file granting client identities (certificate URI/DNS SANs) task types and "+
			"fencing calls; needs --tls-client-ca; followed live")
	env("authz-policy", "LEASEHOLD_AUTHZ_POLICY")
	fs.StringVar(&cfg.adminTokenFile, "admin-token-file", "",
		"file holding a bearer token that /debug/* and /v1/* on the admin port then require "+
			"(re-read when it changes); required when --admin-addr is not loopback")
	env("admin-token-file", "LEASEHOLD_ADMIN_TOKEN_FILE")
	fs.StringVar(&cfg.adminTLS.Cert, "admin-tls-cert", "",
		"PEM certificate: serve the admin port over HTTPS (re-read when it changes)")
	env("admin-tls-cert", "LEASEHOLD_ADMIN_TLS_CERT")
	fs.StringVar(&cfg.adminTLS.Key, "admin-tls-key", "", "PEM private key of --admin-tls-cert")
	env("admin-tls-key", "LEASEHOLD_ADMIN_TLS_KEY")
	fs.StringVar(&cfg.adminTLS.ClientCA, "admin-client-ca", "",
		"PEM CA: a client certificate it signed opens /debug/* and /v1/* (like "+
			"the token); probes need none")
	env("admin-client-ca", "LEASEHOLD_ADMIN_CLIENT_CA")
	fs.StringVar(&cfg.rulesFile, "rules", "",
		"rollout rules file (YAML or JSON: enforce/observe modes, safety limit, approvals, load "+
			"balancing per task type); followed live; Consul KV "+consul.RulesKey+" overrides it")
	env("rules", "LEASEHOLD_RULES")
	fs.StringVar(&cfg.auditLog, "audit-log", "-",
		"file the configuration changes this replica applies or refuses are appended to, one "+
			"JSON object per line (- : as log records on the log stream, standard error)")
	env("audit-log", "LEASEHOLD_AUDIT_LOG")
	fs.BoolVar(&cfg.requireACLApprovals, "require-acl-approvals", false,
		"count a cordon's approval only when Consul attributed it: cordon and approval made "+
			"with two different ACL tokens (an approve --by name proves nothing)")
	env("require-acl-approvals", "LEASEHOLD_REQUIRE_ACL_APPROVALS")
}

// config validates the flags into a serveConfig; errors name each bad flag
// (and the variable its value came from).
func (f *serveFlags) config() (*serveConfig, error) {
	cfg := f.cfg
	cfg.fromEnv = fromEnv(f.fs)
	var errs []string
	bad := func(flag, msg string) {
		errs = append(errs, fmt.Sprintf("invalid %s: %s", flagRef(f.fs, flag), msg))
	}
	badValue := func(flag, v string, err error) {
		errs = append(errs, fmt.Sprintf("invalid %s %q: %v", flagRef(f.fs, flag), v, err))
	}
	// The admin port is HTTP, so its address may be written as a URL, as
	// --consul-addr's may; the gRPC port's is HOST:PORT.
	if _, hp, err := flagx.HostPort(cfg.xdsAddr, 0); err != nil {
		badValue("xds-addr", cfg.xdsAddr, err)
	} else if strings.Contains(cfg.xdsAddr, "://") {
		badValue("xds-addr", cfg.xdsAddr,
			errors.New("the gRPC port (xDS and fencing) takes HOST:PORT, no scheme"))
	} else {
		cfg.xdsAddr = hp
	}
	if scheme, hp, err := flagx.HostPort(cfg.adminAddr, 0); err != nil {
		badValue("admin-addr", cfg.adminAddr, err)
	} else {
		checkAdminScheme(scheme, cfg.adminTLS.Cert != "", func(msg string) {
			badValue("admin-addr", cfg.adminAddr, errors.New(msg))
		})
		cfg.adminAddr = hp
	}
	if fe := health.ValidateTag(f.tag); fe != nil {
		bad("service-tag", fe.Error())
	}
	cfg.tag = f.tag
	if f.logFormat != "text" && f.logFormat != "json" {
		bad("log-format", fmt.Sprintf("%q: want text or json", f.logFormat))
	}
	cfg.logFormat = f.logFormat
	if l, err := parseLogLevel(f.logLevel); err != nil {
		badValue("log-level", f.logLevel, err)
	} else {
		cfg.logLevel = l
	}
	if f.maxConns < 1 || f.maxConns > 190 {
		bad("consul-max-conns", fmt.Sprintf("%d: want 1..190", f.maxConns))
	} else {
		cfg.consulMaxConns = f.maxConns
	}
	if n, err := parseByteRate(f.readRate); err != nil {
		bad("consul-read-rate", err.Error())
	} else {
		cfg.consulReadRate = n
	}
	if n, off, err := parseMemoryLimit(f.memoryLimit); err != nil {
		bad("memory-limit", err.Error())
	} else {
		cfg.memoryLimit, cfg.memoryLimitOff = n, off
	}
	if n, err := parseGCPercent(f.gcPercent); err != nil {
		bad("gc-percent", err.Error())
	} else {
		cfg.gcPercent = n
	}
	cfg.datacenters = parseDatacenters(f.dcs, bad)
	if n := consul.Connections(cfg.consulMaxConns, len(cfg.datacenters)); cfg.consulMaxConns > 0 &&
		n > 200 {
		bad("consul-max-conns",
			fmt.Sprintf("%d with %d datacenters holds up to %d connections to the agent, which "+
				"refuses more than 200 from one address: lower it",
				cfg.consulMaxConns, max(len(cfg.datacenters), 1), n))
	}
	if cfg.shardSize < 0 || (cfg.shardSize > 0 && cfg.shardSize < minShardSize) {
		bad("shard-size", fmt.Sprintf("%d: want at least %d instances per shard, or 0 never "+
			"to shard (a shard is a cluster every dispatcher of the task type holds)",
			cfg.shardSize, minShardSize))
	}
	if p, err := health.ParseLBPolicy("--lb-policy", f.lbPolicy); err != nil {
		bad("lb-policy", err.Error())
	} else {
		cfg.lbPolicy = p
	}
	if f.staleAfter < health.MinStaleBound {
		bad("fencing-stale-after",
			fmt.Sprintf("%s: want a duration of at least %s, e.g. 35s",
				f.staleAfter, health.MinStaleBound))
	} else {
		cfg.staleAfter = f.staleAfter
	}
	checkSecurity(&cfg, bad)
	if len(errs) > 0 {
		return nil, errors.New(strings.Join(errs, "\n"))
	}
	return &cfg, nil
}

// checkAdminScheme checks the scheme an admin address was written with
// against the admin port's TLS: https:// needs its certificate, and http://
// contradicts one.
func checkAdminScheme(scheme string, tls bool, bad func(msg string)) {
	switch {
	case scheme == "https" && !tls:
		bad("https:// needs the admin port's certificate: --admin-tls-cert and --admin-tls-key")
	case scheme == "http" && tls:
		bad("http://, but --admin-tls-cert serves the admin port over HTTPS: " +
			"write https://HOST:PORT or HOST:PORT")
	}
}

// parseDatacenters reads --datacenters: names in Consul's lowercase, each
// once.
func parseDatacenters(list string, bad func(flag, msg string)) []string {
	if list == "" {
		return nil
	}
	var dcs []string
	seen := map[string]bool{}
	for _, dc := range strings.Split(list, ",") {
		dc = health.NormalizeDatacenter(dc) // Consul spells datacenters in lowercase
		if err := health.ValidateDatacenter("datacenters", dc); err != nil {
			bad("datacenters",
				fmt.Sprintf("%q: a datacenter name is 1 to 64 letters "+
					"(lowercase), digits, '-' or '_'", dc))
			continue
		}
		if seen[dc] {
			bad("datacenters", fmt.Sprintf("%q listed twice", dc))
			continue
		}
		seen[dc] = true
		dcs = append(dcs, dc)
	}
	return dcs
}

// checkSecurity checks the TLS, authorization and admin-guard flags
// together, and settles the admin port's TLS options.
func checkSecurity(cfg *serveConfig, bad func(flag, msg string)) {
	if (cfg.tls.Cert == "") != (cfg.tls.Key == "") {
		bad("tls-cert", "--tls-cert and --tls-key go together")
	}
	if cfg.tls.ClientCA != "" && cfg.tls.Cert == "" {
		bad("tls-client-ca", "needs --tls-cert and --tls-key")
	}
	if cfg.authzPolicy != "" && cfg.tls.ClientCA == "" {
		bad("authz-policy",
			"identities come from verified client certificates: needs --tls-client-ca")
	}
	if (cfg.adminTLS.Cert == "") != (cfg.adminTLS.Key == "") {
		bad("admin-tls-cert", "--admin-tls-cert and --admin-tls-key go together")
	}
	if cfg.adminTLS.ClientCA != "" && cfg.adminTLS.Cert == "" {
		bad("admin-client-ca", "needs --admin-tls-cert and --admin-tls-key")
	}
	cfg.adminTLS.ClientCertOptional, cfg.adminTLS.HTTP, cfg.adminTLS.Flags =
		true, true, "--admin-tls"
	if cfg.adminTokenFile == "" && cfg.adminTLS.ClientCA == "" &&
		!server.IsLoopback(cfg.adminAddr) {
		bad("admin-addr",
			fmt.Sprintf("%s is not a loopback address: set --admin-token-file or "+
				"--admin-client-ca to guard /debug/* and /v1/*", cfg.adminAddr))
	}
}

func newServeCmd() *cobra.Command {
	var f serveFlags
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "watch Consul and serve executor endpoints over xDS to dispatchers",
		Long: `Watch the executors' leases in Consul (blocking queries) and serve the
executors each dispatcher may send new work to over xDS (ADS, state of the
world and delta), with the fencing API on the same port and an admin port for
/healthz, /readyz, /metrics and /debug/*. SIGINT and SIGTERM shut it down.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg, err := f.config()
			if err != nil {
				return usagef("%v", err)
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			log := newLogger(cmd.ErrOrStderr(), cfg.logFormat, cfg.logLevel)
			// The process's, set here rather than in serve: tests run serve
			// in their own process.
			limit := decideMemoryLimit(cfg.memoryLimit, cfg.memoryLimitOff, os.Getenv, rootFS())
			limit.apply()
			log.Info("memory limit", "bytes", limit.bytes, "from", limit.source)
			gc := decideGCPercent(cfg.gcPercent, os.Getenv)
			gc.apply()
			log.Info("collector", "gc_percent", gc.percent, "from", gc.source, "paced", gc.paced)
			if gc.paced {
				cfg.gcPace = gc.percent
			}
			if err := serve(ctx, cfg, log, nil); err != nil {
				// The error names flags; those set from a variable name it too.
				msg := withVariables(err.Error(), cfg.fromEnv)
				var ee *exitError
				if errors.As(err, &ee) && ee.code == 2 {
					return usagef("%s", msg) // nothing ran: told as a bad flag is
				}
				log.Error("serve", "err", msg)
				return quiet(1) // already logged
			}
			return nil
		},
	}
	f.register(cmd.Flags())
	completeWords(cmd, "log-format", "text", "json")
	completeWords(cmd, "log-level", "debug", "info", "warn", "error")
	completeWords(cmd, "lb-policy", string(health.LBWeightedRoundRobin),
		string(health.LBRoundRobin), string(health.LBLeastRequest))
	filenameFlags(cmd, "tls-cert", "tls-key", "tls-client-ca", "authz-policy", "admin-token-file",
		"admin-tls-cert", "admin-tls-key", "admin-client-ca", "rules", "audit-log")
	return cmd
}

func newLogger(w io.Writer, format string, level slog.Level) *slog.Logger {
	opts := &slog.HandlerOptions{Level: level}
	if format == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}
