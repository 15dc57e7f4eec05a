package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/server"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// verdict is an executor's route and reason for one constraint set, as a
// replica's /debug/executors says.
func verdict(t *testing.T, admin, instance, set string) server.ExplainVerdict {
	t.Helper()
	var ex server.ExplainExecutors
	getBody(t, "http://"+admin+"/debug/executors", &ex)
	for _, e := range ex.Executors {
		if e.InstanceID != instance {
			continue
		}
		for _, v := range e.Verdicts {
			if v.ConstraintSet == set {
				return v
			}
		}
	}
	return server.ExplainVerdict{}
}

// awaitAll waits until cond holds on every replica.
func awaitAll(t *testing.T, admins []string, what string, cond func(admin string) bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for _, a := range admins {
		for !cond(a) {
			if time.Now().After(deadline) {
				t.Fatalf("replica %s: %s not seen within 15s", a, what)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

func cli(t *testing.T, want int, args ...string) string {
	t.Helper()
	var out bytes.Buffer
	if code := run(args, &out, &out); code != want {
		t.Fatalf("leasehold %s: exit %d, want %d\n%s",
			strings.Join(args, " "), code, want, out.String())
	}
	return out.String()
}

func control(t *testing.T, admin string) fleet.ControlState {
	t.Helper()
	var c fleet.ControlState
	getBody(t, "http://"+admin+"/debug/config", &c)
	return c
}

// Staged rollout and operator controls across two replicas, through the
// commands operators run: a rule in observe mode keeps routing (a real
// grpc-go dispatcher is served by the executor the rule would exclude), a
// scoped mode applies only where scoped, enforce excludes again, an invalid
// configuration is refused with the previous one in force, cordons by
// instance and by version (with a second person's approval) apply on both
// replicas, the safety limit keeps half the fleet routed, and every action
// is in the audit trail.
func TestRolloutAndCordonsAcrossReplicas(t *testing.T) {
	a := consultest.Start(t)
	t.Setenv("CONSUL_HTTP_ADDR", a.HTTPAddr())
	t.Setenv("LEASEHOLD_ADMIN_ADDR", "127.0.0.1:1") // no replica, unless --admin-addr names one
	var logA, logB syncBuffer
	ra, rb := startServeLogged(t, a, &logA), startServeLogged(t, a, &logB)
	admins := []string{ra.admin, rb.admin}
	for _, e := range []struct{ id, v string }{{"e1", "1.0.0"}, {"e2", "1.0.0"}, {"e3", "2.0.0"},
		{"e4", "2.0.0"}} {
		startExecutor(t, a, e.id, e.v)
	}
	d := startDispatcher(t, ra.xds, "d1", map[string]any{"version_constraint": "<2.0.0"})
	d2 := startDispatcher(t, rb.xds, "d2",
		map[string]any{"version_constraint": "<2.0.0"}) // the same set on the other replica
	const set = "v=<2.0.0"
	const open = "v="
	awaitAll(t, admins, "e3 excluded by version for <2.0.0",
		func(ad string) bool { return verdict(t, ad, "e3", set).Reason == "version-incompatible" })

	dir := t.TempDir()
	rules := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	// Scoped to another task type: no effect on work.
	cli(t, 0, "rules", "--by", "alice", "set",
		rules("other.yaml", "modes:\n  - {rule: version, mode: observe, tasks: [other]}\n"))
	awaitAll(t, admins, "the scoped rules applied",
		func(ad string) bool { return control(t, ad).Rollout != nil })
	if v := verdict(t, ra.admin, "e3", set); v.Reason != "version-incompatible" {
		t.Fatalf("a mode scoped to task other changed work: %+v", v)
	}
	// Observe for work under this constraint set: e3 is routed, and says why it would not be.
	cli(t, 0, "rules", "--by", "alice", "set",
		rules("observe.yaml",
			"modes:\n  - rule: version\n    mode: observe\n    tasks: [work]\n    constraint_set: "+
				"{version_constraint: \"<2.0.0\"}\n"),
	)
	awaitAll(t, admins, "e3 routed with version observed", func(ad string) bool {
		v := verdict(t, ad, "e3", set)
		return v.Route == "HEALTHY" && len(v.WouldExclude) == 1 &&
			v.WouldExclude[0].Reason == "version-incompatible"
	})
	since := time.Now()
	for _, x := range []*dispatcher{d, d2} {
		x.await(t, since, 20*time.Second, "calls served by e3 while version is observed",
			func(cs []callResult) bool { return servedBy(cs)["e3"] > 0 })
	}

	// An invalid configuration written straight to KV is refused; observe stays.
	if _, err := a.Client().KV().Put(&api.KVPair{Key: consul.RulesKey,
		Value: []byte(`{"modes":[{"rule":"lease","mode":"observe"}]}`)}, nil); err != nil {
		t.Fatal(err)
	}
	awaitAll(t, admins, "the invalid configuration refused", func(ad string) bool {
		return strings.Contains(control(t, ad).RolloutError, "always enforced")
	})
	if v := verdict(t, rb.admin, "e3", set); v.Route != "HEALTHY" {
		t.Fatalf("an invalid configuration changed routing: %+v", v)
	}
	if out := cli(t, 0, "rules", "show"); !strings.Contains(out, `"observe"`) {
		t.Errorf("rules show: %s", out)
	}
	// Enforce: e3 excluded again, the dispatcher stops calling it.
	cli(t, 0, "rules", "--by", "alice", "set",
		rules("enforce.yaml",
			"modes:\n  - {rule: version, mode: enforce}\napproval: {required: true, "+
				"max_executors: 1}\n"),
	)
	awaitAll(t, admins, "version enforced",
		func(ad string) bool { return verdict(t, ad, "e3", set).Reason == "version-incompatible" })
	enforced := time.Now().Add(time.Second) // the push reaches the dispatcher
	d.await(t, enforced, 20*time.Second, "calls after enforcement",
		func(cs []callResult) bool { return len(servedBy(cs)) > 0 })
	if n := servedBy(d.since(enforced))["e3"]; n > 0 {
		t.Fatalf("%d calls to e3 after the version rule was enforced", n)
	}

	// Cordon by instance: DRAINING on both replicas; the command says it
	// is applied, as a replica sees it.
	out := cli(t, 0, "cordon", "--instance", "e1", "--reason", "disk failing", "--by", "alice",
		"--admin-addr", ra.admin)
	c1 := strings.Fields(out)[0]
	c1 = strings.TrimSuffix(c1, ":")
	if !strings.Contains(out, "state: applied: 1 executor(s) get no new work") {
		t.Errorf("cordon does not say it is applied:\n%s", out)
	}
	awaitAll(t, admins, "e1 cordoned", func(ad string) bool {
		v := verdict(t, ad, "e1", open)
		return v.Route == "DRAINING" && v.Reason == "cordoned"
	})
	// Cordon by version needs a second person.
	out = cli(t, 0, "cordon", "--version-constraint", "=2.0.0", "--reason", "memory leak", "--by",
		"alice", "--admin-addr", rb.admin)
	c2 := strings.TrimSuffix(strings.Fields(out)[0], ":")
	if !strings.Contains(out, "state: pending approval") ||
		!strings.Contains(out, "leasehold approve "+c2) {
		t.Errorf("cordon does not say it is pending approval:\n%s", out)
	}
	// Without a replica to ask, the state is unknown, and said to be.
	out = cli(t, 0, "cordon", "--list")
	if !strings.Contains(out, "STATE not known here") ||
		!regexp.MustCompile(c2+`\s+version =2.0.0\s+\?`).MatchString(out) {
		t.Errorf("cordon --list without a replica:\n%s", out)
	}
	out = cli(t, 0, "cordon", "--list", "--admin-addr", ra.admin)
	if !regexp.MustCompile(c1+`\s+instance e1\s+applied 1/1`).MatchString(out) ||
		!regexp.MustCompile(c2+`\s+version =2.0.0\s+pending approval`).MatchString(out) {
		t.Errorf("cordon --list does not show the states:\n%s", out)
	}
	awaitAll(t, admins, "the version cordon pending", func(ad string) bool {
		for _, st := range control(t, ad).Cordons {
			if st.Cordon.ID == c2 {
				return st.Pending
			}
		}
		return false
	})
	if v := verdict(t, ra.admin, "e3", open); v.Route != "HEALTHY" {
		t.Fatalf("a pending cordon applied: %+v", v)
	}
	cli(t, 1, "approve", "--by", "alice", c2) // its author cannot approve it
	out = cli(t, 0, "approve", c2, "--by", "bob", "--admin-addr", ra.admin)
	if !strings.Contains(out,
		"state: held by the safety limit: 1 of the 2 executor(s) it selects stay routed, 1 "+
			"applied") {
		t.Errorf("approve does not say the safety limit holds part of the cordon:\n%s", out)
	}
	// 4 live executors, limit 0.5: e1 plus one of the two 2.0.0 ones.
	awaitAll(t, admins, "the approved cordon applied up to the safety limit", func(ad string) bool {
		for _, st := range control(t, ad).Cordons {
			if st.Cordon.ID == c2 {
				return !st.Pending && st.Applied == 1 && st.Held == 1
			}
		}
		return false
	})
	if v := verdict(t, rb.admin, "e4", open); v.Route != "HEALTHY" {
		t.Fatalf("the safety limit did not keep e4 routed: %+v", v)
	}
	// Uncordoning e1 frees room under the limit: e4 is cordoned now.
	cli(t, 0, "uncordon", c1, "--by", "bob", "--reason",
		"disk replaced") // flags after the id, as README shows
	awaitAll(t, admins, "e1 routed, e4 cordoned", func(ad string) bool {
		return verdict(t, ad, "e1", open).Route == "HEALTHY" &&
			verdict(t, ad, "e4", open).Reason == "cordoned"
	})

	// The audit trail has every action, by whom.
	audit := cli(t, 0, "audit", "--json")
	for _, want := range []string{`"action":"rules-set","target":"leasehold/control/rules"`,
		`"actor":"alice","action":"cordon"`, `"actor":"bob","action":"approve"`,
		`"actor":"bob","action":"uncordon"`} {
		if !strings.Contains(strings.ReplaceAll(audit, `"at":`, ""), want) &&
			!containsJSON(audit, want) {
			t.Errorf("audit lacks %s:\n%s", want, audit)
		}
	}
	if !strings.Contains(logA.String(), "rule in observe mode would exclude") {
		t.Error("the observed exclusion was not logged")
	}
}

// containsJSON reports whether some line's fields include those of want.
func containsJSON(lines, want string) bool {
	var w map[string]any
	if json.Unmarshal([]byte("{"+want+"}"), &w) != nil {
		return false
	}
	for _, l := range strings.Split(lines, "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) != nil {
			continue
		}
		ok := true
		for k, v := range w {
			if m[k] != v {
				ok = false
			}
		}
		if ok {
			return true
		}
	}
	return false
}

// serve --rules follows its file: observe applies, an invalid rewrite is
// refused (named, audited) with the previous rules in force, enforce
// applies; the replica's audit log gets every change it applied or refused,
// and the cordons it applies, one JSON object per line.
func TestRulesFileFollowedAndAudited(t *testing.T) {
	a := consultest.Start(t)
	t.Setenv("CONSUL_HTTP_ADDR", a.HTTPAddr())
	dir := t.TempDir()
	rulesPath, auditPath := filepath.Join(dir, "rules.yaml"), filepath.Join(dir, "audit.jsonl")
	write := func(body string) {
		t.Helper()
		if err := os.WriteFile(rulesPath+".tmp", []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(rulesPath+".tmp", rulesPath); err != nil {
			t.Fatal(err)
		}
	}
	write("modes:\n  - {rule: version, mode: observe}\n")
	var log syncBuffer
	l := startServeTo(t, a, &log,
		func(c *serveConfig) { c.rulesFile, c.auditLog = rulesPath, auditPath })
	startExecutor(t, a, "e1", "2.0.0")
	startDispatcher(t, l.xds, "d1", map[string]any{"version_constraint": "<2.0.0"})
	const set = "v=<2.0.0"
	admins := []string{l.admin}
	awaitAll(t, admins, "e1 routed with version observed (file rules)", func(ad string) bool {
		v := verdict(t, ad, "e1", set)
		return v.Route == "HEALTHY" && len(v.WouldExclude) == 1
	})
	if src := control(t, l.admin).RolloutSource; src != "file:"+rulesPath {
		t.Fatalf("rules source %q", src)
	}
	write("modes:\n  - {rule: version, mode: sometimes}\n")
	awaitAll(t, admins, "the invalid rules file refused", func(ad string) bool {
		return strings.Contains(control(t, ad).RolloutError, "modes[0].mode")
	})
	if v := verdict(t, l.admin, "e1", set); v.Route != "HEALTHY" {
		t.Fatalf("an invalid rules file changed routing: %+v", v)
	}
	write(
		"modes:\n  - {rule: version, mode: enforce}\nsafety_limit: 1  # one executor: a cordon " +
			"may take it out\n")
	awaitAll(t, admins, "version enforced (file rules)",
		func(ad string) bool { return verdict(t, ad, "e1", set).Reason == "version-incompatible" })
	t.Setenv("LEASEHOLD_ADMIN_ADDR", l.admin)
	if out := cli(t, 0, "cordon", "--instance", "e1", "--reason", "test", "--by",
		"carol"); !strings.Contains(
		out, "state: applied: 1 executor(s)") {
		t.Errorf("cordon does not say it is applied (replica from $LEASEHOLD_ADMIN_ADDR):\n%s", out)
	}
	awaitAll(t, admins, "e1 cordoned",
		func(ad string) bool { return verdict(t, ad, "e1", "v=").Reason == "cordoned" })

	b, err := os.ReadFile(auditPath)
	if err != nil {
		t.Fatal(err)
	}
	var actions []string
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var e fleet.AuditEvent
		if err := json.Unmarshal([]byte(line), &e); err != nil {
			t.Fatalf("audit line is not JSON: %q", line)
		}
		actions = append(actions, e.Actor+":"+e.Action)
	}
	for _, want := range []string{"leasehold:config-applied", "leasehold:config-rejected",
		"carol:cordon-applied"} {
		if !slices.Contains(actions, want) {
			t.Errorf("audit log lacks %s: %v", want, actions)
		}
	}
}

// --audit-max-age in days is refused when it overflows a duration:
// `--audit-max-age 213504d` (meant as "keep for ever") would wrap round to
// about 25 minutes, and the writing command would then delete every audit
// record older than that.
func TestAuditMaxAgeOverflowRefused(t *testing.T) {
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
	if code, _, stderr := runCLI("uncordon", "c-1a2b3c4d", "--by", "alice", "--audit-max-age",
		"213504d"); code != 2 ||
		!strings.Contains(stderr, "--audit-max-age") {
		t.Errorf("uncordon --audit-max-age 213504d: exit %d, want 2 naming the flag\n%s",
			code, stderr)
	}
}

// Cordons and approvals cannot surprise, on real agents: with a <2.0.0
// dispatcher whose only executor is e1, a cordon of e1 is held by the safety
// limit (4 live executors of work would allow 2) and the command names the
// set it would have emptied instead of saying "applied"; a cordon selecting
// nothing is refused (exit 2, nothing written) unless --allow-none; an
// approval without ACLs says it is only a name, in the output and in the
// audit record; with $USER unset a write records the process's user and
// host and says so; and the replica's audit, as log records on its log
// stream, names who removed a cordon.
func TestCordonsAndApprovalsCannotSurprise(t *testing.T) {
	a := consultest.Start(t)
	t.Setenv("CONSUL_HTTP_ADDR", a.HTTPAddr())
	var log syncBuffer
	l := startServeTo(t, a, &log, func(c *serveConfig) { c.auditLog = "-" })
	t.Setenv("LEASEHOLD_ADMIN_ADDR", l.admin)
	for _, e := range []struct{ id, v string }{{"e1", "1.0.0"}, {"e2", "2.0.0"}, {"e3", "2.0.0"},
		{"e4", "2.0.0"}} {
		startExecutor(t, a, e.id, e.v)
	}
	startDispatcher(t, l.xds, "d1", map[string]any{"version_constraint": "<2.0.0"})
	const set = "v=<2.0.0"
	admins := []string{l.admin}
	awaitAll(t, admins, "e1 routed to the <2.0.0 set, e4 seen",
		func(ad string) bool {
			return verdict(t, ad, "e1", set).Route == "HEALTHY" &&
				verdict(t, ad, "e4", "v=").Route == "HEALTHY"
		})
	cordons := func() int {
		t.Helper()
		keys, _, err := a.Client().KV().Keys(consul.CordonPrefix, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		return len(keys)
	}

	out := cli(t, 0, "cordon", "--instance", "e1", "--reason", "disk", "--by", "alice")
	c1 := strings.TrimSuffix(strings.Fields(out)[0], ":")
	if !strings.Contains(out, "state: held by the safety limit: 1 of the 1 executor(s)") ||
		!strings.Contains(out, "task work, constraint set v=<2.0.0: 1 live executor(s), at most "+
			"0 cordoned at once") {
		t.Errorf("cordon of the <2.0.0 set's only executor does not say it is held, naming the "+
			"set:\n%s", out)
	}
	if v := verdict(t, l.admin, "e1", set); v.Route != "HEALTHY" {
		t.Fatalf("the cordon left the <2.0.0 dispatcher without its only executor: %+v", v)
	}

	// A cordon selecting nothing: refused, nothing written; kept with --allow-none.
	out = cli(t, 2, "cordon", "--instance", "nosuch", "--reason", "typo", "--by", "alice")
	if !strings.Contains(out, "selects no executor") || !strings.Contains(out, "--allow-none") {
		t.Errorf("a cordon selecting nothing is not refused naming --allow-none:\n%s", out)
	}
	if n := cordons(); n != 1 {
		t.Fatalf("a refused cordon was written: %d cordons", n)
	}
	out = cli(t, 0, "cordon", "--instance", "nosuch", "--reason", "later", "--by", "alice",
		"--allow-none")
	if !strings.Contains(out, "warning:") || !strings.Contains(out, "kept (--allow-none)") ||
		cordons() != 2 {
		t.Errorf("cordon --allow-none of nothing not kept with a warning (%d cordons):\n%s",
			cordons(), out)
	}

	// An approval without ACLs is only a name: said in the output and the record.
	dir := t.TempDir()
	rules := filepath.Join(dir, "rules.yaml")
	if err := os.WriteFile(rules, []byte("approval: {required: true, max_executors: 5}\n"),
		0o600); err != nil {
		t.Fatal(err)
	}
	cli(t, 0, "rules", "--by", "alice", "set", rules)
	out = cli(t, 0, "cordon", "--version-constraint", "=2.0.0", "--reason", "leak", "--by", "alice")
	c2 := strings.TrimSuffix(strings.Fields(out)[0], ":")
	out = cli(t, 0, "approve", c2, "--by", "bob")
	if !strings.Contains(out, `note: "bob" is not attributed: Consul ACLs are off`) {
		t.Errorf("approve without ACLs does not say --by is only a name:\n%s", out)
	}
	if audit := cli(t, 0, "audit", "--json"); !regexp.MustCompile(
		`"actor":"bob","action":"approve","target":"` + c2 + `","detail":"[^"]*not attributed`).
		MatchString(audit) {
		t.Errorf("the approval's audit record does not say it is not attributed:\n%s", audit)
	}

	// $USER unset: the write records this process's user and host, and says so.
	t.Setenv("USER", "")
	os.Unsetenv("USER")
	who := fallbackBy()
	out = cli(t, 0, "uncordon", c1, "--reason", "disk replaced")
	if !strings.Contains(out, "no --by and $USER unset: recorded as "+strconv.Quote(who)) ||
		!strings.Contains(out, c1+": removed by "+who) {
		t.Errorf("uncordon with $USER unset:\n%s", out)
	}
	// The replica's audit names who removed it, as a log record.
	awaitAll(t, admins, "the removal audited", func(string) bool {
		return strings.Contains(log.String(), "action=cordon-removed")
	})
	var removed string
	for _, line := range strings.Split(log.String(), "\n") {
		if strings.Contains(line, "action=cordon-removed") {
			removed = line
		}
	}
	if !strings.Contains(removed, "msg=audit") || !strings.Contains(removed, "audit=true") ||
		(!strings.Contains(removed, "actor="+who+" ") &&
			!strings.Contains(removed, "actor="+strconv.Quote(who))) ||
		!strings.Contains(removed, "disk replaced") {
		t.Errorf("the removal's audit record does not name who removed it: %s", removed)
	}
}

// serve --require-acl-approvals counts only approvals Consul attributed: with
// ACLs off an `approve --by` is only a name, so the cordon stays pending and
// approve prints why; the same approval applies on a replica without the
// flag.
func TestRequireACLApprovalsRefusesAnUnattributedApproval(t *testing.T) {
	a := consultest.Start(t)
	t.Setenv("CONSUL_HTTP_ADDR", a.HTTPAddr())
	strict := startServeTo(t, a, testWriter{t, "strict"},
		func(c *serveConfig) { c.requireACLApprovals = true })
	lax := startServe(t, a)
	startExecutor(t, a, "e1", "1.0.0")
	startExecutor(t, a, "e2", "1.0.0")
	admins := []string{strict.admin, lax.admin}
	awaitAll(t, admins, "e2 seen", func(ad string) bool {
		return verdict(t, ad, "e2", "v=").Route == "HEALTHY"
	})
	rules := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.WriteFile(rules, []byte("approval: {required: true, max_executors: 0}\n"),
		0o600); err != nil {
		t.Fatal(err)
	}
	cli(t, 0, "rules", "--by", "alice", "set", rules)
	out := cli(t, 0, "cordon", "--instance", "e1", "--reason", "disk", "--by", "alice",
		"--admin-addr", strict.admin)
	id := strings.TrimSuffix(strings.Fields(out)[0], ":")
	out = cli(t, 0, "approve", id, "--by", "bob", "--admin-addr", strict.admin)
	if !strings.Contains(out, "state: pending approval") || !strings.Contains(out,
		`the one it carries does not count: approved by "bob", a name given with --by that `+
			"Consul cannot attribute") {
		t.Errorf("approve on a --require-acl-approvals replica does not say it is refused:\n%s",
			out)
	}
	if !control(t, strict.admin).RequireACLApprovals {
		t.Error("/debug/config does not say the replica requires ACL approvals")
	}
	awaitAll(t, []string{lax.admin}, "the approval applied without the flag", func(ad string) bool {
		return verdict(t, ad, "e1", "v=").Route == "DRAINING"
	})
	if v := verdict(t, strict.admin, "e1", "v="); v.Route != "HEALTHY" {
		t.Fatalf("an unattributed approval counted on the strict replica: %+v", v)
	}
}
