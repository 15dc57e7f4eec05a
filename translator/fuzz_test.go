package translator

import (
	"fmt"
	"math/rand/v2"
	"net"
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"

	"github.com/leasehold/leasehold/health"
)

// FuzzTranslate: arbitrary executor sets (decided from the fuzz input) give
// a consistent resource set whose every endpoint is eligible or draining for
// the constraint set, at an IP address and a socket of its own (what every
// client accepts), with a version that does not depend on input order.
func FuzzTranslate(f *testing.F) {
	f.Add(uint64(1), uint8(5), ">=1.0.0")
	f.Add(uint64(42), uint8(40), "")
	f.Add(uint64(7), uint8(0), "<2.0.0")
	f.Fuzz(func(t *testing.T, seed uint64, n uint8, constraint string) {
		d, err := health.NewDispatcher(constraint, nil)
		if err != nil {
			return
		}
		rng := rand.New(rand.NewPCG(seed, uint64(n)))
		statuses := []health.CheckStatus{health.StatusPassing, health.StatusWarning, health.StatusCritical, "", "maintenance"}
		versions := []string{"1.0.0", "1.5.2", "2.0.0", "0.9.0-rc.1", "garbage"}
		var es []health.Executor
		addresses := []string{"10.0.0.0", "10.0.0.1", "::ffff:10.0.0.1", "10.0.0.3", "exec.internal"}
		for i := range int(n) {
			e := health.Executor{
				Registration: health.Registration{
					InstanceID: fmt.Sprintf("i%d", rng.IntN(8)), SessionID: fmt.Sprintf("s%d", rng.IntN(3)), Generation: uint64(rng.IntN(4) + 1),
					Task: "work", Address: addresses[rng.IntN(len(addresses))], Port: 9000 + i%4 + rng.IntN(2), Version: versions[rng.IntN(len(versions))],
					Capacity: rng.IntN(300), State: []health.State{health.StateActive, health.StateDraining}[rng.IntN(2)],
				},
				ServiceID: fmt.Sprintf("work:i%d-%d", i, rng.IntN(3)), Node: fmt.Sprintf("n%d", rng.IntN(3)),
				LeaseStatus: statuses[rng.IntN(len(statuses))], LeaseFound: rng.IntN(5) > 0,
				NodeChecks: statuses[rng.IntN(3)], Load: rng.IntN(400), LapseSeen: rng.IntN(10) == 0,
			}
			if rng.IntN(10) == 0 {
				e.Err = fmt.Errorf("bad metadata")
			}
			es = append(es, e)
		}
		health.Fence(es, nil)
		cla, version := endpointsVersioned("work", es, d)
		if err := Consistent([]*listenerv3.Listener{Listener("work")}, []*routev3.RouteConfiguration{Route("work")}, []*clusterv3.Cluster{Cluster("work", health.DefaultLBPolicy)}, []*endpointv3.ClusterLoadAssignment{cla}); err != nil {
			t.Fatal(err)
		}
		routable := map[string]bool{}
		for _, e := range es {
			if v := health.Eligible(e, d); v.Route != health.RouteNone {
				routable[fmt.Sprintf("%s|%s|%d", e.InstanceID, e.Address, e.Port)] = true
			}
		}
		for _, loc := range cla.GetEndpoints() {
			if loc.GetLoadBalancingWeight().GetValue() == 0 {
				t.Fatal("locality weight 0: grpc-go would ignore it")
			}
			for _, lb := range loc.GetLbEndpoints() {
				sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
				key := fmt.Sprintf("%s|%s|%d", lb.GetEndpoint().GetHostname(), sa.GetAddress(), sa.GetPortValue())
				if !routable[key] {
					t.Fatalf("endpoint %s is not eligible", key)
				}
				if w := lb.GetLoadBalancingWeight().GetValue(); w < MinWeight || w > MaxWeight {
					t.Fatalf("weight %d out of range", w)
				}
			}
		}
		if err := sendsWhatDecideRoutes(cla, es, d); err != nil {
			t.Fatal(err)
		}
		for _, loc := range cla.GetEndpoints() {
			for _, lb := range loc.GetLbEndpoints() {
				if a := lb.GetEndpoint().GetAddress().GetSocketAddress().GetAddress(); net.ParseIP(a) == nil {
					t.Fatalf("endpoint address %q is not an IP address", a)
				}
			}
		}
		rng.Shuffle(len(es), func(i, j int) { es[i], es[j] = es[j], es[i] })
		if _, v := endpointsVersioned("work", es, d); v != version {
			t.Fatal("version depends on input order")
		}
	})
}
