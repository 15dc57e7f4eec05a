package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
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
	policy := write("policy.yaml", []byte("dispatchers:\n"+
		"  - identity: spiffe://test/dispatcher/d1\n"+
		"    tasks: [work]\n"+
		"    fencing: [CheckSession]\n"))
	cfg := &serveConfig{consulAddr: a.HTTPAddr(), xdsAddr: "127.0.0.1:0",
		adminAddr: "127.0.0.1:0", tag: "leasehold", consulMaxConns: 8,
		tls: server.TLSFiles{Cert: write("server.pem", scert),
			Key: write("server-key.pem", skey), ClientCA: caFile},
		authzPolicy: policy}
	ctx, cancel := context.WithCancel(context.Background())
	bound := make(chan listening, 1)
	served := make(chan error, 1)
	go func() {
		served <- serve(ctx, cfg, slog.New(slog.NewTextHandler(testWriter{t, "serve"}, nil)), bound)
	}()
	t.Cleanup(func() { cancel(); <-served })
	l := <-bound

	startExecutor(t, a, "e1", "1.0.0")
	d := startDispatcher(t, l.xds, "d1", nil,
		bootstrapTLS{CA: caFile, Cert: write("client.pem", ccert),
			Key: write("client-key.pem", ckey)})
	d.await(t, time.Time{}, 30*time.Second, "calls served by e1 over mTLS",
		func(cs []callResult) bool {
			return servedBy(cs)["e1"] >= 5
		})
	if _, err := os.Stat(caFile); err != nil {
		t.Fatal(err)
	}
}

// The admin port over HTTPS with client certificates: probes need none,
// /debug/* and /v1/* need a certificate signed by --admin-client-ca, and
// `leasehold explain --admin-ca --admin-cert --admin-key` gets through.
func TestAdminPortClientCertificates(t *testing.T) {
	a := consultest.Start(t)
	dir := t.TempDir()
	ca := testcerts.NewCA(t, "admin CA")
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		testcerts.WriteFile(t, p, b)
		return p
	}
	scert, skey := ca.Issue(t, true, nil, "localhost")
	ccert, ckey := ca.Issue(t, false, []string{"spiffe://test/operator"})
	caFile, certFile, keyFile := write("ca.pem", ca.PEM),
		write("op.pem", ccert), write("op-key.pem", ckey)
	args := []string{"--admin-tls-cert", write("s.pem", scert),
		"--admin-tls-key", write("s-key.pem", skey), "--admin-client-ca", caFile}
	parsed, err := parseServeFlags(args, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	l := startServeTo(t, a, testWriter{t, "serve"}, func(c *serveConfig) {
		c.adminTLS = parsed.adminTLS
	})

	get := func(c *http.Client, path string) int {
		t.Helper()
		resp, err := c.Get("https://" + l.admin + path)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	anon, err := adminHTTPS(caFile, "", "")
	if err != nil {
		t.Fatal(err)
	}
	operator, err := adminHTTPS(caFile, certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	if code := get(anon, "/healthz"); code != 200 {
		t.Errorf("/healthz without a client certificate: %d", code)
	}
	if code := get(anon, "/debug/executors"); code != 401 {
		t.Errorf("/debug/executors without a client certificate: %d, want 401", code)
	}
	if code := get(operator, "/debug/executors"); code != 200 {
		t.Errorf("/debug/executors with the operator's certificate: %d", code)
	}
	var out bytes.Buffer
	if code := run([]string{"explain", "--admin-addr", l.admin, "--tls-ca", caFile,
		"--tls-cert", certFile, "--tls-key", keyFile}, &out, &out); code != 0 {
		t.Errorf("explain over the admin port's mTLS: exit %d\n%s", code, out.String())
	}
	if _, err := parseServeFlags([]string{"--admin-addr", "0.0.0.0:0",
		"--admin-tls-cert", "c", "--admin-tls-key", "k", "--admin-client-ca", "ca"},
		io.Discard); err != nil {
		t.Errorf("a non-loopback admin port guarded by client certificates refused: %v", err)
	}
}
