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

func dcExecutor(dc, zone, inst string, port int) health.Executor {
	e := fleettest.Executors(1)[0]
	e.InstanceID, e.ServiceID, e.Datacenter, e.Port = inst, "work:"+inst, dc, port
	e.Labels = map[string]string{}
	if zone != "" {
		e.Labels[ZoneLabel] = zone
	}
	return e
}

// layoutOf spells a load assignment's localities, each as
// "p<priority>:<region>/<zone>×<endpoints>(w<weight>)".
func layoutOf(b *Builder, es []health.Executor, d health.Dispatcher) []string {
	var out []string
	for _, l := range Expand(b.BuildPrinted("work", es, nil, d).CLA).GetEndpoints() {
		out = append(out,
			fmt.Sprintf("p%d:%s/%s×%d(w%d)", l.GetPriority(), l.GetLocality().GetRegion(),
				l.GetLocality().GetZone(), len(l.GetLbEndpoints()),
				l.GetLoadBalancingWeight().GetValue()))
	}
	return out
}

// A dispatcher's own datacenter is priority 0, the others follow in the
// failover order; a datacenter without endpoints takes no priority (grpc-go
// rejects a gap), so the next one moves up; zones of one datacenter share its
// priority, weighted by their endpoints' weights.
func TestLocalitiesByDatacenterPriority(t *testing.T) {
	f := Failover{Local: "dc1", Order: []string{"dc1", "dc2", "dc3"}}
	all := []health.Executor{
		dcExecutor("dc1", "", "a1", 1), dcExecutor("dc1", "", "a2", 2),
		dcExecutor("dc2", "z1", "b1", 3), dcExecutor("dc2", "z2", "b2", 4),
		dcExecutor("dc2", "z2", "b3", 5),
		dcExecutor("dc3", "", "c1", 6),
		dcExecutor("dc9", "", "x1", 7), // a datacenter not in the order: last
	}
	without := func(dc string) []health.Executor {
		var out []health.Executor
		for _, e := range all {
			if e.Datacenter != dc {
				out = append(out, e)
			}
		}
		return out
	}
	in := func(dc string) health.Dispatcher {
		d, _ := health.NewDispatcher("", nil)
		return d.InDatacenter(dc)
	}
	w := weight(all[0])
	for _, c := range []struct {
		name string
		es   []health.Executor
		d    health.Dispatcher
		want []string
	}{
		{"no datacenter named: leasehold's own first", all, in(""),
			[]string{"p0:dc1/×2(w1)", fmt.Sprintf("p1:dc2/z1×1(w%d)", w),
				fmt.Sprintf("p1:dc2/z2×2(w%d)", 2*w), "p2:dc3/×1(w1)", "p3:dc9/×1(w1)"}},
		{"in dc2", all, in("dc2"),
			[]string{fmt.Sprintf("p0:dc2/z1×1(w%d)", w), fmt.Sprintf("p0:dc2/z2×2(w%d)", 2*w),
				"p1:dc1/×2(w1)", "p2:dc3/×1(w1)", "p3:dc9/×1(w1)"}},
		{"in dc3", all, in("dc3"),
			[]string{"p0:dc3/×1(w1)", "p1:dc1/×2(w1)", fmt.Sprintf("p2:dc2/z1×1(w%d)", w),
				fmt.Sprintf("p2:dc2/z2×2(w%d)", 2*w), "p3:dc9/×1(w1)"}},
		{"in dc1, dc1 empty: dc2 moves up", without("dc1"), in("dc1"),
			[]string{fmt.Sprintf("p0:dc2/z1×1(w%d)", w), fmt.Sprintf("p0:dc2/z2×2(w%d)", 2*w),
				"p1:dc3/×1(w1)", "p2:dc9/×1(w1)"}},
		{"in dc2, dc2 empty", without("dc2"), in("dc2"),
			[]string{"p0:dc1/×2(w1)", "p1:dc3/×1(w1)", "p2:dc9/×1(w1)"}},
		{"in a datacenter not watched: the order", all, in("dc7"),
			[]string{"p0:dc1/×2(w1)", fmt.Sprintf("p1:dc2/z1×1(w%d)", w),
				fmt.Sprintf("p1:dc2/z2×2(w%d)", 2*w), "p2:dc3/×1(w1)", "p3:dc9/×1(w1)"}},
	} {
		if err := (&Builder{Failover: f}).BuildPrinted("work", c.es, nil,
			c.d).CLA.ValidateAll(); err != nil {
			t.Fatalf("%s: the load assignment fails Envoy's validation: %v", c.name, err)
		}
		got := layoutOf(&Builder{Failover: f}, c.es, c.d)
		if fmt.Sprint(got) != fmt.Sprint(c.want) {
			t.Errorf("%s:\n got %v\nwant %v", c.name, got, c.want)
		}
	}
}

