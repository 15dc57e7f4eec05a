package server

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sort"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	loadstatsv3 "github.com/envoyproxy/go-control-plane/envoy/service/load_stats/v3"
	"github.com/jonboulle/clockwork"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/fleet"
	"github.com/leasehold/leasehold/snapshot/translator"
	"github.com/leasehold/leasehold/snapshot/xdscache"
)

// The Load Reporting Service (LRS, gRFC A27; Envoy's load_stats.proto):
// dispatchers whose clusters name lrs_server {self: {}} open
// envoy.service.load_stats.v3.LoadReportingService/StreamLoadStats on the
// xDS port, are told how often to report, and report per cluster and
// locality what their calls did since their previous report. leasehold
// turns the reports into dispatch outcome metrics and a recent failure rate
// per task type, which `leasehold explain` shows.
const (
	// DefaultLoadReportInterval is how often dispatchers are asked to
	// report: often enough that /metrics is at most a couple of seconds
	// behind the calls, rarely enough that a fleet of thousands of
	// dispatchers costs leasehold a few hundred small messages a second.
	DefaultLoadReportInterval = 2 * time.Second
	// MinLoadReportInterval is the floor of LRSOptions.Interval.
	MinLoadReportInterval = 500 * time.Millisecond
	// MaxReporters is how many LRS streams are remembered at once (each
	// holds its latest in-flight counts, one per task type and datacenter
	// it reports). A stream beyond it is refused with ResourceExhausted,
	// unless a remembered one has been idle for reporterIdleIntervals: that
	// one is ended (the dispatcher reconnects) to make room.
	MaxReporters = 4096
	// reporterIdleIntervals is after how many report intervals without a
	// report a reporter's in-flight counts stop counting.
	reporterIdleIntervals = 3
	// FailureRateWindow is the window of the recent dispatch failure rate
	// per task type (in failureRateStep steps: the oldest step leaves whole).
	FailureRateWindow = time.Minute
	failureRateStep   = 5 * time.Second
	// OtherLabel is the task, datacenter and locality label of what a
	// report says of clusters, datacenters or zones leasehold does not
	// serve (or a task type outside the reporter's grant), so no report can
	// add series. It is no valid task type name (health.ValidateTask), so
	// it is never a task's own.
	OtherLabel = "_other"
	// maxReportCount bounds each count of one report: no dispatcher issues
	// four billion calls in an interval, and a counter must not wrap.
	maxReportCount = 1 << 32
	// maxZeroed bounds the label sets exported at 0 before their first
	// report (one per task type, datacenter, zone and outcome ever served).
	maxZeroed = 1 << 16
)

// Outcomes of leasehold_dispatch_requests_total.
const (
	OutcomeSucceeded = "succeeded"
	OutcomeFailed    = "failed"
	OutcomeDropped   = "dropped"
)

// ViewSource is what the LRS server reads the served task types, their
// datacenters and zones from (*fleet.Syncer).
type ViewSource interface {
	View() *fleet.View
}

// LRSOptions are optional; zero values mean no metrics, the real clock,
// DefaultLoadReportInterval and MaxReporters.
type LRSOptions struct {
	Meter metric.MeterProvider
	// Policy, when set, refuses streams of client identities without a
	// grant (PermissionDenied) and counts reports of task types outside a
	// reporter's grant under OtherLabel.
	Policy   *PolicyStore
	Clock    clockwork.Clock
	Interval time.Duration // raised to MinLoadReportInterval
	// MaxReporters lowers the bound on remembered reporters (tests).
	MaxReporters int
}

// LRS is the Load Reporting Service server.
type LRS struct {
	loadstatsv3.UnimplementedLoadReportingServiceServer
	views    ViewSource
	log      *slog.Logger
	policy   *PolicyStore
	clock    clockwork.Clock
	interval time.Duration
	max      int

	requests metric.Int64Counter
	issued   metric.Int64Counter
	denied   metric.Int64Counter

	mu         sync.Mutex
	next       int64
	reporters  map[int64]*reporter
	servedView *fleet.View
	served     servedSet
	zeroed     map[place]bool
	windows    map[string]*window
	changed    chan struct{} // closed and replaced when a reporter comes, reports or goes
	handled    uint64        // reports handled
}

