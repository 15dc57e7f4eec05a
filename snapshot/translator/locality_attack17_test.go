package translator

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// a17GRPCAccepts applies the checks grpc-go's EDS parser makes
// (xdsresource.parseEDSRespProto, grpc v1.85) and Envoy's validation: it
// returns why a client would NACK the load assignment ("" if none).
func a17GRPCAccepts(cla *endpointv3.ClusterLoadAssignment) string {
	if err := cla.ValidateAll(); err != nil {
		return "Envoy validation: " + err.Error()
	}
	priorities := map[uint32]bool{}
	localities := map[string]bool{}
	addrs := map[string]bool{}
	for _, l := range cla.GetEndpoints() {
		if l.GetLocality() == nil {
			return "a locality without ID"
		}
		if l.GetLoadBalancingWeight().GetValue() == 0 {
			return fmt.Sprintf("locality %v has weight 0 (grpc-go ignores it)", l.GetLocality())
		}
		id := l.GetLocality().GetRegion() + "\x00" + l.GetLocality().GetZone() + "\x00" + l.GetLocality().GetSubZone()
		if localities[id] {
			return fmt.Sprintf("duplicate locality %v", l.GetLocality())
		}
		localities[id] = true
		priorities[l.GetPriority()] = true
		if len(l.GetLbEndpoints()) == 0 {
			return fmt.Sprintf("locality %v has no endpoint", l.GetLocality())
		}
		for _, lb := range l.GetLbEndpoints() {
			sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
			a := fmt.Sprintf("%s:%d", sa.GetAddress(), sa.GetPortValue())
			if addrs[a] {
				return "duplicate endpoint address " + a
			}
			addrs[a] = true
			if lb.GetLoadBalancingWeight() != nil && lb.GetLoadBalancingWeight().GetValue() == 0 {
				return "endpoint weight 0 " + a
			}
		}
	}
	for p := range len(priorities) {
		if !priorities[uint32(p)] {
			return fmt.Sprintf("priority %d missing (priorities %v)", p, priorities)
		}
	}
	return ""
}

// a17Mutate changes one executor of a several-datacenter fleet (or the
// fleet): reach, datacenter, zone, lease, state, sockets, sessions.
func a17Mutate(r *rand.Rand, es *[]health.Executor, dcs []string) {
	if len(*es) == 0 {
		*es = append(*es, dcExecutor(dcs[0], "", "seed", 10000))
		return
	}
	switch r.IntN(4) {
	case 0: // a datacenter's reach changes for all its executors
		dc := dcs[r.IntN(len(dcs))]
		reach := []health.Reach{health.Reached, health.Unanswered, health.Lost}[r.IntN(3)]
		for i := range *es {
			if (*es)[i].Datacenter == dc {
				(*es)[i].Reach = reach
			}
		}
		return
	case 1: // the same instance registers in another datacenter (it moved), at a socket maybe in use there
		fleet := *es
		n := fleet[r.IntN(len(fleet))]
		n.Datacenter = dcs[r.IntN(len(dcs))]
		n.SessionID = fmt.Sprintf("m%d", r.IntN(1000))
		n.Generation++
		n.Node = fmt.Sprintf("n%d", r.IntN(3))
		*es = append(fleet, n)
		return
	case 2: // a zone label
		e := &(*es)[r.IntN(len(*es))]
		e.Labels = map[string]string{ZoneLabel: []string{"", "z1", "z2", "z3"}[r.IntN(4)]}
		return
	}
	mutate(r, es)
	for i := range *es { // joiners come from fleettest.Executors: give them a datacenter
		if (*es)[i].Datacenter == "" {
			(*es)[i].Datacenter = dcs[r.IntN(len(dcs))]
		}
	}
}

// Random several-datacenter fleets (reach, zones, moved instances, shared
// sockets across datacenters, every executor of a datacenter gone): every
// load assignment, for dispatchers in each datacenter, in one not watched
// and in none, is one grpc-go and Envoy accept (weights ≥ 1, no duplicate
// locality or address, priorities from 0 without gaps), puts the
// dispatcher's own datacenter at priority 0 when it has a routed endpoint,
// never routes a lost datacenter's executor, and an incremental build equals
// a fresh one (bytes and version). (Holds.)
func TestAttack17LocalitiesAlwaysAccepted(t *testing.T) {
	dcs := []string{"dc1", "dc2", "dc3"}
	f := Failover{Local: "dc1", Order: dcs}
	r := rand.New(rand.NewPCG(17, 17))
	for _, ddc := range []string{"", "dc1", "dc2", "dc3", "dc9"} {
		d, err := health.NewDispatcher("", nil)
		if err != nil {
			t.Fatal(err)
		}
		d = d.InDatacenter(ddc)
		es := fleettest.Executors(60)
		for i := range es {
			es[i].Datacenter = dcs[i%3]
			es[i].Port = 10000 + i%20 // sockets shared across datacenters
		}
		bl := &Builder{Failover: f}
		for step := range 400 {
			for range 1 + r.IntN(3) {
				a17Mutate(r, &es, dcs)
			}
			got := bl.BuildPrinted("work", es, nil, d)
			if why := a17GRPCAccepts(got.CLA); why != "" {
				t.Fatalf("dispatcher in %q, step %d: a client would reject the assignment: %s", ddc, step, why)
			}
			fresh := (&Builder{Failover: f}).BuildPrinted("work", es, nil, d)
			if !bytes.Equal(marshal(t, got.CLA), marshal(t, fresh.CLA)) || got.Version != fresh.Version {
				t.Fatalf("dispatcher in %q, step %d: incremental build differs from a fresh one", ddc, step)
			}
			own := ddc
			if own == "" {
				own = "dc1"
			}
			ownRouted := false
			for _, e := range es {
				v := health.Eligible(e, d)
				if e.Datacenter == own && v.Route != health.RouteNone {
					ownRouted = true
				}
			}
			lost := map[string]bool{}
			for _, e := range es {
				if e.Reach == health.Lost {
					lost[e.InstanceID+"/"+e.SessionID+"@"+e.Datacenter] = true
				}
			}
			for _, l := range got.CLA.GetEndpoints() {
				if l.GetPriority() == 0 && ownRouted && l.GetLocality().GetRegion() != own {
					// its own datacenter may still have lost every endpoint to duplicates
					hasOwn := false
					for _, l2 := range got.CLA.GetEndpoints() {
						hasOwn = hasOwn || l2.GetLocality().GetRegion() == own
					}
					if hasOwn {
						t.Fatalf("dispatcher in %q, step %d: %s at priority 0 while %s has endpoints", ddc, step, l.GetLocality().GetRegion(), own)
					}
				}
				for _, lb := range l.GetLbEndpoints() {
					md := lb.GetMetadata().GetFilterMetadata()["leasehold"].GetFields()
					key := md["instance_id"].GetStringValue() + "/" + md["session_id"].GetStringValue() + "@" + l.GetLocality().GetRegion()
					if lost[key] {
						t.Fatalf("dispatcher in %q, step %d: %s of a lost datacenter is routed (%s)", ddc, step, key, lb.GetHealthStatus())
					}
					if lb.GetHealthStatus() != corev3.HealthStatus_HEALTHY && lb.GetHealthStatus() != corev3.HealthStatus_DRAINING {
						t.Fatalf("dispatcher in %q, step %d: endpoint status %s", ddc, step, lb.GetHealthStatus())
					}
				}
			}
		}
	}
}
