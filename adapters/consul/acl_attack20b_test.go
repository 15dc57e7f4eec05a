package consul

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

// TestAttack20bLapseMarksNeedWrite (HIGH, fixed): leasehold writes its
// lapse marks (key_prefix "leasehold/lapsed/" write, in the example
// policy), but the lapses watch only read them: a token with read alone on
// the prefix read the (empty) marks, /readyz said 200, and every mark the
// LapseRecorder tried to write was refused with 403 — logged once a lapse
// had happened, never in readiness — so a lapsed session whose check turns
// passing after a restart (or on another replica) was routed again, the
// promise the marks exist for. The read of the marks now also asks for
// the write (a check-and-set that can never apply: Consul checks the
// right first), so such a token is an ACL error naming the write.
func TestAttack20bLapseMarksNeedWrite(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t, consultest.Options{ACLManagementToken: "7c1b0c1e-0000-4000-8000-0000000020b1"})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	full := consultest.ExamplePolicy(t, "leasehold-policy.hcl")
	write := RightKeyPrefix(health.LapseMarkPrefix, "write")
	readOnly := strings.Replace(full, "key_prefix \"leasehold/lapsed/\" {\n  policy = \"write\"", "key_prefix \"leasehold/lapsed/\" {\n  policy = \"read\"", 1)
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
		_, _, werr := c.KV().CAS(&api.KVPair{Key: health.LapseMarkKey("e1", "s-"+tc.name), Value: []byte("{}")}, nil)
		if tc.wantErr != (werr != nil) {
			t.Errorf("%s: writing a mark: %v (the read said %v)", tc.name, werr, err)
		}
	}
	// The probe wrote nothing.
	if pairs, _, err := a.Client().KV().List(health.LapseMarkPrefix, nil); err != nil || len(pairs) != 1 {
		t.Errorf("marks after the probes: %d, %v; want only the example token's own write", len(pairs), err)
	}
}

// TestAttack20bIdentityCannotBeMadeUpWithACLs (MEDIUM, fixed): "who acts is
// the Consul token's identity when ACLs are on (it cannot be made up)", but
// Identity fell back to --by whenever reading the token failed — with ACLs
// on and no token (the anonymous token, which Consul 1.13 does not let read
// itself: 403 "ACL not found"), --by said who acted: one person cordons as
// --by alice and approves as --by bob, the second person's approval made
// up. Only when Consul says ACLs are off does --by say who acts.
func TestAttack20bIdentityCannotBeMadeUpWithACLs(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t, consultest.Options{ACLManagementToken: "7c1b0c1e-0000-4000-8000-0000000020b2"})
	root := a.Client()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// A lax setup: the anonymous token may write the controls.
	p, _, err := root.ACL().PolicyCreate(&api.ACLPolicy{Name: "anon-ops", Rules: consultest.ExamplePolicy(t, "operator-policy.hcl")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := root.ACL().TokenUpdate(&api.ACLToken{AccessorID: "00000000-0000-0000-0000-000000000002", Policies: []*api.ACLTokenPolicyLink{{ID: p.ID}}}, nil); err != nil {
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
		t.Errorf("with ACLs on, --by made up who acts: %q and %q (one anonymous caller)", alice, bob)
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

// TestAttack20bOperatorReadsNoticeACLs (MEDIUM, fixed): the operators'
// reads did not check what Consul left out: with a token that may not
// read leasehold/control/cordons/ or leasehold/audit/, `leasehold cordon
// --list` printed no cordon and `leasehold audit` an empty trail, exit 0 —
// an operator concluding nothing is cordoned, or nothing was done. They now
// fail with ErrACL naming the rule (operator-policy.hcl).
func TestAttack20bOperatorReadsNoticeACLs(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t, consultest.Options{ACLManagementToken: "7c1b0c1e-0000-4000-8000-0000000020b4"})
	root := a.Client()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rk, err := NewControl(root, ControlOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c := health.Cordon{ID: "c-0000beef", Instance: "exec-1", Reason: "disk", By: "root", At: time.Now().UTC()}
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
		{"no-control", consultest.WithoutRule(t, full, `key_prefix "leasehold/control/"`), false, true},
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
		case !tc.cordons && (!errors.Is(err, ErrACL) || !strings.Contains(err.Error(), RightKeyPrefix(CordonPrefix, "read"))):
			t.Errorf("%s: cordons %v, %v; want an ACL error naming the read", tc.name, cs, err)
		}
		page, err := k.AuditLog(ctx, 10, "")
		switch {
		case tc.audit && (err != nil || len(page.Entries) != 1):
			t.Errorf("%s: audit %v, %v; want the one record", tc.name, page.Entries, err)
		case !tc.audit && (!errors.Is(err, ErrACL) || !strings.Contains(err.Error(), RightKeyPrefix(AuditPrefix, "read"))):
			t.Errorf("%s: audit %v, %v; want an ACL error naming the read", tc.name, page.Entries, err)
		}
	}
}