// reporter is one LRS stream.
type reporter struct {
	stream   int64
	nodeID   string
	ident    Identity
	identity string // ident.String()
	grant    *Grant // nil: no policy
	version  int64  // the policy version grant was decided under
	last     time.Time
	inFlight map[flightKey]int64 // its latest report's requests in progress
	gone     chan struct{}       // closed when leasehold ends the stream (idle, evicted)
}

// flightKey labels leasehold_dispatch_requests_in_flight.
type flightKey struct{ task, dc string }

// place labels leasehold_dispatch_requests_total (with an outcome).
type place struct{ task, dc, zone string }

// servedSet is what the view serves: per task type, per datacenter as
// localities name it (the region; "" for leasehold's own with one
// unnamed datacenter), its zones.
type servedSet struct {
	local string
	tasks map[string]map[string]map[string]bool
}

// NewLRS serves load reports; views says which task types, datacenters and
// zones are served (labels for anything else are OtherLabel).
func NewLRS(views ViewSource, log *slog.Logger, opts ...LRSOptions) *LRS {
	var o LRSOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	if o.Meter == nil {
		o.Meter = metricnoop.NewMeterProvider()
	}
	if o.Clock == nil {
		o.Clock = clockwork.NewRealClock()
	}
	if o.Interval == 0 {
		o.Interval = DefaultLoadReportInterval
	}
	if o.MaxReporters <= 0 || o.MaxReporters > MaxReporters {
		o.MaxReporters = MaxReporters
	}
	l := &LRS{views: views, log: log.With("component", "lrs"), policy: o.Policy, clock: o.Clock,
		interval: max(o.Interval, MinLoadReportInterval), max: o.MaxReporters,
		reporters: map[int64]*reporter{}, zeroed: map[place]bool{}, windows: map[string]*window{},
		changed: make(chan struct{})}
	m := o.Meter.Meter("github.com/leasehold/leasehold/server")
	l.requests, _ = m.Int64Counter("leasehold.dispatch.requests",
		metric.WithDescription("dispatch calls dispatchers reported over LRS, by task, the "+
			"executors' datacenter and locality (zone), and outcome (succeeded, failed, dropped)"))
	l.issued, _ = m.Int64Counter("leasehold.dispatch.requests_issued",
		metric.WithDescription("dispatch calls dispatchers reported issued over LRS, by task, "+
			"datacenter and locality"))
	l.denied, _ = m.Int64Counter("leasehold.authz.denied", metric.WithDescription(
		"requests refused by the authorization policy, by API (xds, fencing)"))
	l.denied.Add(context.Background(), 0, metric.WithAttributes(attribute.String("api", "lrs")))
	l.zero(place{OtherLabel, OtherLabel, OtherLabel}, true)
	m.Int64ObservableGauge("leasehold.dispatch.requests_in_flight",
		metric.WithDescription("dispatch calls in progress as the connected dispatchers last "+
			"reported them over LRS, by task and the executors' datacenter"),
		metric.WithInt64Callback(l.observeInFlight))
	return l
}

// Register adds the Load Reporting Service to g.
func (l *LRS) Register(g *grpc.Server) { loadstatsv3.RegisterLoadReportingServiceServer(g, l) }

// Interval is the load_reporting_interval dispatchers are sent.
func (l *LRS) Interval() time.Duration { return l.interval }

