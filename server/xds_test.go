package server

import (
	"context"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	endpointservice "github.com/envoyproxy/go-control-plane/envoy/service/endpoint/v3"
	listenerservice "github.com/envoyproxy/go-control-plane/envoy/service/listener/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

type fixture struct {
	t     *testing.T
	obs   chan health.Observation
	addr  string
	idx   uint64
	creds credentials.TransportCredentials // dial's; nil: plaintext
	xds   *XDS
}

// secureOpts turn the fixture's server into a TLS one with a policy.
type secureOpts struct {
	tls    *ServerTLS
	policy *PolicyStore
}

func member(task, inst string, port int, version string) health.Member {
	reg := health.Registration{InstanceID: inst, SessionID: "s-" + inst, Generation: 1, Task: task, Address: "127.0.0.1", Port: port, Version: version, Capacity: 4, State: health.StateActive}
	return health.Member{
		Executor: health.Executor{Registration: reg, ServiceID: health.ServiceID(inst, task), Node: "n1", CreateIndex: 5},
		Checks: []health.CheckState{
			{Node: "n1", CheckID: "serfHealth", Status: health.StatusPassing, ModifyIndex: 1},
			{Node: "n1", CheckID: health.CheckID(inst, "s-"+inst, task), ServiceID: health.ServiceID(inst, task), Status: health.StatusPassing, Output: "load=0", ModifyIndex: 5},
		},
	}
}

// startXDS runs a syncer fed by the test and an xDS server for it.
func startXDS(t *testing.T) *fixture { return startXDSWith(t, secureOpts{}) }

func startXDSWith(t *testing.T, so secureOpts) *fixture {
	f := &fixture{t: t, obs: make(chan health.Observation, 16)}
	ctx, cancel := context.WithCancel(context.Background())
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	syncer := fleet.NewSyncer(fleet.SyncConfig{Logger: log, AddDelay: time.Millisecond})
	done := make(chan struct{})
	go func() { syncer.Run(ctx, f.obs); close(done) }()
	opts := []grpc.ServerOption{ServerOption()}
	if so.tls != nil {
		opts = append(opts, grpc.Creds(so.tls.Credentials()))
	}
	if a := NewFencingAuthorizer(so.policy, metricnoop.NewMeterProvider()); a != nil {
		opts = append(opts, grpc.ChainUnaryInterceptor(a.UnaryInterceptor()), grpc.ChainStreamInterceptor(a.StreamInterceptor()))
	}
	g := grpc.NewServer(opts...)
	f.xds = NewXDS(ctx, syncer, log, XDSOptions{Policy: so.policy})
	f.xds.Register(g)
	leaseholdv1.RegisterFencingServer(g, NewFencing(syncer, nowAt))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve(lis)
	f.addr = lis.Addr().String()
	t.Cleanup(func() { g.Stop(); cancel(); <-done })
	f.send(health.Observation{Tasks: &health.TaskList{Tasks: []string{"other", "work"}}})
	f.send(health.Observation{NonPassing: &health.NonPassing{Index: 2}})
	f.send(health.Observation{Generations: &health.Generations{Index: 2}})
	f.members("work", member("work", "a", 9001, "1.0.0"), member("work", "b", 9002, "2.0.0"))
	f.members("other", member("other", "o", 9100, "1.0.0"))
	return f
}

func (f *fixture) send(o health.Observation) { f.obs <- o }

func (f *fixture) members(task string, ms ...health.Member) {
	f.idx++
	f.send(health.Observation{Members: &health.TaskMembers{Task: task, Index: 10 + f.idx, Members: ms}})
}

func node(id string, meta map[string]any) *corev3.Node {
	st, _ := structpb.NewStruct(meta)
	return &corev3.Node{Id: id, Metadata: st}
}

func (f *fixture) dial() *grpc.ClientConn {
	creds := f.creds
	if creds == nil {
		creds = insecure.NewCredentials()
	}
	conn, err := grpc.NewClient(f.addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { conn.Close() })
	return conn
}

type adsStream struct {
	t *testing.T
	s discovery.AggregatedDiscoveryService_StreamAggregatedResourcesClient
	n *corev3.Node
}

func (f *fixture) ads(n *corev3.Node) *adsStream {
	ctx, cancel := context.WithCancel(context.Background())
	f.t.Cleanup(cancel)
	s, err := discovery.NewAggregatedDiscoveryServiceClient(f.dial()).StreamAggregatedResources(ctx)
	if err != nil {
		f.t.Fatal(err)
	}
	return &adsStream{t: f.t, s: s, n: n}
}

func (a *adsStream) send(typeURL, version, nonce string, names ...string) {
	a.t.Helper()
	if err := a.s.Send(&discovery.DiscoveryRequest{Node: a.n, TypeUrl: typeURL, VersionInfo: version, ResponseNonce: nonce, ResourceNames: names}); err != nil {
		a.t.Fatal(err)
	}
}

func (a *adsStream) recv() (*discovery.DiscoveryResponse, error) {
	a.t.Helper()
	type res struct {
		r   *discovery.DiscoveryResponse
		err error
	}
	ch := make(chan res, 1)
	go func() { r, err := a.s.Recv(); ch <- res{r, err} }()
	select {
	case r := <-ch:
		return r.r, r.err
	case <-time.After(5 * time.Second):
		a.t.Fatal("no response within 5s")
		return nil, nil
	}
}

func (a *adsStream) must() *discovery.DiscoveryResponse {
	a.t.Helper()
	r, err := a.recv()
	if err != nil {
		a.t.Fatal(err)
	}
	return r
}

func names(r *discovery.DiscoveryResponse) []string {
	var out []string
	for _, res := range r.GetResources() {
		switch r.GetTypeUrl() {
		case resource.EndpointType:
			cla := &endpointv3.ClusterLoadAssignment{}
			res.UnmarshalTo(cla)
			out = append(out, cla.GetClusterName())
		default:
			out = append(out, res.GetTypeUrl())
		}
	}
	return out
}

func hosts(t *testing.T, r *discovery.DiscoveryResponse, cluster string) []string {
	for _, res := range r.GetResources() {
		cla := &endpointv3.ClusterLoadAssignment{}
		if err := res.UnmarshalTo(cla); err != nil {
			t.Fatal(err)
		}
		if cla.GetClusterName() != cluster {
			continue
		}
		var out []string
		for _, loc := range cla.GetEndpoints() {
			for _, lb := range loc.GetLbEndpoints() {
				out = append(out, lb.GetEndpoint().GetHostname())
			}
		}
		return out
	}
	return nil
}

func TestInvalidNodeMetadataRefusedNamingTheField(t *testing.T) {
	f := startXDS(t)
	for _, tt := range []struct {
		meta  map[string]any
		field string
	}{
		{map[string]any{"version_constraint": ">= banana"}, "version_constraint"},
		{map[string]any{"version_constraint": 3.0}, "version_constraint"},
		{map[string]any{"labels": "zone=eu"}, "labels"},
		{map[string]any{"labels": map[string]any{"a.b": "x"}}, "labels.a.b"},
		{map[string]any{"labels": map[string]any{"zone": 1.0}}, "labels.zone"},
		{map[string]any{"endpoint_metadata": "compact"}, "node.metadata.endpoint_metadata"},
		{map[string]any{"endpoint_metadata": true}, "node.metadata.endpoint_metadata"},
	} {
		a := f.ads(node("bad", tt.meta))
		a.send(resource.ListenerType, "", "", "work")
		_, err := a.recv()
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("meta %v: err %v, want InvalidArgument naming %s", tt.meta, err, tt.field)
		}
	}
}

