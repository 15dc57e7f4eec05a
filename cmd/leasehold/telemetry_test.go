package main

import (
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// otlpReceiver is an in-process OTLP trace collector (the official protos).
type otlpReceiver struct {
	coltrace.UnimplementedTraceServiceServer
	mu    sync.Mutex
	spans []*tracepb.Span
	more  chan struct{}
}

func (r *otlpReceiver) Export(
	_ context.Context, req *coltrace.ExportTraceServiceRequest,
) (*coltrace.ExportTraceServiceResponse, error) {
	r.mu.Lock()
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			r.spans = append(r.spans, ss.GetSpans()...)
		}
	}
	r.mu.Unlock()
	select {
	case r.more <- struct{}{}:
	default:
	}
	return &coltrace.ExportTraceServiceResponse{}, nil
}

func startOTLPReceiver(t *testing.T) (*otlpReceiver, string) {
	r := &otlpReceiver{more: make(chan struct{}, 1)}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	coltrace.RegisterTraceServiceServer(g, r)
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	return r, lis.Addr().String()
}

// await waits for spans matching cond.
func (r *otlpReceiver) await(
	t *testing.T, what string, cond func([]*tracepb.Span) bool,
) []*tracepb.Span {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		r.mu.Lock()
		spans := append([]*tracepb.Span(nil), r.spans...)
		r.mu.Unlock()
		if cond(spans) {
			return spans
		}
		select {
		case <-r.more:
		case <-deadline:
			names := map[string]int{}
			for _, s := range spans {
				names[s.Name]++
			}
			t.Fatalf("spans: %s not received; got %v", what, names)
		}
	}
}

func id(b []byte) string { return hex.EncodeToString(b) }

