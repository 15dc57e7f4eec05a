package fleet

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// syncTelemetry are the Syncer's instruments and tracer.
type syncTelemetry struct {
	groupCount atomic.Int64
	tracer     trace.Tracer
	lapseCount metric.Int64Counter
	badMeta    metric.Int64Counter
	// rollout
	wouldExclude  metric.Int64Counter
	rulesRejected metric.Int64Counter
	buildTime     metric.Float64Histogram
	// zeroed are the task types whose series are exported at 0 (zeroTasks);
	// the Syncer's goroutine only.
	zeroed map[string]bool
}

// zeroer is what the histograms of leasehold's telemetry (adapters/otel)
// implement: a series shown empty before its first measurement. An
// interface of its own, because fleet imports no adapter.
type zeroer interface {
	Zero(attrs ...attribute.KeyValue)
}

// initTelemetry creates the instruments. Gauges are computed from the latest
// View when scraped, so the hot path pays nothing for them.
func (s *Syncer) initTelemetry() {
	s.tracer = s.cfg.Tracer.Tracer("github.com/leasehold/leasehold/snapshot/fleet")
	m := s.cfg.Meter.Meter("github.com/leasehold/leasehold/snapshot/fleet")
	s.lapseCount, _ = m.Int64Counter("leasehold.lease.lapses",
		metric.WithDescription("lease lapses observed (a session's lease check turned critical), "+
			"by task"))
	s.wouldExclude, _ = m.Int64Counter("leasehold.rules.would_exclude",
		metric.WithDescription("decisions where a rule in observe mode would have excluded a "+
			"routed executor, by rule and task (once per change)"))
	s.rulesRejected, _ = m.Int64Counter("leasehold.rules.config_rejected",
		metric.WithDescription("rollout configurations refused as invalid (the previous one "+
			"stays in force)"))
	m.Int64ObservableGauge("leasehold.cordons.held",
		metric.WithDescription("executors a cordon selects that the safety limit keeps routed"),
		metric.WithInt64Callback(func(_ context.Context, obs metric.Int64Observer) error {
			n := 0 // without controls read yet nothing is held
			if c := s.View().Control; c != nil {
				for _, st := range c.Cordons {
					n += st.Held
				}
			}
			obs.Observe(int64(n))
			return nil
		}))
	m.Int64ObservableGauge("leasehold.rules.info",
		metric.WithDescription("always 1: the content version of the rules in force (one "+
			"series; the defaults' version when no rules document is in force)"),
		metric.WithInt64Callback(func(_ context.Context, obs metric.Int64Observer) error {
			obs.Observe(1, metric.WithAttributes(attribute.String("version",
				s.View().RulesVersion())))
			return nil
		}))
	s.badMeta, _ = m.Int64Counter("leasehold.registrations.bad_metadata",
		metric.WithDescription("registrations excluded for metadata that breaks the contract "+
			"(counted once per change)"))
	s.buildTime, _ = m.Float64Histogram("leasehold.snapshot.build.duration", metric.WithUnit("s"),
		metric.WithDescription("time to rebuild the resources of the changed task types for "+
			"every constraint set"),
		metric.WithExplicitBucketBoundaries(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1))
	// The counters without labels are exported at 0 from the start, so that
	// an alert on them answers 0 rather than "no data" until the first event.
	s.rulesRejected.Add(context.Background(), 0)
	s.badMeta.Add(context.Background(), 0)
	if z, ok := s.buildTime.(zeroer); ok {
		z.Zero()
	}
	m.Int64ObservableGauge("leasehold.executors",
		metric.WithDescription("registrations by task, state and verdict for an unconstrained "+
			"dispatcher"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			for k, n := range s.View().gauges().executors {
				o.Observe(n,
					metric.WithAttributes(attribute.String("task", k.task),
						attribute.String("state", k.state), attribute.String("verdict", k.verdict)))
			}
			return nil
		}))
	m.Int64ObservableGauge("leasehold.capacity",
		metric.WithDescription("capacity of executors holding a valid lease, by task: "+
			"kind=total; in_use, the load in their lease checks' output (up to 7.5 minutes "+
			"old: Consul syncs an output-only change every check_update_interval); "+
			"load_unreported, the capacity of those whose output carried no load yet"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			for task, c := range s.View().gauges().capacity {
				for kind, n := range map[string]int64{"total": c.total, "in_use": c.inUse,
					"load_unreported": c.unreported} {
					o.Observe(n, metric.WithAttributes(attribute.String("task", task),
						attribute.String("kind", kind)))
				}
			}
			return nil
		}))
	m.Int64ObservableGauge("leasehold.datacenter.reach",
		metric.WithDescription("per watched datacenter (with several): 0 reached, 1 unanswered "+
			"(its sessions are answered UNKNOWN), 2 lost (not answered for longer than the "+
			"staleness bound while another datacenter answers: its executors are not routed)"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			v := s.View()
			// One datacenter too, so that the family is there from the start
			// whatever --datacenters says: it is reached while it answers.
			if dcs := v.Datacenters(); len(dcs) > 0 {
				for _, dc := range dcs {
					i, _ := v.Datacenter(dc)
					o.Observe(int64(i.Reach),
						metric.WithAttributes(attribute.String("datacenter", dc)))
				}
			}
			return nil
		}))
	m.Int64ObservableGauge("leasehold.constraint_sets",
		metric.WithDescription("distinct dispatcher constraint sets with open streams"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			o.Observe(s.groupCount.Load())
			return nil
		}))
}

