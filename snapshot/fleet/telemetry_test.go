package fleet

import (
	"context"
	"io"
	"log/slog"
	"maps"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// leasehold.capacity counts the load of executors whose lease check output
// carried one in in_use, and the capacity of those whose did not in
// load_unreported, never as a load of 0; lapsed executors count in none.
func TestCapacityCountsAnUnreportedLoadApart(t *testing.T) {
	join := func(inst, output string, lease health.CheckStatus) health.Executor {
		m := fleettest.Member("work", inst, "s1", 1, 9000+len(inst), "1.0.0", lease, 3)
		for i := range m.Checks {
			if m.Checks[i].ServiceID != "" {
				m.Checks[i].Output = output
			}
		}
		return health.Join(m, health.NewNonPassingSet(health.NonPassing{}))
	}
	got := capacityByTask([]health.Executor{
		join("busy", "load=3", health.StatusPassing),
		join("new", "", health.StatusPassing),
		join("lapsed", "TTL expired", health.StatusCritical),
	})
	want := map[string]taskCapacity{"work": {total: 8, inUse: 3, unreported: 4}}
	if len(got) != 1 || got["work"] != want["work"] {
		t.Fatalf("capacity %+v, want %+v", got, want)
	}
	if got := capacityByTask([]health.Executor{
		join("lapsed", "load=2", health.StatusCritical)}); got["work"] != (taskCapacity{}) {
		t.Fatalf("only lapsed executors: %+v, want the series at 0", got)
	}
}

// rulesInfo is every series of leasehold.rules.info: version → value.
func rulesInfo(t *testing.T, r *sdkmetric.ManualReader) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "leasehold.rules.info" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Gauge[int64]).DataPoints {
				v, _ := dp.Attributes.Value("version")
				out[v.AsString()] = dp.Value
			}
		}
	}
	return out
}

// leasehold.rules.info has one series, the content version of the rules in
// force (the defaults' before any): a new document replaces the series, a
// refused one leaves it; the consul_change span of the batch a rules change
// caused carries the version and a "rules applied" event.
func TestRulesInfoIsTheVersionInForce(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	spans := endedSpans{tracetest.NewSpanRecorder(), make(chan struct{}, 1)}
	h := startSyncerWith(t, SyncConfig{
		Meter:  sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
		Tracer: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	defaults := (*health.Rollout)(nil).ContentVersion()
	if got := rulesInfo(t, reader); len(got) != 1 || got[defaults] != 1 {
		t.Fatalf("before any rules: %v, want {%s: 1}", got, defaults)
	}
	readWorkAndBatch(h, t)
	const doc = `{"dispatch":{"default":{"deadline":"20s"}}}`
	r, err := health.ParseRollout([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	want := r.ContentVersion()
	h.obs <- health.Observation{Data: &health.RulesSource{Source: "consul-kv:x", Raw: []byte(doc)}}
	h.advanceWindow()
	h.publish()
	if got := rulesInfo(t, reader); len(got) != 1 || got[want] != 1 {
		t.Fatalf("after the rules: %v, want only {%s: 1}", got, want)
	}
	if v := h.s.View().Control.RulesVersion; v != want {
		t.Fatalf("view: rules version %s, want %s", v, want)
	}
	var change sdktrace.ReadOnlySpan
	for _, s := range spans.Ended() {
		if s.Name() == "leasehold.consul_change" {
			change = s
		}
	}
	if change == nil {
		t.Fatal("no consul_change span")
	}
	attr := func(kvs []attribute.KeyValue, key string) string {
		for _, kv := range kvs {
			if string(kv.Key) == key {
				return kv.Value.AsString()
			}
		}
		return ""
	}
	if got := attr(change.Attributes(), "leasehold.rules.version"); got != want {
		t.Errorf("the change's span: rules version %q, want %s", got, want)
	}
	applied := false
	for _, e := range change.Events() {
		if e.Name == "rules applied" && attr(e.Attributes, "leasehold.rules.version") == want &&
			attr(e.Attributes, "leasehold.rules.source") == "consul-kv:x" {
			applied = true
		}
	}
	if !applied {
		t.Errorf("the change's span has no rules applied event: %v", change.Events())
	}

	h.obs <- health.Observation{Data: &health.RulesSource{Source: "consul-kv:x",
		Raw: []byte(`{"dispatch":{"default":{"deadline":"-1s"}}}`)}}
	awaitRolloutError(h, "")
	if got := rulesInfo(t, reader); len(got) != 1 || got[want] != 1 {
		t.Fatalf("after refused rules: %v, want only {%s: 1}", got, want)
	}
	h.obs <- health.Observation{Data: &health.RulesSource{Source: "consul-kv:x", Raw: nil}}
	h.advanceWindow()
	h.publish()
	if got := rulesInfo(t, reader); len(got) != 1 || got[defaults] != 1 {
		t.Fatalf("rules removed: %v, want only {%s: 1}", got, defaults)
	}
}

// The executors and capacity gauges' values are a view's: counted per task
// type and verdict once per view (a second collection of the same view
// counts nothing again), and the next view counts its own.
func TestGaugesAreAViewsCountedOnce(t *testing.T) {
	h := startSyncer(t)
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work", "other")
	h.nonPassing()
	a := fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 4)
	b := fleettest.Member("work", "b", "s1", 1, 9002, "1.0.0", health.StatusWarning, 5)
	c := fleettest.Member("other", "c", "s1", 1, 9003, "1.0.0", health.StatusPassing, 6)
	h.members("work", a, b)
	h.members("other", c)
	lease := leaseCheckOf(b)
	lease.Status = health.StatusWarning
	h.nonPassing(lease)
	v := h.settle()
	g := v.gauges()
	want := map[executorsKey]int64{{"work", "active", "eligible"}: 1,
		{"work", "active", string(health.ReasonFull)}: 1, {"other", "active", "eligible"}: 1}
	if !maps.Equal(g.executors, want) {
		t.Fatalf("executors %v, want %v", g.executors, want)
	}
	if g.capacity["work"].total == 0 || g.capacity["other"].total == 0 {
		t.Fatalf("capacity %+v", g.capacity)
	}
	if v.gauges() != g {
		t.Fatal("the same view counted again")
	}
	h.members("other")
	next := h.settle()
	if n := next.gauges().executors[executorsKey{"other", "active", "eligible"}]; n != 0 {
		t.Fatalf("the next view still counts c: %d", n)
	}
}
