package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/pflag"
)

// noConsul points every Consul client at a port nothing listens on: a
// command that gets that far fails at run time (exit 1), after parsing.
func noConsul(t *testing.T) {
	t.Setenv("CONSUL_HTTP_ADDR", "127.0.0.1:1")
	t.Setenv("LEASEHOLD_ADMIN_ADDR", "127.0.0.1:1")
	unsetenv(t, "LEASEHOLD_CONSUL_ADDR")
}

// unsetenv unsets v for the test (restored after it).
func unsetenv(t *testing.T, v string) {
	t.Setenv(v, "")
	os.Unsetenv(v)
}

// A stray word in the middle of bootstrap's flags does not end parsing
// there, which would silently drop the constraint after it from the
// bootstrap printed: the command fails naming the word, and writes nothing.
func TestBootstrapRefusesStrayArgument(t *testing.T) {
	out := filepath.Join(t.TempDir(), "d1.json")
	code, stdout, stderr := runCLI("bootstrap",
		"--node-id", "d1", "extra", "--version-constraint", "<2.0.0", "--out", out)
	if code != 2 || !strings.Contains(stderr, `"extra"`) || stdout != "" {
		t.Fatalf("exit %d, stdout %q, stderr %q; want 2 and an error naming \"extra\"",
			code, stdout, stderr)
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Fatalf("--out written despite the error: %v", err)
	}
	// Flags after the stray word are parsed, not dropped: without it the
	// constraint is in the bootstrap.
	code, stdout, stderr = runCLI("bootstrap", "--node-id", "d1", "--version-constraint", "<2.0.0")
	var b bootstrapConfig
	if code != 0 || json.Unmarshal([]byte(stdout), &b) != nil ||
		b.Node.Metadata["version_constraint"] != "<2.0.0" {
		t.Fatalf("exit %d: %s %s", code, stdout, stderr)
	}
}

// Every command refuses an argument it does not take, before doing
// anything, naming the argument.
func TestEveryCommandRefusesStrayArguments(t *testing.T) {
	noConsul(t)
	for _, args := range [][]string{
		{"serve", "now"},
		{"bootstrap", "--node-id", "d1", "x"},
		{"explain", "e1"},
		{"register", "x", "--instance", "i"},
		{"cordon", "--instance", "e1", "x", "--reason", "r", "--by", "a"},
		{"cordon", "--list", "x"},
		{"uncordon", "c-1", "c-2", "--by", "a"},
		{"approve", "c-1", "c-2", "--by", "a"},
		{"rules", "show", "x"},
		{"rules", "clear", "x", "--by", "a"},
		{"rules", "set", "a.yaml", "b.yaml", "--by", "a"},
		{"audit", "x"},
		{"version", "x"},
	} {
		code, stdout, stderr := runCLI(args...)
		if code != 2 || !strings.Contains(stderr, "unexpected argument") || stdout != "" {
			t.Errorf("leasehold %s: exit %d, stdout %q, stderr %q; want 2, unexpected argument",
				strings.Join(args, " "), code, stdout, stderr)
		}
	}
	for _, args := range [][]string{{"uncordon", "--by", "a"}, {"approve"}, {"rules", "set"}} {
		if code, _, stderr := runCLI(args...); code != 2 || !strings.Contains(stderr, "missing") {
			t.Errorf("leasehold %s: exit %d, %q; want 2 naming what is missing",
				strings.Join(args, " "), code, stderr)
		}
	}
	for _, args := range [][]string{{"rules"}, {"rules", "frob"}} {
		if code, _, stderr := runCLI(args...); code != 2 ||
			!strings.Contains(stderr, "set FILE, show or clear") {
			t.Errorf("leasehold %s: exit %d, %q", strings.Join(args, " "), code, stderr)
		}
	}
}

// Flags may follow arguments, as README shows: these parse (and fail only
// at run time, with Consul unreachable: exit 1).
func TestFlagsAfterArguments(t *testing.T) {
	noConsul(t)
	for _, args := range [][]string{
		{"uncordon", "c-1a2b3c4d", "--reason", "fixed", "--by", "me"},
		{"approve", "c-1a2b3c4d", "--by", "me"},
		{"rules", "--by", "me", "clear"}, // flags before the subcommand too
		{"rules", "clear", "--by", "me"},
	} {
		code, _, stderr := runCLI(args...)
		if code != 1 || !strings.Contains(stderr, "127.0.0.1:1") {
			t.Errorf("leasehold %s: exit %d, %q; want 1 from the unreachable Consul",
				strings.Join(args, " "), code, stderr)
		}
	}
}

