package server

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	loadstatsv3 "github.com/envoyproxy/go-control-plane/envoy/service/load_stats/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	xdsserver "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/jonboulle/clockwork"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	grpchealth "google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/xds"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/testcerts"
	"github.com/leasehold/leasehold/snapshot/fleet"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// lrsFixture is a syncer fed by the test, serving tasks work (executors a
// in zone z1, b in zone z2) and other (o, no zone), and an LRS server on
// the fake clock whose metrics the test reads.
type lrsFixture struct {
	*fixture
	lrs     *LRS
	clock   *clockwork.FakeClock
	metrics *sdkmetric.ManualReader
	ca      *testcerts.CA // with secure: the CA client certificates come from
	policy  *PolicyStore  // with secure: testPolicy, in dir
	dir     string
}

type lrsOpts struct {
	secure       bool // mTLS with testPolicy
	maxReporters int
	interval     time.Duration
	register     func(*grpc.Server) // more services on the LRS server's port
}

func startLRS(t *testing.T, o lrsOpts) *lrsFixture {
	f := &lrsFixture{fixture: &fixture{t: t, obs: make(chan health.Observation, 16)},
		clock: clockwork.NewFakeClock(), metrics: sdkmetric.NewManualReader()}
	ctx, cancel := context.WithCancel(context.Background())
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	syncer := fleet.NewSyncer(fleet.SyncConfig{Logger: log, AddDelay: time.Millisecond})
	done := make(chan struct{})
	go func() { syncer.Run(ctx, f.obs); close(done) }()
	var opts []grpc.ServerOption
	lo := LRSOptions{Meter: sdkmetric.NewMeterProvider(sdkmetric.WithReader(f.metrics)),
		Clock: f.clock, MaxReporters: o.maxReporters, Interval: o.interval}
	if o.secure {
		dir := t.TempDir()
		f.dir = dir
		f.ca = testcerts.NewCA(t, "test CA")
		cert, key := f.ca.Issue(t, true, nil, "localhost")
		testcerts.WriteFile(t, filepath.Join(dir, "cert.pem"), cert)
		testcerts.WriteFile(t, filepath.Join(dir, "key.pem"), key)
		testcerts.WriteFile(t, filepath.Join(dir, "ca.pem"), f.ca.PEM)
		testcerts.WriteFile(t, filepath.Join(dir, "policy.yaml"), []byte(testPolicy))
		st, err := NewServerTLS(TLSFiles{Cert: filepath.Join(dir, "cert.pem"),
			Key: filepath.Join(dir, "key.pem"), ClientCA: filepath.Join(dir, "ca.pem")}, log)
		if err != nil {
			t.Fatal(err)
		}
		if lo.Policy, err = LoadPolicy(filepath.Join(dir, "policy.yaml"), log); err != nil {
			t.Fatal(err)
		}
		f.policy = lo.Policy
		opts = append(opts, grpc.Creds(st.Credentials()))
	}
	g := grpc.NewServer(opts...)
	f.lrs = NewLRS(syncer, log, lo)
	f.lrs.Register(g)
	if o.register != nil {
		o.register(g)
	}
	f.sync = syncer
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve(lis)
	f.addr = lis.Addr().String()
	t.Cleanup(func() { g.Stop(); cancel(); <-done })
	a, b := member("work", "a", 9001, "1.0.0"), member("work", "b", 9002, "1.0.0")
	a.Labels = map[string]string{"zone": "z1"}
	b.Labels = map[string]string{"zone": "z2"}
	f.send(health.Observation{Data: &health.TaskList{Tasks: []string{"other", "work"}}})
	f.send(health.Observation{Data: &health.NonPassing{Index: 2}})
	f.send(health.Observation{Data: &health.Generations{Index: 2}})
	f.members("work", a, b)
	f.members("other", member("other", "o", 9100, "1.0.0"))
	for v := syncer.View(); len(v.Executors()) < 3; v = syncer.View() {
		select {
		case <-v.Changed():
		case <-time.After(10 * time.Second):
			t.Fatal("the fleet was never read")
		}
	}
	return f
}

