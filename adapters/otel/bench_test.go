package otel

import (
	"context"
	"io"
	"log/slog"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// benchChanges measures one observed change (a lapse or a recovery of one
// executor among 1,000) through decide, build and publish, with tp tracing.
func benchChanges(b *testing.B, tp trace.TracerProvider) {
	s := fleet.NewSyncer(fleet.SyncConfig{Tracer: tp, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	obs := make(chan health.Observation)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.Run(ctx, obs)
	obs <- health.Observation{Data: &health.TaskList{Tasks: []string{"work"}}}
	obs <- health.Observation{Data: &health.NonPassing{Index: 1}}
	obs <- health.Observation{Data: &health.Generations{Index: 1}}
	s.Subscribe(health.Dispatcher{})
	members := fleetOf(1, 1000, false)
	obs <- health.Observation{Data: &health.TaskMembers{Task: "work", Index: 2, Members: members}}
	victim := members[500].Checks[1]
	b.ResetTimer()
	for i := range b.N {
		np := health.NonPassing{Index: uint64(10 + i)}
		if i%2 == 0 {
			c := victim
			c.Status, c.ModifyIndex = health.StatusWarning, np.Index // full, then free again
			np.Checks = []health.CheckState{c}
		}
		v := s.View()
		obs <- health.Observation{Data: &np}
		<-v.Changed()
	}
}

func BenchmarkChangeTracingOff(b *testing.B) { benchChanges(b, tracenoop.NewTracerProvider()) }

func BenchmarkChangeTracingOn(b *testing.B) {
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sdktrace.NewBatchSpanProcessor(tracetest.NewNoopExporter())))
	defer tp.Shutdown(context.Background())
	benchChanges(b, tp)
}