// StreamLoadStats serves one dispatcher's LRS stream: its first request
// names its node (validated as an xDS stream's is), the answer asks for
// every cluster every Interval, and each request after is a report.
func (l *LRS) StreamLoadStats(stream loadstatsv3.LoadReportingService_StreamLoadStatsServer) error {
	ctx := stream.Context()
	rep := &reporter{gone: make(chan struct{})}
	if l.policy != nil {
		ident := PeerIdentity(ctx)
		rep.version = l.policy.Version()
		g, ok := l.policy.Grant(ident)
		if !ok {
			l.denied.Add(ctx, 1, metric.WithAttributes(attribute.String("api", "lrs")))
			l.log.Warn("load reports refused: no grant for the client identity",
				"identity", ident.String())
			return status.Errorf(codes.PermissionDenied,
				"no authorization grant for client identity %s", ident)
		}
		rep.grant, rep.ident, rep.identity = &g, ident, ident.String()
	}
	req, err := stream.Recv()
	if err != nil {
		return err
	}
	node := req.GetNode()
	if node == nil {
		return status.Error(codes.InvalidArgument,
			"node: required on the first LoadStatsRequest of a stream")
	}
	// As on an xDS stream, a grant in the node's metadata is leasehold's to
	// write, never the client's.
	var granted []string
	if rep.grant != nil {
		granted = rep.grant.TaskList()
	}
	xdscache.StampGrant(node, granted)
	if _, err := xdscache.DispatcherOf(node); err != nil {
		l.log.Warn("load reports refused: invalid node metadata", "node_id", node.GetId(),
			"err", err)
		return status.Error(codes.InvalidArgument, err.Error())
	}
	rep.nodeID = node.GetId()
	if err := l.open(rep); err != nil {
		return err
	}
	defer l.close(rep)
	// The first request's counts are added before the answer: a client that
	// has its answer knows its first report was counted.
	if err := l.report(rep, req); err != nil {
		return err
	}
	if err := stream.Send(l.response(node)); err != nil {
		return err
	}
	l.log.Debug("load reports: stream open", "node_id", rep.nodeID, "stream", rep.stream,
		"identity", rep.identity)
	reqs, errs := make(chan *loadstatsv3.LoadStatsRequest), make(chan error, 1)
	go func() {
		for {
			r, err := stream.Recv()
			if err != nil {
				errs <- err
				return
			}
			select {
			case reqs <- r:
			case <-ctx.Done():
				return
			}
		}
	}()
	for {
		select {
		case r := <-reqs:
			if err := l.report(rep, r); err != nil {
				return err
			}
		case err := <-errs:
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		case <-rep.gone:
			return status.Error(codes.Unavailable,
				"load reports: stream idle while others wait to report: reconnect")
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		}
	}
}

// response asks for every cluster. A client without the
// envoy.lrs.supports_send_all_clusters feature (gRPC has it; Envoy
// announces it) is given the task types by name too (unsharded clusters).
func (l *LRS) response(node *corev3.Node) *loadstatsv3.LoadStatsResponse {
	resp := &loadstatsv3.LoadStatsResponse{SendAllClusters: true,
		LoadReportingInterval: durationpb.New(l.interval)}
	for _, f := range node.GetClientFeatures() {
		if f == "envoy.lrs.supports_send_all_clusters" {
			return resp
		}
	}
	l.mu.Lock()
	s := l.servedLocked()
	l.mu.Unlock()
	for task := range s.tasks {
		resp.Clusters = append(resp.Clusters, task)
	}
	sort.Strings(resp.Clusters)
	return resp
}

// open remembers a new reporter, making room by ending one idle for
// reporterIdleIntervals, or refuses it (ResourceExhausted).
func (l *LRS) open(rep *reporter) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.clock.Now()
	rep.last = now
	if len(l.reporters) >= l.max {
		var idlest *reporter
		for _, r := range l.reporters {
			if idlest == nil || r.last.Before(idlest.last) {
				idlest = r
			}
		}
		if idlest == nil || now.Sub(idlest.last) < l.idleAfter() {
			l.log.Warn("load reports refused: too many dispatchers report at once",
				"node_id", rep.nodeID, "reporters", len(l.reporters))
			return status.Errorf(codes.ResourceExhausted,
				"load reports: %d dispatchers already report to this replica (the most it "+
					"remembers); retry later", len(l.reporters))
		}
		l.log.Info("load reports: ending an idle stream to make room", "node_id", idlest.nodeID,
			"stream", idlest.stream, "idle", now.Sub(idlest.last))
		delete(l.reporters, idlest.stream)
		close(idlest.gone)
	}
	l.next++
	rep.stream = l.next
	l.reporters[rep.stream] = rep
	l.changedLocked()
	return nil
}

func (l *LRS) close(rep *reporter) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.reporters[rep.stream] == rep {
		delete(l.reporters, rep.stream)
	}
	l.changedLocked()
}

func (l *LRS) idleAfter() time.Duration { return reporterIdleIntervals * l.interval }

// changedLocked wakes what waits for a change of the reporters; l.mu is held.
func (l *LRS) changedLocked() {
	close(l.changed)
	l.changed = make(chan struct{})
}

// Changed is closed at the next change of the reporters (one comes,
// reports or goes).
func (l *LRS) Changed() <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.changed
}

