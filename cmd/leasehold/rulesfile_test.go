package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/health"
)

// TestRulesFileSendsEachChangeOnItsClock: the rules file is compared at
// every tick of its clock; a change goes to the syncer as the file's rules,
// an unreadable one as why it cannot be read (the syncer refuses and audits
// it), an unchanged file sends nothing, and Run returns the context's error.
func TestRulesFileSendsEachChangeOnItsClock(t *testing.T) {
	path := filepath.Join(t.TempDir(), "rules.yaml")
	write := func(s string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("approval: {required: false}\n")
	clock := clockwork.NewFakeClock()
	obs := make(chan health.Observation, 4)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	r := rulesFile{path: path, obs: obs, log: slog.New(slog.NewTextHandler(io.Discard, nil)), clock: clock}
	go func() { done <- r.Run(ctx) }()
	armed := func() {
		t.Helper()
		bctx, bcancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer bcancel()
		if err := clock.BlockUntilContext(bctx, 1); err != nil {
			t.Fatal("the rules file is not waiting on its clock")
		}
	}
	tick := func() {
		t.Helper()
		armed()
		clock.Advance(time.Second)
	}
	next := func() *health.RulesSource {
		t.Helper()
		select {
		case o := <-obs:
			return o.Rules()
		case <-time.After(5 * time.Second):
			t.Fatal("no rules sent")
			return nil
		}
	}
	armed() // the file as it was is read
	write("approval: {required: true}\n")
	tick()
	if rs := next(); rs == nil || rs.Source != "file:"+path || !strings.Contains(string(rs.Raw), `"required":true`) {
		t.Fatalf("the changed file sent as %+v", rs)
	}
	write(":\n  - not: [yaml")
	tick()
	if rs := next(); rs == nil || !strings.HasPrefix(string(rs.Raw), "not readable: ") {
		t.Fatalf("an unreadable file sent as %+v, want why it cannot be read", rs)
	}
	tick() // unchanged: nothing goes out
	tick()
	select {
	case o := <-obs:
		t.Fatalf("an unchanged file sent %+v", o)
	default:
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run = %v, want the context's error", err)
	}
}
