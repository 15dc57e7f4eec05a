package server

import (
	"context"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/leasehold/leasehold/snapshot/fleet"
)

// lapseWait is how long a lapse waits for every affected stream's ACK before
// it is dropped from the lapse-to-push histogram (counted as expired).
const lapseWait = time.Minute

type xdsTelemetry struct {
	tracer      trace.Tracer
	pushTime    metric.Float64Histogram
	nacks       metric.Int64Counter
	lapseToPush metric.Float64Histogram
	lapseLost   metric.Int64Counter
	denied      metric.Int64Counter
	latest      map[string]context.Context          // group → context of its latest cache update
	typeAttrs   map[string]metric.MeasurementOption // guarded by x.mu
	lapses      []*pendingLapse
	nacksSeen   map[string]bool // type URL and version of each NACK logged, guarded by x.mu
	nackOrder   []string        // nacksSeen's keys, oldest first
}

// nacksRemembered bounds the versions whose NACK was logged.
const nacksRemembered = 256

// pendingLapse waits for every stream that must drop a lapsed executor to
// ACK endpoints sent after the publication that dropped it.
type pendingLapse struct {
	at, published time.Time
	waiting       map[int64]bool // by streamKey
}

var latencyBuckets = metric.WithExplicitBucketBoundaries(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
	0.1, 0.25, 0.5, 1, 2.5, 5, 10)

func (x *XDS) initTelemetry(o XDSOptions) {
	if o.Tracer == nil {
		o.Tracer = tracenoop.NewTracerProvider()
	}
	if o.Meter == nil {
		o.Meter = metricnoop.NewMeterProvider()
	}
	x.tracer = o.Tracer.Tracer("github.com/leasehold/leasehold/server")
	x.latest = map[string]context.Context{}
	x.typeAttrs = map[string]metric.MeasurementOption{}
	m := o.Meter.Meter("github.com/leasehold/leasehold/server")
	x.pushTime, _ = m.Float64Histogram("leasehold.xds.push.duration", metric.WithUnit("s"),
		latencyBuckets, metric.WithDescription(
			"from a response sent to a dispatcher until its ACK or NACK, by type URL"))
	x.nacks, _ = m.Int64Counter("leasehold.xds.nacks",
		metric.WithDescription("responses rejected by dispatchers, by type URL and reason "+
			"(duplicate, address, weight, validation, decode, unspecified, other)"))
	x.lapseToPush, _ = m.Float64Histogram("leasehold.lapse_to_push.duration", metric.WithUnit("s"),
		latencyBuckets, metric.WithDescription("from Consul reporting a lease lapse "+
			"until the last affected dispatcher ACKed endpoints without it"))
	x.denied, _ = m.Int64Counter("leasehold.authz.denied", metric.WithDescription(
		"requests refused by the authorization policy, by API (xds, fencing)"))
	x.lapseLost, _ = m.Int64Counter("leasehold.lapse_to_push.expired",
		metric.WithDescription("lapses whose removal was not ACKed by every affected dispatcher "+
			"within a minute"))
	x.zeroSeries()
	m.Int64ObservableGauge("leasehold.dispatchers",
		metric.WithDescription("open xDS streams of dispatchers, by mode (sotw, delta)"),
		metric.WithInt64Callback(func(_ context.Context, obs metric.Int64Observer) error {
			for mode, n := range x.streamsByMode() {
				obs.Observe(n, metric.WithAttributes(attribute.String("mode", mode)))
			}
			return nil
		}))
}

// servedTypes are the type URLs leasehold serves, the known values of the
// type_url label.
var servedTypes = []string{resource.ListenerType, resource.RouteType, resource.ClusterType,
	resource.EndpointType}

// NackReasons are the values NackReason returns, the known values of the
// reason label.
var NackReasons = []string{"duplicate", "address", "weight", "validation", "decode",
	"unspecified", "other"}

// zeroer is what the histograms of leasehold's telemetry (adapters/otel)
// implement: a series shown empty before its first measurement. An
// interface of its own, because server imports no adapter.
type zeroer interface {
	Zero(attrs ...attribute.KeyValue)
}

func zero(h metric.Float64Histogram, attrs ...attribute.KeyValue) {
	if z, ok := h.(zeroer); ok {
		z.Zero(attrs...)
	}
}

// zeroSeries exports every series with known labels at 0 from the start, so
// that an alert on NACKs or slow pushes answers 0 rather than "no data"
// until the first event.
func (x *XDS) zeroSeries() {
	ctx := context.Background()
	for _, u := range servedTypes {
		zero(x.pushTime, attribute.String("type_url", u))
		for _, r := range NackReasons {
			x.nacks.Add(ctx, 0, metric.WithAttributes(attribute.String("type_url", u),
				attribute.String("reason", r)))
		}
	}
	zero(x.lapseToPush)
	x.lapseLost.Add(ctx, 0)
	for _, api := range []string{"xds", "fencing"} {
		x.denied.Add(ctx, 0, metric.WithAttributes(attribute.String("api", api)))
	}
}

