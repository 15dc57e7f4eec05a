package consul

import (
	"context"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// attrs are a metric's attributes with the watched datacenter's (when named:
// a handful of configured names, a bounded label).
func (w *Watcher) attrs(kv ...attribute.KeyValue) []attribute.KeyValue {
	if w.cfg.Datacenter != "" {
		kv = append(kv, attribute.String("datacenter", w.cfg.Datacenter))
	}
	return kv
}

func (w *Watcher) dcAttrs() metric.MeasurementOption { return metric.WithAttributes(w.attrs()...) }

// countRead records the sizes of one query's answers and charges budget
// (nil: none) with what it parsed.
func (w *Watcher) countRead(
	ctx context.Context,
	spec watchSpec,
	sizes *readSizes,
	budget *readBudget,
) {
	kind := w.attrs(attribute.String("watch", watchKind(spec.name)))
	if n := sizes.wire.Load(); n > 0 {
		w.readBytes.Add(
			ctx,
			n,
			metric.WithAttributes(append(kind, attribute.String("encoding", "wire"))...),
		)
	}
	if n := sizes.decoded.Load(); n > 0 {
		w.readBytes.Add(
			ctx,
			n,
			metric.WithAttributes(append(kind, attribute.String("encoding", "json"))...),
		)
		budget.chargeRead(spec.name, n)
	}
}

// watchKind is the bounded metric label of a watch name ("task X" → "task").
func watchKind(name string) string {
	kind, _, _ := strings.Cut(name, " ")
	return kind
}

// initMetrics registers the Watcher's instruments with provider.
func (w *Watcher) initMetrics(provider metric.MeterProvider) {
	m := provider.Meter("github.com/leasehold/leasehold/adapters/consul")
	w.requests, _ = m.Int64Counter(
		"leasehold.consul.requests",
		metric.WithDescription("Consul HTTP queries made, by watch kind"),
	)
	w.errs, _ = m.Int64Counter(
		"leasehold.consul.errors",
		metric.WithDescription("Consul queries that failed, by watch kind"),
	)
	w.wakeups, _ = m.Int64Counter(
		"leasehold.consul.wakeups",
		metric.WithDescription("blocking queries that returned a new index, by watch kind"),
	)
	w.readBytes, _ = m.Int64Counter(
		"leasehold.consul.read_bytes",
		metric.WithUnit("By"),
		metric.WithDescription(
			"bytes of Consul answers, by watch kind, as sent (encoding=wire, gzip) and as parsed "+
				"(encoding=json)",
		),
	)
	w.budgetWait, _ = m.Float64Counter(
		"leasehold.consul.read_budget_wait",
		metric.WithUnit("s"),
		metric.WithDescription(
			"time task-membership and generation watches, and refresh rounds (watch=refresh), "+
				"waited for the read budget (--consul-read-rate) before querying, by watch kind",
		),
	)
	w.rounds, _ = m.Int64Counter(
		"leasehold.consul.refreshes",
		metric.WithDescription(
			"refresh rounds that read Consul afresh for fencing calls whose min_consul_index the "+
				"view had not reached",
		),
	)
	w.rounds.Add(context.Background(), 0, w.dcAttrs()) // exported before the first round
	m.Float64ObservableGauge(
		"leasehold.consul.read_rate",
		metric.WithUnit("By/s"),
		metric.WithDescription(
			"the rate task-membership reads are paced at now: --consul-read-rate, or down to a "+
				"quarter of it while the datacenter's catalog is being written (50 raft entries a "+
				"second over Consul's rate of them)",
		),
		metric.WithFloat64Callback(func(_ context.Context, o metric.Float64Observer) error {
			if w.budget != nil {
				o.Observe(w.budget.rateNow(), w.dcAttrs())
			}
			return nil
		}),
	)
	m.Float64ObservableGauge(
		"leasehold.consul.contact_age",
		metric.WithUnit("s"),
		metric.WithDescription(
			"seconds since Consul last answered a query (-1 before the first answer)",
		),
		metric.WithFloat64Callback(func(_ context.Context, o metric.Float64Observer) error {
			if t := w.LastContact(); t.IsZero() {
				o.Observe(-1, w.dcAttrs())
			} else {
				o.Observe(w.cfg.Clock.Since(t).Seconds(), w.dcAttrs())
			}
			return nil
		}),
	)
}