// scrape parses /metrics with the Prometheus text parser.
func scrape(t *testing.T, admin string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get("http://" + admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	return families
}

func sum(f *dto.MetricFamily) float64 {
	var total float64
	for _, m := range f.GetMetric() {
		switch {
		case m.Counter != nil:
			total += m.Counter.GetValue()
		case m.Gauge != nil:
			total += m.Gauge.GetValue()
		case m.Histogram != nil:
			total += float64(m.Histogram.GetSampleCount())
		}
	}
	return total
}

func TestTelemetryOfALapse(t *testing.T) {
	recv, addr := startOTLPReceiver(t)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+addr)
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
	t.Setenv("OTEL_SERVICE_NAME", "leasehold-test")

	a := consultest.Start(t)
	a.SettleSync()
	e1 := startExecutor(t, a, "e1", "1.0.0")
	e2 := startExecutor(t, a, "e2", "1.0.0")
	var serveLog syncBuffer
	addrs := startServeTo(t, a, io.MultiWriter(testWriter{t, "serve"}, &serveLog))
	eds := openEDS(t, addrs.xds) // a dispatcher that ACKs
	if got, want := eds(), endpointSet(e1.endpoint(), e2.endpoint()); !got.equal(want) {
		t.Fatalf("endpoints %v, want %v", got, want)
	}
	// The gauges come from the decided view, published just after the
	// cache update the dispatcher saw: scrape until they are there.
	names := []string{
		"leasehold_executors", "leasehold_capacity",
		"leasehold_constraint_sets", "leasehold_dispatchers",
		"leasehold_consul_requests_total", "leasehold_consul_wakeups_total",
		"leasehold_consul_contact_age_seconds",
		"leasehold_snapshot_build_duration_seconds",
	}
	before := scrape(t, addrs.admin)
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); before = scrape(t,
		addrs.admin) {
		missing := false
		for _, name := range names {
			missing = missing || before[name] == nil
		}
		if !missing {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, name := range names {
		if before[name] == nil {
			t.Errorf("metric %s missing", name)
		}
	}

	e1.silent.Store(true) // the lapse
	if got, want := eds(), endpointSet(e2.endpoint()); !got.equal(want) {
		t.Fatalf("after the lapse: %v, want %v", got, want)
	}
	// the removal's trace: change → eligibility, build, cache update → push ending at ACK
	spans := recv.await(t, "lapse → push → ACK", func(spans []*tracepb.Span) bool {
		for _, root := range spans {
			if root.Name != "leasehold.consul_change" || !hasEvent(root, "lease lapsed") {
				continue
			}
			var update *tracepb.Span
			for _, s := range spans {
				if s.Name == "leasehold.cache_update" && id(s.ParentSpanId) == id(root.SpanId) {
					update = s
				}
			}
			if update == nil {
				continue
			}
			for _, s := range spans {
				if s.Name == "leasehold.xds_push" &&
					id(s.ParentSpanId) == id(update.SpanId) && hasEvent(s, "ACK") {
					return true
				}
			}
		}
		return false
	})
	var root *tracepb.Span
	for _, s := range spans {
		if s.Name == "leasehold.consul_change" && hasEvent(s, "lease lapsed") {
			root = s
		}
	}
	children := map[string]bool{}
	for _, s := range spans {
		if id(s.TraceId) == id(root.TraceId) && id(s.ParentSpanId) == id(root.SpanId) {
			children[s.Name] = true
		}
	}
	for _, want := range []string{"leasehold.eligibility",
		"leasehold.snapshot_build", "leasehold.cache_update"} {
		if !children[want] {
			t.Errorf("root span lacks child %s (children %v)", want, children)
		}
	}
	ev := root.Events[0]
	for _, e := range root.Events {
		if e.Name == "lease lapsed" {
			ev = e
		}
	}
	attrs := map[string]string{}
	for _, kv := range ev.Attributes {
		attrs[kv.Key] = kv.Value.GetStringValue()
	}
	if attrs["leasehold.instance_id"] != "e1" || attrs["leasehold.session_id"] == "" {
		t.Errorf("lapse event attributes %v", attrs)
	}

	// metrics moved
	after := scrape(t, addrs.admin)
	if sum(after["leasehold_lease_lapses_total"]) < 1 {
		t.Errorf("lapses counter did not move: %v", after["leasehold_lease_lapses_total"])
	}
	deadline := time.Now().Add(10 * time.Second)
	for sum(after["leasehold_lapse_to_push_duration_seconds"]) < 1 ||
		sum(after["leasehold_xds_push_duration_seconds"]) < 1 {
		if time.Now().After(deadline) {
			t.Fatalf("lapse-to-push or push-duration histogram empty")
		}
		<-time.After(50 * time.Millisecond) // /metrics has no watch API
		after = scrape(t, addrs.admin)
	}
	for _, f := range after {
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if n := l.GetName(); n == "instance_id" || n == "session_id" || n == "node_id" {
					t.Errorf("%s has an unbounded label %s", f.GetName(), n)
				}
			}
		}
	}
	if !strings.Contains(after["leasehold_executors"].String(), "lapsed") {
		t.Errorf("executors gauge does not show the lapsed one: %v", after["leasehold_executors"])
	}
	buildInfoIsTold(t, after["leasehold_build_info"], serveLog.String(), a.HTTPAddr())

	// a dispatcher's trace continues into the fencing API
	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	ctx := metadata.AppendToOutgoingContext(context.Background(),
		"traceparent", "00-"+traceID+"-00f067aa0ba902b7-01")
	if _, err := fencingClient(t, addrs.xds).CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: "e2", SessionId: "x"}); err != nil {
		t.Fatal(err)
	}
	recv.await(t, "fencing span in the dispatcher's trace", func(spans []*tracepb.Span) bool {
		for _, s := range spans {
			if id(s.TraceId) == traceID && strings.Contains(s.Name, "CheckSession") {
				return true
			}
		}
		return false
	})
}

func hasEvent(s *tracepb.Span, name string) bool {
	for _, e := range s.Events {
		if e.Name == name {
			return true
		}
	}
	return false
}