// onPublish runs on the syncer's goroutine after a snapshot is set.
func (x *XDS) onPublish(p fleet.Publication) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.latest[p.Group] = p.Ctx
	if p.LapsedAt.IsZero() {
		return
	}
	removed := map[string]bool{} // load assignments that changed with a removal
	for _, n := range p.RemovedLoads {
		removed[n] = true
	}
	pl := &pendingLapse{at: p.LapsedAt, published: time.Now(), waiting: map[int64]bool{}}
	set := x.followers[p.Group]
	for id := range set[""] { // wildcards
		pl.waiting[id] = true
	}
	for name := range removed {
		for id := range set[name] {
			pl.waiting[id] = true
		}
	}
	if len(pl.waiting) > 0 {
		x.lapses = append(x.lapses, pl)
	}
}

// startPush opens the span of one response; x.mu is held.
func (x *XDS) startPush(info *StreamInfo, t *TypeInfo, typeURL, version string) {
	if t.push != nil { // superseded before it was answered
		t.push.End()
		t.push = nil
	}
	parent := x.latest[info.Group]
	if parent == nil || !trace.SpanContextFromContext(parent).IsValid() {
		return // only pushes that belong to a traced change get a span
	}
	_, t.push = x.tracer.Start(parent, "leasehold.xds_push", trace.WithAttributes(
		attribute.String("xds.node_id", info.NodeID), attribute.String("xds.type_url", typeURL),
		attribute.String("xds.version", version), attribute.String("xds.mode", info.Mode),
	))
}

// answered records an ACK or NACK of the latest response; x.mu is held.
func (x *XDS) answered(
	t *TypeInfo, typeURL string, now time.Time, nack bool, reason, detail string,
) {
	// One attribute set per type URL is built once, because building it per
	// ACK took ~10% of the server's CPU with 10,000 streams (as a profile
	// showed), under x.mu.
	attrs, ok := x.typeAttrs[typeURL]
	if !ok {
		attrs = metric.WithAttributeSet(attribute.NewSet(attribute.String("type_url", typeURL)))
		if len(x.typeAttrs) < 64 { // type URLs are few; never grow with bad input
			x.typeAttrs[typeURL] = attrs
		}
	}
	x.pushTime.Record(context.Background(), now.Sub(t.SentAt).Seconds(), attrs)
	if nack { // NACKs are rare, so their attribute set is built each time
		x.nacks.Add(context.Background(), 1,
			metric.WithAttributes(attribute.String("type_url", typeURL),
				attribute.String("reason", reason)))
	}
	if t.push != nil {
		if nack {
			t.push.SetStatus(codes.Error, detail)
			t.push.AddEvent("NACK",
				trace.WithAttributes(attribute.String("xds.error_detail", detail)))
		} else {
			t.push.AddEvent("ACK")
		}
		t.push.End()
		t.push = nil
	}
}

// firstNack reports whether no NACK of this version of typeURL was logged
// yet (among the last nacksRemembered); x.mu is held.
func (x *XDS) firstNack(typeURL, version string) bool {
	key := typeURL + "\x00" + version
	if x.nacksSeen[key] {
		return false
	}
	if x.nacksSeen == nil {
		x.nacksSeen = map[string]bool{}
	}
	if len(x.nackOrder) >= nacksRemembered {
		delete(x.nacksSeen, x.nackOrder[0])
		x.nackOrder = x.nackOrder[1:]
	}
	x.nacksSeen[key] = true
	x.nackOrder = append(x.nackOrder, key)
	return true
}

// endpointsAcked settles pending lapses for a stream that ACKed endpoints
// sent after their publication; x.mu is held.
func (x *XDS) endpointsAcked(stream int64, t *TypeInfo, now time.Time) {
	kept := x.lapses[:0]
	for _, pl := range x.lapses {
		if pl.waiting[stream] && t.SentAt.After(pl.published) {
			delete(pl.waiting, stream)
		}
		switch {
		case len(pl.waiting) == 0:
			x.lapseToPush.Record(context.Background(), now.Sub(pl.at).Seconds())
		case now.Sub(pl.published) > lapseWait:
			x.lapseLost.Add(context.Background(), 1)
		default:
			kept = append(kept, pl)
		}
	}
	x.lapses = kept
}

// streamGone drops a closed stream from pending lapses; x.mu is held.
func (x *XDS) streamGone(info *StreamInfo) {
	for _, t := range info.Types {
		if t.push != nil {
			t.push.SetStatus(codes.Error, "stream closed before ACK")
			t.push.End()
		}
	}
	now := time.Now()
	kept := x.lapses[:0]
	for _, pl := range x.lapses {
		delete(pl.waiting, info.key)
		if len(pl.waiting) == 0 {
			x.lapseToPush.Record(context.Background(), now.Sub(pl.at).Seconds())
			continue
		}
		kept = append(kept, pl)
	}
	x.lapses = kept
}
