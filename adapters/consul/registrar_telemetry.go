package consul

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
)

// registrarTelemetry: one span per session (events for heartbeat failures,
// the loss as an error status), child spans for register, drain and
// deregister; heartbeat latency, failures, lease losses, load and capacity.
type registrarTelemetry struct {
	tracer      trace.Tracer
	heartbeat   metric.Float64Histogram
	hbFailures  metric.Int64Counter
	leaseLosses metric.Int64Counter
}

func (r *Registrar) initTelemetry() {
	tp, mp := r.cfg.Tracer, r.cfg.Meter
	if tp == nil {
		tp = tracenoop.NewTracerProvider()
	}
	if mp == nil {
		mp = metricnoop.NewMeterProvider()
	}
	r.tracer = tp.Tracer("github.com/leasehold/leasehold/adapters/consul")
	m := mp.Meter("github.com/leasehold/leasehold/adapters/consul")
	r.heartbeat, _ = m.Float64Histogram(
		"leasehold.executor.heartbeat.duration",
		metric.WithUnit("s"),
		metric.WithDescription(
			"round trip of one heartbeat (every task's check update) to the local agent",
		),
		metric.WithExplicitBucketBoundaries(
			0.0005,
			0.001,
			0.0025,
			0.005,
			0.01,
			0.025,
			0.05,
			0.1,
			0.25,
			0.5,
			1,
			5,
		),
	)
	r.hbFailures, _ = m.Int64Counter(
		"leasehold.executor.heartbeat.failures",
		metric.WithDescription("heartbeats that failed (retried inside the lease)"),
	)
	r.leaseLosses, _ = m.Int64Counter(
		"leasehold.executor.lease.losses",
		metric.WithDescription("sessions whose lease was lost, by reason (refused, expired)"),
	)
	// Exported at 0 from the start, so that an alert on failed heartbeats or
	// lost leases answers 0 rather than "no data" until the first one.
	ctx := context.Background()
	r.hbFailures.Add(ctx, 0)
	for _, reason := range LossReasons {
		r.leaseLosses.Add(ctx, 0, metric.WithAttributes(attribute.String("reason", string(reason))))
	}
	if z, ok := r.heartbeat.(interface{ Zero(...attribute.KeyValue) }); ok {
		z.Zero() // adapters/otel shows it empty until the first heartbeat
	}
	m.Int64ObservableGauge("leasehold.executor.load", metric.WithDescription("work in flight"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			o.Observe(int64(r.cfg.Load()))
			return nil
		}))
	m.Int64ObservableGauge(
		"leasehold.executor.capacity",
		metric.WithDescription("concurrent tasks accepted"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			o.Observe(int64(r.cfg.Capacity))
			return nil
		}),
	)
}

func (r *Registrar) sessionSpan(key sessionKey, started time.Time) (context.Context, trace.Span) {
	return r.tracer.Start(
		context.Background(),
		"leasehold.executor.session",
		trace.WithTimestamp(started),
		trace.WithAttributes(
			attribute.String(
				"leasehold.instance_id",
				r.cfg.InstanceID,
			),
			attribute.String("leasehold.session_id", key.id),
			attribute.Int64(
				"leasehold.generation",
				int64(key.generation),
			),
			attribute.StringSlice("leasehold.tasks", r.cfg.Tasks),
			attribute.String("leasehold.version", r.cfg.Version),
		),
	)
}

func (r *Registrar) heartbeatDone(
	ctx context.Context,
	span trace.Span,
	took time.Duration,
	err error,
) {
	if err == nil {
		r.heartbeat.Record(ctx, took.Seconds())
		return
	}
	r.hbFailures.Add(ctx, 1)
	span.AddEvent("heartbeat failed", trace.WithAttributes(attribute.String("error", err.Error())))
}

func (r *Registrar) lossRecorded(span trace.Span, loss LeaseLoss) {
	r.leaseLosses.Add(
		context.Background(),
		1,
		metric.WithAttributes(attribute.String("reason", string(loss.Reason))),
	)
	span.AddEvent(
		"lease lost",
		trace.WithAttributes(
			attribute.String("reason", string(loss.Reason)),
			attribute.Bool("superseded", loss.Superseded),
			attribute.Float64("since_ack_seconds", loss.SinceAck.Seconds()),
		),
	)
	span.SetStatus(codes.Error, "lease lost: "+string(loss.Reason))
}