func TestADSExactNameSubsetsAndResubscribe(t *testing.T) {
	f := startXDS(t)
	a := f.ads(node("d1", map[string]any{"version_constraint": "<2.0.0"}))
	// a subset of the EDS names (one of two tasks), as gRPC clients ask
	a.send(resource.EndpointType, "", "", "work")
	r := a.must()
	if got := hosts(t, r, "work"); len(got) != 1 || got[0] != "a" {
		t.Fatalf("work endpoints for <2.0.0: %v", got)
	}
	if n := names(r); len(n) != 1 {
		t.Fatalf("answered %v, want only work", n)
	}
	// ACK, then subscribe to the other as well
	a.send(resource.EndpointType, r.VersionInfo, r.Nonce, "work")
	a.send(resource.EndpointType, r.VersionInfo, r.Nonce, "work", "other")
	r2 := a.must()
	if len(hosts(t, r2, "other")) != 1 {
		t.Fatalf("other not sent after subscribing: %v", names(r2))
	}
	// unsubscribe from everything, then resubscribe: answered again
	a.send(resource.EndpointType, r2.VersionInfo, r2.Nonce)
	a.send(resource.EndpointType, r2.VersionInfo, r2.Nonce, "work")
	r3 := a.must()
	if got := hosts(t, r3, "work"); len(got) != 1 {
		t.Fatalf("resubscribe: %v", names(r3))
	}
	// listener, route and cluster by exact name
	for _, typ := range []string{resource.ListenerType, resource.RouteType, resource.ClusterType} {
		b := f.ads(node("d2", nil))
		b.send(typ, "", "", "work")
		if r := b.must(); len(r.GetResources()) != 1 {
			t.Fatalf("%s: %d resources", typ, len(r.GetResources()))
		}
	}
}