// as is a copy of the fixture whose connections present identity uri.
func (f *lrsFixture) as(uri string) *lrsFixture {
	c, fx := *f, *f.fixture
	fx.creds = f.ca.ClientCreds(f.t, f.ca, uri)
	c.fixture = &fx
	return &c
}

// reporter is one LRS client stream.
type lrsClient struct {
	f      *lrsFixture
	stream loadstatsv3.LoadReportingService_StreamLoadStatsClient
	cancel context.CancelFunc
}

// open starts a stream as node n and returns it with the server's answer
// (or its error).
func (f *lrsFixture) open(n *corev3.Node) (*lrsClient, *loadstatsv3.LoadStatsResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	f.t.Cleanup(cancel)
	s, err := loadstatsv3.NewLoadReportingServiceClient(f.dial()).StreamLoadStats(ctx)
	if err != nil {
		f.t.Fatal(err)
	}
	// A stream the server refuses at once (no grant) may end before the
	// request is sent: Send says io.EOF, and Recv has the status.
	if err := s.Send(&loadstatsv3.LoadStatsRequest{Node: n}); err != nil && err != io.EOF {
		f.t.Fatal(err)
	}
	resp, err := s.Recv()
	return &lrsClient{f: f, stream: s, cancel: cancel}, resp, err
}

// mustOpen is open that wants an answer.
func (f *lrsFixture) mustOpen(id string) *lrsClient {
	f.t.Helper()
	c, _, err := f.open(node(id, nil))
	if err != nil {
		f.t.Fatalf("LRS stream of %s: %v", id, err)
	}
	return c
}

// report sends a report and waits until the server has handled it.
func (c *lrsClient) report(stats ...*endpointv3.ClusterStats) {
	c.f.t.Helper()
	before := c.f.handled()
	if err := c.stream.Send(&loadstatsv3.LoadStatsRequest{ClusterStats: stats}); err != nil {
		c.f.t.Fatal(err)
	}
	c.f.await(func() bool { return c.f.handled() > before }, "the report to be handled")
}

// leave ends the stream and waits until the server forgot it.
func (c *lrsClient) leave() {
	before := c.f.lrs.Outcomes("").Reporters
	c.cancel()
	c.f.await(func() bool { return c.f.lrs.Outcomes("").Reporters < before },
		"the stream to be forgotten")
}

func (f *lrsFixture) handled() uint64 {
	f.lrs.mu.Lock()
	defer f.lrs.mu.Unlock()
	return f.lrs.handled
}

// await waits for cond, woken by every change of the reporters.
func (f *lrsFixture) await(cond func() bool, what string) {
	f.t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		ch := f.lrs.Changed()
		if cond() {
			return
		}
		select {
		case <-ch:
		case <-deadline:
			f.t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func clusterStats(name string, dropped uint64,
	locs ...*endpointv3.UpstreamLocalityStats) *endpointv3.ClusterStats {
	return &endpointv3.ClusterStats{ClusterName: name, TotalDroppedRequests: dropped,
		UpstreamLocalityStats: locs}
}

func localityStats(region, zone string,
	succeeded, failed, inProgress, issued uint64) *endpointv3.UpstreamLocalityStats {
	return &endpointv3.UpstreamLocalityStats{
		Locality:                &corev3.Locality{Region: region, Zone: zone},
		TotalSuccessfulRequests: succeeded, TotalErrorRequests: failed,
		TotalRequestsInProgress: inProgress, TotalIssuedRequests: issued}
}

// collect reads metric name's data points as "label=value,…" → value, for
// sums and gauges, checking that the labels are exactly want.
func (f *lrsFixture) collect(name string, labels ...string) map[string]int64 {
	f.t.Helper()
	var rm metricdata.ResourceMetrics
	if err := f.metrics.Collect(context.Background(), &rm); err != nil {
		f.t.Fatal(err)
	}
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			var points []metricdata.DataPoint[int64]
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				points = d.DataPoints
			case metricdata.Gauge[int64]:
				points = d.DataPoints
			}
			for _, dp := range points {
				if dp.Attributes.Len() != len(labels) {
					f.t.Fatalf("%s labels %v, want exactly %v", name, dp.Attributes.ToSlice(), labels)
				}
				var key []string
				for _, l := range labels {
					v, ok := dp.Attributes.Value(attribute.Key(l))
					if !ok {
						f.t.Fatalf("%s labels %v, want %v", name, dp.Attributes.ToSlice(), labels)
					}
					key = append(key, v.AsString())
				}
				out[strings.Join(key, "/")] += dp.Value
			}
		}
	}
	return out
}

