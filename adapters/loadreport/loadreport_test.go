package loadreport

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	v3orcapb "github.com/cncf/xds/go/xds/data/orca/v3"
	v3orcaservicepb "github.com/cncf/xds/go/xds/service/orca/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/examples/workpb"
)

type work struct {
	workpb.UnimplementedWorkServer
	r *Reporter
}

func (w work) Run(ctx context.Context, req *workpb.RunRequest) (*workpb.RunResult, error) {
	defer w.r.Done()
	w.r.Report(ctx)
	return &workpb.RunResult{TaskId: req.GetTaskId()}, nil
}

// An executor reports its load in every call's trailer and on the
// out-of-band service: utilization = in flight ÷ capacity, qps from the
// tasks that ended, in_flight and capacity by name.
func TestReportsLoadPerCallAndOutOfBand(t *testing.T) {
	var inFlight atomic.Int64
	inFlight.Store(3)
	r, err := New(4, func() int { return int(inFlight.Load()) })
	if err != nil {
		t.Fatal(err)
	}
	conn := serveReporter(t, r, func(srv *grpc.Server) { workpb.RegisterWorkServer(srv, work{r: r}) })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	var trailer metadata.MD
	for i := range 3 {
		if _, err := workpb.NewWorkClient(conn).Run(ctx, &workpb.RunRequest{TaskId: "t"}, grpc.Trailer(&trailer)); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	raw := trailer.Get("endpoint-load-metrics-bin")
	if len(raw) != 1 {
		t.Fatalf("trailer %v: no ORCA load report", trailer)
	}
	var rep v3orcapb.OrcaLoadReport
	if err := proto.Unmarshal([]byte(raw[0]), &rep); err != nil {
		t.Fatal(err)
	}
	// The third call reports the two before it as done.
	if rep.GetApplicationUtilization() != 0.75 || rep.GetRpsFractional() != 2.0/qpsWindow.Seconds() ||
		rep.GetNamedMetrics()[MetricInFlight] != 3 || rep.GetNamedMetrics()[MetricCapacity] != 4 {
		t.Fatalf("per-call report %v", &rep)
	}

	inFlight.Store(9) // more than capacity (a burst): utilization stays 1
	r.update()        // what Run does every period
	stream, err := v3orcaservicepb.NewOpenRcaServiceClient(conn).StreamCoreMetrics(ctx, &v3orcaservicepb.OrcaLoadReportRequest{})
	if err != nil {
		t.Fatal(err)
	}
	oob, err := stream.Recv() // the first report comes at once
	if err != nil {
		t.Fatalf("out-of-band report: %v", err)
	}
	if oob.GetApplicationUtilization() != 1 || oob.GetNamedMetrics()[MetricInFlight] != 9 {
		t.Fatalf("out-of-band report %v", oob)
	}
}

func TestNewRefusesBadInput(t *testing.T) {
	if _, err := New(0, func() int { return 0 }); err == nil {
		t.Error("capacity 0 accepted")
	}
	if _, err := New(1, nil); err == nil {
		t.Error("no in-flight function accepted")
	}
}

// serveReporter serves r's options and out-of-band service (and whatever
// register adds) on a loopback port; returns a client connection to it.
func serveReporter(t *testing.T, r *Reporter, register ...func(*grpc.Server)) *grpc.ClientConn {
	t.Helper()
	srv := grpc.NewServer(r.ServerOption())
	for _, f := range register {
		f(srv)
	}
	if err := r.Register(srv); err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// windowClock is a settable clock for the qps window.
type windowClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *windowClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *windowClock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// An executor that counts its tasks with Done but reports only now and then
// (no Run, Report not in every handler — e.g. streaming tasks) must not keep
// every completion since it started: the qps window is 5 s.
func TestDoneWithoutReportStaysBounded(t *testing.T) {
	r, err := New(4, func() int { return 0 })
	if err != nil {
		t.Fatal(err)
	}
	clk := &windowClock{t: time.Unix(1000, 0)}
	r.now = clk.now
	for range 200_000 { // 200 s of one task per millisecond
		r.Done()
		clk.add(time.Millisecond)
	}
	r.mu.Lock()
	n := len(r.done)
	r.mu.Unlock()
	if limit := int(qpsWindow/time.Millisecond) + 1; n > limit {
		t.Fatalf("%d completions held after 200 s without a report; the qps window needs at most %d", n, limit)
	}
	r.update()
	if got, want := r.rec.ServerMetrics().QPS, 1000.0; got < want*0.99 || got > want*1.01 {
		t.Fatalf("qps %v, want ~%v", got, want)
	}
}

// The qps window: tasks that ended exactly 5 s ago still count, older not.
func TestQPSWindowEdges(t *testing.T) {
	r, err := New(4, func() int { return 0 })
	if err != nil {
		t.Fatal(err)
	}
	clk := &windowClock{t: time.Unix(1000, 0)}
	r.now = clk.now
	for range 10 {
		r.Done()
	}
	clk.add(qpsWindow)
	r.update()
	if got := r.rec.ServerMetrics().QPS; got != 2 {
		t.Fatalf("qps at the window's edge %v, want 2", got)
	}
	clk.add(time.Nanosecond)
	r.update()
	if got := r.rec.ServerMetrics().QPS; got != 0 {
		t.Fatalf("qps past the window %v, want 0", got)
	}
}

// Utilization stays within [0.5 ÷ capacity, 1] whatever the executor's
// counter says (never 0: weighted round robin ignores such a report), and
// Report outside a handler (no recorder in the context) is harmless.
func TestUtilizationBounds(t *testing.T) {
	var n atomic.Int64
	r, err := New(4, func() int { return int(n.Load()) })
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		in   int64
		want float64
	}{{-3, 0.125}, {0, 0.125}, {2, 0.5}, {4, 1}, {1 << 40, 1}} { // idle: half a task of 4
		n.Store(tt.in)
		r.Report(context.Background())
		if got := r.rec.ServerMetrics().AppUtilization; got != tt.want {
			t.Errorf("in flight %d: utilization %v, want %v", tt.in, got, tt.want)
		}
	}
}

// Every handler calls Report concurrently (and Run ticks): one update must
// not interleave with another, or the report mixes two moments — the
// utilization of one with the in_flight of another (grpc-go's recorder sets
// each field by copy-and-swap, so fields of concurrent updates interleave
// and can even be lost). Once all updates are over, the report must
// describe one state.
func TestConcurrentReportsStayConsistent(t *testing.T) {
	var calls atomic.Int64
	r, err := New(1000, func() int { return int(calls.Add(1) % 1000) })
	if err != nil {
		t.Fatal(err)
	}
	bad := 0
	for round := 0; round < 2000 && bad == 0; round++ {
		var wg sync.WaitGroup
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r.Report(context.Background())
			}()
		}
		wg.Wait()
		sm := r.rec.ServerMetrics()
		if in := sm.NamedMetrics[MetricInFlight]; sm.AppUtilization != utilization(int(in), 1000) {
			bad++
			t.Errorf("round %d: after concurrent reports, utilization %v but in_flight %v of capacity 1000", round, sm.AppUtilization, in)
		}
	}
}