func TestADSPushesRemovalAndReplicasAgree(t *testing.T) {
	f := startXDS(t)
	g := startXDS(t) // a second replica fed the same state
	a := f.ads(node("d1", nil))
	b := g.ads(node("d1", nil))
	a.send(resource.EndpointType, "", "", "work")
	b.send(resource.EndpointType, "", "", "work")
	ra, rb := a.must(), b.must()
	if ra.VersionInfo != rb.VersionInfo || !proto.Equal(ra.Resources[0], rb.Resources[0]) {
		t.Fatalf("replicas disagree: %q vs %q", ra.VersionInfo, rb.VersionInfo)
	}
	// a reconnecting client that already has the version gets nothing new
	c := g.ads(node("d1", nil))
	c.send(resource.EndpointType, ra.VersionInfo, "", "work")
	if rc := c.must(); rc.VersionInfo != ra.VersionInfo {
		t.Fatalf("failover answered version %q, want the same %q", rc.VersionInfo, ra.VersionInfo)
	}
	a.send(resource.EndpointType, ra.VersionInfo, ra.Nonce, "work")
	// b's endpoint lapses: pushed to the open stream
	f.send(health.Observation{NonPassing: &health.NonPassing{Index: 100, Checks: []health.CheckState{
		{Node: "n1", CheckID: health.CheckID("b", "s-b", "work"), ServiceID: "work:b", Status: health.StatusCritical, ModifyIndex: 100},
	}}})
	r := a.must()
	if got := hosts(t, r, "work"); len(got) != 1 || got[0] != "a" {
		t.Fatalf("after lapse: %v", got)
	}
	if r.VersionInfo == ra.VersionInfo {
		t.Fatal("version unchanged after a change")
	}
}

