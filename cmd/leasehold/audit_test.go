package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/trace/noop"

	"github.com/leasehold/leasehold/snapshot/fleet"
)

// serve's --audit-log is read by people: a cordon of <2.0.0 is written as
// <2.0.0, not \u003c2.0.0.
func TestAuditLogIsNotHTMLEscaped(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.jsonl")
	write, closeAudit, err := openAudit(path, noop.NewTracerProvider())
	if err != nil {
		t.Fatal(err)
	}
	write(fleet.AuditEvent{Actor: "leasehold", Action: "cordon-applied",
		Detail: `version_constraint <2.0.0 & >=1.0.0`})
	closeAudit()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"detail":"version_constraint <2.0.0 & >=1.0.0"`) {
		t.Fatalf("escaped for HTML: %s", b)
	}
}