// zeroTasks exports the task-labelled counters of task types not seen before
// at 0, for every rule a rollout may observe: an alert on lapses of a task
// type answers 0, not "no data", until its first lapse.
func (s *Syncer) zeroTasks(tasks []string) {
	for _, task := range tasks {
		if s.zeroed[task] {
			continue
		}
		if s.zeroed == nil {
			s.zeroed = map[string]bool{}
		}
		s.zeroed[task] = true
		ctx, t := context.Background(), attribute.String("task", task)
		s.lapseCount.Add(ctx, 0, metric.WithAttributes(t))
		for _, rule := range health.ObservableRules {
			s.wouldExclude.Add(ctx, 0, metric.WithAttributes(
				attribute.String("rule", health.RuleName(rule)), t))
		}
	}
}

// execDiff counts registrations added, changed and removed by a batch (for
// the change span).
type execDiff struct{ added, changed, removed int }

// changeTrace is the trace of one batch that matters (a task type changed or
// a session lapsed): the root span covers the batch, its children the
// eligibility decisions, the snapshot build and (publish) each cache update.
// Its zero value traces nothing.
type changeTrace struct {
	tracer      trace.Tracer
	root, build trace.Span
}

// traceChange starts the trace of batch r, whose decisions took from started
// to decided; the context returned carries the root span, if any.
func (s *Syncer) traceChange(ctx context.Context, r batchResult,
	started, decided time.Time) (context.Context, changeTrace) {
	changed, lapses := r.changed, r.lapses
	if len(changed) == 0 && len(lapses) == 0 {
		return ctx, changeTrace{}
	}
	diff := r.diff
	ctx, root := s.tracer.Start(ctx, "leasehold.consul_change", trace.WithTimestamp(s.batchStart),
		trace.WithAttributes(
			attribute.Int64("consul.index", int64(s.consulIndex(s.localDC()))),
			attribute.StringSlice("leasehold.tasks_changed", changed),
			attribute.Int("leasehold.instances.added", diff.added),
			attribute.Int("leasehold.instances.changed", diff.changed),
			attribute.Int("leasehold.instances.removed", diff.removed),
			attribute.Int("leasehold.instances.lapsed", len(lapses)),
		))
	// The rules this change was decided under; a change that applied new
	// rules says so in an event.
	version := s.ctl.version
	if version == "" {
		version = defaultRulesVersion
	}
	root.SetAttributes(attribute.String("leasehold.rules.version", version))
	if v := s.ctl.applied; v != "" {
		root.AddEvent("rules applied", trace.WithAttributes(
			attribute.String("leasehold.rules.version", v),
			attribute.String("leasehold.rules.source", s.ctl.rolloutFrom)))
	}
	for _, e := range lapses {
		root.AddEvent("lease lapsed", trace.WithAttributes(
			attribute.String("leasehold.instance_id", e.InstanceID),
			attribute.String("leasehold.session_id", e.SessionID),
			attribute.String("leasehold.task", e.Task)))
	}
	_, el := s.tracer.Start(ctx, "leasehold.eligibility", trace.WithTimestamp(started),
		trace.WithAttributes(attribute.Int("leasehold.executors", r.present)))
	el.End(trace.WithTimestamp(decided))
	return ctx, changeTrace{tracer: s.tracer, root: root}
}