// The out-of-band report is what `leasehold register` reads at each probe to
// turn the lease full or free. docs/design.md tells an executor to install
// ServerOption, call Report in each handler (as it returns), Done, and
// Register — not Run. Tasks that start do not call Report, so an executor
// that fills up with long tasks and never runs Run reports, out of band,
// the load of whenever a handler last returned: never full.
func TestOutOfBandReportIsCurrentWithoutRun(t *testing.T) {
	var inFlight atomic.Int64
	r, err := New(2, func() int { return int(inFlight.Load()) })
	if err != nil {
		t.Fatal(err)
	}
	conn := serveReporter(t, r)
	read := func() *v3orcapb.OrcaLoadReport {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		stream, err := v3orcaservicepb.NewOpenRcaServiceClient(conn).StreamCoreMetrics(ctx, &v3orcaservicepb.OrcaLoadReportRequest{})
		if err != nil {
			t.Fatal(err)
		}
		rep, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		return rep
	}
	r.Report(context.Background()) // a handler returned while idle
	inFlight.Store(2)              // two long tasks started: full
	if rep := read(); rep.GetNamedMetrics()[MetricInFlight] != 2 || rep.GetApplicationUtilization() != 1 {
		t.Fatalf("out-of-band report while full: %v, want in_flight 2, utilization 1", rep)
	}
	inFlight.Store(0)
	if rep := read(); rep.GetNamedMetrics()[MetricInFlight] != 0 {
		t.Fatalf("out-of-band report once free: %v, want in_flight 0", rep)
	}
}