// report adds one LoadStatsRequest's counts to the metrics and the failure
// rates, and makes its requests in progress the reporter's.
func (l *LRS) report(rep *reporter, req *loadstatsv3.LoadStatsRequest) error {
	if err := l.regrant(rep); err != nil {
		return err
	}
	ctx := context.Background()
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.clock.Now()
	s := l.servedLocked()
	// A report's counts are summed per label set before they are added,
	// each sum capped at maxReportCount: a report may name one cluster and
	// locality many times over, and capping each entry alone would let one
	// report add hundreds of thousands of times the bound (and a few
	// thousand such reports wrap a counter).
	type outcomeKey struct {
		p       place
		outcome string
	}
	requests, issued := map[outcomeKey]int64{}, map[place]int64{}
	rates := map[string]*[3]int64{} // task → succeeded, failed, dropped
	flight := map[flightKey]int64{}
	for _, cs := range req.GetClusterStats() {
		name := cs.GetClusterName()
		if name == "" {
			name = cs.GetClusterServiceName()
		}
		task := translator.TaskOf(name)
		if _, ok := s.tasks[task]; !ok || (rep.grant != nil && !rep.grant.AllowsTask(task)) {
			task = OtherLabel
		}
		rate := rates[task]
		if rate == nil {
			rate = &[3]int64{}
			rates[task] = rate
		}
		dropped := count(cs.GetTotalDroppedRequests())
		if dropped > 0 {
			// A drop happens before a locality is picked: it has none.
			p := place{task: task}
			if task == OtherLabel {
				p = place{OtherLabel, OtherLabel, OtherLabel}
			}
			addCapped(requests, outcomeKey{p, OutcomeDropped}, dropped)
			rate[2] = capped(rate[2], dropped)
		}
		for _, ls := range cs.GetUpstreamLocalityStats() {
			p := s.placeOf(task, ls.GetLocality())
			ok, bad := count(ls.GetTotalSuccessfulRequests()), count(ls.GetTotalErrorRequests())
			addCapped(requests, outcomeKey{p, OutcomeSucceeded}, ok)
			addCapped(requests, outcomeKey{p, OutcomeFailed}, bad)
			addCapped(issued, p, count(ls.GetTotalIssuedRequests()))
			rate[0], rate[1] = capped(rate[0], ok), capped(rate[1], bad)
			addCapped(flight, flightKey{p.task, p.dc}, count(ls.GetTotalRequestsInProgress()))
		}
	}
	for k, n := range requests {
		l.add(ctx, k.p, k.outcome, n)
	}
	for p, n := range issued {
		if n > 0 {
			l.issued.Add(ctx, n, metric.WithAttributes(p.attrs()...))
		}
	}
	for task, r := range rates {
		if task != OtherLabel && r[0]+r[1]+r[2] > 0 {
			w := l.windows[task]
			if w == nil {
				w = &window{}
				l.windows[task] = w
			}
			w.add(now, r[0], r[1], r[2])
		}
	}
	for k, n := range flight {
		if n == 0 {
			delete(flight, k)
		}
	}
	if l.reporters[rep.stream] == rep {
		rep.inFlight, rep.last = flight, now
	}
	l.handled++
	l.changedLocked()
	return nil
}

// regrant follows a policy change: a reporter whose identity lost its
// grant is ended (PermissionDenied); a changed grant applies from now on.
func (l *LRS) regrant(rep *reporter) error {
	if l.policy == nil {
		return nil
	}
	v := l.policy.Version()
	l.mu.Lock()
	same := v == rep.version
	l.mu.Unlock()
	if same {
		return nil
	}
	g, ok := l.policy.Grant(rep.ident)
	if !ok {
		l.denied.Add(context.Background(), 1, metric.WithAttributes(attribute.String("api", "lrs")))
		l.log.Info("authorization policy changed: ending the load reports of an identity "+
			"without a grant", "identity", rep.identity, "stream", rep.stream)
		return status.Errorf(codes.PermissionDenied,
			"authorization policy changed: no grant for client identity %s", rep.ident)
	}
	l.mu.Lock()
	rep.grant, rep.version = &g, v
	l.mu.Unlock()
	return nil
}

func (l *LRS) add(ctx context.Context, p place, outcome string, n int64) {
	if n > 0 {
		l.requests.Add(ctx, n, metric.WithAttributes(append(p.attrs(),
			attribute.String("outcome", outcome))...))
	}
}

