// Command executor is an example executor: an HTTP "work" service that
// registers itself through the local Consul agent with consul.Registrar, runs
// each task under the session it was claimed in, and drains on SIGTERM.
//
//	POST /work?ms=N   run a task for N ms (429 when full, 503 without a lease)
//	GET  /healthz     200 while serving
//	GET  /load        {"load": N}
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/flagx"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "executor:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		cfg          consul.Config
		tasks        flagx.List
		labels       = flagx.Labels{}
		listen       string
		consulAddr   string
		drainTimeout time.Duration
	)
	flag.StringVar(&cfg.InstanceID, "instance", "", "stable instance id (required)")
	flag.Var(&tasks, "task", "task type(s), comma-separated or repeated (required)")
	flag.StringVar(&listen, "listen", "127.0.0.1:0", "HTTP listen address; the registered address is the one bound")
	flag.StringVar(&cfg.Version, "version", "1.0.0", "semantic version")
	flag.IntVar(&cfg.Capacity, "capacity", 2, "concurrent tasks")
	flag.Var(labels, "label", "label key=value (repeatable)")
	flag.DurationVar(&cfg.Lease.TTL, "lease", health.DefaultLeaseTTL, "lease")
	flag.DurationVar(&cfg.Lease.Heartbeat, "heartbeat", health.DefaultHeartbeat, "heartbeat interval")
	flag.DurationVar(&drainTimeout, "drain-timeout", time.Minute, "on SIGTERM, how long to wait for in-flight tasks")
	flag.StringVar(&consulAddr, "consul", "", "Consul agent HTTP address (default $CONSUL_HTTP_ADDR or 127.0.0.1:8500)")
	flag.Parse()
	cfg.Tasks, cfg.Labels = tasks, labels
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	cfg.Logger = log

	lis, err := net.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("--listen: %w", err)
	}
	addr := lis.Addr().(*net.TCPAddr)
	cfg.Address, cfg.Port = addr.IP.String(), addr.Port

	var inFlight atomic.Int64
	cfg.Load = func() int { return int(inFlight.Load()) }
	cfg.OnLeaseLost = func(l consul.LeaseLoss) {
		log.Warn("lease lost: tasks claimed under the session are abandoned", "session_id", l.SessionID, "reason", l.Reason, "superseded", l.Superseded)
	}

	acfg := api.DefaultConfig()
	if consulAddr != "" {
		acfg.Address = consulAddr
	}
	client, err := api.NewClient(acfg)
	if err != nil {
		return err
	}
	reg, err := consul.NewRegistrar(consul.NewAPIAgent(client), cfg)
	if err != nil {
		return err
	}

	srv := &http.Server{Handler: handler(reg, cfg, &inFlight)}
	go srv.Serve(lis)
	defer srv.Close()

	runCtx, cancelRun := context.WithCancel(context.Background())
	defer cancelRun()
	runErr := make(chan error, 1)
	go func() { runErr <- reg.Run(runCtx) }()

	sig, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	select {
	case err := <-runErr:
		return fmt.Errorf("registration ended: %w", err)
	case <-sig.Done():
	}
	log.Info("SIGTERM: draining", "in_flight", inFlight.Load())
	dctx, cancel := context.WithTimeout(context.Background(), drainTimeout)
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

type result struct {
	Instance string `json:"instance_id"`
	Session  string `json:"session_id"`
	Version  string `json:"version"`
	Outcome  string `json:"outcome"`
}

func handler(reg *consul.Registrar, cfg consul.Config, inFlight *atomic.Int64) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {})
	mux.HandleFunc("GET /load", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, `{"load": %d}`, inFlight.Load())
	})
	mux.HandleFunc("POST /work", func(w http.ResponseWriter, r *http.Request) {
		ms, err := strconv.Atoi(r.URL.Query().Get("ms"))
		if err != nil || ms < 0 || ms > 600_000 {
			http.Error(w, "ms: want an integer 0..600000", http.StatusBadRequest)
			return
		}
		s := reg.Session()
		if s == nil || s.Err() != nil {
			// Consul may show a registration a moment before Run has
			// published its session; wait briefly rather than refuse.
			ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
			s, err = reg.WaitSession(ctx, s)
			cancel()
			if err != nil {
				http.Error(w, "no current lease", http.StatusServiceUnavailable)
				return
			}
		}
		if n := inFlight.Add(1); n > int64(cfg.Capacity) {
			inFlight.Add(-1)
			http.Error(w, "full", http.StatusTooManyRequests)
			return
		}
		defer inFlight.Add(-1)
		res := result{Instance: cfg.InstanceID, Session: s.ID, Version: cfg.Version, Outcome: "done"}
		select { // the work, abandoned if the session ends under it
		case <-time.After(time.Duration(ms) * time.Millisecond):
		case <-s.Done():
			res.Outcome = "abandoned: " + s.Err().Error()
			w.WriteHeader(http.StatusConflict)
		case <-r.Context().Done():
			return
		}
		if errors.Is(s.Err(), consul.ErrLeaseLost) && res.Outcome == "done" {
			res.Outcome = "done after the lease was lost: do not confirm"
		}
		json.NewEncoder(w).Encode(res)
	})
	return mux
}
