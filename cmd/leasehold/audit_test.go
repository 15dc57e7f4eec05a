package main

import (
	"bytes"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/trace/noop"

	"github.com/leasehold/leasehold/snapshot/fleet"
)

// TestAuditDashIsLogRecordsNotStdout: serve's default --audit-log "-" writes
// each audit event as a log record on the log stream, and nothing on
// standard output (JSON there mixed with the text logs on standard error).
func TestAuditDashIsLogRecordsNotStdout(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = w
	defer func() { os.Stdout = stdout }()
	var log bytes.Buffer
	audit, closeAudit, err := openAudit("-", slog.New(slog.NewTextHandler(&log, nil)),
		noop.NewTracerProvider())
	if err != nil {
		t.Fatal(err)
	}
	audit(fleet.AuditEvent{Actor: "bob", Action: "cordon-removed", Source: "consul-kv",
		Detail: "c-1 instance e1: fixed"})
	closeAudit()
	os.Stdout = stdout
	w.Close()
	out, _ := io.ReadAll(r)
	if len(out) > 0 {
		t.Errorf("audit written to standard output: %q", out)
	}
	for _, want := range []string{"msg=audit", "audit=true", "actor=bob",
		"action=cordon-removed", `detail="c-1 instance e1: fixed"`} {
		if !strings.Contains(log.String(), want) {
			t.Errorf("audit log record lacks %s: %q", want, log.String())
		}
	}
}

// serve's --audit-log is read by people: a cordon of <2.0.0 is written as
// <2.0.0, not \u003c2.0.0.
func TestAuditLogIsNotHTMLEscaped(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.jsonl")
	write, closeAudit, err := openAudit(path, slog.New(slog.NewTextHandler(io.Discard, nil)),
		noop.NewTracerProvider())
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
