package main

import (
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
)

// TestAttack20bReadyzNamesTheLapseMarksWrite (HIGH, fixed): leasehold serve
// with a token that may read leasehold/lapsed/ but not write it answered
// /readyz 200: its lapse marks were refused (403) as lapses happened, so a
// lapsed session was routed again after a restart, with nothing in
// readiness to say so. Now it stays unready, reason acl, naming the write.
func TestAttack20bReadyzNamesTheLapseMarksWrite(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t, consultest.Options{ACLManagementToken: "7c1b0c1e-0000-4000-8000-0000000020c1"})
	root := a.Client()
	full := consultest.ExamplePolicy(t, "leasehold-policy.hcl")
	readOnly := strings.Replace(full, "key_prefix \"leasehold/lapsed/\" {\n  policy = \"write\"", "key_prefix \"leasehold/lapsed/\" {\n  policy = \"read\"", 1)
	if readOnly == full {
		t.Fatal("no write rule on leasehold/lapsed/ in the example policy")
	}
	tok := policyToken(t, root, "leasehold-lapsed-read", readOnly, "leasehold serve, lapse marks read only")
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
