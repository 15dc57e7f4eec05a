package main

import (
	"context"
	"testing"
	"time"

	v3orcapb "github.com/cncf/xds/go/xds/data/orca/v3"

	"math"
	"net"
	"sync/atomic"

	v3orcaservicepb "github.com/cncf/xds/go/xds/service/orca/v3"
	"github.com/hashicorp/consul/api"
	"google.golang.org/grpc"
	grpchealth "google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/adapters/loadreport"
	"github.com/leasehold/leasehold/health"
)

// orcaProber is a gRPC prober of an executor serving orca.
func orcaProber(t *testing.T, orca *scriptedORCA) *grpcProber {
	t.Helper()
	p, err := newProber("grpc://" + orcaExecutor(t, orca))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p.(*grpcProber)
}

// probeLoad probes once and returns the load the prober then holds.
func probeLoad(t *testing.T, p *grpcProber) (int, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := p.Probe(ctx); err != nil {
		t.Fatal(err)
	}
	return p.Load()
}

// A probe that gets no load report keeps the last one for a few probes (an
// overloaded executor answers slowly: it must not read as free at once),
// then stops counting it.
func TestGRPCProbeKeepsTheLastLoadForAFewMisses(t *testing.T) {
	orca := &scriptedORCA{
		rep: &v3orcapb.OrcaLoadReport{
			NamedMetrics: map[string]float64{loadreport.MetricInFlight: 2},
		},
	}
	p := orcaProber(t, orca)
	if n, ok := probeLoad(t, p); n != 2 || !ok {
		t.Fatalf("load %d (%v), want 2", n, ok)
	}
	orca.hang.Store(true)
	for i := range maxORCAMisses {
		if n, ok := probeLoad(t, p); n != 2 || !ok {
			t.Fatalf("miss %d: load %d (%v), want the last one, 2", i+1, n, ok)
		}
	}
	if _, ok := probeLoad(t, p); ok {
		t.Fatal("a load kept after more misses than maxORCAMisses")
	}
	orca.hang.Store(false)
	if n, ok := probeLoad(t, p); n != 2 || !ok {
		t.Fatalf("answering again: load %d (%v), want 2", n, ok)
	}
}

// scriptedORCA is an executor's out-of-band ORCA service that sends rep, or
// with hang nothing at all.
type scriptedORCA struct {
	v3orcaservicepb.UnimplementedOpenRcaServiceServer
	rep  *v3orcapb.OrcaLoadReport
	hang atomic.Bool
}

func (f *scriptedORCA) StreamCoreMetrics(_ *v3orcaservicepb.OrcaLoadReportRequest,
	s grpc.ServerStreamingServer[v3orcapb.OrcaLoadReport]) error {
	if !f.hang.Load() {
		if err := s.Send(f.rep); err != nil {
			return err
		}
	}
	<-s.Context().Done()
	return s.Context().Err()
}

// orcaExecutor serves the standard health service (SERVING) and orca.
func orcaExecutor(t *testing.T, orca *scriptedORCA) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, grpchealth.NewServer())
	v3orcaservicepb.RegisterOpenRcaServiceServer(srv, orca)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

// An executor whose ORCA report claims more tasks in flight than an int64
// holds (or +Inf) is full by any reading — not "reports nothing, load 0".
// A float64 beyond int64's range converts to an implementation-defined value
// (math.MinInt64 on amd64), which the prober must not take for "no report".
func TestORCAHugeLoadIsFull(t *testing.T) {
	for name, rep := range map[string]*v3orcapb.OrcaLoadReport{
		"in_flight 1e300": {NamedMetrics: map[string]float64{loadreport.MetricInFlight: 1e300}},
		"in_flight +Inf": {
			NamedMetrics: map[string]float64{loadreport.MetricInFlight: math.Inf(1)}},
		"in_flight 2^63": {
			NamedMetrics: map[string]float64{loadreport.MetricInFlight: math.Ldexp(1, 63)}},
		"utilization 1e300 × cap 2": {ApplicationUtilization: 1e300,
			NamedMetrics: map[string]float64{loadreport.MetricCapacity: 2}},
		"utilization 1 × cap 1e300": {ApplicationUtilization: 1,
			NamedMetrics: map[string]float64{loadreport.MetricCapacity: 1e300}},
		"utilization +Inf × cap 2": {ApplicationUtilization: math.Inf(1),
			NamedMetrics: map[string]float64{loadreport.MetricCapacity: 2}},
	} {
		t.Run(name, func(t *testing.T) {
			n, ok := probeLoad(t, orcaProber(t, &scriptedORCA{rep: rep}))
			if !ok || n < 1<<20 {
				t.Fatalf("Load() = %d, %v after a report of %v: want a huge load (full), reported",
					n, ok, rep)
			}
		})
	}
	// Nonsense that is not a load stays "no report".
	for name, rep := range map[string]*v3orcapb.OrcaLoadReport{
		"in_flight NaN": {NamedMetrics: map[string]float64{loadreport.MetricInFlight: math.NaN()}},
		"in_flight -Inf": {
			NamedMetrics: map[string]float64{loadreport.MetricInFlight: math.Inf(-1)}},
		"negative cap": {ApplicationUtilization: 0.5,
			NamedMetrics: map[string]float64{loadreport.MetricCapacity: -4}},
	} {
		t.Run(name, func(t *testing.T) {
			if n, ok := probeLoad(t, orcaProber(t, &scriptedORCA{rep: rep})); ok || n != 0 {
				t.Fatalf("Load() = %d, %v after a report of %v: want 0, false", n, ok, rep)
			}
		})
	}
}

// An executor that is healthy but whose ORCA stream never sends a report
// must not cost it its lease. The probe context is bounded by the heartbeat,
// and the heartbeat is stamped before the probe: with the shortest lease the
// flags allow (2× the heartbeat), a probe that waits out its whole context
// for an optional load report sends the renewal when the lease is already
// over, and the sidecar loses its session over and over.
func TestHangingORCAKeepsTheLease(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	hanging := &scriptedORCA{}
	hanging.hang.Store(true)
	addr := orcaExecutor(t, hanging)
	inProcess(t, sidecarArgs(a, "grpc://"+addr, "--lease", "1s", "--heartbeat", "500ms"))
	first := waitStatus(t, c, "transcode", api.HealthPassing, "")
	sess := first.Service.Meta[health.MetaSessionID]
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		es, _, err := c.Health().Service("transcode", "", false, nil)
		if err != nil {
			t.Fatal(err)
		}
		e, ch := leaseCheck(es)
		if e == nil || ch == nil {
			t.Fatalf("registration gone %s after it passed", time.Until(deadline))
		}
		if got := e.Service.Meta[health.MetaSessionID]; got != sess ||
			ch.Status != api.HealthPassing {
			t.Fatalf("a hanging ORCA stream cost a healthy executor its lease: "+
				"session %s → %s, check %s", sess, got, ch.Status)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
