package consul

// Consul 1.13 leaves out, without an error, what a token may not read: on a
// real default-deny agent every read leasehold relies on notices, and names
// the rule of examples/consul/leasehold-policy.hcl that is missing.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

const aclRoot = "7c1b0c1e-0000-4000-8000-0000000000a1"

// clientWith is a client of a whose token holds a new policy of rules.
func clientWith(t *testing.T, a *consultest.Agent, name, rules string) *api.Client {
	t.Helper()
	root := a.Client()
	p, _, err := root.ACL().PolicyCreate(&api.ACLPolicy{Name: name, Rules: rules}, nil)
	if err != nil {
		t.Fatalf("policy %s: %v", name, err)
	}
	tok, _, err := root.ACL().
		TokenCreate(&api.ACLToken{Description: name,
			Policies: []*api.ACLTokenPolicyLink{{ID: p.ID}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return clientOf(t, a, tok.SecretID)
}

func clientOf(t *testing.T, a *consultest.Agent, token string) *api.Client {
	cfg := a.Config()
	cfg.Token = token
	c, err := api.NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// aclReads runs every read leasehold serve makes with c, and returns each
// one's error by name.
func aclReads(ctx context.Context, a *consultest.Agent, c *api.Client) map[string]error {
	cat := apiCatalog{c: c, checked: new(atomic.Uint64)}
	errs := map[string]error{}
	_, _, errs["services"] = cat.Services(ctx, 0, 0)
	_, _, errs["members"] = cat.ServiceNodes(ctx, "work", health.DefaultTag, 0, 0)
	_, _, errs["health"] = cat.HealthService(ctx, "work", health.DefaultTag, nil)
	_, _, errs["critical"] = cat.ChecksInState(ctx, health.DefaultTag, api.HealthCritical, 0, 0)
	_, _, errs["serf"] = cat.SerfHealth(ctx, 0, 0)
	_, errs["node-serf"] = cat.NodeSerf(ctx, a.Node)
	_, _, errs["generations"] = cat.Generations(ctx, 0, 0)
	_, _, errs["control"] = readControl(ctx, c, (&api.QueryOptions{}).WithContext(ctx))
	return errs
}

// checkACLErrors wants ErrACL naming want[read] for each read in want,
// and no error for the others.
func checkACLErrors(t *testing.T, errs map[string]error, want map[string][]string) {
	t.Helper()
	for read, err := range errs {
		rights, bad := want[read]
		if !bad {
			if err != nil {
				t.Errorf("%s: %v, want no error", read, err)
			}
			continue
		}
		var ae *ACLError
		if !errors.As(err, &ae) || !errors.Is(err, ErrACL) {
			t.Errorf("%s: %v, want an ACL error naming %s", read, err, rights)
			continue
		}
		if fmt.Sprint(ae.Rights) != fmt.Sprint(rights) {
			t.Errorf("%s: names %q, want %q (%v)", read, ae.Rights, rights, err)
		}
		for _, r := range rights {
			if !strings.Contains(err.Error(), r) {
				t.Errorf("%s: the message does not name %s: %v", read, r, err)
			}
		}
	}
}

// Every read leasehold serve relies on — the task types, a task's members
// and their checks, the non-passing checks, every node's serfHealth and one
// node's, the generation keys, the operators' controls — fails with ErrACL
// naming the missing rule when the token lacks it, whether Consul filtered
// something out or (an empty prefix) there was nothing to filter.
func TestConsulACLEveryReadNamesTheMissingRight(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t, consultest.Options{ACLManagementToken: aclRoot})
	root := a.Client()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// An executor's registration whose lease check is critical (so the
	// critical set has a service check), its generation, a cordon and rules.
	if err := root.Agent().ServiceRegister(&api.AgentServiceRegistration{ID: "work:e1",
		Name: "work", Port: 9001, Tags: []string{health.DefaultTag},
		Check: &api.AgentServiceCheck{CheckID: "lease-e1", TTL: "30s"}}); err != nil {
		t.Fatal(err)
	}
	for key, v := range map[string]string{health.GenerationKeyPrefix + "e1": "1", RulesKey: "{}",
		CordonPrefix + "c-1": "{}"} {
		if _, err := root.KV().Put(&api.KVPair{Key: key, Value: []byte(v)}, nil); err != nil {
			t.Fatal(err)
		}
	}
	consultest.WaitService(
		t,
		root,
		"work",
		10*time.Second,
		"work:e1 critical in the catalog",
		func(es []*api.ServiceEntry) bool {
			for _, e := range es {
				for _, c := range e.Checks {
					if c.CheckID == "lease-e1" && c.Status == api.HealthCritical {
						return true
					}
				}
			}
			return false
		},
	)

	full := consultest.ExamplePolicy(t, "leasehold-policy.hcl")
	gen, ctl := RightKeyPrefix(
		health.GenerationKeyPrefix,
		"read",
	), RightKeyPrefix(
		ControlPrefix,
		"read",
	)
	both := []string{RightServices, RightNodes}
	for _, tc := range []struct {
		name  string
		rules string
		want  map[string][]string
	}{
		{"the example policy", full, nil},
		{"no node read", consultest.WithoutRule(t, full, `node_prefix ""`), map[string][]string{
			"services": {RightNodes}, "members": {RightNodes}, "health": {RightNodes},
			"critical": {RightNodes}, "serf": {RightNodes}, "node-serf": {RightNodes},
		}},
		{"no service read", consultest.WithoutRule(t, full, `service_prefix ""`),
			map[string][]string{
				"services": {RightServices}, "members": both, "health": both, "critical": both,
			}},
		{"no generation read", consultest.WithoutRule(t, full,
			`key_prefix "leasehold/generation/"`), map[string][]string{"generations": {gen}}},
		{"no control read", consultest.WithoutRule(t, full, `key_prefix "leasehold/control/"`),
			map[string][]string{"control": {ctl}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := clientWith(t, a, strings.ReplaceAll(tc.name, " ", "-"), tc.rules)
			checkACLErrors(t, aclReads(ctx, a, c), tc.want)
		})
	}

	// Empty prefixes: nothing to filter out, yet a token that may not read
	// them is told apart from one that may (a probe of the prefix key).
	for _, key := range []string{health.GenerationKeyPrefix + "e1", RulesKey,
		CordonPrefix + "c-1"} {
		if _, err := root.KV().Delete(key, nil); err != nil {
			t.Fatal(err)
		}
	}
	noKV := clientWith(
		t,
		a,
		"no-kv",
		consultest.WithoutRule(
			t,
			consultest.WithoutRule(t, full, `key_prefix "leasehold/generation/"`),
			`key_prefix "leasehold/control/"`,
		),
	)
	checkACLErrors(
		t,
		aclReads(ctx, a, noKV),
		map[string][]string{"generations": {gen}, "control": {ctl}},
	)
	checkACLErrors(t, aclReads(ctx, a, clientWith(t, a, "full-empty", full)), nil)
	// Only the rules key readable: the cordons are not.
	rulesOnly := clientWith(
		t,
		a,
		"rules-only",
		consultest.WithoutRule(
			t,
			full,
			`key_prefix "leasehold/control/"`,
		)+`key "leasehold/control/rules" { policy = "read" }`+"\n",
	)
	_, _, err := readControl(ctx, rulesOnly, (&api.QueryOptions{}).WithContext(ctx))
	if !errors.Is(err, ErrACL) || !strings.Contains(err.Error(), ctl) {
		t.Errorf("control read without the cordons: %v, want an ACL error naming %s", err, ctl)
	}

	// A token Consul does not know is said so, not taken for a missing right.
	unknown := clientOf(t, a, "11111111-2222-4333-8444-555555555555")
	var ae *ACLError
	_, _, err = (apiCatalog{c: unknown}).ServiceNodes(ctx, "work", health.DefaultTag, 0, 0)
	if !errors.As(err, &ae) || ae.Right() != unknownToken {
		t.Errorf("unknown token: %v, want an ACL error saying the token is not known", err)
	}
}

// The Watcher and the control watch report a missing right as a contact
// failure of kind ACL naming it (what /readyz shows), and the control
// watch reads the cordons once the policy grants them.
func TestConsulACLWatchesReportTheMissingRight(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t, consultest.Options{ACLManagementToken: aclRoot})
	root := a.Client()
	_, err := root.KV().Put(&api.KVPair{Key: CordonPrefix + "c-1", Value: []byte(`{"id":"c-1"}`)},
		nil)
	if err != nil {
		t.Fatal(err)
	}
	full := consultest.ExamplePolicy(t, "leasehold-policy.hcl")
	rules := consultest.WithoutRule(
		t,
		consultest.WithoutRule(t, full, `key_prefix "leasehold/generation/"`),
		`key_prefix "leasehold/control/"`,
	)
	p, _, err := root.ACL().PolicyCreate(&api.ACLPolicy{Name: "partial", Rules: rules}, nil)
	if err != nil {
		t.Fatal(err)
	}
	tok, _, err := root.ACL().
		TokenCreate(&api.ACLToken{Policies: []*api.ACLTokenPolicyLink{{ID: p.ID}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	c := clientOf(t, a, tok.SecretID)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	out := make(chan health.Observation, 64)
	w := NewWatcher(c, WatchConfig{Tag: health.DefaultTag, FastWait: time.Second, Out: out})
	go w.Run(ctx)
	go NewControlWatch(c, WatchConfig{Out: out}).Run(ctx)
	gen, ctl := RightKeyPrefix(
		health.GenerationKeyPrefix,
		"read",
	), RightKeyPrefix(
		ControlPrefix,
		"read",
	)
	var sawGen, sawCtl bool
	for !sawGen || !sawCtl {
		select {
		case o := <-out:
			if o.Cordons() != nil {
				t.Fatalf("the control watch sent cordons it may not read: %v", o.Cordons().Raw)
			}
			if ct := o.Contact(); ct != nil && !ct.OK {
				if ct.Problem != health.ProblemACL || ct.Detail != gen {
					t.Fatalf("watcher contact %+v, want ACL naming %s", *ct, gen)
				}
				sawGen = true
			}
			if ct := o.ControlContact(); ct != nil {
				if ct.OK || ct.Problem != health.ProblemACL || ct.Detail != ctl {
					t.Fatalf("control contact %+v, want ACL naming %s", *ct, ctl)
				}
				sawCtl = true
			}
		case <-ctx.Done():
			t.Fatalf("no ACL failure reported (generation keys %v, controls %v)", sawGen, sawCtl)
		}
	}

	// The policy gains the rights: the control watch reads the cordon and
	// says so, and the watcher's contact recovers.
	p.Rules = full
	if _, _, err := root.ACL().PolicyUpdate(p, nil); err != nil {
		t.Fatal(err)
	}
	var cordons, ctlOK, contactOK bool
	for !cordons || !ctlOK || !contactOK {
		select {
		case o := <-out:
			switch {
			case o.Cordons() != nil:
				cordons = len(o.Cordons().Raw) == 1
			case o.ControlContact() != nil && o.ControlContact().OK:
				if !cordons {
					t.Fatal("the control watch said OK before sending the cordons it read")
				}
				ctlOK = true
			case o.Contact() != nil && o.Contact().OK:
				contactOK = true
			}
		case <-ctx.Done():
			t.Fatalf(
				"after the policy update: cordons %v, control OK %v, contact OK %v",
				cordons,
				ctlOK,
				contactOK,
			)
		}
	}
}

// TestConsulLapseMarksReadAsksForTheWriteRight: leasehold writes its lapse
// marks as well as reading them (key_prefix "leasehold/lapsed/" write, in the
// example policy), so the lapses watch's first read also asks for the write
// right, with a check-and-set that can never apply (Consul checks the right
// first). A token that may only read the prefix is an ACL error naming the
// write: otherwise /readyz would say 200 while every mark the LapseRecorder
// writes is refused, and a lapsed session whose check passes again after a
// restart, or on another replica, would be routed again. The probes write
// nothing.
func TestConsulLapseMarksReadAsksForTheWriteRight(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(
		t,
		consultest.Options{ACLManagementToken: "7c1b0c1e-0000-4000-8000-0000000020b1"},
	)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	full := consultest.ExamplePolicy(t, "leasehold-policy.hcl")
	write := RightKeyPrefix(health.LapseMarkPrefix, "write")
	readOnly := strings.Replace(
		full,
		"key_prefix \"leasehold/lapsed/\" {\n  policy = \"write\"",
		"key_prefix \"leasehold/lapsed/\" {\n  policy = \"read\"",
		1,
	)
	if readOnly == full {
		t.Fatal("the example policy has no write rule on leasehold/lapsed/ to downgrade")
	}
	for _, tc := range []struct {
		name, rules string
		wantErr     bool
	}{
		{"example", full, false},
		{"lapsed-read-only", readOnly, true},
		{"no-lapsed-rule", consultest.WithoutRule(t, full, `key_prefix "leasehold/lapsed/"`), true},
	} {
		c := clientWith(t, a, tc.name, tc.rules)
		cat := apiCatalog{c: c, checked: new(atomic.Uint64)}
		_, _, err := cat.LapseMarks(ctx, 0, 0)
		var ae *ACLError
		switch {
		case !tc.wantErr && err != nil:
			t.Errorf("%s: %v, want the marks read", tc.name, err)
		case tc.wantErr && (!errors.As(err, &ae) || ae.Right() != write):
			t.Errorf("%s: %v, want an ACL error naming %s", tc.name, err, write)
		}
		// What the recorder would meet: the write itself.
		_, _, werr := c.KV().
			CAS(&api.KVPair{Key: health.LapseMarkKey("e1", "s-"+tc.name), Value: []byte("{}")}, nil)
		if tc.wantErr != (werr != nil) {
			t.Errorf("%s: writing a mark: %v (the read said %v)", tc.name, werr, err)
		}
	}
	// The probe wrote nothing.
	if pairs, _, err := a.Client().KV().List(health.LapseMarkPrefix, nil); err != nil ||
		len(pairs) != 1 {
		t.Errorf(
			"marks after the probes: %d, %v; want only the example token's own write",
			len(pairs),
			err,
		)
	}
}

// TestConsulIdentityCannotBeMadeUpWithACLs: with ACLs on, who acts is the
// Consul token's identity, and --by never says it, not even when the token
// cannot be read (the anonymous token, which Consul 1.13 does not let read
// itself: 403 "ACL not found"); otherwise one person could cordon as --by
// alice and approve as --by bob. Only when Consul says ACLs are off does --by
// say who acts, and it is required then.
func TestConsulIdentityCannotBeMadeUpWithACLs(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(
		t,
		consultest.Options{ACLManagementToken: "7c1b0c1e-0000-4000-8000-0000000020b2"},
	)
	root := a.Client()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// A lax setup: the anonymous token may write the controls.
	p, _, err := root.ACL().
		PolicyCreate(&api.ACLPolicy{Name: "anon-ops", Rules: consultest.ExamplePolicy(t,
			"operator-policy.hcl")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	anonymous := &api.ACLToken{AccessorID: "00000000-0000-0000-0000-000000000002",
		Policies: []*api.ACLTokenPolicyLink{{ID: p.ID}}}
	_, _, err = root.ACL().TokenUpdate(anonymous, nil)
	if err != nil {
		t.Fatal(err)
	}
	anon := clientOf(t, a, "")
	k, err := NewControl(anon, ControlOptions{})
	if err != nil {
		t.Fatal(err)
	}
	alice, aerr := k.Identity(ctx, "alice")
	bob, berr := k.Identity(ctx, "bob")
	if aerr == nil && berr == nil && alice != bob {
		t.Errorf(
			"with ACLs on, --by made up who acts: %q and %q (one anonymous caller)",
			alice,
			bob,
		)
	}
	if aerr == nil && (alice == "alice" || alice == "bob") {
		t.Errorf("with ACLs on, the actor is --by %q", alice)
	}

	// ACLs off: --by.
	b := consultest.Start(t)
	kb, err := NewControl(b.Client(), ControlOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if who, err := kb.Identity(ctx, "alice"); err != nil || who != "alice" {
		t.Errorf("ACLs off: %q, %v; want --by alice", who, err)
	}
	if who, err := kb.Identity(ctx, " "); !errors.Is(err, ErrByRequired) {
		t.Errorf("ACLs off, no --by: %q, %v; want ErrByRequired", who, err)
	}
}

// TestConsulOperatorReadsNoticeACLs: the operators' reads check what Consul
// left out. With a token that may not read leasehold/control/cordons/ or
// leasehold/audit/, `leasehold cordon --list` and `leasehold audit` fail with
// ErrACL naming the rule (operator-policy.hcl) instead of printing no cordon
// or an empty trail, from which an operator would conclude that nothing is
// cordoned, or that nothing was done.
func TestConsulOperatorReadsNoticeACLs(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(
		t,
		consultest.Options{ACLManagementToken: "7c1b0c1e-0000-4000-8000-0000000020b4"},
	)
	root := a.Client()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rk, err := NewControl(root, ControlOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c := health.Cordon{
		ID:       "c-0000beef",
		Instance: "exec-1",
		Reason:   "disk",
		By:       "root",
		At:       time.Now().UTC(),
	}
	if err := rk.Cordon(ctx, c); err != nil {
		t.Fatal(err)
	}
	full := consultest.ExamplePolicy(t, "operator-policy.hcl")
	for _, tc := range []struct {
		name, rules string
		cordons     bool // the cordons are readable
		audit       bool
	}{
		{"operator", full, true, true},
		{"no-control", consultest.WithoutRule(t, full, `key_prefix "leasehold/control/"`), false,
			true},
		{"no-audit", consultest.WithoutRule(t, full, `key_prefix "leasehold/audit/"`), true, false},
	} {
		k, err := NewControl(clientWith(t, a, "op-"+tc.name, tc.rules), ControlOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cs, _, err := k.Cordons(ctx)
		switch {
		case tc.cordons && (err != nil || len(cs) != 1):
			t.Errorf("%s: cordons %v, %v; want the one stored", tc.name, cs, err)
		case !tc.cordons && (!errors.Is(err, ErrACL) || !strings.Contains(err.Error(),
			RightKeyPrefix(CordonPrefix, "read"))):
			t.Errorf("%s: cordons %v, %v; want an ACL error naming the read", tc.name, cs, err)
		}
		page, err := k.AuditLog(ctx, 10, "")
		switch {
		case tc.audit && (err != nil || len(page.Entries) != 1):
			t.Errorf("%s: audit %v, %v; want the one record", tc.name, page.Entries, err)
		case !tc.audit && (!errors.Is(err, ErrACL) || !strings.Contains(err.Error(),
			RightKeyPrefix(AuditPrefix, "read"))):
			t.Errorf(
				"%s: audit %v, %v; want an ACL error naming the read",
				tc.name,
				page.Entries,
				err,
			)
		}
	}
}

// A registration Consul's ACLs refuse (the executor's token may write the
// service "work", not "other") ends Run with a *PermissionError naming the
// right, after a bounded retry, instead of retrying for ever.
func TestConsulRegistrationRefusedEndsWithAPermissionError(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t,
		consultest.Options{ACLManagementToken: "7c1b0c1e-0000-4000-8000-0000000020b5"})
	c := clientWith(t, a, "exec-1", consultest.ExamplePolicy(t, "executor-policy.hcl"))
	reg, err := NewRegistrar(NewAPIAgent(c), Config{
		InstanceID: "exec-1", Tasks: []string{"other"}, Address: "127.0.0.1", Port: 9001,
		Version: "1.0.0", Capacity: 1,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = reg.Run(ctx)
	var perr *PermissionError
	if !errors.As(err, &perr) || ctx.Err() != nil ||
		!strings.Contains(err.Error(), `service "other" { policy = "write" }`) {
		t.Fatalf("Run: %v, want a *PermissionError naming the write on service other", err)
	}
}