// Reads need no --by: with USER unset they get as far as Consul.
func TestReadsNeedNoBy(t *testing.T) {
	noConsul(t)
	unsetenv(t, "USER")
	for _, args := range [][]string{{"cordon", "--list"}, {"audit"}, {"rules", "show"},
		{"audit", "--by", "old-scripts"}} {
		code, _, stderr := runCLI(args...)
		if code != 1 || strings.Contains(stderr, "--by: required") {
			t.Errorf(
				"leasehold %s: exit %d, %q; want 1 from the unreachable Consul, no --by needed",
				strings.Join(args, " "), code, stderr)
		}
	}
	// A write asks Consul who acts (the token's identity, --by only when
	// ACLs are off): unreachable, it fails saying so, not blaming ACLs.
	if code, _, stderr := runCLI("cordon", "--instance", "e1", "--reason", "r"); code != 1 ||
		!strings.Contains(stderr, "Consul did not answer") ||
		strings.Contains(stderr, "ACLs on") {
		t.Errorf("a cordon without --by or USER, Consul unreachable: exit %d, %q", code, stderr)
	}
}

// Help exits 0 on standard output for every command; no command at all, and
// help or completion for something that does not exist, is a usage error.
func TestHelpAndVersion(t *testing.T) {
	for _, path := range append(commandPaths(), []string{}) {
		for _, h := range [][]string{{"--help"}, {"-h"}} {
			args := append(append([]string{}, path...), h...)
			code, stdout, stderr := runCLI(args...)
			if code != 0 || !strings.Contains(stdout, "Usage:") || stderr != "" {
				t.Errorf("leasehold %s: exit %d, stdout %q, stderr %q",
					strings.Join(args, " "), code, stdout, stderr)
			}
		}
	}
	if code, stdout, _ := runCLI("help", "cordon"); code != 0 ||
		!strings.Contains(stdout, "--version-constraint") {
		t.Errorf("leasehold help cordon: exit %d: %s", code, stdout)
	}
	if code, _, stderr := runCLI(); code != 2 || !strings.Contains(stderr, "Available Commands") ||
		!strings.Contains(stderr, "completion") {
		t.Errorf("no command: exit %d, %q", code, stderr)
	}
	b := readBuild()
	if code, stdout, _ := runCLI("version"); code != 0 || stdout != fmt.Sprintf(
		"leasehold %s (revision %s, %s)\n", b.Version, b.Revision, b.GoVersion) {
		t.Errorf("version: exit %d, %q", code, stdout)
	}
	for _, shell := range []string{"bash", "zsh", "fish", "powershell"} {
		if code, stdout, stderr := runCLI("completion", shell); code != 0 ||
			!strings.Contains(stdout, "leasehold") {
			t.Errorf("completion %s: exit %d, %d bytes, %q", shell, code, len(stdout), stderr)
		}
	}
	// What help and completion do not know is a usage error, as for every
	// other command: a script (or a shell's rc file) must not take it for
	// success.
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"completion", "tcsh"}, `no completion for shell "tcsh": the shells are bash`},
		{[]string{"completion"}, "name a shell: bash, zsh, fish, powershell"},
		{[]string{"help", "nosuch"}, `no command "nosuch"`},
		{[]string{"help", "cordon", "nosuch"}, `no command "cordon nosuch"`},
	} {
		if code, stdout, stderr := runCLI(c.args...); code != 2 || stdout != "" ||
			!strings.Contains(stderr, c.want) {
			t.Errorf("leasehold %s: exit %d, stdout %q, stderr %q; want 2 saying %q",
				strings.Join(c.args, " "), code, stdout, stderr, c.want)
		}
	}
	// Flag values complete too.
	if code, stdout, _ := runCLI("__complete", "serve", "--lb-policy", ""); code != 0 ||
		!strings.Contains(stdout, "least_request") {
		t.Errorf("completing --lb-policy: exit %d, %q", code, stdout)
	}
}