func (p place) attrs() []attribute.KeyValue {
	return []attribute.KeyValue{attribute.String("task", p.task),
		attribute.String("datacenter", p.dc), attribute.String("locality", p.zone)}
}

// count is a report's count as a counter adds it.
func count(n uint64) int64 { return int64(min(n, maxReportCount)) }

// capped is a+n, at most maxReportCount (a and n are within it).
func capped(a, n int64) int64 { return min(a+n, maxReportCount) }

// addCapped adds n to m[k], the sum at most maxReportCount.
func addCapped[K comparable](m map[K]int64, k K, n int64) { m[k] = capped(m[k], n) }

// placeOf labels a locality a report names for task: its datacenter and
// zone when task has executors there, else OtherLabel.
func (s servedSet) placeOf(task string, loc *corev3.Locality) place {
	if task == OtherLabel {
		return place{OtherLabel, OtherLabel, OtherLabel}
	}
	zones, ok := s.tasks[task][loc.GetRegion()]
	if !ok {
		return place{task, OtherLabel, OtherLabel}
	}
	p := place{task: task, dc: s.dcLabel(loc.GetRegion()), zone: loc.GetZone()}
	if !zones[p.zone] {
		p.zone = OtherLabel
	}
	return p
}

// dcLabel is a locality region's datacenter label: leasehold's own for the
// unnamed region.
func (s servedSet) dcLabel(region string) string {
	if region == "" {
		return s.local
	}
	return region
}

// servedLocked is what the latest view serves, worked out again when the
// view changed (once per view, and only when a report or a collection asks);
// the label sets new in it are exported at 0. l.mu is held.
func (l *LRS) servedLocked() servedSet {
	if l.views == nil {
		return servedSet{}
	}
	v := l.views.View()
	if v == l.servedView {
		return l.served
	}
	s := servedSet{local: v.Local, tasks: map[string]map[string]map[string]bool{}}
	for e := range v.All() {
		if health.ValidateTask(e.Task) != nil {
			continue
		}
		dcs := s.tasks[e.Task]
		if dcs == nil {
			dcs = map[string]map[string]bool{}
			s.tasks[e.Task] = dcs
		}
		zones := dcs[e.Datacenter]
		if zones == nil {
			zones = map[string]bool{}
			dcs[e.Datacenter] = zones
		}
		zones[e.Labels[translator.ZoneLabel]] = true
	}
	l.servedView, l.served = v, s
	for task, dcs := range s.tasks {
		l.zero(place{task: task}, false) // drops
		for region, zones := range dcs {
			for zone := range zones {
				l.zero(place{task, s.dcLabel(region), zone}, true)
			}
		}
	}
	return s
}

// zero exports p's series at 0 before their first report: with all
// outcomes, or (a drop's place) only dropped.
func (l *LRS) zero(p place, all bool) {
	if l.zeroed[p] || len(l.zeroed) >= maxZeroed {
		return
	}
	l.zeroed[p] = true
	ctx := context.Background()
	outcomes := []string{OutcomeDropped}
	if all {
		outcomes = []string{OutcomeSucceeded, OutcomeFailed, OutcomeDropped}
		l.issued.Add(ctx, 0, metric.WithAttributes(p.attrs()...))
	}
	for _, o := range outcomes {
		l.requests.Add(ctx, 0, metric.WithAttributes(append(p.attrs(),
			attribute.String("outcome", o))...))
	}
}

// observeInFlight reports every (task, datacenter) served at 0 and adds
// the requests in progress of every reporter heard from within
// reporterIdleIntervals; the others no longer count.
func (l *LRS) observeInFlight(_ context.Context, obs metric.Int64Observer) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	sums := l.inFlightLocked()
	for k, n := range sums {
		obs.Observe(n, metric.WithAttributes(attribute.String("task", k.task),
			attribute.String("datacenter", k.dc)))
	}
	return nil
}