// requests is leasehold.dispatch.requests by task/datacenter/locality/outcome,
// the series at 0 left out.
func (f *lrsFixture) requests() map[string]int64 {
	out := f.collect("leasehold.dispatch.requests", "task", "datacenter", "locality", "outcome")
	for k, v := range out {
		if v == 0 {
			delete(out, k)
		}
	}
	return out
}

// inFlight is leasehold.dispatch.requests_in_flight by task/datacenter.
func (f *lrsFixture) inFlight() map[string]int64 {
	return f.collect("leasehold.dispatch.requests_in_flight", "task", "datacenter")
}

func equalCounts(got, want map[string]int64) bool {
	if len(got) != len(want) {
		return false
	}
	for k, v := range want {
		if got[k] != v {
			return false
		}
	}
	return true
}

// Reports of two dispatchers add up, exactly, per task type (a shard's
// calls are its task's), the executors' datacenter and zone, and outcome;
// drops have no locality; the in-flight gauge is the latest report's.
func TestLoadReportsAggregateIntoDispatchMetrics(t *testing.T) {
	f := startLRS(t, lrsOpts{})
	d1, resp, err := f.open(node("d1", nil))
	if err != nil {
		t.Fatal(err)
	}
	if !resp.GetSendAllClusters() ||
		resp.GetLoadReportingInterval().AsDuration() != DefaultLoadReportInterval {
		t.Fatalf("LRS answer %v: want send_all_clusters and a %s interval", resp,
			DefaultLoadReportInterval)
	}
	// A client that does not announce send_all_clusters is named the task types.
	if got := resp.GetClusters(); !slices.Equal(got, []string{"other", "work"}) {
		t.Fatalf("clusters asked of a client without send_all_clusters: %v", got)
	}
	withAll := node("d-all", nil)
	withAll.ClientFeatures = []string{"envoy.lrs.supports_send_all_clusters"}
	if _, resp, err := f.open(withAll); err != nil || len(resp.GetClusters()) != 0 ||
		!resp.GetSendAllClusters() {
		t.Fatalf("a client announcing send_all_clusters: %v %v", resp, err)
	}
	d1.report(
		clusterStats("work", 4,
			localityStats("", "z1", 5, 2, 3, 7), localityStats("", "z2", 1, 0, 1, 1)),
		clusterStats("work/shard-1", 0, localityStats("", "z1", 2, 1, 0, 3)),
	)
	d2 := f.mustOpen("d2")
	d2.report(clusterStats("other", 0, localityStats("", "", 3, 0, 2, 3)))
	want := map[string]int64{
		"work//z1/succeeded": 7, "work//z1/failed": 3, "work//z2/succeeded": 1,
		"work///dropped": 4, "other///succeeded": 3,
	}
	if got := f.requests(); !equalCounts(got, want) {
		t.Errorf("leasehold.dispatch.requests %v, want %v", got, want)
	}
	issued := f.collect("leasehold.dispatch.requests_issued", "task", "datacenter", "locality")
	if issued["work//z1"] != 10 || issued["work//z2"] != 1 || issued["other//"] != 3 {
		t.Errorf("leasehold.dispatch.requests_issued %v", issued)
	}
	wantFlight := map[string]int64{"work/": 4, "other/": 2, "_other/_other": 0}
	if got := f.inFlight(); !equalCounts(got, wantFlight) {
		t.Errorf("in flight %v, want %v", got, wantFlight)
	}
	// The next report's counts add; its calls in progress replace the last.
	d1.report(clusterStats("work", 0, localityStats("", "z2", 1, 0, 0, 1)))
	want["work//z2/succeeded"] = 2
	if got := f.requests(); !equalCounts(got, want) {
		t.Errorf("after a second report: %v, want %v", got, want)
	}
	wantFlight["work/"] = 0
	if got := f.inFlight(); !equalCounts(got, wantFlight) {
		t.Errorf("after a second report, in flight %v, want %v", got, wantFlight)
	}
}