// Dispatchers that differ only in their datacenter get different priorities,
// so they are different groups with different versions: nothing is shared.
func TestDatacenterIsPartOfTheGroupAndVersion(t *testing.T) {
	f := Failover{Local: "dc1", Order: []string{"dc1", "dc2"}}
	es := []health.Executor{dcExecutor("dc1", "", "a", 1), dcExecutor("dc2", "", "b", 2)}
	d1, _ := health.NewDispatcher(">=1.0.0", nil)
	d2 := d1.InDatacenter("dc2")
	if d1.Key() == d2.Key() {
		t.Fatalf("same key %q for dispatchers in different datacenters", d1.Key())
	}
	if d1.InDatacenter("dc1").Key() == d1.Key() {
		t.Fatalf("naming leasehold's own datacenter and naming none share the key %q (a "+
			"configuration change would move them)", d1.Key())
	}
	v1 := (&Builder{Failover: f}).BuildPrinted("work", es, nil, d1).Version
	v2 := (&Builder{Failover: f}).BuildPrinted("work", es, nil, d2).Version
	if v1 == v2 {
		t.Fatalf("equal versions %s for different priorities", v1)
	}
	// A datacenter spelled with a delimiter stays one field of the key.
	a, b := d1.InDatacenter("x&tasks=y"), d1.WithTasks([]string{"y"}).InDatacenter("x")
	if a.Key() == b.Key() {
		t.Fatalf("datacenter %q collides with a grant: %q", "x&tasks=y", a.Key())
	}
}

// clientRejection applies the checks grpc-go's EDS parser makes
// (xdsresource.parseEDSRespProto, grpc v1.85) and Envoy's validation: it
// returns why a client would NACK the load assignment ("" if none would).
func clientRejection(cla *endpointv3.ClusterLoadAssignment) string {
	if err := cla.ValidateAll(); err != nil {
		return "Envoy validation: " + err.Error()
	}
	priorities := map[uint32]bool{}
	localities := map[string]bool{}
	addrs := map[string]bool{}
	for _, l := range Expand(cla).GetEndpoints() {
		if l.GetLocality() == nil {
			return "a locality without ID"
		}
		if l.GetLoadBalancingWeight().GetValue() == 0 {
			return fmt.Sprintf("locality %v has weight 0 (grpc-go ignores it)", l.GetLocality())
		}
		id := l.GetLocality().GetRegion() + "\x00" + l.GetLocality().GetZone() + "\x00" +
			l.GetLocality().GetSubZone()
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

// mutateAcrossDatacenters changes one executor of a several-datacenter fleet (or the
// fleet): reach, datacenter, zone, lease, state, sockets, sessions.
func mutateAcrossDatacenters(r *rand.Rand, es *[]health.Executor, dcs []string) {
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
	// The same instance registers in another datacenter (it moved), at a socket maybe in use there.
	case 1:
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

// TestLocalitiesOfRandomFleetsAreAcceptedByClients: for random
// several-datacenter fleets (reach, zones, moved instances, sockets shared
// across datacenters, every executor of a datacenter gone), every load
// assignment, for dispatchers in each datacenter, in one not watched and in
// none, is one grpc-go and Envoy accept (weights ≥ 1, no duplicate locality or
// address, priorities from 0 without gaps); it puts the dispatcher's own
// datacenter at priority 0 when that has a routed endpoint, never routes a
// lost datacenter's executor, and an incremental build equals a fresh one
// (bytes and version).
func TestLocalitiesOfRandomFleetsAreAcceptedByClients(t *testing.T) {
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
				mutateAcrossDatacenters(r, &es, dcs)
			}
			got := bl.BuildPrinted("work", es, nil, d)
			if why := clientRejection(got.CLA); why != "" {
				t.Fatalf("dispatcher in %q, step %d: a client would reject the assignment: %s", ddc,
					step, why)
			}
			fresh := (&Builder{Failover: f}).BuildPrinted("work", es, nil, d)
			if !bytes.Equal(marshal(t, got.CLA), marshal(t, fresh.CLA)) ||
				got.Version != fresh.Version {
				t.Fatalf("dispatcher in %q, step %d: incremental build differs from a fresh one",
					ddc, step)
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
			for _, l := range Expand(got.CLA).GetEndpoints() {
				if l.GetPriority() == 0 && ownRouted && l.GetLocality().GetRegion() != own {
					// its own datacenter may still have lost every endpoint to duplicates
					hasOwn := false
					for _, l2 := range Expand(got.CLA).GetEndpoints() {
						hasOwn = hasOwn || l2.GetLocality().GetRegion() == own
					}
					if hasOwn {
						t.Fatalf("dispatcher in %q, step %d: %s at priority 0 while %s has "+
							"endpoints", ddc, step, l.GetLocality().GetRegion(), own)
					}
				}
				for _, lb := range l.GetLbEndpoints() {
					md := lb.GetMetadata().GetFilterMetadata()["leasehold"].GetFields()
					key := md["instance_id"].GetStringValue() + "/" +
						md["session_id"].GetStringValue() + "@" + l.GetLocality().GetRegion()
					if lost[key] {
						t.Fatalf("dispatcher in %q, step %d: %s of a lost datacenter is routed "+
							"(%s)", ddc, step, key, lb.GetHealthStatus())
					}
					if lb.GetHealthStatus() != corev3.HealthStatus_HEALTHY &&
						lb.GetHealthStatus() != corev3.HealthStatus_DRAINING {
						t.Fatalf("dispatcher in %q, step %d: endpoint status %s", ddc, step,
							lb.GetHealthStatus())
					}
				}
			}
		}
	}
}
