package main

import (
	"fmt"
	"maps"
	"net"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/internal/adstest"
)

// edsEndpoints asks leasehold over ADS for task work's endpoints once.
func edsEndpoints(t *testing.T, xdsAddr string) endpoints {
	t.Helper()
	return openEDS(t, xdsAddr)()
}

// dialADS opens an ADS stream to leasehold as node that lives until the
// test ends; a response waited for may take up to 20 s.
func dialADS(t *testing.T, xdsAddr string, node *corev3.Node) *adstest.Client {
	t.Helper()
	c := adstest.Dial(t, xdsAddr, node)
	c.Timeout = 20 * time.Second
	return c
}

// openEDS opens an ADS stream for task work's endpoints; each call of the
// returned func waits for the next response and ACKs it.
func openEDS(t *testing.T, xdsAddr string) func() endpoints {
	t.Helper()
	s := dialADS(t, xdsAddr, &corev3.Node{Id: "probe"})
	s.Subscribe(resource.EndpointType, "work")
	return func() endpoints {
		t.Helper()
		r := s.Next()
		s.ACK(r, "work")
		return endpointsOf(r)
	}
}

// edsVersions is the version_info leasehold answers for task work's endpoints.
func edsVersions(t *testing.T, xdsAddr string) string {
	t.Helper()
	s := dialADS(t, xdsAddr, &corev3.Node{Id: "version-probe"})
	s.Subscribe(resource.EndpointType, "work")
	return s.Next().VersionInfo
}

// endpoint is one routed endpoint as a dispatcher sees it. Comparing whole
// (instance, session, address) sets is what lets a test see a stale session
// served next to the current one of the same instance.
type endpoint struct{ instance, session, addr string }

// endpoints counts each endpoint of a response (a count above 1 is a
// duplicate, which grpc-go rejects).
type endpoints map[endpoint]int

func endpointSet(eps ...endpoint) endpoints {
	out := endpoints{}
	for _, e := range eps {
		out[e]++
	}
	return out
}

func (s endpoints) equal(o endpoints) bool { return maps.Equal(s, o) }

// has reports whether some endpoint of s serves this instance's session.
func (s endpoints) has(instance, session string) bool {
	for e := range s {
		if e.instance == instance && e.session == session {
			return true
		}
	}
	return false
}

func (s endpoints) String() string {
	out := make([]string, 0, len(s))
	for e, n := range s {
		x := e.instance + "/" + e.session + "@" + e.addr
		if n > 1 {
			x += fmt.Sprintf("×%d", n)
		}
		out = append(out, x)
	}
	sort.Strings(out)
	return "{" + strings.Join(out, " ") + "}"
}

func endpointsOf(r *discovery.DiscoveryResponse) endpoints {
	out := endpoints{}
	for _, res := range r.GetResources() {
		cla := &endpointv3.ClusterLoadAssignment{}
		if err := res.UnmarshalTo(cla); err != nil {
			out[endpoint{instance: "unreadable: " + err.Error()}]++
			continue
		}
		for _, loc := range cla.GetEndpoints() {
			for _, lb := range loc.GetLbEndpoints() {
				md := lb.GetMetadata().GetFilterMetadata()["leasehold"].GetFields()
				sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
				out[endpoint{
					instance: md["instance_id"].GetStringValue(),
					session:  md["session_id"].GetStringValue(),
					addr: net.JoinHostPort(sa.GetAddress(),
						strconv.Itoa(int(sa.GetPortValue()))),
				}]++
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
	d.await(t, start, 20*time.Second, "calls to e1 and e2",
		func(cs []callResult) bool { m := servedBy(cs); return m["e1"] > 0 && m["e2"] > 0 })
	awaitReadyz(http.StatusOK)
	before := edsEndpoints(t, addrs.xds)
	if want := endpointSet(e1.endpoint(), e2.endpoint()); !before.equal(want) {
		t.Fatalf("before the outage leasehold serves %v, want %v", before, want)
	}

	// Consul goes away: leasehold keeps serving the last snapshot, not ready.
	a.Stop()
	down := time.Now()
	awaitReadyz(http.StatusServiceUnavailable)
	d.await(t, down.Add(2*time.Second), 10*time.Second, "calls during the outage",
		func(cs []callResult) bool {
			m := servedBy(cs)
			return m["e1"] > 5 && m["e2"] > 5
		},
	)
	for _, c := range d.since(down) {
		if c.Err != "" {
			t.Fatalf("call failed during the outage: %s", c.Err)
		}
	}
	// the metrics show the age of the last Consul contact growing
	if age := sum(scrape(t, addrs.admin)["leasehold_consul_contact_age_seconds"]); age < 1 {
		t.Fatalf("contact age %.2fs two seconds into the outage", age)
	}
	if got := edsEndpoints(t, addrs.xds); !got.equal(before) {
		t.Fatalf("snapshot changed during the outage: %v, before %v", got, before)
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
		// exactly the new sessions: none of before's next to them
		want := endpointSet(e1.endpoint(), e2.endpoint())
		fresh := true
		for e := range before {
			fresh = fresh && !want.has(e.instance, e.session)
		}
		if fresh && got.equal(want) {
			break
		}
		select {
		case <-deadline:
			t.Fatalf("after the outage leasehold serves %v, want %v with no session of before %v",
				got, want, before)
		default:
		}
	}
	resync := time.Now()
	d.await(t, resync, 10*time.Second, "calls after the resync",
		func(cs []callResult) bool { m := servedBy(cs); return m["e1"] > 0 && m["e2"] > 0 })
}

func TestTwoReplicasServeIdenticalVersions(t *testing.T) {
	a := consultest.Start(t)
	e1, e2 := startExecutor(t, a, "e1", "1.0.0"), startExecutor(t, a, "e2", "1.2.0")
	addrs := []listening{startServe(t, a), startServe(t, a)}
	want := endpointSet(e1.endpoint(), e2.endpoint())
	versions := func(addr string) map[string]string {
		s := dialADS(t, addr, &corev3.Node{Id: "replica-probe"})
		out := map[string]string{}
		for _, typ := range []string{resource.ListenerType, resource.RouteType,
			resource.ClusterType, resource.EndpointType} {
			s.Subscribe(typ, "work")
			r := s.Next()
			out[typ] = r.VersionInfo
			if got := endpointsOf(r); typ == resource.EndpointType && !got.equal(want) {
				t.Fatalf("replica %s serves %v, want %v", addr, got, want)
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