// A dispatcher that goes away, or falls silent for three intervals, no
// longer counts in flight; one that reports again does.
func TestInFlightStopsCountingWhenAReporterLeavesOrFallsSilent(t *testing.T) {
	f := startLRS(t, lrsOpts{})
	d1, d2 := f.mustOpen("d1"), f.mustOpen("d2")
	d1.report(clusterStats("work", 0, localityStats("", "z1", 0, 0, 3, 3)))
	d2.report(clusterStats("work", 0, localityStats("", "z2", 0, 0, 4, 4)))
	if got := f.inFlight()["work/"]; got != 7 {
		t.Fatalf("in flight %d, want 7", got)
	}
	d1.leave()
	if got := f.inFlight()["work/"]; got != 4 {
		t.Fatalf("after d1 left: in flight %d, want 4", got)
	}
	f.clock.Advance(reporterIdleIntervals*DefaultLoadReportInterval - time.Millisecond)
	if got := f.inFlight()["work/"]; got != 4 {
		t.Fatalf("d2 silent for less than three intervals: in flight %d, want 4", got)
	}
	f.clock.Advance(time.Millisecond)
	if got := f.inFlight()["work/"]; got != 0 {
		t.Fatalf("d2 silent for three intervals: in flight %d, want 0", got)
	}
	d2.report(clusterStats("work", 0, localityStats("", "z2", 0, 0, 1, 1)))
	if got := f.inFlight()["work/"]; got != 1 {
		t.Fatalf("d2 reporting again: in flight %d, want 1", got)
	}
}

// At most MaxReporters streams are remembered: one more is refused
// (ResourceExhausted) while all report, and makes room by ending the one
// idle for three intervals.
func TestReporterBoundRefusesBeyondAndEndsTheIdle(t *testing.T) {
	f := startLRS(t, lrsOpts{maxReporters: 3})
	var cs []*lrsClient
	for i := range 3 {
		cs = append(cs, f.mustOpen(fmt.Sprintf("d%d", i)))
	}
	for i := range 20 {
		_, _, err := f.open(node(fmt.Sprintf("more-%d", i), nil))
		if status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("stream %d beyond the bound of 3: %v, want ResourceExhausted", i, err)
		}
	}
	if n := f.lrs.Outcomes("").Reporters; n != 3 {
		t.Fatalf("%d reporters remembered, want 3", n)
	}
	f.clock.Advance(2 * DefaultLoadReportInterval)
	cs[0].report()
	cs[1].report()
	f.clock.Advance(DefaultLoadReportInterval) // d2 idle for three intervals
	if _, _, err := f.open(node("newcomer", nil)); err != nil {
		t.Fatalf("a stream when one is idle: %v", err)
	}
	if _, err := cs[2].stream.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("the idle stream made room: %v, want Unavailable", err)
	}
	if n := f.lrs.Outcomes("").Reporters; n != 3 {
		t.Fatalf("%d reporters remembered, want 3", n)
	}
	if _, _, err := f.open(node("one-more", nil)); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("no idle one left: %v, want ResourceExhausted", err)
	}
}

