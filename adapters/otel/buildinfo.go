package otel

import (
	"context"
	"runtime"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// BuildInfo exports leasehold_build_info{version, revision, go_version} = 1
// on mp, the usual Prometheus way of telling which build runs where (a
// query joins it to any other series by instance). goVersion is the
// toolchain's that built the binary ("" for this one's runtime.Version).
func BuildInfo(mp metric.MeterProvider, version, revision, goVersion string) error {
	if goVersion == "" {
		goVersion = runtime.Version()
	}
	attrs := metric.WithAttributes(attribute.String("version", version),
		attribute.String("revision", revision), attribute.String("go_version", goVersion))
	_, err := mp.Meter("github.com/leasehold/leasehold").Int64ObservableGauge(
		"leasehold.build_info",
		metric.WithDescription("the running build: its version, VCS revision and Go version"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			o.Observe(1, attrs)
			return nil
		}))
	return err
}