// startBuild starts the snapshot build's span, a leaf: the rebuilds are not
// traced one by one.
func (t *changeTrace) startBuild(ctx context.Context, groups int, tasks []string) {
	if t.root == nil {
		return
	}
	_, t.build = t.tracer.Start(ctx, "leasehold.snapshot_build",
		trace.WithAttributes(attribute.Int("leasehold.groups", groups),
			attribute.StringSlice("leasehold.tasks", tasks)))
}

// built records how long the build took since the decisions and ends its
// span.
func (s *Syncer) built(ctx context.Context, t *changeTrace, decided time.Time) {
	s.buildTime.Record(ctx, time.Since(decided).Seconds())
	if t.build != nil {
		t.build.End()
	}
}

// end ends the batch's trace, once everything it decided is published.
func (t *changeTrace) end() {
	if t.root != nil {
		t.root.End()
	}
}

// explainBuild counts and logs what the rules in observe mode would have
// excluded from a group's load assignment of task (routed all the same) and,
// at debug level, logs every decision.
func (s *Syncer) explainBuild(g *group, task string, parts [][]health.Executor,
	observed []translator.ObservedDecision) {
	for _, o := range observed {
		for _, x := range o.Exclusions {
			s.wouldExclude.Add(context.Background(), 1,
				metric.WithAttributes(attribute.String("rule", health.RuleName(x.Reason)),
					attribute.String("task", task)))
			s.log.Info("rule in observe mode would exclude; routed", "rule", x.Reason,
				"detail", x.Detail, "instance_id", o.InstanceID, "session_id", o.SessionID,
				"task", task, "group", g.d.Key())
		}
	}
	if s.log.Enabled(context.Background(), slog.LevelDebug) {
		var execs []health.Executor
		for _, part := range parts {
			execs = append(execs, part...)
		}
		for _, d := range translator.Decide(execs, g.d, s.observed(task, g.d)...) {
			s.log.Debug("decision", "group", g.d.Key(), "task", task,
				"instance_id", d.Executor.InstanceID, "session_id", d.Executor.SessionID,
				"route", d.Verdict.Route, "reason", d.Verdict.Reason, "detail", d.Verdict.Detail)
		}
	}
}

// taskCapacity is one task type's leasehold.capacity.
type taskCapacity struct{ total, inUse, unreported int64 }

// capacityByTask sums the capacity and load of the executors an
// unconstrained dispatcher would route or that are draining or full, per
// task type (every task type seen, so that its series stay when nothing is
// valid). An executor whose lease check output carried no load yet (a new
// one's reaches the catalog only with Consul's next output sync) adds its
// capacity to unreported, not 0 to in_use: a silent 0 would read as idle.
// fleetGauges are the executors and capacity gauges' values of one view.
// A view is immutable, so they are computed once per view, on the first
// collection that asks (a collection of an unchanged view decides nothing
// again), and per task type, without the view's flat list: at 10,000
// executors each collection used to allocate ~35 MB.
type fleetGauges struct {
	executors map[executorsKey]int64
	capacity  map[string]taskCapacity
}

type executorsKey struct{ task, state, verdict string }

func (v *View) gauges() *fleetGauges {
	v.gaugesOnce.Do(func() {
		g := &fleetGauges{executors: map[executorsKey]int64{}, capacity: map[string]taskCapacity{}}
		var d health.Dispatcher  // unconstrained
		var es []health.Executor // one task state's, in one slice (duplicates are per task)
		for _, l := range v.byTask {
			es = l.appendTo(es[:0])
			verdicts := v.decideEach(es, d)
			for i := range es {
				e := &es[i]
				reason := string(verdicts[i].Reason)
				if reason == "" {
					reason = "eligible"
				}
				state := string(e.State)
				if e.Err != nil {
					state = "unknown"
				}
				g.executors[executorsKey{e.Task, state, reason}]++
			}
			for task, c := range capacityByTask(es) {
				t := g.capacity[task]
				t.total, t.inUse, t.unreported = t.total+c.total, t.inUse+c.inUse,
					t.unreported+c.unreported
				g.capacity[task] = t
			}
		}
		v.gaugeValues = g
	})
	return v.gaugeValues
}

func capacityByTask(executors []health.Executor) map[string]taskCapacity {
	out := map[string]taskCapacity{}
	for _, e := range executors {
		c := out[e.Task]
		switch health.Eligible(e, health.Dispatcher{}).Reason {
		case health.ReasonNone, health.ReasonFull, health.ReasonDraining:
			c.total += int64(e.Capacity)
			if e.LoadReported {
				c.inUse += int64(e.Load)
			} else {
				c.unreported += int64(e.Capacity)
			}
		}
		out[e.Task] = c
	}
	return out
}