// Clusters, datacenters and zones leasehold does not serve are counted
// under _other: however many names a dispatcher reports, the series do
// not grow.
func TestReportsOfUnservedPlacesAddNoSeries(t *testing.T) {
	f := startLRS(t, lrsOpts{})
	d := f.mustOpen("hostile")
	hostile := func(round int) {
		var stats []*endpointv3.ClusterStats
		for i := range 50 {
			stats = append(stats,
				clusterStats(fmt.Sprintf("nope-%d-%d", round, i), 1,
					localityStats("", "z1", 1, 0, 1, 1)),
				clusterStats("work", 1,
					localityStats(fmt.Sprintf("dc-%d-%d", round, i), "z1", 1, 0, 1, 1),
					localityStats("", fmt.Sprintf("zone-%d-%d", round, i), 0, 1, 0, 1)))
		}
		d.report(stats...)
	}
	series := func() int {
		return len(f.collect("leasehold.dispatch.requests", "task", "datacenter", "locality",
			"outcome")) + len(f.inFlight())
	}
	hostile(0)
	after := series()
	want := map[string]int64{"_other/_other/_other/succeeded": 50,
		"_other/_other/_other/dropped": 50, "work///dropped": 50,
		"work/_other/_other/succeeded": 50, "work//_other/failed": 50}
	if got := f.requests(); !equalCounts(got, want) {
		t.Fatalf("counted %v, want %v", got, want)
	}
	if got := f.inFlight(); got["_other/_other"] != 50 || got["work/_other"] != 50 {
		t.Fatalf("in flight %v", got)
	}
	hostile(1)
	if n := series(); n != after {
		t.Fatalf("series grew from %d to %d with new names", after, n)
	}
}

// A report's counts are bounded per label set, not per entry: a hostile
// dispatcher naming one cluster and locality a thousand times over at the
// largest counts adds maxReportCount once (a few thousand such reports
// would otherwise wrap the counters, and the failure rate with them).
func TestAReportRepeatingOnePlaceAddsTheBoundOnce(t *testing.T) {
	f := startLRS(t, lrsOpts{})
	d := f.mustOpen("hostile")
	const huge = ^uint64(0)
	var stats []*endpointv3.ClusterStats
	for range 1000 {
		stats = append(stats, clusterStats("work", huge,
			localityStats("", "z1", huge, huge, huge, huge)))
	}
	d.report(stats...)
	want := map[string]int64{"work//z1/succeeded": maxReportCount,
		"work//z1/failed": maxReportCount, "work///dropped": maxReportCount}
	if got := f.requests(); !equalCounts(got, want) {
		t.Errorf("counted %v, want %v", got, want)
	}
	if got := f.collect("leasehold.dispatch.requests_issued", "task", "datacenter",
		"locality")["work//z1"]; got != maxReportCount {
		t.Errorf("issued %d, want %d", got, int64(maxReportCount))
	}
	if got := f.inFlight()["work/"]; got != maxReportCount {
		t.Errorf("in flight %d, want %d", got, int64(maxReportCount))
	}
	r := f.lrs.Outcomes("work").Tasks
	if len(r) != 1 || r[0].Succeeded != maxReportCount || r[0].Failed != maxReportCount ||
		r[0].FailureRate == nil || *r[0].FailureRate != 0.5 {
		t.Errorf("outcomes %+v", r)
	}
}

// The first request must carry a valid node, checked as an xDS stream's:
// InvalidArgument naming the field.
func TestLoadStatsRefusesAnInvalidNode(t *testing.T) {
	f := startLRS(t, lrsOpts{})
	for _, tt := range []struct {
		node  *corev3.Node
		field string
	}{
		{nil, "node: required"},
		{node("bad", map[string]any{"version_constraint": 5.0}), "node.metadata.version_constraint"},
		{node("bad", map[string]any{"labels": "x"}), "node.metadata.labels"},
	} {
		_, _, err := f.open(tt.node)
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("node %v: %v, want InvalidArgument naming %s", tt.node, err, tt.field)
		}
	}
	if n := f.lrs.Outcomes("").Reporters; n != 0 {
		t.Errorf("refused streams remembered: %d", n)
	}
}

