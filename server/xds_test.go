package server

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
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
	"github.com/leasehold/leasehold/internal/adstest"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/snapshot/fleet"
	"github.com/leasehold/leasehold/snapshot/xdscache"
)

type fixture struct {
	t     *testing.T
	obs   chan health.Observation
	addr  string
	idx   uint64
	creds credentials.TransportCredentials // dial's; nil: plaintext
	xds   *XDS
	sync  *fleet.Syncer
}

// fixtureOpts turn the fixture's server into a TLS one with a policy.
type fixtureOpts struct {
	tls       *ServerTLS
	policy    *PolicyStore
	shardSize int // the syncer's (0: the default)
}

func member(task, inst string, port int, version string) health.Member {
	reg := health.Registration{
		InstanceID: inst,
		SessionID:  "s-" + inst,
		Generation: 1,
		Task:       task,
		Address:    "127.0.0.1",
		Port:       port,
		Version:    version,
		Capacity:   4,
		State:      health.StateActive,
	}
	return health.Member{
		Observed: health.Observed{
			Registration: reg,
			ServiceID:    health.ServiceID(inst, task),
			Node:         "n1",
			CreateIndex:  5,
		},
		Checks: []health.CheckState{
			{Node: "n1", CheckID: "serfHealth", Status: health.StatusPassing, ModifyIndex: 1},
			{
				Node:        "n1",
				CheckID:     health.CheckID(inst, "s-"+inst, task),
				ServiceID:   health.ServiceID(inst, task),
				Status:      health.StatusPassing,
				Output:      "load=0",
				ModifyIndex: 5,
			},
		},
	}
}

// startXDS runs a syncer fed by the test and an xDS server for it.
func startXDS(t *testing.T) *fixture { return startXDSWith(t, fixtureOpts{}) }

func startXDSWith(t *testing.T, so fixtureOpts) *fixture {
	f := &fixture{t: t, obs: make(chan health.Observation, 16)}
	ctx, cancel := context.WithCancel(context.Background())
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	syncer := fleet.NewSyncer(fleet.SyncConfig{Logger: log, AddDelay: time.Millisecond,
		ShardSize: so.shardSize})
	done := make(chan struct{})
	go func() { syncer.Run(ctx, f.obs); close(done) }()
	opts := []grpc.ServerOption{ServerOption()}
	if so.tls != nil {
		opts = append(opts, grpc.Creds(so.tls.Credentials()))
	}
	if a := NewFencingAuthorizer(so.policy, metricnoop.NewMeterProvider()); a != nil {
		opts = append(opts, grpc.ChainUnaryInterceptor(a.UnaryInterceptor()),
			grpc.ChainStreamInterceptor(a.StreamInterceptor()))
	}
	g := grpc.NewServer(opts...)
	f.xds = NewXDS(ctx, syncer, log, XDSOptions{Policy: so.policy})
	f.sync = syncer
	f.xds.Register(g)
	leaseholdv1.RegisterFencingServer(g, NewFencing(syncer, nowAt))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve(lis)
	f.addr = lis.Addr().String()
	t.Cleanup(func() { g.Stop(); cancel(); <-done })
	f.send(health.Observation{Data: &health.TaskList{Tasks: []string{"other", "work"}}})
	f.send(health.Observation{Data: &health.NonPassing{Index: 2}})
	f.send(health.Observation{Data: &health.Generations{Index: 2}})
	f.members("work", member("work", "a", 9001, "1.0.0"), member("work", "b", 9002, "2.0.0"))
	f.members("other", member("other", "o", 9100, "1.0.0"))
	return f
}

func (f *fixture) send(o health.Observation) { f.obs <- o }

func (f *fixture) members(task string, ms ...health.Member) {
	f.idx++
	f.send(
		health.Observation{
			Data: &health.TaskMembers{Task: task, Index: 10 + f.idx, Members: ms},
		},
	)
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

// ads opens an ADS stream to the fixture's server as node n; it ends with
// the test.
func (f *fixture) ads(n *corev3.Node) *adstest.Client { return adstest.Open(f.t, f.dial(), n) }

// delta opens an incremental ADS stream to the fixture's server as node n;
// it ends with the test.
func (f *fixture) delta(n *corev3.Node) *adstest.DeltaClient {
	return adstest.OpenDelta(f.t, f.dial(), n)
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
		a.Subscribe(resource.ListenerType, "work")
		_, err := a.Recv()
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("meta %v: err %v, want InvalidArgument naming %s", tt.meta, err, tt.field)
		}
	}
}

