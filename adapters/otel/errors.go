package otel

import (
	"log/slog"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
)

// errorRepeat is how long the same OpenTelemetry error is not logged again:
// a failing exporter fails at every batch (every few seconds), and one line
// a minute says as much as twelve.
const errorRepeat = time.Minute

// errorLog is OpenTelemetry's error handler: its errors (an export that
// failed, mostly) become log records of leasehold's logger instead of bare
// lines from the standard library's log package on stderr.
type errorLog struct {
	log *slog.Logger
	now func() time.Time

	mu       sync.Mutex
	last     map[string]time.Time // message → when it was last logged
	repeated map[string]int       // message → times it came since
}

// setErrorHandler routes OpenTelemetry's errors to log. The handler is
// global to the process (otel.SetErrorHandler), as OpenTelemetry's is.
func setErrorHandler(log *slog.Logger) *errorLog {
	h := &errorLog{log: log, now: time.Now, last: map[string]time.Time{},
		repeated: map[string]int{}}
	otel.SetErrorHandler(otel.ErrorHandlerFunc(h.handle))
	return h
}

func (h *errorLog) handle(err error) {
	if err == nil {
		return
	}
	msg := err.Error()
	h.mu.Lock()
	now := h.now()
	if at, ok := h.last[msg]; ok && now.Sub(at) < errorRepeat {
		h.repeated[msg]++
		h.mu.Unlock()
		return
	}
	if len(h.last) > 64 { // errors are few; never grow with odd ones
		clear(h.last)
		clear(h.repeated)
	}
	h.last[msg] = now
	repeated := h.repeated[msg]
	delete(h.repeated, msg)
	h.mu.Unlock()
	args := []any{"err", msg}
	if repeated > 0 {
		args = append(args, "repeated", repeated)
	}
	if hint := exportHint(msg); hint != "" {
		args = append(args, "hint", hint)
	}
	h.log.Warn("OpenTelemetry error", args...)
}

// exportHint explains the errors of an exporter speaking the wrong protocol
// to its endpoint, which say nothing a person understands on their own.
func exportHint(msg string) string {
	switch {
	case strings.Contains(msg, "malformed HTTP response"),
		strings.Contains(msg, "readLoopPeekFailLocked"):
		// An HTTP/1.1 client (OTLP/HTTP) reading the HTTP/2 frames a gRPC
		// server answers with: "\x00\x00\x06\x04…" is a SETTINGS frame. A
		// server that sends it before the request is written makes net/http
		// fail with readLoopPeekFailLocked instead (it saw bytes on an idle
		// connection).
		return "the endpoint speaks gRPC (HTTP/2), not OTLP/HTTP: set " +
			"OTEL_EXPORTER_OTLP_PROTOCOL=grpc, or point OTEL_EXPORTER_OTLP_ENDPOINT at the " +
			"collector's OTLP/HTTP port (4318 by convention)"
	case strings.Contains(msg, "error reading server preface"),
		strings.Contains(msg, "http2: frame too large"):
		// A gRPC client reading an HTTP/1.1 answer.
		return "the endpoint speaks OTLP/HTTP, not gRPC: set " +
			"OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf, or point OTEL_EXPORTER_OTLP_ENDPOINT at " +
			"the collector's OTLP/gRPC port (4317 by convention)"
	}
	return ""
}
