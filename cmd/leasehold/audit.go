package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// openAudit returns the syncer's audit sink: one JSON object per line to
// path ("-": standard output, "": nowhere) and a span event each.
func openAudit(path string, tp trace.TracerProvider) (func(fleet.AuditEvent), func(), error) {
	var w io.Writer = io.Discard
	closeFn := func() {}
	switch path {
	case "":
	case "-":
		w = os.Stdout
	default:
		f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o640)
		if err != nil {
			return nil, nil, fmt.Errorf("--audit-log: %w", err)
		}
		w, closeFn = f, func() { f.Close() }
	}
	var mu sync.Mutex
	enc := json.NewEncoder(w)
	tracer := tp.Tracer("github.com/leasehold/leasehold/audit")
	return func(e fleet.AuditEvent) {
		mu.Lock()
		enc.Encode(e)
		mu.Unlock()
		_, span := tracer.Start(context.Background(), "leasehold.audit")
		span.AddEvent(e.Action, trace.WithAttributes(
			attribute.String("leasehold.audit.actor", e.Actor),
			attribute.String("leasehold.audit.source", e.Source),
			attribute.String("leasehold.audit.error", e.Error)))
		span.End()
	}, closeFn, nil
}

// followRules re-reads the rules file when it changes (checked every
// second) and hands it to the syncer, which validates it: an invalid version
// is refused there and the previous one stays in force.
func followRules(
	ctx context.Context, path string, obs chan<- health.Observation, log *slog.Logger,
) {
	stamp, _ := os.ReadFile(path)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now, _ := os.ReadFile(path) // the file is small, so it is compared whole, once a second
		if string(now) == string(stamp) {
			continue
		}
		stamp = now
		raw, err := rulesYAMLToJSON(path)
		if err != nil {
			log.Error("rules file changed but cannot be read: the previous rules stay in force",
				"path", path, "err", err)
			raw = []byte("not readable: " + err.Error()) // refused by the syncer, and audited there
		}
		select {
		case obs <- health.Observation{Data: &health.RulesSource{Source: "file:" + path, Raw: raw}}:
		case <-ctx.Done():
			return
		}
	}
}
