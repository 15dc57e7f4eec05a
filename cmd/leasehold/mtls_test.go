package main

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/internal/testcerts"
	"github.com/leasehold/leasehold/server"
)

// A real grpc-go dispatcher whose bootstrap (from `leasehold bootstrap
// --tls-*`) speaks mTLS to leasehold, with an authorization policy granting
// its certificate identity the task type: it is routed to the executors.
func TestGRPCDispatcherOverMTLS(t *testing.T) {
	a := consultest.Start(t)
	dir := t.TempDir()
	ca := testcerts.NewCA(t, "test CA")
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		testcerts.WriteFile(t, p, b)
		return p
	}
	scert, skey := ca.Issue(t, true, nil, "localhost")
	ccert, ckey := ca.Issue(t, false, []string{"spiffe://test/dispatcher/d1"})
	caFile := write("ca.pem", ca.PEM)
	policy := write("policy.yaml", []byte("dispatchers:\n  - identity: spiffe://test/dispatcher/d1\n    tasks: [work]\n    fencing: [CheckSession]\n"))
	cfg := &serveConfig{consulAddr: a.HTTPAddr(), xdsAddr: "127.0.0.1:0", adminAddr: "127.0.0.1:0", tag: "leasehold", consulMaxConns: 8,
		tls:         server.TLSFiles{Cert: write("server.pem", scert), Key: write("server-key.pem", skey), ClientCA: caFile},
		authzPolicy: policy}
	ctx, cancel := context.WithCancel(context.Background())
	bound := make(chan listening, 1)
	served := make(chan error, 1)
	go func() { served <- serve(ctx, cfg, slog.New(slog.NewTextHandler(testWriter{t, "serve"}, nil)), bound) }()
	t.Cleanup(func() { cancel(); <-served })
	l := <-bound

	startExecutor(t, a, "e1", "1.0.0")
	d := startDispatcher(t, l.xds, "d1", nil, bootstrapTLS{CA: caFile, Cert: write("client.pem", ccert), Key: write("client-key.pem", ckey)})
	d.await(t, time.Time{}, 30*time.Second, "calls served by e1 over mTLS", func(cs []callResult) bool {
		return servedBy(cs)["e1"] >= 5
	})
	if _, err := os.Stat(caFile); err != nil {
		t.Fatal(err)
	}
}