func TestADSExactNameSubsetsAndResubscribe(t *testing.T) {
	f := startXDS(t)
	a := f.ads(node("d1", map[string]any{"version_constraint": "<2.0.0"}))
	// a subset of the EDS names (one of two tasks), as gRPC clients ask
	a.Subscribe(resource.EndpointType, "work")
	r := a.Next()
	if got := hosts(t, r, "work"); len(got) != 1 || got[0] != "a" {
		t.Fatalf("work endpoints for <2.0.0: %v", got)
	}
	if n := names(r); len(n) != 1 {
		t.Fatalf("answered %v, want only work", n)
	}
	// ACK, then subscribe to the other as well
	a.ACK(r, "work")
	a.ACK(r, "work", "other")
	r2 := a.Next()
	if len(hosts(t, r2, "other")) != 1 {
		t.Fatalf("other not sent after subscribing: %v", names(r2))
	}
	// unsubscribe from everything, then resubscribe: answered again
	a.ACK(r2)
	a.ACK(r2, "work")
	r3 := a.Next()
	if got := hosts(t, r3, "work"); len(got) != 1 {
		t.Fatalf("resubscribe: %v", names(r3))
	}
	// listener, route and cluster by exact name
	for _, typ := range []string{resource.ListenerType, resource.RouteType, resource.ClusterType} {
		b := f.ads(node("d2", nil))
		b.Subscribe(typ, "work")
		if r := b.Next(); len(r.GetResources()) != 1 {
			t.Fatalf("%s: %d resources", typ, len(r.GetResources()))
		}
	}
}

func TestADSPushesRemovalAndReplicasAgree(t *testing.T) {
	f := startXDS(t)
	g := startXDS(t) // a second replica fed the same state
	a := f.ads(node("d1", nil))
	b := g.ads(node("d1", nil))
	a.Subscribe(resource.EndpointType, "work")
	b.Subscribe(resource.EndpointType, "work")
	ra, rb := a.Next(), b.Next()
	if ra.VersionInfo != rb.VersionInfo || !proto.Equal(ra.Resources[0], rb.Resources[0]) {
		t.Fatalf("replicas disagree: %q vs %q", ra.VersionInfo, rb.VersionInfo)
	}
	// a reconnecting client that already has the version gets nothing new
	c := g.ads(node("d1", nil))
	c.Request(resource.EndpointType, ra.VersionInfo, "", "work")
	if rc := c.Next(); rc.VersionInfo != ra.VersionInfo {
		t.Fatalf("failover answered version %q, want the same %q", rc.VersionInfo, ra.VersionInfo)
	}
	a.ACK(ra, "work")
	// b's endpoint lapses: pushed to the open stream
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
	r := a.Next()
	if got := hosts(t, r, "work"); len(got) != 1 || got[0] != "a" {
		t.Fatalf("after lapse: %v", got)
	}
	if r.VersionInfo == ra.VersionInfo {
		t.Fatal("version unchanged after a change")
	}
}

