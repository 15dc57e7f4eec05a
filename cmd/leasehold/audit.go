package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

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
	enc.SetEscapeHTML(false) // a cordon of <2.0.0 reads <2.0.0, not \u003c2.0.0
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