// Numbers are numbers: help shows the type, and a value that is none is
// refused naming the flag.
func TestNumberFlagsAreTyped(t *testing.T) {
	for _, c := range []struct {
		path []string
		flag string
	}{
		{[]string{"serve"}, "--consul-max-conns int"},
		{[]string{"serve"}, "--fencing-stale-after duration"},
		{[]string{"register"}, "--capacity int"},
		{[]string{"register"}, "--lease duration"},
		{[]string{"audit"}, "--limit int"},
		{[]string{"cordon"}, "--audit-keep int"},
	} {
		_, stdout, _ := runCLI(append(c.path, "--help")...)
		if !strings.Contains(stdout, c.flag) {
			t.Errorf("leasehold %s --help does not show %q", c.path[0], c.flag)
		}
	}
	for _, args := range [][]string{
		{"serve", "--consul-max-conns", "many"},
		{"serve", "--fencing-stale-after", "35"},
		{"audit", "--limit", "ten"},
	} {
		if code, _, stderr := runCLI(args...); code != 2 || !strings.Contains(stderr, args[1]) {
			t.Errorf("leasehold %s: exit %d, %q", strings.Join(args, " "), code, stderr)
		}
	}
}

// A flag overrides its variables; the first variable set applies; a bad
// value from a variable is refused naming the flag and the variable.
func TestEnvironmentAndFlags(t *testing.T) {
	t.Setenv("LEASEHOLD_CONSUL_MAX_CONNS", "7")
	t.Setenv("CONSUL_HTTP_ADDR", "127.0.0.2:8500")
	unsetenv(t, "LEASEHOLD_CONSUL_ADDR")
	cfg, err := parseServeFlags(nil, io.Discard)
	if err != nil || cfg.consulMaxConns != 7 || cfg.consulAddr != "127.0.0.2:8500" {
		t.Fatalf("from the environment: %+v %v", cfg, err)
	}
	t.Setenv("LEASEHOLD_CONSUL_ADDR", "127.0.0.3:8500")
	cfg, err = parseServeFlags([]string{"--consul-max-conns", "9"}, io.Discard)
	if err != nil || cfg.consulMaxConns != 9 || cfg.consulAddr != "127.0.0.3:8500" {
		t.Fatalf("flag over variable, LEASEHOLD_CONSUL_ADDR over CONSUL_HTTP_ADDR: %+v %v",
			cfg, err)
	}
	if cfg, err = parseServeFlags([]string{"--consul-addr", "127.0.0.4:8500"},
		io.Discard); err != nil ||
		cfg.consulAddr != "127.0.0.4:8500" {
		t.Fatalf("--consul-addr over both variables: %+v %v", cfg, err)
	}
	for env, want := range map[string]string{
		"LEASEHOLD_CONSUL_MAX_CONNS":    "--consul-max-conns (from $LEASEHOLD_CONSUL_MAX_CONNS)",
		"LEASEHOLD_FENCING_STALE_AFTER": "--fencing-stale-after (from $LEASEHOLD_FENCING_STALE_AFTER)",
		"LEASEHOLD_XDS_ADDR":            "--xds-addr (from $LEASEHOLD_XDS_ADDR)",
	} {
		t.Run(env, func(t *testing.T) {
			t.Setenv(env, "nonsense")
			if _, err := parseServeFlags(nil, io.Discard); err == nil ||
				!strings.Contains(err.Error(), want) {
				t.Fatalf("want an error naming %s, got %v", want, err)
			}
		})
	}
}

// The old spellings still work, hidden from help, with a deprecation note;
// giving both spellings is refused; a variable never overrides a value given
// under the old spelling.
func TestDeprecatedSpellings(t *testing.T) {
	root := newRootCmd()
	for _, c := range []struct{ cmd, old, now string }{
		{"register", "consul", "consul-addr"}, {"register", "tag", "service-tag"},
		{"cordon", "consul", "consul-addr"}, {"cordon", "version", "version-constraint"},
		{"uncordon", "consul", "consul-addr"}, {"approve", "consul", "consul-addr"},
		{"audit", "consul", "consul-addr"},
		{"explain", "admin-ca", "tls-ca"}, {"explain", "admin-cert", "tls-cert"},
		{"explain", "admin-key", "tls-key"},
		{"cordon", "admin-ca", "tls-ca"}, {"serve", "consul", "consul-addr"},
		{"serve", "tag", "service-tag"},
	} {
		cmd, _, err := root.Find([]string{c.cmd})
		if err != nil {
			t.Fatal(err)
		}
		f := cmd.Flags().Lookup(c.old)
		if f == nil || !f.Hidden || f.Value != cmd.Flags().Lookup(c.now).Value {
			t.Errorf("leasehold %s --%s is not a hidden spelling of --%s", c.cmd, c.old, c.now)
		}
		_, stdout, _ := runCLI(c.cmd, "--help")
		if strings.Contains(stdout, "--"+c.old+" ") {
			t.Errorf("leasehold %s --help shows the old --%s", c.cmd, c.old)
		}
	}

	t.Setenv("LEASEHOLD_CONSUL_ADDR", "127.0.0.9:8500")
	fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
	var addr string
	consulAddrFlag(fs, &addr)
	var notes bytes.Buffer
	if err := fs.Parse([]string{"--consul", "127.0.0.5:8500"}); err != nil {
		t.Fatal(err)
	}
	if err := finishFlags(fs, &notes); err != nil || addr != "127.0.0.5:8500" ||
		!strings.Contains(notes.String(), "--consul is deprecated") {
		t.Fatalf("--consul: %q, %v, notes %q", addr, err, notes.String())
	}
	fs = pflag.NewFlagSet("t", pflag.ContinueOnError)
	consulAddrFlag(fs, &addr)
	if err := fs.Parse([]string{"--consul", "a:1", "--consul-addr", "b:1"}); err != nil {
		t.Fatal(err)
	}
	if err := finishFlags(fs, io.Discard); err == nil ||
		!strings.Contains(err.Error(), "--consul-addr only") {
		t.Fatalf("both spellings: %v", err)
	}
	// through a command: the note goes to standard error, the value is used
	noConsul(t)
	code, _, stderr := runCLI("cordon", "--list", "--consul", "127.0.0.1:2")
	if code != 1 || !strings.Contains(stderr, "--consul is deprecated") ||
		!strings.Contains(stderr, "127.0.0.1:2") {
		t.Fatalf("cordon --list --consul: exit %d, %q", code, stderr)
	}
}

