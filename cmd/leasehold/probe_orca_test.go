package main

import (
	"context"
	"testing"
	"time"

	v3orcapb "github.com/cncf/xds/go/xds/data/orca/v3"

	"github.com/leasehold/leasehold/adapters/loadreport"
)

// orcaProber is a gRPC prober of an executor serving orca.
func orcaProber(t *testing.T, orca *attack16ORCA) *grpcProber {
	t.Helper()
	p, err := newProber("grpc://" + attack16Executor(t, orca))
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
	orca := &attack16ORCA{rep: &v3orcapb.OrcaLoadReport{NamedMetrics: map[string]float64{loadreport.MetricInFlight: 2}}}
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
