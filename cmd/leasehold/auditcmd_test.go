package main

import (
	"bytes"
	"encoding/json"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
)

// runCLI runs leasehold with args and returns its exit code, standard
// output and standard error.
func runCLI(args ...string) (int, string, string) {
	var out, errOut bytes.Buffer
	code := run(args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// Bad audit flags are refused before Consul is asked, naming the flag.
func TestAuditFlagsNameTheFlag(t *testing.T) {
	t.Setenv("CONSUL_HTTP_ADDR", "127.0.0.1:1") // nothing listens: a refusal must not get that far
	for _, tt := range []struct {
		args []string
		flag string
	}{
		{[]string{"audit", "--limit", "0"}, "--limit"},
		{[]string{"audit", "--before", "yesterday"}, "--before"},
		{[]string{"audit", "--before", "20250102T030405.000000000Z-zzzzzz"}, "--before"},
		{[]string{"cordon", "--audit-keep", "0", "--instance", "e1", "--reason", "r", "--by", "a"},
			"--audit-keep"},
		{[]string{"uncordon", "--audit-max-age", "0s", "--by", "a", "c-1"}, "--audit-max-age"},
		{[]string{"approve", "--audit-max-age", "-2d", "--by", "a", "c-1"}, "--audit-max-age"},
		// The flag package's own message names the flag with a single dash.
		{[]string{"rules", "--audit-max-age", "5x", "clear"}, "-audit-max-age"},
		{[]string{"rules", "--audit-keep", "-3", "clear"}, "--audit-keep"},
	} {
		code, _, stderr := runCLI(tt.args...)
		if code != 2 || !strings.Contains(stderr, tt.flag) {
			t.Errorf("leasehold %s: exit %d, want 2 and an error naming %s:\n%s",
				strings.Join(tt.args, " "), code, tt.flag, stderr)
		}
	}
}

// leasehold audit pages from the newest back, printing the next page's
// --before; following it returns every record once. Retention flags reach
// the command that writes.
func TestAuditCommandPagesAndPrunes(t *testing.T) {
	a := consultest.Start(t)
	t.Setenv("CONSUL_HTTP_ADDR", a.HTTPAddr())
	for range 7 {
		cli(t, 0, "rules", "--by", "alice", "clear")
	}
	next := regexp.MustCompile(`--before (\S+)`)
	var ids []string
	args := []string{"audit", "--json", "--limit", "3"}
	for pages := 0; ; pages++ {
		if pages > 3 {
			t.Fatalf("more than 3 pages of 3 for 7 records: %v", ids)
		}
		code, stdout, stderr := runCLI(args...)
		if code != 0 {
			t.Fatalf("leasehold %s: exit %d\n%s", strings.Join(args, " "), code, stderr)
		}
		var page []string
		for _, line := range strings.Split(strings.TrimSpace(stdout), "\n") {
			var e consul.AuditEntry
			if err := json.Unmarshal([]byte(line), &e); err != nil ||
				e.ID == "" || e.Action != "rules-cleared" {
				t.Fatalf("audit line %q: %+v %v", line, e, err)
			}
			page = append(page, e.ID)
		}
		ids = append(page, ids...) // pages come newest first, each oldest first
		m := next.FindStringSubmatch(stderr)
		if m == nil {
			break
		}
		if m[1] != page[0] {
			t.Fatalf("next page starts before %s, want this page's oldest %s", m[1], page[0])
		}
		args = []string{"audit", "--json", "--limit", "3", "--before", m[1]}
	}
	if len(ids) != 7 || !slices.IsSorted(ids) || len(slices.Compact(slices.Clone(ids))) != 7 {
		t.Fatalf("paged ids %v, want 7 distinct in order", ids)
	}
	// the table shows the id too
	if out := cli(t, 0, "audit", "--limit", "1"); !strings.Contains(out, ids[6]) ||
		!strings.Contains(out, "ID") {
		t.Errorf("audit table lacks the id column:\n%s", out)
	}

	// a write with --audit-keep 2 leaves its record and the one before
	cli(t, 0, "rules", "--by", "bob", "--audit-keep", "2", "clear")
	code, stdout, stderr := runCLI("audit", "--json")
	if code != 0 {
		t.Fatalf("audit: exit %d\n%s", code, stderr)
	}
	lines := strings.Split(strings.TrimSpace(stdout), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], ids[6]) ||
		!strings.Contains(lines[1], `"actor":"bob"`) {
		t.Fatalf("after --audit-keep 2 the trail is:\n%s", stdout)
	}
}