// inFlightLocked sums the live reporters' requests in progress over every
// served (task, datacenter), each at least 0, and forgets the counts of
// reporters idle too long. l.mu is held.
func (l *LRS) inFlightLocked() map[flightKey]int64 {
	s := l.servedLocked()
	sums := map[flightKey]int64{{OtherLabel, OtherLabel}: 0}
	for task, dcs := range s.tasks {
		for region := range dcs {
			sums[flightKey{task, s.dcLabel(region)}] = 0
		}
	}
	now := l.clock.Now()
	for _, r := range l.reporters {
		if now.Sub(r.last) >= l.idleAfter() {
			r.inFlight = nil
			continue
		}
		for k, n := range r.inFlight {
			_, served := s.tasks[k.task]
			if _, ok := sums[k]; !ok && (!served || k.dc != OtherLabel) {
				// Served when reported, no longer: other until it reports again.
				k = flightKey{OtherLabel, OtherLabel}
			}
			sums[k] += n
		}
	}
	return sums
}

// window counts one task type's outcomes over the last FailureRateWindow,
// in failureRateStep steps.
type window struct {
	steps [FailureRateWindow / failureRateStep]step
}

type step struct {
	n                          int64 // which step of time (now / failureRateStep)
	succeeded, failed, dropped int64
}

func (w *window) add(now time.Time, succeeded, failed, dropped int64) {
	n := now.UnixNano() / int64(failureRateStep)
	s := &w.steps[n%int64(len(w.steps))]
	if s.n != n {
		*s = step{n: n}
	}
	s.succeeded += succeeded
	s.failed += failed
	s.dropped += dropped
}

// sum is the window's counts at now.
func (w *window) sum(now time.Time) (succeeded, failed, dropped int64) {
	n := now.UnixNano() / int64(failureRateStep)
	for _, s := range w.steps {
		if s.n > n-int64(len(w.steps)) && s.n <= n {
			succeeded += s.succeeded
			failed += s.failed
			dropped += s.dropped
		}
	}
	return succeeded, failed, dropped
}

// DispatchRate is one task type's recent dispatch outcomes as its
// dispatchers reported them over LRS: over the last WindowSeconds,
// FailureRate = Failed / (Succeeded + Failed) (absent when no call
// completed); Dropped calls (never sent: circuit breaking, drop overload)
// are not in it. InFlight is what the connected dispatchers last reported
// in progress.
type DispatchRate struct {
	Task          string   `json:"task"`
	Succeeded     int64    `json:"succeeded"`
	Failed        int64    `json:"failed"`
	Dropped       int64    `json:"dropped"`
	FailureRate   *float64 `json:"failure_rate,omitempty"`
	InFlight      int64    `json:"in_flight"`
	WindowSeconds float64  `json:"window_seconds"`
}

// DispatchOutcomes is the recent dispatch outcomes of every task type
// something was reported of, or that has calls in flight, sorted by task.
type DispatchOutcomes struct {
	WindowSeconds   float64        `json:"window_seconds"`
	IntervalSeconds float64        `json:"report_interval_seconds"`
	Reporters       int            `json:"reporters"`
	Tasks           []DispatchRate `json:"tasks"`
}

// Outcomes are the recent dispatch outcomes of task ("": every task type);
// task types with nothing in the window are left out (and forgotten).
func (l *LRS) Outcomes(task string) DispatchOutcomes {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.clock.Now()
	out := DispatchOutcomes{WindowSeconds: FailureRateWindow.Seconds(),
		IntervalSeconds: l.interval.Seconds(), Reporters: len(l.reporters),
		Tasks: []DispatchRate{}}
	inFlight := map[string]int64{}
	for k, n := range l.inFlightLocked() {
		if k.task != OtherLabel {
			inFlight[k.task] += n
		}
	}
	rates := map[string]DispatchRate{}
	for name, w := range l.windows {
		var r DispatchRate
		r.Succeeded, r.Failed, r.Dropped = w.sum(now)
		if r.Succeeded+r.Failed+r.Dropped == 0 {
			delete(l.windows, name) // nothing in the window: forgotten
			continue
		}
		rates[name] = r
	}
	for name, n := range inFlight {
		if r, ok := rates[name]; ok || n > 0 {
			r.InFlight = n
			rates[name] = r
		}
	}
	for name, r := range rates {
		if task != "" && name != task {
			continue
		}
		r.Task, r.WindowSeconds = name, FailureRateWindow.Seconds()
		if done := r.Succeeded + r.Failed; done > 0 {
			rate := float64(r.Failed) / float64(done)
			r.FailureRate = &rate
		}
		out.Tasks = append(out.Tasks, r)
	}
	sort.Slice(out.Tasks, func(i, j int) bool { return out.Tasks[i].Task < out.Tasks[j].Task })
	return out
}
