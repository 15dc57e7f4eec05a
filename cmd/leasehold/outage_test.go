package main

import (
	"context"
	"net/http"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
)

// edsSessions asks leasehold over ADS for task work's endpoints once and
// returns instance → session of each.
func edsSessions(t *testing.T, xdsAddr string) map[string]string {
	t.Helper()
	return openEDS(t, xdsAddr)()
}

// adsTo opens an ADS stream to leasehold that lives until the test ends.
func adsTo(t *testing.T, xdsAddr string) discovery.AggregatedDiscoveryService_StreamAggregatedResourcesClient {
	t.Helper()
	conn, err := grpc.NewClient(xdsAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); conn.Close() })
	s, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// openEDS opens an ADS stream for task work's endpoints; each call of the
// returned func waits for the next response (ACKing the previous one).
func openEDS(t *testing.T, xdsAddr string) func() map[string]string {
	t.Helper()
	s := adsTo(t, xdsAddr)
	req := &discovery.DiscoveryRequest{Node: &corev3.Node{Id: "probe"}, TypeUrl: resource.EndpointType, ResourceNames: []string{"work"}}
	if err := s.Send(req); err != nil {
		t.Fatal(err)
	}
	return func() map[string]string {
		t.Helper()
		type res struct {
			r   *discovery.DiscoveryResponse
			err error
		}
		ch := make(chan res, 1)
		go func() { r, err := s.Recv(); ch <- res{r, err} }()
		var r *discovery.DiscoveryResponse
		select {
		case got := <-ch:
			if got.err != nil {
				t.Fatal(got.err)
			}
			r = got.r
		case <-time.After(20 * time.Second):
			t.Fatal("no EDS response within 20s")
		}
		req.VersionInfo, req.ResponseNonce = r.VersionInfo, r.Nonce
		s.Send(req) // ACK
		return sessionsOf(r)
	}
}

// edsVersions is the version_info leasehold answers for task work's endpoints.
func edsVersions(t *testing.T, xdsAddr string) string {
	t.Helper()
	s := adsTo(t, xdsAddr)
	if err := s.Send(&discovery.DiscoveryRequest{Node: &corev3.Node{Id: "version-probe"}, TypeUrl: resource.EndpointType, ResourceNames: []string{"work"}}); err != nil {
		t.Fatal(err)
	}
	r, err := s.Recv()
	if err != nil {
		t.Fatal(err)
	}
	return r.VersionInfo
}

func sessionsOf(r *discovery.DiscoveryResponse) map[string]string {
	out := map[string]string{}
	for _, res := range r.GetResources() {
		cla := &endpointv3.ClusterLoadAssignment{}
		res.UnmarshalTo(cla)
		for _, loc := range cla.GetEndpoints() {
			for _, lb := range loc.GetLbEndpoints() {
				md := lb.GetMetadata().GetFilterMetadata()["leasehold"].GetFields()
				out[md["instance_id"].GetStringValue()] = md["session_id"].GetStringValue()
			}
		}
	}
	return out
}

func TestServeSurvivesConsulOutage(t *testing.T) {
	a := consultest.Start(t)
	e1 := startExecutor(t, a, "e1", "1.0.0")
	e2 := startExecutor(t, a, "e2", "1.0.0")
	addrs := startServe(t, a)
	readyz := func() int { return readyzStatus(addrs.admin) }
	awaitReadyz := func(want int) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		tick := time.NewTicker(50 * time.Millisecond) // /readyz has no watch API: poll it
		defer tick.Stop()
		for readyz() != want {
			if time.Now().After(deadline) {
				t.Fatalf("/readyz never returned %d", want)
			}
			<-tick.C
		}
	}

	d := startDispatcher(t, addrs.xds, "dispatcher", map[string]any{})
	start := time.Now()
	d.await(t, start, 20*time.Second, "calls to e1 and e2", func(cs []callResult) bool { m := servedBy(cs); return m["e1"] > 0 && m["e2"] > 0 })
	awaitReadyz(http.StatusOK)
	before := edsSessions(t, addrs.xds)

	// Consul goes away: leasehold keeps serving the last snapshot, not ready.
	a.Stop()
	down := time.Now()
	awaitReadyz(http.StatusServiceUnavailable)
	d.await(t, down.Add(2*time.Second), 10*time.Second, "calls during the outage", func(cs []callResult) bool {
		m := servedBy(cs)
		return m["e1"] > 5 && m["e2"] > 5
	})
	for _, c := range d.since(down) {
		if c.Err != "" {
			t.Fatalf("call failed during the outage: %s", c.Err)
		}
	}
	// the metrics show the age of the last Consul contact growing
	if age := sum(scrape(t, addrs.admin)["leasehold_consul_contact_age_seconds"]); age < 1 {
		t.Fatalf("contact age %.2fs two seconds into the outage", age)
	}
	if got := edsSessions(t, addrs.xds); got["e1"] != before["e1"] || got["e2"] != before["e2"] {
		t.Fatalf("snapshot changed during the outage: %v vs %v", got, before)
	}

	// Consul returns without its state: executors re-register under new
	// sessions, leasehold resyncs, no stale session survives.
	a.Restart()
	awaitReadyz(http.StatusOK)
	// One ADS stream: read pushes until the served sessions are the current ones.
	watch := openEDS(t, addrs.xds)
	deadline := time.After(20 * time.Second)
	for {
		got := watch()
		cur1, cur2 := e1.reg.Session(), e2.reg.Session()
		if cur1 != nil && cur2 != nil && len(got) == 2 && got["e1"] == cur1.ID && got["e2"] == cur2.ID && got["e1"] != before["e1"] && got["e2"] != before["e2"] {
			break
		}
		select {
		case <-deadline:
			t.Fatalf("after the outage leasehold serves %v (before %v)", got, before)
		default:
		}
	}
	resync := time.Now()
	d.await(t, resync, 10*time.Second, "calls after the resync", func(cs []callResult) bool { m := servedBy(cs); return m["e1"] > 0 && m["e2"] > 0 })
}

func TestTwoReplicasServeIdenticalVersions(t *testing.T) {
	a := consultest.Start(t)
	startExecutor(t, a, "e1", "1.0.0")
	startExecutor(t, a, "e2", "1.2.0")
	addrs := []listening{startServe(t, a), startServe(t, a)}
	versions := func(addr string) map[string]string {
		s := adsTo(t, addr)
		out := map[string]string{}
		node := &corev3.Node{Id: "replica-probe"}
		for _, typ := range []string{resource.ListenerType, resource.RouteType, resource.ClusterType, resource.EndpointType} {
			if err := s.Send(&discovery.DiscoveryRequest{Node: node, TypeUrl: typ, ResourceNames: []string{"work"}}); err != nil {
				t.Fatal(err)
			}
			r, err := s.Recv()
			if err != nil {
				t.Fatal(err)
			}
			out[typ] = r.VersionInfo
			if typ == resource.EndpointType && len(sessionsOf(r)) != 2 {
				t.Fatalf("replica %s serves %v", addr, sessionsOf(r))
			}
		}
		return out
	}
	v0, v1 := versions(addrs[0].xds), versions(addrs[1].xds)
	for typ, v := range v0 {
		if v1[typ] != v || v == "" {
			t.Fatalf("%s: replica versions %q and %q", typ, v, v1[typ])
		}
	}
}
