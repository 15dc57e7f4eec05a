package fleet

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/health"
)

// Publication describes one snapshot set in the cache, for the xDS server's
// push tracing and lapse-to-push latency.
type Publication struct {
	Group        string
	Snapshot     *cache.Snapshot
	Ctx          context.Context // carries the span of the cache update, if traced
	LapsedAt     time.Time       // when Consul reported the earliest lapse this publication removes (zero: none)
	RemovedTasks []string        // task types whose endpoints lost or drained one
}

// Notify registers f to be called (from Run; it must not block) for every
// publication, just before the snapshot is set, so it hears of it before any
// response the snapshot causes. Call before Run.
func (s *Syncer) Notify(f func(Publication)) { s.listeners = append(s.listeners, f) }

type syncTelemetry struct {
	groupCount atomic.Int64
	tracer     trace.Tracer
	lapseCount metric.Int64Counter
	badMeta    metric.Int64Counter
	// rollout
	wouldExclude  metric.Int64Counter
	rulesRejected metric.Int64Counter
	buildTime     metric.Float64Histogram
}

// initTelemetry creates the instruments. Gauges are computed from the latest
// View when scraped, so the hot path pays nothing for them.
func (s *Syncer) initTelemetry() {
	s.tracer = s.cfg.Tracer.Tracer("github.com/leasehold/leasehold/snapshot/fleet")
	m := s.cfg.Meter.Meter("github.com/leasehold/leasehold/snapshot/fleet")
	s.lapseCount, _ = m.Int64Counter("leasehold.lease.lapses", metric.WithDescription("lease lapses observed (a session's lease check turned critical), by task"))
	s.wouldExclude, _ = m.Int64Counter("leasehold.rules.would_exclude", metric.WithDescription("decisions where a rule in observe mode would have excluded a routed executor, by rule and task (once per change)"))
	s.rulesRejected, _ = m.Int64Counter("leasehold.rules.config_rejected", metric.WithDescription("rollout configurations refused as invalid (the previous one stays in force)"))
	m.Int64ObservableGauge("leasehold.cordons.held", metric.WithDescription("executors a cordon selects that the safety limit keeps routed"),
		metric.WithInt64Callback(func(_ context.Context, obs metric.Int64Observer) error {
			if c := s.View().Control; c != nil {
				n := 0
				for _, st := range c.Cordons {
					n += st.Held
				}
				obs.Observe(int64(n))
			}
			return nil
		}))
	s.badMeta, _ = m.Int64Counter("leasehold.registrations.bad_metadata", metric.WithDescription("registrations excluded for metadata that breaks the contract (counted once per change)"))
	s.buildTime, _ = m.Float64Histogram("leasehold.snapshot.build.duration", metric.WithUnit("s"),
		metric.WithDescription("time to rebuild the resources of the changed task types for every constraint set"),
		metric.WithExplicitBucketBoundaries(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1))
	m.Int64ObservableGauge("leasehold.executors", metric.WithDescription("registrations by task, state and verdict for an unconstrained dispatcher"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			v := s.View()
			type key struct{ task, state, verdict string }
			counts := map[key]int64{}
			verdicts := v.DecideAll(health.Dispatcher{})
			for i, e := range v.Executors() {
				verdict := verdicts[i]
				reason := string(verdict.Reason)
				if reason == "" {
					reason = "eligible"
				}
				state := string(e.State)
				if e.Err != nil {
					state = "unknown"
				}
				counts[key{e.Task, state, reason}]++
			}
			for k, n := range counts {
				o.Observe(n, metric.WithAttributes(attribute.String("task", k.task), attribute.String("state", k.state), attribute.String("verdict", k.verdict)))
			}
			return nil
		}))
	m.Int64ObservableGauge("leasehold.capacity", metric.WithDescription("capacity of executors holding a valid lease, by task: kind=total or in_use (their load)"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			total, used := map[string]int64{}, map[string]int64{}
			for _, e := range s.View().Executors() {
				switch health.Eligible(e, health.Dispatcher{}).Reason {
				case health.ReasonNone, health.ReasonFull, health.ReasonDraining:
					total[e.Task] += int64(e.Capacity)
					used[e.Task] += int64(e.Load)
				default:
					total[e.Task] += 0 // keep the series when nothing is valid
					used[e.Task] += 0
				}
			}
			for task := range total {
				o.Observe(total[task], metric.WithAttributes(attribute.String("task", task), attribute.String("kind", "total")))
				o.Observe(used[task], metric.WithAttributes(attribute.String("task", task), attribute.String("kind", "in_use")))
			}
			return nil
		}))
	m.Int64ObservableGauge("leasehold.datacenter.reach", metric.WithDescription("per watched datacenter (with several): 0 reached, 1 unanswered (its sessions are answered UNKNOWN), 2 lost (not answered for longer than the staleness bound while another datacenter answers: its executors are not routed)"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			v := s.View()
			if dcs := v.Datacenters(); len(dcs) > 1 {
				for _, dc := range dcs {
					i, _ := v.Datacenter(dc)
					o.Observe(int64(i.Reach), metric.WithAttributes(attribute.String("datacenter", dc)))
				}
			}
			return nil
		}))
	m.Int64ObservableGauge("leasehold.constraint_sets", metric.WithDescription("distinct dispatcher constraint sets with open streams"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			o.Observe(s.groupCount.Load())
			return nil
		}))
}

// execDiff counts registrations added, changed and removed by a batch (for
// the change span).
type execDiff struct{ added, changed, removed int }

// consulIndex is the highest index of any answer from datacenter dc.
func (s *Syncer) consulIndex(dc string) uint64 {
	d := s.dc(dc)
	index := max(d.np.Index(), d.genIndex, d.marksIndex)
	for k, m := range s.members {
		if k.dc == dc {
			index = max(index, m.Index)
		}
	}
	return index
}