func TestDeltaXDS(t *testing.T) {
	f := startXDS(t)
	s := f.delta(node("delta-1", nil))
	s.Subscribe(resource.EndpointType, "work")
	r := s.Next()
	if len(r.Resources) != 1 || r.Resources[0].Name != "work" {
		t.Fatalf("delta response %v", r.Resources)
	}
	cla := &endpointv3.ClusterLoadAssignment{}
	r.Resources[0].Resource.UnmarshalTo(cla)
	if r.Resources[0].Version == "" {
		t.Fatal("no resource version")
	}
	s.ACK(r)
	// a change of task other must not be sent to a client subscribed to work only
	f.members("other", member("other", "o", 9100, "1.0.0"), member("other", "o2", 9101, "1.0.0"))
	// then a change of work is
	f.send(
		health.Observation{Data: &health.NonPassing{Index: 100, Checks: []health.CheckState{
			{
				Node:        "n1",
				CheckID:     health.CheckID("a", "s-a", "work"),
				ServiceID:   "work:a",
				Status:      health.StatusCritical,
				ModifyIndex: 100,
			},
		}}},
	)
	r2 := s.Next()
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
	a.Subscribe(resource.EndpointType, "work", "other")
	r := a.Next()
	if n := names(r); len(n) != 2 {
		t.Fatalf("initial EDS %v", n)
	}
	a.ACK(r, "work", "other")
	l := f.ads(node("d1", nil))
	l.Subscribe(resource.ListenerType, "work", "other")
	lr := l.Next()
	l.ACK(lr, "work", "other")

	// task other gains an executor: only other's endpoints are sent
	f.members("other", member("other", "o", 9100, "1.0.0"), member("other", "o2", 9101, "1.0.0"))
	r2 := a.Next()
	if n := names(r2); len(n) != 1 || n[0] != "other" {
		t.Fatalf("EDS update carried %v, want only other", n)
	}
	if r2.VersionInfo == r.VersionInfo {
		t.Fatal("type version unchanged")
	}
	// listeners did not change: nothing is sent on the LDS stream; a full-state
	// type is resent whole only when one of its resources changes
	f.send(health.Observation{Data: &health.TaskList{Tasks: []string{"other", "work", "new"}}})
	f.members("new", member("new", "n", 9200, "1.0.0"))
	l.ACK(lr, "work", "other", "new")
	lr2 := l.Next()
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
	if err := eds.Send(&discovery.DiscoveryRequest{Node: node("per-type", nil),
		TypeUrl: resource.EndpointType, ResourceNames: []string{"work"}}); err != nil {
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
	if err := lds.Send(&discovery.DeltaDiscoveryRequest{Node: node("per-type", nil),
		TypeUrl: resource.ListenerType, ResourceNamesSubscribe: []string{"work"}}); err != nil {
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

// envoyNode is a node as Envoy sends it on every request: its id and
// metadata, and a user agent, build version and the extensions it has.
func envoyNode(meta map[string]any) *corev3.Node {
	st, _ := structpb.NewStruct(meta)
	n := &corev3.Node{Id: "envoy-1", Cluster: "dispatchers", Metadata: st, UserAgentName: "envoy",
		UserAgentVersionType: &corev3.Node_UserAgentBuildVersion{
			UserAgentBuildVersion: &corev3.BuildVersion{Metadata: st},
		}}
	for i := range 300 {
		n.Extensions = append(n.Extensions,
			&corev3.Extension{
				Name:     fmt.Sprintf("envoy.filters.http.f%d", i),
				Category: "envoy.filters.http",
				TypeUrls: []string{"type.googleapis.com/x.y.Z"},
			},
		)
	}
	return n
}

// The nodes sameDispatch calls the same are those sameNode would let go on
// after a full check: everything but the id and what the cache's GroupOf
// reads (metadata keys and locality region) may differ.
func TestSameDispatch(t *testing.T) {
	base := map[string]any{
		"version_constraint": "<2.0.0",
		"labels":             map[string]any{"zone": "eu-1"},
		"endpoint_metadata":  "session",
		"owner":              "a",
	}
	a := envoyNode(base)
	same := envoyNode(base)
	same.UserAgentName = "envoy-2"
	same.Extensions = same.Extensions[:10]
	same.Metadata.Fields["owner"] = structpb.NewStringValue("b")
	if !sameDispatch(a, same) {
		t.Fatal("a node differing outside the dispatch keys counted as another")
	}
	for _, k := range []string{health.NodeMetaVersionConstraint, health.NodeMetaLabels,
		xdscache.NodeMetaGrantedTasks, xdscache.NodeMetaEndpointMetadata,
		health.NodeMetaDatacenter, xdscache.NodeMetaWeightedClusters} {
		b := proto.Clone(a).(*corev3.Node)
		b.Metadata.Fields[k] = structpb.NewStringValue("other")
		if sameDispatch(a, b) {
			t.Errorf("%s changed: counted as the same", k)
		}
		delete(b.Metadata.Fields, k)
		if _, had := a.Metadata.Fields[k]; had && sameDispatch(a, b) {
			t.Errorf("%s dropped: counted as the same", k)
		}
	}
	other := proto.Clone(a).(*corev3.Node)
	other.Id = "envoy-2"
	if sameDispatch(a, other) {
		t.Error("another node id counted as the same")
	}
	region := proto.Clone(a).(*corev3.Node)
	region.Locality = &corev3.Locality{Region: "dc2"}
	if sameDispatch(a, region) {
		t.Error("another locality region (the datacenter without metadata) counted as the same")
	}
}

// What each ACK of an Envoy dispatcher (its whole node on every request)
// costs to tell that its node is unchanged.
func BenchmarkSameNode(b *testing.B) {
	meta := map[string]any{"version_constraint": "<2.0.0", "labels": map[string]any{"zone": "eu-1"}}
	x, y := envoyNode(meta), envoyNode(meta)
	b.Run("proto.Equal", func(b *testing.B) {
		for b.Loop() {
			proto.Equal(x, y)
		}
	})
	b.Run("sameDispatch", func(b *testing.B) {
		for b.Loop() {
			sameDispatch(x, y)
		}
	})
}

// go-control-plane numbers SotW and delta streams with separate counters, so
// the first stream of each is stream 1: both must be listed, and the end of
// one must leave the other (and its constraint set) in place.
func TestSotwAndDeltaStreamsOfOneNumberAreKeptApart(t *testing.T) {
	f := startXDS(t)
	s := f.ads(node("sotw-1", map[string]any{"version_constraint": "<2.0.0"}))
	s.Subscribe(resource.EndpointType, "work")
	s.ACK(s.Next(), "work")
	d := f.delta(node("delta-1", nil))
	d.Subscribe(resource.EndpointType, "work")
	d.ACK(d.Next())
	modes := func() map[string]string {
		out := map[string]string{}
		for _, i := range f.xds.Dispatchers() {
			out[i.NodeID] = i.Mode
		}
		return out
	}
	if got := modes(); got["sotw-1"] != "sotw" || got["delta-1"] != "delta" {
		t.Fatalf("dispatchers %v, want sotw-1 (sotw) and delta-1 (delta)", got)
	}
	s.Close()
	deadline := time.Now().Add(5 * time.Second)
	for got := modes(); got["sotw-1"] != ""; got = modes() {
		if time.Now().After(deadline) {
			t.Fatalf("closed SotW stream still listed: %v", got)
		}
		<-time.After(10 * time.Millisecond) // Dispatchers has no watch API
	}
	if got := modes(); got["delta-1"] != "delta" {
		t.Fatalf("closing the SotW stream took the delta one with it: %v", got)
	}
}

// A later request whose node keeps the version constraint, labels and
// endpoint metadata but names another datacenter (metadata or locality
// region) or turns weighted clusters off is another constraint set: the
// stream ends with InvalidArgument naming the field. It must never go on
// with its next watch in a group nothing subscribed, where no publication
// (no lapse) would reach it again.
func TestANodeChangingItsDatacenterOrClustersEndsTheStream(t *testing.T) {
	first := map[string]any{"version_constraint": "<2.0.0"}
	for _, tt := range []struct {
		name, field string
		node        func() *corev3.Node
	}{
		{"same node", "", func() *corev3.Node { return node("d1", first) }},
		{"datacenter", "node.metadata.datacenter", func() *corev3.Node {
			return node("d1", map[string]any{"version_constraint": "<2.0.0", "datacenter": "dc2"})
		}},
		{"locality region", "node.metadata.datacenter", func() *corev3.Node {
			n := node("d1", first)
			n.Locality = &corev3.Locality{Region: "dc2"}
			return n
		}},
		{"weighted clusters off", "node.metadata.weighted_clusters", func() *corev3.Node {
			return node("d1", map[string]any{"version_constraint": "<2.0.0",
				"weighted_clusters": false})
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := startXDS(t)
			f.members("work", member("work", "a", 9001, "1.0.0"))
			a := f.ads(node("d1", first))
			a.Subscribe(resource.EndpointType, "work")
			r := a.Next()
			a.Node = tt.node()
			a.ACK(r, "work", "other") // ACK, and ask for more
			got := make(chan error, 1)
			go func() {
				_, err := a.Recv()
				got <- err
			}()
			select {
			case err := <-got:
				switch {
				case tt.field == "" && err != nil:
					t.Fatalf("the same node: %v, want an answer", err)
				case tt.field != "" && (status.Code(err) != codes.InvalidArgument ||
					!strings.Contains(status.Convert(err).Message(), tt.field)):
					t.Fatalf("err %v, want InvalidArgument naming %s", err, tt.field)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("the request naming \"other\" was never answered nor refused: its watch " +
					"sits in a group no constraint set publishes")
			}
		})
	}
}

// endpointsState is what /debug/dispatchers says node id's stream follows of
// load assignments, and whether the stream is among the followers of load.
func endpointsState(f *fixture, id, load string) (ti *TypeInfo, follows bool, types []string) {
	for _, s := range f.xds.Dispatchers() {
		if s.NodeID != id {
			continue
		}
		for k := range s.Types {
			types = append(types, k)
		}
		ti = s.Types[resource.EndpointType]
		f.xds.mu.Lock()
		_, follows = f.xds.followers[s.Group][load][streamKey(s.Stream, s.Mode == "delta")]
		f.xds.mu.Unlock()
	}
	return ti, follows, types
}

// go-control-plane forgets a type's nonce once it processes a request (the
// new watch's nonce is ""), so until its next response any request of the
// type is processed, whatever nonce it carries. A client that ACKs, then
// asks for other names without a nonce, is sent them: what leasehold says
// the stream follows must be those names.
func TestASotwRequestAfterAnACKIsFollowedWhateverItsNonce(t *testing.T) {
	f := startXDS(t)
	a := f.ads(node("renamer", nil))
	a.Subscribe(resource.EndpointType, "work")
	r := a.Next()
	a.ACK(r, "work") // processed: go-control-plane's watch has no nonce now
	time.Sleep(100 * time.Millisecond)
	a.Request(resource.EndpointType, "", "", "other") // nonce "": a confused client
	r2 := a.Next()
	if got := names(r2); len(got) != 1 || got[0] != "other" {
		t.Fatalf("go-control-plane sent %v, want [other] (it processed the request)", got)
	}
	ti, follows, _ := endpointsState(f, "renamer", "other")
	if ti == nil || len(ti.Subscribed) != 1 || ti.Subscribed[0] != "other" || !follows {
		t.Fatalf("go-control-plane pushes the stream \"other\"; leasehold says it subscribes %v, "+
			"follows other: %v", ti.Subscribed, follows)
	}
}

// The per-type delta EDS service: go-control-plane calls
// OnStreamDeltaRequest before it fills in an empty type URL (the
// state-of-the-world server fills it in first), then serves load
// assignments. The stream must be seen to follow what it is sent.
func TestADeltaEDSRequestWithoutTypeURLIsFollowedAsEndpoints(t *testing.T) {
	f := startXDS(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	eds, err := endpointservice.NewEndpointDiscoveryServiceClient(f.dial()).DeltaEndpoints(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := eds.Send(&discovery.DeltaDiscoveryRequest{Node: node("no-type", nil),
		ResourceNamesSubscribe: []string{"work"}}); err != nil {
		t.Fatal(err)
	}
	r, err := eds.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if r.GetTypeUrl() != resource.EndpointType || len(r.GetResources()) != 1 {
		t.Fatalf("go-control-plane answered %s %v", r.GetTypeUrl(), r.GetResources())
	}
	if err := eds.Send(&discovery.DeltaDiscoveryRequest{ResponseNonce: r.GetNonce()}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	ti, follows, types := endpointsState(f, "no-type", "work")
	if ti == nil || !slices.Equal(ti.Subscribed, []string{"work"}) || !follows ||
		ti.LastAcked == "" || slices.Contains(types, "") {
		t.Fatalf("sent load assignment work; leasehold's types %q, endpoints %+v, follows work: %v",
			types, ti, follows)
	}
}

// A delta stream adding names request after request is ended, with
// InvalidArgument naming the field, once it would subscribe more than
// maxSubscribedNames of one type (the subscription and each request's work
// would otherwise grow without end), and the refusal says why; the stream's
// first requests, under the bound, are answered.
func TestAStreamSubscribingTooManyNamesIsEnded(t *testing.T) {
	f := startXDS(t)
	f.members("work", member("work", "a", 9001, "1.0.0"))
	d := f.delta(node("greedy", nil))
	batch := func(round int) []string {
		names := make([]string, 0, maxSubscribedNames/2+1)
		if round == 0 {
			names = append(names, "work")
		}
		for i := range maxSubscribedNames / 2 {
			names = append(names, fmt.Sprintf("t%d-%d", round, i))
		}
		return names
	}
	d.Subscribe(resource.EndpointType, batch(0)...)
	d.ACK(d.Next()) // "work" is answered
	d.Subscribe(resource.EndpointType, batch(1)...)
	_, err := d.Recv()
	if status.Code(err) != codes.InvalidArgument ||
		!strings.Contains(status.Convert(err).Message(), "resource_names_subscribe") {
		t.Fatalf("subscribing %d names: %v, want InvalidArgument naming resource_names_subscribe",
			maxSubscribedNames+1, err)
	}
	refused, _ := f.xds.Refusals()
	if len(refused) != 1 || refused[0].Reason != RefusedTooManyNames || refused[0].NodeID != "greedy" {
		t.Fatalf("refusals %+v, want greedy's too-many-names", refused)
	}
}
