package consultest

import (
	"os"
	"path/filepath"
	"regexp"
	"testing"
)

// ExamplePolicy is an ACL policy file of examples/consul, as operators use
// it (found from the test's directory up to the module root).
func ExamplePolicy(t testing.TB, file string) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			break
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("examples/consul: no go.mod above the test's directory")
		}
		dir = parent
	}
	b, err := os.ReadFile(filepath.Join(dir, "examples", "consul", file))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// WithoutRule is ACL rules without the block opened by header (e.g.
// `key_prefix "leasehold/control/"`); the test fails if there is none.
func WithoutRule(t testing.TB, rules, header string) string {
	t.Helper()
	out := regexp.MustCompile(`(?m)^`+regexp.QuoteMeta(header)+` \{[^}]*\}\n`).
		ReplaceAllString(rules, "")
	if out == rules {
		t.Fatalf("no rule %s in:\n%s", header, rules)
	}
	return out
}
