package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// policyToken creates a policy of rules and a token holding it, described
// as who.
func policyToken(t *testing.T, root *api.Client, policy, rules, who string) string {
	t.Helper()
	p, _, err := root.ACL().PolicyCreate(&api.ACLPolicy{Name: policy, Rules: rules}, nil)
	if err != nil {
		t.Fatalf("policy %s: %v", policy, err)
	}
	return tokenOf(t, root, p, who)
}

// tokenOf is a new token holding policy p, described as who.
func tokenOf(t *testing.T, root *api.Client, p *api.ACLPolicy, who string) string {
	t.Helper()
	tok, _, err := root.ACL().TokenCreate(&api.ACLToken{Description: who,
		Policies: []*api.ACLTokenPolicyLink{{ID: p.ID}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return tok.SecretID
}

// readyzBody is /readyz's status and body.
func readyzBody(t *testing.T, admin string) (int, map[string]any) {
	t.Helper()
	var body map[string]any
	code := getBody(t, "http://"+admin+"/readyz", &body)
	return code, body
}

// The example ACL policies work on a default-deny agent: leasehold serve
// with a token of examples/consul/leasehold-policy.hcl serves, and
// operators with tokens of examples/consul/operator-policy.hcl set rules
// requiring approval, cordon an executor (pending), approve it as another
// operator (their tokens are who acts), see it take effect (DRAINING:
// cordoned, in explain too), list, audit and uncordon it. A leasehold token
// without the control read stays unready, and /readyz names the missing
// rule, whether there is a cordon to miss or not.
func TestExampleACLPoliciesApplyACordon(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t,
		consultest.Options{ACLManagementToken: "7c1b0c1e-0000-4000-8000-0000000000b1"})
	root := a.Client()
	lhRules, opRules := consultest.ExamplePolicy(t, "leasehold-policy.hcl"),
		consultest.ExamplePolicy(t, "operator-policy.hcl")
	lhTok := policyToken(t, root, "leasehold", lhRules, "leasehold serve")
	noCtlTok := policyToken(t, root, "leasehold-no-control",
		consultest.WithoutRule(t, lhRules, `key_prefix "leasehold/control/"`),
		"leasehold serve, no control read")
	op, _, err := root.ACL().PolicyCreate(&api.ACLPolicy{Name: "leasehold-operator",
		Rules: opRules}, nil)
	if err != nil {
		t.Fatalf("the operator policy: %v", err)
	}
	alice, bob := tokenOf(t, root, op, "alice"), tokenOf(t, root, op, "bob")
	secrets := []string{lhTok, noCtlTok, alice, bob}

	e1 := startExecutor(t, a, "exec-1", "1.0.0")
	e2 := startExecutor(t, a, "exec-2", "1.0.0")
	t.Setenv("CONSUL_HTTP_ADDR", a.HTTPAddr())
	t.Setenv("CONSUL_HTTP_TOKEN_FILE", "")
	t.Setenv("LEASEHOLD_CONSUL_ADDR", "")

	// Without the control read: unready, naming the rule (no cordon yet:
	// nothing is filtered out, the read of the prefix key tells).
	const ctlRight = `key_prefix "leasehold/control/" { policy = "read" }`
	unreadyNamesRight := func(admin, what string) {
		t.Helper()
		consultest.WaitFor(t, 20*time.Second, what, func() bool {
			code, body := readyzBody(t, admin)
			return code == 503 && body["reason"] == "acl" &&
				strings.Contains(body["detail"].(string), ctlRight) &&
				body["source"] == "operator controls"
		})
	}
	t.Setenv("CONSUL_HTTP_TOKEN", noCtlTok)
	var noCtlLog syncBuffer
	noCtl := startServeTo(t, a, &noCtlLog)
	unreadyNamesRight(noCtl.admin, "/readyz naming the control read, no cordon stored")

	t.Setenv("CONSUL_HTTP_TOKEN", lhTok)
	var lhLog syncBuffer
	l := startServeTo(t, a, &lhLog)
	fc := fencingClient(t, l.xds)
	awaitState(t, fc, "exec-1", e1.reg.Session().ID, leaseholdv1.SessionState_CURRENT)
	awaitState(t, fc, "exec-2", e2.reg.Session().ID, leaseholdv1.SessionState_CURRENT)
	consultest.WaitFor(t, 10*time.Second, "/readyz 200 with the example policy", func() bool {
		return readyzStatus(l.admin) == 200
	})

	// The operators, each with a token of the example policy.
	t.Setenv("CONSUL_HTTP_TOKEN", alice)
	t.Setenv("USER", "mallory") // ignored: with ACLs the token says who acts
	rules := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.WriteFile(rules,
		[]byte("approval: {required: true, max_executors: 0}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cli(t, 0, "rules", "set", rules)
	if out := cli(t, 0, "rules", "show"); !strings.Contains(out, `"max_executors":0`) {
		t.Fatalf("rules show: %s", out)
	}
	consultest.WaitFor(t, 10*time.Second, "the rules applied", func() bool {
		r := control(t, l.admin).Rollout
		return r != nil && r.Approval.Required
	})
	out := cli(t, 0, "cordon", "--instance", "exec-1",
		"--reason", "disk failing", "--admin-addr", l.admin)
	t.Logf("leasehold cordon:\n%s", out)
	id := strings.Fields(out)[0]
	id = strings.TrimSuffix(id, ":")
	if !strings.Contains(out, "pending approval") || !strings.Contains(out, "token:alice") {
		t.Fatalf("cordon: %s", out)
	}
	if v := verdict(t, l.admin, "exec-1", "v="); v.Route != "HEALTHY" {
		t.Fatalf("a cordon pending approval took effect: %+v", v)
	}
	if code, _, stderr := runCLI("approve", id); code != 1 ||
		!strings.Contains(stderr, "different identity") {
		t.Fatalf("alice approved her own cordon: exit %d %s", code, stderr)
	}
	t.Setenv("CONSUL_HTTP_TOKEN", bob)
	if out := cli(t, 0, "approve", id,
		"--admin-addr", l.admin); !strings.Contains(out, "token:bob") {
		t.Fatalf("approve: %s", out)
	}
	consultest.WaitFor(t, 10*time.Second, "exec-1 cordoned", func() bool {
		v := verdict(t, l.admin, "exec-1", "v=")
		return v.Route == "DRAINING" && v.Reason == "cordoned"
	})
	if v := verdict(t, l.admin, "exec-2", "v="); v.Route != "HEALTHY" {
		t.Errorf("exec-2: %+v, want routed", v)
	}
	if out := cli(t, 0, "explain", "--admin-addr", l.admin,
		"--instance", "exec-1"); !strings.Contains(out, "cordoned") {
		t.Errorf("explain does not show the cordon:\n%s", out)
	}
	if out := cli(t, 0, "cordon", "--list", "--admin-addr", l.admin); !strings.Contains(out, id) ||
		!strings.Contains(out, "applied 1/1") {
		t.Errorf("cordon --list:\n%s", out)
	}
	// The replica without the control read now misses a cordon: still
	// unready, naming the rule (the listing comes back filtered).
	unreadyNamesRight(noCtl.admin, "/readyz naming the control read, a cordon stored")

	cli(t, 0, "uncordon", id, "--reason", "disk replaced")
	consultest.WaitFor(t, 10*time.Second, "exec-1 routed again", func() bool {
		return verdict(t, l.admin, "exec-1", "v=").Route == "HEALTHY"
	})
	cli(t, 0, "rules", "clear")

	// The audit trail names the tokens' owners, whatever $USER says.
	actions := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(cli(t, 0, "audit", "--json")), "\n") {
		var e struct{ Actor, Action string }
		if err := json.Unmarshal([]byte(line), &e); err != nil {
			t.Fatalf("audit line %q: %v", line, err)
		}
		actions[e.Action] = e.Actor
	}
	for action, who := range map[string]string{"rules-set": "alice", "cordon": "alice",
		"approve": "bob", "uncordon": "bob", "rules-cleared": "bob"} {
		if !strings.HasPrefix(actions[action], "token:"+who+" (") {
			t.Errorf("audit %s by %q, want token:%s", action, actions[action], who)
		}
	}
	for _, log := range []string{noCtlLog.String(), lhLog.String()} {
		for _, s := range secrets {
			if strings.Contains(log, s) {
				t.Error("a token appears in leasehold's log")
			}
		}
	}
}
