package main

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/testcerts"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// tokenFor creates a policy from one of examples/consul's files and a token
// holding it.
func tokenFor(t *testing.T, root *api.Client, name, file string) string {
	t.Helper()
	rules, err := os.ReadFile("../../examples/consul/" + file)
	if err != nil {
		t.Fatal(err)
	}
	p, _, err := root.ACL().PolicyCreate(&api.ACLPolicy{Name: name, Rules: string(rules)}, nil)
	if err != nil {
		t.Fatalf("policy %s from %s: %v", name, file, err)
	}
	tok, _, err := root.ACL().TokenCreate(
		&api.ACLToken{Policies: []*api.ACLTokenPolicyLink{{ID: p.ID}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return tok.SecretID
}

// A Consul agent with ACLs on and default deny, using the example policies:
// an executor's token registers its own service and no other (registration
// is authenticated by Consul); leasehold with the read-only token serves it;
// without a token leasehold stays unready and says which rights it lacks.
func TestConsulACLs(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t,
		consultest.Options{ACLManagementToken: "7c1b0c1e-0000-4000-8000-000000000001"})
	root := a.Client()
	readTok := tokenFor(t, root, "leasehold", "leasehold-policy.hcl")
	execTok := tokenFor(t, root, "exec-1", "executor-policy.hcl")

	ecfg := a.Config()
	ecfg.Token = execTok
	ec, err := api.NewClient(ecfg)
	if err != nil {
		t.Fatal(err)
	}
	err = ec.Agent().ServiceRegister(
		&api.AgentServiceRegistration{
			ID:   "other:exec-1",
			Name: "other",
			Port: 9002,
			Tags: []string{health.DefaultTag},
		},
	)
	if err == nil || !strings.Contains(err.Error(), "403") {
		t.Fatalf("the executor token registered a service it was not granted: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	reg, err := consul.NewRegistrar(consul.NewAPIAgent(ec), consul.Config{
		InstanceID: "exec-1", Tasks: []string{"work"}, Address: "127.0.0.1", Port: 9001,
		Version: "1.0.0", Capacity: 2,
		Lease: health.Lease{
			TTL:             3 * time.Second,
			Heartbeat:       time.Second,
			DeregisterAfter: time.Minute,
		},
		Logger: slog.New(slog.NewTextHandler(testWriter{t, "registrar"}, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	go reg.Run(ctx)
	wctx, wcancel := context.WithTimeout(ctx, 15*time.Second)
	defer wcancel()
	sess, err := reg.WaitSession(wctx, nil)
	if err != nil {
		t.Fatalf("the executor could not register its own service with its token: %v", err)
	}

	// Anonymous (no token): Consul filters everything out silently.
	t.Setenv("CONSUL_HTTP_TOKEN", "")
	t.Setenv("CONSUL_HTTP_TOKEN_FILE", "")
	var anonLog syncBuffer
	anon := startServeLogged(t, a, &anonLog)
	deadline := time.Now().Add(15 * time.Second)
	for !strings.Contains(anonLog.String(), `service_prefix \"\"`) {
		if time.Now().After(deadline) {
			t.Fatalf("leasehold without a token did not say which ACL rights it lacks:\n%s",
				anonLog.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	consultest.WaitFor(t, 10*time.Second, "/readyz naming the missing rights", func() bool {
		code, body := readyzBody(t, anon.admin)
		detail, _ := body["detail"].(string)
		// every right missing, whichever watch lacks it
		return code == 503 && body["reason"] == "acl" &&
			strings.Contains(detail, `service_prefix ""`) &&
			strings.Contains(detail, `node_prefix ""`) &&
			strings.Contains(detail, `key_prefix "leasehold/generation/"`) &&
			strings.Contains(detail, `key_prefix "leasehold/control/"`)
	})
	if strings.Contains(anonLog.String(), execTok) || strings.Contains(anonLog.String(), readTok) {
		t.Error("a token appears in the log")
	}

	// With the example's read-only policy it serves the executor.
	t.Setenv("CONSUL_HTTP_TOKEN", readTok)
	var okLog syncBuffer
	l := startServeLogged(t, a, &okLog)
	awaitState(t, fencingClient(t, l.xds), "exec-1", sess.ID, leaseholdv1.SessionState_CURRENT)
	if code := readyzStatus(l.admin); code != 200 {
		t.Errorf("leasehold with the read token: /readyz %d, want 200", code)
	}
	if strings.Contains(okLog.String(), readTok) {
		t.Error("the token appears in the log")
	}
}

func startServeLogged(t *testing.T, a *consultest.Agent, w *syncBuffer) listening {
	t.Helper()
	return startServeTo(t, a, w)
}

// leasehold reaches Consul over HTTPS with the standard CONSUL_* variables
// (here CONSUL_CACERT): it serves the fleet; without the CA it stays unready
// and says why.
func TestConsulOverHTTPS(t *testing.T) {
	consultest.RequireBinary(t)
	dir := t.TempDir()
	ca := testcerts.NewCA(t, "consul CA")
	cert, key := ca.Issue(t, true, nil, "localhost")
	files := consultest.TLSFiles{
		CA:   filepath.Join(dir, "ca.pem"),
		Cert: filepath.Join(dir, "consul.pem"),
		Key:  filepath.Join(dir, "consul-key.pem"),
	}
	testcerts.WriteFile(t, files.CA, ca.PEM)
	testcerts.WriteFile(t, files.Cert, cert)
	testcerts.WriteFile(t, files.Key, key)
	a := consultest.Start(t, consultest.Options{TLS: &files})
	e := startExecutor(t, a, "e1", "1.0.0")
	sess := e.reg.Session().ID

	https := func(c *serveConfig) { c.consulAddr = "https://" + a.HTTPSAddr() }
	t.Setenv("CONSUL_CACERT", "")
	var noCA syncBuffer
	bad := startServeTo(t, a, &noCA, https)
	deadline := time.Now().Add(15 * time.Second)
	for !strings.Contains(noCA.String(), "certificate") {
		if time.Now().After(deadline) {
			t.Fatalf("without the CA leasehold did not say why Consul is unreachable:\n%s",
				noCA.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	consultest.WaitFor(t, 10*time.Second, "/readyz naming the certificate problem", func() bool {
		code, body := readyzBody(t, bad.admin)
		detail, _ := body["detail"].(string)
		return code == 503 && body["reason"] == "tls" &&
			strings.Contains(detail, "certificate signed by unknown authority")
	})

	t.Setenv("CONSUL_CACERT", files.CA)
	l := startServeTo(t, a, testWriter{t, "serve"}, https)
	awaitState(t, fencingClient(t, l.xds), "e1", sess, leaseholdv1.SessionState_CURRENT)
}

// / leasehold serve with a token that may read leasehold/lapsed/ but not write
// it stays unready, reason acl, naming the write rule it lacks: its lapse
// marks are refused (403) as lapses happen, so a lapsed session would be
// routed again after a restart, with nothing in readiness to say so.
func TestReadyzNamesTheLapseMarksWriteTheTokenLacks(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t,
		consultest.Options{ACLManagementToken: "7c1b0c1e-0000-4000-8000-0000000020c1"})
	root := a.Client()
	full := consultest.ExamplePolicy(t, "leasehold-policy.hcl")
	readOnly := strings.Replace(full, "key_prefix \"leasehold/lapsed/\" {\n  policy = \"write\"",
		"key_prefix \"leasehold/lapsed/\" {\n  policy = \"read\"", 1)
	if readOnly == full {
		t.Fatal("no write rule on leasehold/lapsed/ in the example policy")
	}
	tok := policyToken(t, root, "leasehold-lapsed-read", readOnly,
		"leasehold serve, lapse marks read only")
	startExecutor(t, a, "exec-1", "1.0.0")
	t.Setenv("CONSUL_HTTP_TOKEN", tok)
	t.Setenv("CONSUL_HTTP_TOKEN_FILE", "")
	l := startServeTo(t, a, testWriter{t, "serve"})
	const right = `key_prefix "leasehold/lapsed/" { policy = "write" }`
	var last map[string]any
	consultest.WaitFor(t, 20*time.Second, "/readyz 503 naming the lapse marks' write", func() bool {
		code, body := readyzBody(t, l.admin)
		last = body
		detail, _ := body["detail"].(string)
		return code == 503 && body["reason"] == "acl" && strings.Contains(detail, right)
	})
	t.Logf("/readyz: %v", last)
}
