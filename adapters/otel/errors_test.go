package otel

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
)

// syncBuffer is a log sink safe for the exporter's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// An OTLP/HTTP export to a gRPC endpoint (Jaeger's 4317) is a log record of
// leasehold's logger that says what to change, not a bare line on stderr.
func TestOTLPHTTPToAGRPCEndpointSaysSo(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer() // speaks HTTP/2 only, as an OTLP/gRPC collector does
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+lis.Addr().String())
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "")
	t.Setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2000")
	var logs syncBuffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	tel, err := Setup(context.Background(), Config{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	_, span := tel.Tracer.Tracer("test").Start(context.Background(), "a span")
	span.End()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	tel.Shutdown(ctx) // exports what is pending, and fails
	deadline := time.After(10 * time.Second)
	for !strings.Contains(logs.String(), "OpenTelemetry error") {
		select {
		case <-deadline:
			t.Fatalf("no log record of the failed export; logs:\n%s", logs.String())
		case <-time.After(20 * time.Millisecond): // the exporter has no event to wait on
		}
	}
	out := logs.String()
	for _, want := range []string{"level=WARN", "OTEL_EXPORTER_OTLP_PROTOCOL=grpc", "4318"} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %q:\n%s", want, out)
		}
	}
}

// The same error, repeated at every batch, is logged once a minute with the
// count of repeats.
func TestOTelErrorsRepeatedAreLoggedOnceAMinute(t *testing.T) {
	var logs syncBuffer
	now := time.Unix(1000, 0)
	h := &errorLog{log: slog.New(slog.NewTextHandler(&logs, nil)),
		now:  func() time.Time { return now },
		last: map[string]time.Time{}, repeated: map[string]int{}}
	boom := errors.New("traces export: connection refused")
	h.handle(boom)
	h.handle(boom)
	now = now.Add(30 * time.Second)
	h.handle(boom)
	if n := strings.Count(logs.String(), "connection refused"); n != 1 {
		t.Fatalf("logged %d times within a minute:\n%s", n, logs.String())
	}
	now = now.Add(31 * time.Second)
	h.handle(boom)
	out := logs.String()
	n := strings.Count(out, "connection refused")
	if n != 2 || !strings.Contains(out, "repeated=2") {
		t.Fatalf("after a minute: want a second line with repeated=2:\n%s", out)
	}
	h.handle(errors.New("another"))
	if !strings.Contains(logs.String(), "another") {
		t.Fatalf("a different error was not logged:\n%s", logs.String())
	}
}

func TestExportHintNamesTheOtherProtocol(t *testing.T) {
	for _, tc := range []struct{ err, want string }{
		{`traces export: Post "http://127.0.0.1:4317/v1/traces": net/http: HTTP/1.x transport ` +
			`connection broken: malformed HTTP response "\x00\x00\x06\x04"`,
			"OTEL_EXPORTER_OTLP_PROTOCOL=grpc"},
		{`traces export: rpc error: code = Unavailable desc = connection error: desc = "error ` +
			`reading server preface: http2: frame too large"`,
			"OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"},
		// The gRPC server's SETTINGS frame arrived before the request was
		// written (seen in make test, 1 run in several).
		{`traces export: Post "http://127.0.0.1:46447/v1/traces": readLoopPeekFailLocked: ` +
			`%!w(<nil>)`, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc"},
		{"traces export: connection refused", ""},
	} {
		if got := exportHint(tc.err); (tc.want == "") != (got == "") ||
			!strings.Contains(got, tc.want) {
			t.Errorf("exportHint(%q) = %q, want it to say %q", tc.err, got, tc.want)
		}
	}
}