// The failure rate is failed / (succeeded + failed) over the last minute;
// drops are shown apart, and older reports leave the window.
func TestFailureRateOverTheLastMinute(t *testing.T) {
	f := startLRS(t, lrsOpts{})
	d := f.mustOpen("d")
	d.report(clusterStats("work", 5, localityStats("", "z1", 90, 10, 0, 100)))
	check := func(when string, succeeded, failed, dropped int64, rate float64) {
		t.Helper()
		out := f.lrs.Outcomes("work")
		if len(out.Tasks) != 1 {
			t.Fatalf("%s: outcomes %+v", when, out)
		}
		r := out.Tasks[0]
		if r.Task != "work" || r.Succeeded != succeeded || r.Failed != failed ||
			r.Dropped != dropped || r.FailureRate == nil || *r.FailureRate != rate ||
			r.WindowSeconds != 60 {
			t.Fatalf("%s: %+v (rate %v), want %d/%d/%d rate %v over 60 s", when, r,
				r.FailureRate, succeeded, failed, dropped, rate)
		}
	}
	check("at once", 90, 10, 5, 0.1)
	f.clock.Advance(30 * time.Second)
	d.report(clusterStats("work/shard-0", 0, localityStats("", "z2", 0, 10, 0, 10)))
	check("30 s on", 90, 20, 5, 20.0/110)
	f.clock.Advance(35 * time.Second)
	d.report()
	check("65 s on", 0, 10, 0, 1)
	if out := f.lrs.Outcomes("other"); len(out.Tasks) != 0 {
		t.Fatalf("a task nothing was reported of: %+v", out.Tasks)
	}
	f.clock.Advance(time.Minute)
	if out := f.lrs.Outcomes(""); len(out.Tasks) != 0 {
		t.Fatalf("outcomes older than the window: %+v", out.Tasks)
	}
}

// Under an authorization policy, an identity without a grant may not
// report (PermissionDenied), and a granted one's reports of task types
// outside its grant count as _other.
func TestLoadReportsRefusedWithoutAGrant(t *testing.T) {
	f := startLRS(t, lrsOpts{secure: true})
	if _, _, err := f.as("spiffe://test/dispatcher/none").open(node("rogue", nil)); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("an identity without a grant: %v, want PermissionDenied", err)
	}
	if got := f.collect("leasehold.authz.denied", "api"); got["lrs"] != 1 {
		t.Errorf("denied %v, want lrs 1", got)
	}
	w := f.as("spiffe://test/dispatcher/work").mustOpen("d-work")
	w.report(clusterStats("work", 0, localityStats("", "z1", 2, 0, 0, 2)),
		clusterStats("other", 0, localityStats("", "", 3, 0, 0, 3)))
	want := map[string]int64{"work//z1/succeeded": 2, "_other/_other/_other/succeeded": 3}
	if got := f.requests(); !equalCounts(got, want) {
		t.Errorf("counted %v, want %v", got, want)
	}
}

// A policy change that takes a reporter's grant away ends its stream at its
// next report (PermissionDenied); one that narrows it applies from then on.
func TestLoadReportsFollowAPolicyChange(t *testing.T) {
	f := startLRS(t, lrsOpts{secure: true})
	w := f.as("spiffe://test/dispatcher/work").mustOpen("d-work")
	a := f.as("spiffe://test/dispatcher/all").mustOpen("d-all")
	a.report(clusterStats("other", 0, localityStats("", "", 1, 0, 0, 1)))
	testcerts.WriteFile(t, filepath.Join(f.dir, "policy.yaml"), []byte(`
dispatchers:
  - identity: spiffe://test/dispatcher/all
    tasks: [work]
`))
	f.policy.reload()
	if err := w.stream.Send(&loadstatsv3.LoadStatsRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := w.stream.Recv(); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a reporter whose grant was taken away: %v, want PermissionDenied", err)
	}
	a.report(clusterStats("other", 0, localityStats("", "", 2, 0, 0, 2)))
	want := map[string]int64{"other///succeeded": 1, "_other/_other/_other/succeeded": 2}
	if got := f.requests(); !equalCounts(got, want) {
		t.Errorf("counted %v, want %v (other no longer granted)", got, want)
	}
}