// documentedMetrics are the families of docs/metrics.md's table, a row's
// `_suffix` shorthand spelled out, split into serve's and the sidecar's
// (leasehold_executor_*).
func documentedMetrics(t *testing.T) (serve, sidecar []string) {
	t.Helper()
	doc, err := os.ReadFile("../../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	name := regexp.MustCompile("`(leasehold_[a-z_]+|_[a-z_]+)`")
	for _, line := range strings.Split(string(doc), "\n") {
		if !strings.HasPrefix(line, "| `leasehold_") {
			continue
		}
		first := strings.SplitN(line, "|", 3)[1]
		base := ""
		for _, m := range name.FindAllStringSubmatch(first, -1) {
			n := m[1]
			if strings.HasPrefix(n, "_") { // `_errors_total` after `leasehold_consul_requests_total`
				n = strings.TrimSuffix(strings.TrimSuffix(base, "_total"), "_requests") + n
			} else {
				base = n
			}
			if strings.HasPrefix(n, "leasehold_executor_") {
				sidecar = append(sidecar, n)
			} else {
				serve = append(serve, n)
			}
		}
	}
	if len(serve) < 20 || len(sidecar) < 4 {
		t.Fatalf("docs/metrics.md: read %d serve and %d sidecar families", len(serve), len(sidecar))
	}
	return serve, sidecar
}

// Every family docs/metrics.md lists is on serve's /metrics before any
// event (no lapse, NACK, rule, cordon, refusal or failed write yet), with its
// known label values at 0: an alert on one answers 0, not "no data".
func TestEveryDocumentedFamilyIsExportedFromTheStart(t *testing.T) {
	families, _ := documentedMetrics(t)
	a := consultest.Start(t)
	a.SettleSync()
	startExecutor(t, a, "e1", "1.0.0")
	addrs := startServe(t, a)
	var got map[string]*dto.MetricFamily
	for deadline := time.Now().Add(10 * time.Second); ; {
		got = scrape(t, addrs.admin)
		if got["leasehold_executors"] != nil || time.Now().After(deadline) {
			break // the first view is decided
		}
		<-time.After(50 * time.Millisecond) // /metrics has no watch API
	}
	for _, name := range families {
		if got[name] == nil {
			t.Errorf("%s is not exported before its first event", name)
		}
	}
	documented := map[string]bool{}
	for _, name := range families {
		documented[name] = true
	}
	for name := range got {
		if strings.HasPrefix(name, "leasehold_") && !documented[name] {
			t.Errorf("%s is exported but not in docs/metrics.md", name)
		}
	}
	lapses := got["leasehold_lease_lapses_total"].String()
	if !strings.Contains(lapses, `value:"work"`) {
		t.Errorf("lapses of the known task work are not at 0: %s", lapses)
	}
	rules := got["leasehold_rules_would_exclude_total"].String()
	if !strings.Contains(rules, `value:"version"`) || strings.Contains(rules, "incompatible") {
		t.Errorf("rule labels are not the rules' names (version, labels, …): %s", rules)
	}
}

// buildInfoIsTold checks that a running serve says which build it is: the
// leasehold_build_info gauge (1, labelled with the version, revision and Go
// version `leasehold version` prints) and its start line, which also names
// the Consul agent it reads, and whether it was built without grpcnotrace.
func buildInfoIsTold(t *testing.T, f *dto.MetricFamily, serveLog, consulAddr string) {
	t.Helper()
	b := readBuild()
	want := map[string]string{"version": b.Version, "revision": b.Revision,
		"go_version": b.GoVersion}
	if f == nil || len(f.GetMetric()) != 1 || f.GetMetric()[0].GetGauge().GetValue() != 1 {
		t.Errorf("leasehold_build_info: %v", f)
	} else {
		for _, l := range f.GetMetric()[0].GetLabel() {
			if v, ok := want[l.GetName()]; ok && v != l.GetValue() {
				t.Errorf("leasehold_build_info{%s=%q}, want %q", l.GetName(), l.GetValue(), v)
			}
			delete(want, l.GetName())
		}
		if len(want) > 0 {
			t.Errorf("leasehold_build_info lacks %v: %v", want, f)
		}
	}
	var start string
	for _, l := range strings.Split(serveLog, "\n") {
		if strings.Contains(l, `msg="leasehold serving"`) {
			start = l
		}
	}
	for _, kv := range []string{"version=" + b.Version, "revision=" + b.Revision,
		fmt.Sprintf("consul=%s ", consulAddr)} {
		if !strings.Contains(start, kv) {
			t.Errorf("start line lacks %s: %q", kv, start)
		}
	}
	// A binary built without -tags grpcnotrace (as this test's is, unless
	// go test was given the tag) says so; one built with it does not.
	if said := strings.Contains(serveLog, "built without -tags grpcnotrace"); said != grpcTraceLinked {
		t.Errorf("serve said it was built without grpcnotrace: %v; the build links gRPC's "+
			"tracing: %v", said, grpcTraceLinked)
	}
}
