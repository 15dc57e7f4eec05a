package loadreport

import (
	"context"
	"net"
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
