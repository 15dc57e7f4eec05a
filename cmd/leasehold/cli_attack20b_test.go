package main

import (
	"io"
	"strings"
	"testing"
)

// TestAttack20bEmptyFlagValueRefused (HIGH, fixed): a flag given on the
// command line with an empty value (`--instance "$INST"` with INST unset,
// `--flag=`) was read as if the flag had not been given at all:
//
//   - `leasehold cordon --instance "" --task work --reason r` stored a
//     cordon of the whole task type "work" (the empty instance selects
//     every executor) instead of one executor;
//   - `leasehold bootstrap --node-id d1 --version-constraint ""` wrote a
//     bootstrap without the constraint (exit 0): the dispatcher sends work
//     to every version — the very mistake of issue 20's first bullet;
//   - `bootstrap --tls-ca ""` wrote insecure channel credentials;
//   - `serve --authz-policy "" ...` served every task type to every
//     verified client, `serve --rules ""` served without the rules file.
//
// Each is now refused (exit 2) naming the flag: leave a flag out for its
// default. (An empty environment variable is not a flag given.)
func TestAttack20bEmptyFlagValueRefused(t *testing.T) {
	t.Setenv("CONSUL_HTTP_ADDR", "127.0.0.1:1") // nothing listens: a refusal must not get that far
	t.Setenv("LEASEHOLD_CONSUL_ADDR", "127.0.0.1:1")
	t.Setenv("LEASEHOLD_ADMIN_ADDR", "127.0.0.1:1")
	t.Setenv("USER", "alice")
	for _, tt := range []struct {
		args []string
		flag string
	}{
		{[]string{"cordon", "--instance", "", "--task", "work", "--reason", "disk"}, "--instance"},
		{[]string{"cordon", "--instance=", "--reason", "disk", "--task", "work"}, "--instance"},
		{[]string{"cordon", "--version-constraint", "", "--task", "work", "--reason", "leak"}, "--version-constraint"},
		{[]string{"cordon", "--version", "", "--task", "work", "--reason", "leak"}, "--version"},
		{[]string{"bootstrap", "--node-id", "d1", "--version-constraint", ""}, "--version-constraint"},
		{[]string{"bootstrap", "--node-id", "d1", "--tls-ca="}, "--tls-ca"},
		{[]string{"bootstrap", "--node-id", "d1", "--out", ""}, "--out"},
		{[]string{"explain", "--admin-token-file", ""}, "--admin-token-file"},
		{[]string{"uncordon", "c-1a2b3c4d", "--by="}, "--by"},
	} {
		code, stdout, stderr := runCLI(tt.args...)
		if code != 2 || !strings.Contains(stderr, tt.flag) || !strings.Contains(stderr, "empty") {
			t.Errorf("leasehold %q: exit %d, want 2 with an error naming %s as empty\nstdout: %s\nstderr: %s", tt.args, code, tt.flag, stdout, stderr)
		}
	}
	for _, args := range [][]string{
		{"--rules", ""},
		{"--authz-policy=", "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"},
		{"--admin-token-file", "", "--admin-addr", "127.0.0.1:19000"},
	} {
		if _, err := parseServeFlags(args, io.Discard); err == nil || !strings.Contains(err.Error(), "empty") {
			t.Errorf("serve %q: %v, want refused as an empty value", args, err)
		}
	}
	// Empty where empty is a documented value stays accepted, and so does
	// an empty variable (not a flag given).
	if _, err := parseServeFlags([]string{"--datacenters", ""}, io.Discard); err != nil {
		t.Errorf("serve --datacenters \"\" (none: the agent's own): %v", err)
	}
	t.Setenv("LEASEHOLD_RULES", "")
	if _, err := parseServeFlags(nil, io.Discard); err != nil {
		t.Errorf("serve with LEASEHOLD_RULES empty: %v", err)
	}
}

// TestAttack20bAuditMaxAgeOverflowRefused (MEDIUM, fixed): --audit-max-age
// in days multiplied without an overflow check, so `--audit-max-age
// 213504d` (meant as "keep for ever") wrapped round to about 25 minutes and
// was accepted: the writing command then deleted every audit record older
// than 25 minutes.
func TestAttack20bAuditMaxAgeOverflowRefused(t *testing.T) {
	for _, v := range []string{"213504d", "106752d", "2147483647d", "9223372036854775807d"} {
		var a ageValue
		if err := a.Set(v); err == nil {
			t.Errorf("--audit-max-age %s accepted as %s", v, a.String())
		}
	}
	var a ageValue
	if err := a.Set("106751d"); err != nil || a.String() != "106751d" {
		t.Errorf("--audit-max-age 106751d (the longest duration in days): %v, %s", err, a.String())
	}
	t.Setenv("CONSUL_HTTP_ADDR", "127.0.0.1:1")
	t.Setenv("LEASEHOLD_CONSUL_ADDR", "127.0.0.1:1")
	if code, _, stderr := runCLI("uncordon", "c-1a2b3c4d", "--by", "alice", "--audit-max-age", "213504d"); code != 2 || !strings.Contains(stderr, "--audit-max-age") {
		t.Errorf("uncordon --audit-max-age 213504d: exit %d, want 2 naming the flag\n%s", code, stderr)
	}
}

// TestAttack20bBootstrapUnspecifiedDialAddress (LOW, fixed): the refusal
// of unspecified dial addresses looked at net.ParseIP of the host only, so
// a gRPC target (`dns:///0.0.0.0:18000`, which grpc-go's xDS client dials
// as written: 0.0.0.0, this machine) and an unspecified address with a
// zone (`[::%lo]:18000`) were written for dispatchers to dial.
func TestAttack20bBootstrapUnspecifiedDialAddress(t *testing.T) {
	for _, addr := range []string{"dns:///0.0.0.0:18000", "passthrough:///[::]:18000", "[::%lo]:18000", "[0:0:0:0:0:ffff:0.0.0.0]:18000", "[::ffff:0:0]:18000"} {
		if b, err := newBootstrap(addr, "d1", "", nil, "", ""); err == nil {
			t.Errorf("--xds-addr %s accepted:\n%s", addr, b)
		}
	}
	for _, addr := range []string{"10.0.0.5:18000", "[fe80::1%eth0]:18000", "leasehold.internal:18000", "localhost:18000"} {
		if _, err := newBootstrap(addr, "d1", "", nil, "", ""); err != nil {
			t.Errorf("--xds-addr %s refused: %v", addr, err)
		}
	}
}