// A flag given on the command line with an empty value (`--instance "$INST"`
// with INST unset, `--flag=`) is refused (exit 2) naming the flag, never
// read as if the flag had not been given: leave a flag out for its default.
// Read as absent,
//
//   - `leasehold cordon --instance "" --task work --reason r` would store a
//     cordon of the whole task type "work" (the empty instance selects
//     every executor) instead of one executor;
//   - `leasehold bootstrap --node-id d1 --version-constraint ""` would write
//     a bootstrap without the constraint (exit 0), and the dispatcher would
//     send work to every version;
//   - `bootstrap --tls-ca ""` would write insecure channel credentials;
//   - `serve --authz-policy "" ...` would serve every task type to every
//     verified client, and `serve --rules ""` would serve without the rules
//     file.
//
// An empty environment variable is not a flag given.
func TestEmptyFlagValueRefusedNamingTheFlag(t *testing.T) {
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
		{[]string{"cordon", "--version-constraint", "", "--task", "work", "--reason", "leak"},
			"--version-constraint"},
		{[]string{"cordon", "--version", "", "--task", "work", "--reason", "leak"}, "--version"},
		{[]string{"bootstrap", "--node-id", "d1", "--version-constraint", ""},
			"--version-constraint"},
		{[]string{"bootstrap", "--node-id", "d1", "--tls-ca="}, "--tls-ca"},
		{[]string{"bootstrap", "--node-id", "d1", "--out", ""}, "--out"},
		{[]string{"explain", "--admin-token-file", ""}, "--admin-token-file"},
		{[]string{"uncordon", "c-1a2b3c4d", "--by="}, "--by"},
	} {
		code, stdout, stderr := runCLI(tt.args...)
		if code != 2 || !strings.Contains(stderr, tt.flag) || !strings.Contains(stderr, "empty") {
			t.Errorf(
				"leasehold %q: exit %d, want 2 with an error naming %s as empty\nstdout: "+
					"%s\nstderr: %s",
				tt.args, code, tt.flag, stdout, stderr)
		}
	}
	for _, args := range [][]string{
		{"--rules", ""},
		{"--authz-policy=", "--tls-cert", "c.pem",
			"--tls-key", "k.pem", "--tls-client-ca", "ca.pem"},
		{"--admin-token-file", "", "--admin-addr", "127.0.0.1:19000"},
	} {
		if _, err := parseServeFlags(args, io.Discard); err == nil ||
			!strings.Contains(err.Error(), "empty") {
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

// A bad --version-constraint is one line naming the flag and saying what to
// write, in bootstrap and cordon alike: not the library's "improper
// constraint" after a line that repeats it.
func TestBadVersionConstraintIsOneClearLine(t *testing.T) {
	t.Setenv("USER", "alice")
	for _, args := range [][]string{
		{"bootstrap", "--node-id", "d1", "--version-constraint", "foo"},
		{"cordon", "--version-constraint", "foo", "--reason", "r", "--consul-addr", "127.0.0.1:1"},
	} {
		code, _, stderr := runCLI(args...)
		first, _, _ := strings.Cut(stderr, "\n")
		if code != 2 || !strings.Contains(first, `--version-constraint`) ||
			!strings.Contains(first, `"foo": not a version constraint: write`) ||
			strings.Contains(stderr, "improper") ||
			strings.Count(stderr, "\n") != 2 { // the error, then "Run … --help"
			t.Errorf("leasehold %s: exit %d, %q", strings.Join(args, " "), code, stderr)
		}
	}
}

// envVarsOf lists the variables every flag of the command at path reads.
func envVarsOf(t *testing.T, path []string) []string {
	t.Helper()
	cmd, _, err := newRootCmd().Find(path)
	if err != nil {
		t.Fatal(err)
	}
	var vars []string
	cmd.Flags().VisitAll(func(f *pflag.Flag) { vars = append(vars, envOf(f)...) })
	return vars
}

// An empty variable counts as unset, for every command and every variable:
// systemd units (Environment=LEASEHOLD_X=) and templates produce empty
// variables all the time, and "" taken as a value refused most flags
// (LEASEHOLD_XDS_ADDR= bootstrap: "missing port"; LEASEHOLD_LOG_LEVEL= serve).
func TestEmptyVariablesCountAsUnset(t *testing.T) {
	for _, path := range commandPaths() {
		cmd, _, err := newRootCmd().Find(path)
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range envVarsOf(t, path) {
			t.Setenv(v, "")
		}
		if err := applyEnv(cmd.Flags()); err != nil {
			t.Errorf("leasehold %s with its variables empty: %v", strings.Join(path, " "), err)
		}
		cmd.Flags().VisitAll(func(f *pflag.Flag) {
			if f.Changed || f.Annotations[annotationFromEnv] != nil {
				t.Errorf("leasehold %s --%s set from an empty variable",
					strings.Join(path, " "), f.Name)
			}
		})
	}

	// serve: the configuration is the one without the variables.
	serveVars := envVarsOf(t, []string{"serve"})
	for _, v := range serveVars {
		unsetenv(t, v)
	}
	want, err := parseServeFlags(nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range serveVars {
		t.Setenv(v, "")
	}
	got, err := parseServeFlags(nil, io.Discard)
	if err != nil {
		t.Fatalf("serve with %d variables empty: %v", len(serveVars), err)
	}
	if fmt.Sprintf("%+v", got) != fmt.Sprintf("%+v", want) {
		t.Errorf("serve with its variables empty:\n%+v\nwant\n%+v", got, want)
	}

	// bootstrap: the same bootstrap as without them.
	bootVars := envVarsOf(t, []string{"bootstrap"})
	for _, v := range bootVars {
		unsetenv(t, v)
	}
	_, wantOut, _ := runCLI("bootstrap", "--node-id", "d1")
	for _, v := range bootVars {
		t.Setenv(v, "")
	}
	if code, stdout, stderr := runCLI("bootstrap", "--node-id", "d1"); code != 0 ||
		stdout != wantOut {
		t.Errorf("bootstrap with %v empty: exit %d, %q, %s", bootVars, code, stdout, stderr)
	}
}

// The commands asking a replica (explain, cordon, approve) take its admin
// address as serve does: HOST:PORT or a URL ending at the port; https://
// without TLS flags verifies against the system's CAs.
func TestAdminAddrOfAReplica(t *testing.T) {
	fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
	for _, c := range []struct {
		addr, admin string
		https       bool
		want        string // "" = accepted
	}{
		{"127.0.0.1:19000", "127.0.0.1:19000", false, ""},
		{"0.0.0.0:19000", "0.0.0.0:19000", false, ""},
		{"http://127.0.0.1:19100", "127.0.0.1:19100", false, ""},
		{"https://127.0.0.1:19100/", "127.0.0.1:19100", true, ""},
		{"127.0.0.1", "", false, `invalid --admin-addr "127.0.0.1": no port: write HOST:PORT`},
		{"ftp://127.0.0.1:1", "", false, "ftp:// is not a scheme this address takes"},
	} {
		var f explainFlags
		errs := (&adminFlags{addr: c.addr}).explainFlags(fs, &f)
		switch {
		case c.want == "" && (len(errs) > 0 || f.admin != c.admin || (f.client != nil) != c.https):
			t.Errorf("%s: %v, admin %q, https %v", c.addr, errs, f.admin, f.client != nil)
		case c.want != "" && (len(errs) != 1 || !strings.Contains(errs[0], c.want)):
			t.Errorf("%s: %v, want %q", c.addr, errs, c.want)
		}
	}
}
