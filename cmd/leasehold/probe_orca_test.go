package main

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	v3orcapb "github.com/cncf/xds/go/xds/data/orca/v3"
	v3orcaservicepb "github.com/cncf/xds/go/xds/service/orca/v3"
	"google.golang.org/grpc"
	grpchealth "google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/leasehold/leasehold/adapters/loadreport"
)

// orcaServer answers with in_flight = 2, or hangs.
type orcaServer struct {
	v3orcaservicepb.UnimplementedOpenRcaServiceServer
	hang atomic.Bool
}

func (o *orcaServer) StreamCoreMetrics(_ *v3orcaservicepb.OrcaLoadReportRequest, s v3orcaservicepb.OpenRcaService_StreamCoreMetricsServer) error {
	if o.hang.Load() {
		<-s.Context().Done()
		return s.Context().Err()
	}
	if err := s.Send(&v3orcapb.OrcaLoadReport{NamedMetrics: map[string]float64{loadreport.MetricInFlight: 2}}); err != nil {
		return err
	}
	<-s.Context().Done()
	return nil
}

// A probe that gets no load report keeps the last one for a few probes (an
// overloaded executor answers slowly: it must not read as free at once),
// then stops counting it.
func TestGRPCProbeKeepsTheLastLoadForAFewMisses(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, grpchealth.NewServer())
	orca := &orcaServer{}
	v3orcaservicepb.RegisterOpenRcaServiceServer(srv, orca)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	pr, err := newProber("grpc://" + lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pr.Close() })
	p := pr.(*grpcProber)
	probe := func() (int, bool) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		if err := p.Probe(ctx); err != nil {
			t.Fatal(err)
		}
		return p.Load()
	}
	if n, ok := probe(); n != 2 || !ok {
		t.Fatalf("load %d (%v), want 2", n, ok)
	}
	orca.hang.Store(true)
	for i := range maxORCAMisses {
		if n, ok := probe(); n != 2 || !ok {
			t.Fatalf("miss %d: load %d (%v), want the last one, 2", i+1, n, ok)
		}
	}
	if _, ok := probe(); ok {
		t.Fatal("a load kept after more misses than maxORCAMisses")
	}
	orca.hang.Store(false)
	if n, ok := probe(); n != 2 || !ok {
		t.Fatalf("answering again: load %d (%v), want 2", n, ok)
	}
}
