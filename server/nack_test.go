package server

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/adstest"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// observedXDS is startXDS with the server's log and metrics kept for the test.
type observedXDS struct {
	*fixture
	x       *XDS
	log     *lockedBuffer
	metrics *sdkmetric.ManualReader
}

func startObservedXDS(t *testing.T) *observedXDS {
	o := &observedXDS{
		fixture: &fixture{t: t, obs: make(chan health.Observation, 16)},
		log:     &lockedBuffer{},
		metrics: sdkmetric.NewManualReader(),
	}
	ctx, cancel := context.WithCancel(context.Background())
	log := slog.New(slog.NewTextHandler(o.log, nil))
	syncer := fleet.NewSyncer(fleet.SyncConfig{Logger: log, AddDelay: time.Millisecond})
	done := make(chan struct{})
	go func() { syncer.Run(ctx, o.obs); close(done) }()
	g := grpc.NewServer(ServerOption())
	o.x = NewXDS(ctx, syncer, log,
		XDSOptions{Meter: sdkmetric.NewMeterProvider(sdkmetric.WithReader(o.metrics))})
	o.x.Register(g)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve(lis)
	o.addr = lis.Addr().String()
	t.Cleanup(func() { g.Stop(); cancel(); <-done })
	o.send(health.Observation{Data: &health.TaskList{Tasks: []string{"other", "work"}}})
	o.send(health.Observation{Data: &health.NonPassing{Index: 2}})
	o.send(health.Observation{Data: &health.Generations{Index: 2}})
	o.members("work", member("work", "a", 9001, "1.0.0"), member("work", "b", 9002, "2.0.0"))
	o.members("other", member("other", "o", 9100, "1.0.0"))
	return o
}

// lapse makes b's lease critical: a removal from task work.
func (f *fixture) lapseB() {
	f.send(
		health.Observation{Data: &health.NonPassing{Index: 100, Checks: []health.CheckState{
			{
				Node:        "n1",
				CheckID:     health.CheckID("b", "s-b", "work"),
				ServiceID:   "work:b",
				Status:      health.StatusCritical,
				ModifyIndex: 100,
			},
		}}},
	)
}

// metric collects the server's metrics and returns the data of the one
// named (nil: not exported).
func (o *observedXDS) metric(name string) metricdata.Aggregation {
	var rm metricdata.ResourceMetrics
	if err := o.metrics.Collect(context.Background(), &rm); err != nil {
		o.t.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == name {
				return m.Data
			}
		}
	}
	return nil
}

// nacks is the leasehold.xds.nacks counter by (type URL, reason).
func (o *observedXDS) nacks() map[[2]string]int64 {
	out := map[[2]string]int64{}
	sum, _ := o.metric("leasehold.xds.nacks").(metricdata.Sum[int64])
	for _, dp := range sum.DataPoints {
		typeURL, _ := dp.Attributes.Value("type_url")
		reason, _ := dp.Attributes.Value("reason")
		if len(dp.Attributes.ToSlice()) != 2 {
			o.t.Fatalf("NACK counter labels %v: want type_url and reason only",
				dp.Attributes.ToSlice())
		}
		if dp.Value != 0 { // every known series is exported at 0 from the start
			out[[2]string{typeURL.AsString(), reason.AsString()}] += dp.Value
		}
	}
	return out
}

const duplicateDetail = "xds: resource \"work\": " +
	"duplicate endpoint with the same address 127.0.0.1:9001"

// Two dispatchers of one constraint set NACK the same version: both are
// counted (type URL and a bounded reason), the version is logged once, each
// stream shows its NACK, and the next removal still reaches both.
func TestNackCountedLoggedOnceAndNextRemovalArrives(t *testing.T) {
	o := startObservedXDS(t)
	streams := []*adstest.Client{o.ads(node("d1", nil)), o.ads(node("d2", nil))}
	var v1 string
	for _, a := range streams {
		a.Subscribe(resource.EndpointType, "work")
		r := a.Next()
		if got := hosts(t, r, "work"); len(got) != 2 {
			t.Fatalf("initial endpoints %v", got)
		}
		v1 = r.VersionInfo
		if err := a.Stream().Send(&discovery.DiscoveryRequest{TypeUrl: resource.EndpointType,
			ResponseNonce: r.Nonce, ResourceNames: []string{"work"},
			ErrorDetail: &rpcstatus.Status{Code: 3, Message: duplicateDetail}}); err != nil {
			t.Fatal(err)
		}
	}
	o.lapseB()
	for _, a := range streams {
		r := a.Next() // sent after the NACK was handled: a stream's requests are handled in order
		if got := hosts(t, r, "work"); len(got) != 1 || got[0] != "a" {
			t.Fatalf("after a NACK, the removal: %v", got)
		}
		if r.VersionInfo == v1 {
			t.Fatal("the same version again")
		}
	}
	if n := strings.Count(o.log.String(), "rejected a response (NACK)"); n != 1 {
		t.Fatalf("NACK of one version logged %d times, want once:\n%s", n, o.log.String())
	}
	if !strings.Contains(o.log.String(), "reason=duplicate") ||
		!strings.Contains(o.log.String(), v1) {
		t.Fatalf("NACK log names no reason or version:\n%s", o.log.String())
	}
	if got := o.nacks(); got[[2]string{resource.EndpointType, "duplicate"}] != 2 || len(got) != 1 {
		t.Fatalf("NACKs counted %v, want 2 of EDS, reason duplicate", got)
	}
	for _, s := range o.x.Dispatchers() {
		n := s.Types[resource.EndpointType].LastNack
		if n == nil || n.Reason != "duplicate" || n.Version != v1 || n.Detail != duplicateDetail ||
			s.Types[resource.EndpointType].Nacks != 1 {
			t.Fatalf("%s: last NACK %+v", s.NodeID, n)
		}
	}
}

func TestDeltaNackThenRemovalArrives(t *testing.T) {
	o := startObservedXDS(t)
	s := o.delta(node("delta-nacker", nil))
	s.Subscribe(resource.EndpointType, "work")
	s.NACK(s.Next(), "malformed IP address: exec.internal")
	o.lapseB()
	r2 := s.Next()
	if len(r2.Resources) != 1 {
		t.Fatalf("delta update %v", r2.Resources)
	}
	got := hosts(t, &discovery.DiscoveryResponse{Resources: []*anypb.Any{r2.Resources[0].Resource}},
		"work")
	if len(got) != 1 || got[0] != "a" {
		t.Fatalf("after a NACK, the removal: %v", got)
	}
	if n := o.nacks()[[2]string{resource.EndpointType, "address"}]; n != 1 {
		t.Fatalf("delta NACK counted %d times", n)
	}
}

func TestNackReasonIsBounded(t *testing.T) {
	for detail, want := range map[string]string{
		"":                                    "unspecified",
		duplicateDetail:                       "duplicate",
		"malformed IP address: exec.internal": "address",
		"EDS response contains an endpoint with zero weight": "weight",
		"Proto constraint validation failed (ClusterLoadAssignmentValidationError.ClusterName: value length must be at least 1 characters)": "validation",
		"failed to unmarshal resource: proto: cannot parse invalid wire-format data":                                                        "decode",
		"unexpected resource type: \"x\"":       "decode",
		"something else entirely, session 7f3a": "other",
	} {
		if got := NackReason(detail); got != want || !slices.Contains(NackReasons, got) {
			t.Errorf("NackReason(%q) = %q, want %q (one of NackReasons)", detail, got, want)
		}
	}
}