// A real grpc-go xds:/// dispatcher, whose cluster names lrs_server
// {self: {}}, reports the calls it made to leasehold's LRS: the counts
// equal the calls, within a report interval. (leasehold's own clusters name
// lrs_server once the translator emits it; here a management server of the
// test's serves translator's resources with the field set.)
func TestRealGRPCDispatcherReportsItsCalls(t *testing.T) {
	backend := grpc.NewServer()
	hs := grpchealth.NewServer()
	healthpb.RegisterHealthServer(backend, hs)
	blis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go backend.Serve(blis)
	t.Cleanup(backend.Stop)
	port := blis.Addr().(*net.TCPAddr).Port

	snaps := cache.NewSnapshotCache(false, cache.IDHash{}, nil)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	f := startLRS(t, lrsOpts{interval: MinLoadReportInterval, register: func(g *grpc.Server) {
		discovery.RegisterAggregatedDiscoveryServiceServer(g, xdsserver.NewServer(ctx, snaps, nil))
	}})
	// The load assignment the translator would send for one executor in
	// zone z1 (its eligibility is the syncer's to decide, not this test's).
	cla := &endpointv3.ClusterLoadAssignment{ClusterName: "work",
		Endpoints: []*endpointv3.LocalityLbEndpoints{{
			Locality:            &corev3.Locality{Zone: "z1"},
			LoadBalancingWeight: wrapperspb.UInt32(1),
			LbEndpoints: []*endpointv3.LbEndpoint{{
				HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{
					Address: &corev3.Address{Address: &corev3.Address_SocketAddress{
						SocketAddress: &corev3.SocketAddress{Address: "127.0.0.1",
							PortSpecifier: &corev3.SocketAddress_PortValue{
								PortValue: uint32(port)}}}}}},
				HealthStatus:        corev3.HealthStatus_HEALTHY,
				LoadBalancingWeight: wrapperspb.UInt32(1),
			}},
		}}}
	// The translator's cluster names lrs_server self; no retries, so each
	// call the test makes is one attempt the dispatcher reports.
	cluster := translator.Cluster("work", health.LBRoundRobin, health.TaskDispatch{})
	if cluster.GetLrsServer().GetSelf() == nil {
		t.Fatal("the translator's cluster does not ask for load reports (lrs_server self)")
	}
	snap, err := cache.NewSnapshot("1", map[resource.Type][]types.Resource{
		resource.ListenerType: {translator.Listener("work")},
		resource.RouteType:    {translator.Route("work", health.TaskDispatch{})},
		resource.ClusterType:  {cluster},
		resource.EndpointType: {cla},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := snaps.SetSnapshot(ctx, "e2e", snap); err != nil {
		t.Fatal(err)
	}
	bootstrap := fmt.Sprintf(`{"xds_servers": [{"server_uri": %q, "channel_creds": [{"type": "insecure"}],
		"server_features": ["xds_v3"]}], "node": {"id": "e2e"}}`, f.addr)
	xdsResolver, err := xds.NewXDSResolverWithConfigForTesting([]byte(bootstrap))
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient("xds:///work", grpc.WithResolvers(xdsResolver),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	client := healthpb.NewHealthClient(conn)
	cctx, ccancel := context.WithTimeout(ctx, 20*time.Second)
	defer ccancel()
	const succeeded, failed = 7, 3
	for range succeeded {
		if _, err := client.Check(cctx, &healthpb.HealthCheckRequest{},
			grpc.WaitForReady(true)); err != nil {
			t.Fatal(err)
		}
	}
	for range failed {
		_, err := client.Check(cctx, &healthpb.HealthCheckRequest{Service: "no-such-service"})
		if status.Code(err) != codes.NotFound {
			t.Fatalf("a failing call: %v, want NotFound", err)
		}
	}
	want := map[string]int64{"work//z1/succeeded": succeeded, "work//z1/failed": failed}
	f.await(func() bool { return equalCounts(f.requests(), want) },
		fmt.Sprintf("the reported calls to be %v (%v when the wait began)", want, f.requests()))
	if r := f.lrs.Outcomes("work").Tasks; len(r) != 1 || r[0].FailureRate == nil ||
		*r[0].FailureRate != 0.3 {
		t.Errorf("work's outcomes %+v", r)
	}
}