func TestDeltaXDS(t *testing.T) {
	f := startXDS(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s, err := discovery.NewAggregatedDiscoveryServiceClient(f.dial()).DeltaAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	n := node("delta-1", nil)
	if err := s.Send(&discovery.DeltaDiscoveryRequest{Node: n, TypeUrl: resource.EndpointType, ResourceNamesSubscribe: []string{"work"}}); err != nil {
		t.Fatal(err)
	}
	r, err := s.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Resources) != 1 || r.Resources[0].Name != "work" {
		t.Fatalf("delta response %v", r.Resources)
	}
	cla := &endpointv3.ClusterLoadAssignment{}
	r.Resources[0].Resource.UnmarshalTo(cla)
	if r.Resources[0].Version == "" {
		t.Fatal("no resource version")
	}
	s.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.EndpointType, ResponseNonce: r.Nonce})
	// a change of task other must not be sent to a client subscribed to work only
	f.members("other", member("other", "o", 9100, "1.0.0"), member("other", "o2", 9101, "1.0.0"))
	// then a change of work is
	f.send(health.Observation{NonPassing: &health.NonPassing{Index: 100, Checks: []health.CheckState{
		{Node: "n1", CheckID: health.CheckID("a", "s-a", "work"), ServiceID: "work:a", Status: health.StatusCritical, ModifyIndex: 100},
	}}})
	r2, err := s.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if len(r2.Resources) != 1 || r2.Resources[0].Name != "work" {
		t.Fatalf("delta update %v", r2.Resources)
	}
	if r2.Resources[0].Version == r.Resources[0].Version {
		t.Fatal("resource version unchanged")
	}
}

func TestSotwSendsOnlyChangedTaskTypes(t *testing.T) {
	f := startXDS(t)
	a := f.ads(node("d1", nil))
	a.send(resource.EndpointType, "", "", "work", "other")
	r := a.must()
	if n := names(r); len(n) != 2 {
		t.Fatalf("initial EDS %v", n)
	}
	a.send(resource.EndpointType, r.VersionInfo, r.Nonce, "work", "other") // ACK
	l := f.ads(node("d1", nil))
	l.send(resource.ListenerType, "", "", "work", "other")
	lr := l.must()
	l.send(resource.ListenerType, lr.VersionInfo, lr.Nonce, "work", "other")

	// task other gains an executor: only other's endpoints are sent
	f.members("other", member("other", "o", 9100, "1.0.0"), member("other", "o2", 9101, "1.0.0"))
	r2 := a.must()
	if n := names(r2); len(n) != 1 || n[0] != "other" {
		t.Fatalf("EDS update carried %v, want only other", n)
	}
	if r2.VersionInfo == r.VersionInfo {
		t.Fatal("type version unchanged")
	}
	// listeners did not change: nothing is sent on the LDS stream; a full-state
	// type is resent whole only when one of its resources changes
	f.send(health.Observation{Tasks: &health.TaskList{Tasks: []string{"other", "work", "new"}}})
	f.members("new", member("new", "n", 9200, "1.0.0"))
	l.send(resource.ListenerType, lr.VersionInfo, lr.Nonce, "work", "other", "new")
	lr2 := l.must()
	if len(lr2.GetResources()) != 3 {
		t.Fatalf("LDS after a new task: %d listeners, want all 3", len(lr2.GetResources()))
	}
}

func TestPerTypeServices(t *testing.T) {
	f := startXDS(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	conn := f.dial()
	eds, err := endpointservice.NewEndpointDiscoveryServiceClient(conn).StreamEndpoints(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := eds.Send(&discovery.DiscoveryRequest{Node: node("per-type", nil), TypeUrl: resource.EndpointType, ResourceNames: []string{"work"}}); err != nil {
		t.Fatal(err)
	}
	r, err := eds.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if got := hosts(t, r, "work"); len(got) != 2 {
		t.Fatalf("EDS service: %v", got)
	}
	lds, err := listenerservice.NewListenerDiscoveryServiceClient(conn).DeltaListeners(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := lds.Send(&discovery.DeltaDiscoveryRequest{Node: node("per-type", nil), TypeUrl: resource.ListenerType, ResourceNamesSubscribe: []string{"work"}}); err != nil {
		t.Fatal(err)
	}
	dr, err := lds.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if len(dr.Resources) != 1 || dr.Resources[0].Name != "work" {
		t.Fatalf("delta LDS service: %v", dr.Resources)
	}
}
