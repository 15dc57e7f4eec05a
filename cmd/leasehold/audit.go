package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/snapshot/fleet"
)

// openAudit returns the syncer's audit sink: "-" writes each event as a
// log record ("audit", with its fields) on serve's log stream, so standard
// output never mixes JSON with the text logs on standard error; a path gets
// one JSON object per line; "" writes nowhere. Each event is also a span
// event.
func openAudit(
	path string, log *slog.Logger, tp trace.TracerProvider,
) (func(fleet.AuditEvent), func(), error) {
	var write func(fleet.AuditEvent)
	closeFn := func() {}
	switch path {
	case "":
		write = func(fleet.AuditEvent) {}
	case "-":
		write = func(e fleet.AuditEvent) {
			attrs := []any{"audit", true, "actor", e.Actor, "action", e.Action}
			for _, kv := range [][2]string{{"source", e.Source}, {"detail", e.Detail},
				{"error", e.Error}} {
				if kv[1] != "" {
					attrs = append(attrs, kv[0], kv[1])
				}
			}
			log.Info("audit", attrs...)
		}
	default:
		f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o640)
		if err != nil {
			return nil, nil, fmt.Errorf("--audit-log: %w", err)
		}
		var mu sync.Mutex
		enc := json.NewEncoder(f)
		enc.SetEscapeHTML(false) // a cordon of <2.0.0 reads <2.0.0, not \u003c2.0.0
		write = func(e fleet.AuditEvent) {
			mu.Lock()
			enc.Encode(e)
			mu.Unlock()
		}
		closeFn = func() { f.Close() }
	}
	tracer := tp.Tracer("github.com/leasehold/leasehold/audit")
	return func(e fleet.AuditEvent) {
		write(e)
		_, span := tracer.Start(context.Background(), "leasehold.audit")
		span.AddEvent(e.Action, trace.WithAttributes(
			attribute.String("leasehold.audit.actor", e.Actor),
			attribute.String("leasehold.audit.source", e.Source),
			attribute.String("leasehold.audit.error", e.Error)))
		span.End()
	}, closeFn, nil
}
