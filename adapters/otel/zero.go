package otel

import (
	"slices"
	"sort"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/protobuf/proto"
)

// Empty histograms. A counter is exported from the start by adding 0 to each
// of its known label sets, a gauge by observing it; but OpenTelemetry exports
// no histogram series before its first measurement, and recording a fake one
// would count an event that never happened. So the histograms of the meters
// Telemetry hands out can be shown empty: a component that holds one calls
// its Zero method with each known label set,
//
//	type zeroer interface{ Zero(attrs ...attribute.KeyValue) }
//	if z, ok := h.(zeroer); ok { z.Zero(attribute.String("type_url", u)) }
//
// (an interface of its own: it imports nothing of this package), and /metrics
// then shows that series with every bucket at 0 until OpenTelemetry exports
// it. Over OTLP a histogram still starts at its first measurement.

// Zeroer is what the histograms of Telemetry.Meter implement.
type Zeroer interface {
	// Zero shows the series of attrs (none: the series without labels) at 0
	// on /metrics until it is first recorded.
	Zero(attrs ...attribute.KeyValue)
}

// zeros are the empty histogram series /metrics shows until they are
// recorded.
type zeros struct {
	mu   sync.Mutex
	fams map[string]*zeroFamily // by Prometheus name
}

type zeroFamily struct {
	help   string
	bounds []float64
	sets   [][]*dto.LabelPair // each sorted by name
}

type zeroMeterProvider struct {
	metric.MeterProvider
	z *zeros
}

func (p zeroMeterProvider) Meter(name string, opts ...metric.MeterOption) metric.Meter {
	return zeroMeter{Meter: p.MeterProvider.Meter(name, opts...), z: p.z}
}

type zeroMeter struct {
	metric.Meter
	z *zeros
}

// defaultBounds are the OpenTelemetry SDK's buckets of a histogram that
// names none.
var defaultBounds = []float64{0, 5, 10, 25, 50, 75, 100, 250, 500, 750, 1000, 2500, 5000, 7500,
	10000}

func (m zeroMeter) Float64Histogram(
	name string, opts ...metric.Float64HistogramOption,
) (metric.Float64Histogram, error) {
	h, err := m.Meter.Float64Histogram(name, opts...)
	if err != nil {
		return h, err
	}
	cfg := metric.NewFloat64HistogramConfig(opts...)
	bounds := cfg.ExplicitBucketBoundaries()
	if bounds == nil {
		bounds = defaultBounds
	}
	return zeroHistogram{Float64Histogram: h, z: m.z, name: promName(name, cfg.Unit()),
		help: cfg.Description(), bounds: slices.Clone(bounds)}, nil
}

type zeroHistogram struct {
	metric.Float64Histogram
	z          *zeros
	name, help string
	bounds     []float64
}

func (h zeroHistogram) Zero(attrs ...attribute.KeyValue) {
	set := make([]*dto.LabelPair, 0, len(attrs))
	for _, kv := range attrs {
		set = append(set, &dto.LabelPair{Name: proto.String(string(kv.Key)),
			Value: proto.String(kv.Value.String())})
	}
	sort.Slice(set, func(i, j int) bool { return set[i].GetName() < set[j].GetName() })
	h.z.mu.Lock()
	defer h.z.mu.Unlock()
	if h.z.fams == nil {
		h.z.fams = map[string]*zeroFamily{}
	}
	f := h.z.fams[h.name]
	if f == nil {
		f = &zeroFamily{help: h.help, bounds: h.bounds}
		h.z.fams[h.name] = f
	}
	for _, s := range f.sets {
		if sameLabels(s, set) {
			return
		}
	}
	f.sets = append(f.sets, set)
}

// promName is the Prometheus exporter's name of an instrument: dots become
// underscores and the unit a suffix (TestZeroHistogramNamedAsTheExporterDoes
// holds the two to the same name).
func promName(name, unit string) string {
	n := strings.ReplaceAll(name, ".", "_")
	switch unit {
	case "s":
		n += "_seconds"
	case "ms":
		n += "_milliseconds"
	case "By":
		n += "_bytes"
	}
	return n
}

func sameLabels(a, b []*dto.LabelPair) bool {
	return slices.EqualFunc(a, b, func(x, y *dto.LabelPair) bool {
		return x.GetName() == y.GetName() && x.GetValue() == y.GetValue()
	})
}

// zeroGatherer is the registry's families with the empty histogram series
// added that were not recorded yet.
type zeroGatherer struct {
	reg prometheus.Gatherer
	z   *zeros
}

func (g zeroGatherer) Gather() ([]*dto.MetricFamily, error) {
	fams, err := g.reg.Gather()
	g.z.mu.Lock()
	defer g.z.mu.Unlock()
	if len(g.z.fams) == 0 {
		return fams, err
	}
	byName := make(map[string]*dto.MetricFamily, len(fams))
	for _, f := range fams {
		byName[f.GetName()] = f
	}
	for name, zf := range g.z.fams {
		f := byName[name]
		if f == nil {
			f = &dto.MetricFamily{Name: proto.String(name), Help: proto.String(zf.help),
				Type: dto.MetricType_HISTOGRAM.Enum()}
			fams = append(fams, f)
		} else if f.GetType() != dto.MetricType_HISTOGRAM {
			continue // never mix types in one family
		}
		for _, set := range zf.sets {
			if !hasSeries(f, set) {
				f.Metric = append(f.Metric, emptyHistogram(set, zf.bounds))
			}
		}
	}
	sort.Slice(fams, func(i, j int) bool { return fams[i].GetName() < fams[j].GetName() })
	return fams, err
}

func hasSeries(f *dto.MetricFamily, set []*dto.LabelPair) bool {
	for _, m := range f.GetMetric() {
		labels := slices.Clone(m.GetLabel())
		sort.Slice(labels, func(i, j int) bool { return labels[i].GetName() < labels[j].GetName() })
		if sameLabels(labels, set) {
			return true
		}
	}
	return false
}

func emptyHistogram(set []*dto.LabelPair, bounds []float64) *dto.Metric {
	h := &dto.Histogram{SampleCount: proto.Uint64(0), SampleSum: proto.Float64(0)}
	for _, b := range bounds {
		h.Bucket = append(h.Bucket, &dto.Bucket{UpperBound: proto.Float64(b),
			CumulativeCount: proto.Uint64(0)})
	}
	return &dto.Metric{Label: set, Histogram: h}
}
