package otel

import (
	"context"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

func families(t *testing.T, tel *Telemetry) map[string]*dto.MetricFamily {
	t.Helper()
	fams, err := zeroGatherer{reg: tel.registry, z: tel.zeros}.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*dto.MetricFamily{}
	for _, f := range fams {
		out[f.GetName()] = f
	}
	return out
}

func seriesOf(f *dto.MetricFamily) map[string]*dto.Histogram {
	out := map[string]*dto.Histogram{}
	for _, m := range f.GetMetric() {
		key := ""
		for _, l := range m.GetLabel() {
			key += l.GetName() + "=" + l.GetValue() + ","
		}
		if _, dup := out[key]; dup {
			out[key+"DUPLICATE"] = nil
		}
		out[key] = m.GetHistogram()
	}
	return out
}

// A histogram shown empty is the family the exporter itself writes once it
// is recorded: same name, same buckets, and a recorded series replaces its
// empty one instead of repeating it.
func TestZeroHistogramNamedAsTheExporterDoes(t *testing.T) {
	tel, err := Setup(context.Background(), Config{})
	if err != nil {
		t.Fatal(err)
	}
	h, err := tel.Meter.Meter("test").Float64Histogram("leasehold.test.push.duration",
		metric.WithUnit("s"), metric.WithDescription("a test histogram"),
		metric.WithExplicitBucketBoundaries(0.1, 1))
	if err != nil {
		t.Fatal(err)
	}
	z, ok := h.(Zeroer)
	if !ok {
		t.Fatal("the histogram of Telemetry.Meter is no Zeroer")
	}
	z.Zero(attribute.String("type_url", "a"))
	z.Zero(attribute.String("type_url", "b"))
	z.Zero(attribute.String("type_url", "b")) // twice: one series
	f := families(t, tel)["leasehold_test_push_duration_seconds"]
	if f == nil || f.GetType() != dto.MetricType_HISTOGRAM {
		t.Fatalf("empty histogram not exported: %v", f)
	}
	s := seriesOf(f)
	if len(s) != 2 || s["type_url=a,"] == nil || s["type_url=b,"] == nil {
		t.Fatalf("series %v, want type_url a and b", s)
	}
	if b := s["type_url=a,"]; b.GetSampleCount() != 0 || len(b.GetBucket()) != 2 ||
		b.GetBucket()[1].GetUpperBound() != 1 || b.GetBucket()[1].GetCumulativeCount() != 0 {
		t.Fatalf("empty series %v, want buckets 0.1 and 1 at 0", b)
	}

	h.Record(context.Background(), 0.5, metric.WithAttributes(attribute.String("type_url", "a")))
	f = families(t, tel)["leasehold_test_push_duration_seconds"]
	s = seriesOf(f)
	if len(s) != 2 {
		t.Fatalf("after a record: series %v, want a (recorded) and b (empty), once each", s)
	}
	if s["type_url=a,"].GetSampleCount() != 1 || s["type_url=b,"].GetSampleCount() != 0 {
		t.Fatalf("after a record: %v", s)
	}
	if f.GetHelp() != "a test histogram" {
		t.Errorf("help %q", f.GetHelp())
	}
}
