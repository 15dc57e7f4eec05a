// Package otel sets up OpenTelemetry for leasehold: traces exported over
// OTLP only when the standard OTEL_* environment asks for it, metrics always
// available as Prometheus text (and over OTLP when configured).
package otel

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlpmetric/otlpmetricgrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlpmetric/otlpmetrichttp"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	promexporter "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
)

// Config names the service; OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
// take precedence, as the specification says.
type Config struct {
	ServiceName    string // default "leasehold"
	ServiceVersion string // default "dev"
	// Logger receives OpenTelemetry's own errors (a failed export, mostly);
	// default slog.Default().
	Logger *slog.Logger
}

// Telemetry holds the providers leasehold's components take.
type Telemetry struct {
	Tracer    trace.TracerProvider
	Meter     metric.MeterProvider
	registry  *prometheus.Registry
	zeros     *zeros // the empty histogram series /metrics shows (zero.go)
	shutdowns []func(context.Context) error
	// TracesExported is true when an OTLP trace exporter is configured.
	TracesExported bool
}

// Setup builds the providers from the environment. Traces: OTLP (gRPC or
// HTTP, by OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, default http/protobuf) when
// OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT is set and OTEL_TRACES_EXPORTER is not
// "none"; otherwise a no-op provider, so nothing is recorded or slowed.
// Sampling follows OTEL_TRACES_SAMPLER. Metrics: a Prometheus registry for
// /metrics always, plus OTLP export under the same rules for metrics; the
// histograms of Meter can be shown empty before their first measurement
// (zero.go). OpenTelemetry's own errors become warnings of cfg.Logger, once a
// minute per error, with a hint when the endpoint speaks the other OTLP
// protocol.
func Setup(ctx context.Context, cfg Config) (*Telemetry, error) {
	if cfg.ServiceName == "" {
		cfg.ServiceName = "leasehold"
	}
	if cfg.ServiceVersion == "" {
		cfg.ServiceVersion = "dev"
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	setErrorHandler(cfg.Logger)
	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName(cfg.ServiceName), semconv.ServiceVersion(cfg.ServiceVersion)),
		resource.WithHost(),
		resource.WithFromEnv(), // OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES win
	)
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		return nil, fmt.Errorf("otel resource: %w", err)
	}
	t := &Telemetry{Tracer: tracenoop.NewTracerProvider(), registry: prometheus.NewRegistry(),
		zeros: &zeros{}}

	if exporting("TRACES") {
		var exp sdktrace.SpanExporter
		if protocol("TRACES") == "grpc" {
			exp, err = otlptracegrpc.New(ctx)
		} else {
			exp, err = otlptracehttp.New(ctx)
		}
		if err != nil {
			return nil, fmt.Errorf("OTLP trace exporter: %w", err)
		}
		tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res)) // sampler from OTEL_TRACES_SAMPLER
		t.Tracer, t.TracesExported = tp, true
		t.shutdowns = append(t.shutdowns, tp.Shutdown)
	}
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))

	prom, err := promexporter.New(promexporter.WithRegisterer(t.registry), promexporter.WithoutScopeInfo())
	if err != nil {
		return nil, fmt.Errorf("prometheus exporter: %w", err)
	}
	opts := []sdkmetric.Option{sdkmetric.WithResource(res), sdkmetric.WithReader(prom)}
	if exporting("METRICS") {
		var exp sdkmetric.Exporter
		if protocol("METRICS") == "grpc" {
			exp, err = otlpmetricgrpc.New(ctx)
		} else {
			exp, err = otlpmetrichttp.New(ctx)
		}
		if err != nil {
			return nil, fmt.Errorf("OTLP metric exporter: %w", err)
		}
		opts = append(opts, sdkmetric.WithReader(sdkmetric.NewPeriodicReader(exp)))
	}
	mp := sdkmetric.NewMeterProvider(opts...)
	t.Meter = zeroMeterProvider{MeterProvider: mp, z: t.zeros}
	t.shutdowns = append(t.shutdowns, mp.Shutdown)
	return t, nil
}

// exporting reports whether OTLP export of signal (TRACES or METRICS) is
// configured by the environment.
func exporting(signal string) bool {
	if v := strings.TrimSpace(os.Getenv("OTEL_" + signal + "_EXPORTER")); v != "" {
		return v == "otlp" && (os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_"+signal+"_ENDPOINT") != "")
	}
	return os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_"+signal+"_ENDPOINT") != ""
}

func protocol(signal string) string {
	if p := os.Getenv("OTEL_EXPORTER_OTLP_" + signal + "_PROTOCOL"); p != "" {
		return p
	}
	if p := os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL"); p != "" {
		return p
	}
	return "http/protobuf"
}

// MetricsHandler serves the Prometheus text format: what OpenTelemetry
// exports, and the histograms shown empty until their first measurement
// (zero.go).
func (t *Telemetry) MetricsHandler() http.Handler {
	return promhttp.HandlerFor(zeroGatherer{reg: t.registry, z: t.zeros}, promhttp.HandlerOpts{})
}

// Shutdown flushes and stops exporters.
func (t *Telemetry) Shutdown(ctx context.Context) error {
	var errs []error
	for _, f := range t.shutdowns {
		errs = append(errs, f(ctx))
	}
	return errors.Join(errs...)
}
