package translator

import (
	"fmt"
	"testing"

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

// layoutOf spells a load assignment's localities: "p<priority>:<region>/<zone>×<endpoints>(w<weight>)".
func layoutOf(b *Builder, es []health.Executor, d health.Dispatcher) []string {
	var out []string
	for _, l := range b.BuildPrinted("work", es, nil, d).CLA.GetEndpoints() {
		out = append(out, fmt.Sprintf("p%d:%s/%s×%d(w%d)", l.GetPriority(), l.GetLocality().GetRegion(), l.GetLocality().GetZone(), len(l.GetLbEndpoints()), l.GetLoadBalancingWeight().GetValue()))
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
		dcExecutor("dc2", "z1", "b1", 3), dcExecutor("dc2", "z2", "b2", 4), dcExecutor("dc2", "z2", "b3", 5),
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
	in := func(dc string) health.Dispatcher { d, _ := health.NewDispatcher("", nil); return d.InDatacenter(dc) }
	w := weight(all[0])
	for _, c := range []struct {
		name string
		es   []health.Executor
		d    health.Dispatcher
		want []string
	}{
		{"no datacenter named: leasehold's own first", all, in(""), []string{"p0:dc1/×2(w1)", fmt.Sprintf("p1:dc2/z1×1(w%d)", w), fmt.Sprintf("p1:dc2/z2×2(w%d)", 2*w), "p2:dc3/×1(w1)", "p3:dc9/×1(w1)"}},
		{"in dc2", all, in("dc2"), []string{fmt.Sprintf("p0:dc2/z1×1(w%d)", w), fmt.Sprintf("p0:dc2/z2×2(w%d)", 2*w), "p1:dc1/×2(w1)", "p2:dc3/×1(w1)", "p3:dc9/×1(w1)"}},
		{"in dc3", all, in("dc3"), []string{"p0:dc3/×1(w1)", "p1:dc1/×2(w1)", fmt.Sprintf("p2:dc2/z1×1(w%d)", w), fmt.Sprintf("p2:dc2/z2×2(w%d)", 2*w), "p3:dc9/×1(w1)"}},
		{"in dc1, dc1 empty: dc2 moves up", without("dc1"), in("dc1"), []string{fmt.Sprintf("p0:dc2/z1×1(w%d)", w), fmt.Sprintf("p0:dc2/z2×2(w%d)", 2*w), "p1:dc3/×1(w1)", "p2:dc9/×1(w1)"}},
		{"in dc2, dc2 empty", without("dc2"), in("dc2"), []string{"p0:dc1/×2(w1)", "p1:dc3/×1(w1)", "p2:dc9/×1(w1)"}},
		{"in a datacenter not watched: the order", all, in("dc7"), []string{"p0:dc1/×2(w1)", fmt.Sprintf("p1:dc2/z1×1(w%d)", w), fmt.Sprintf("p1:dc2/z2×2(w%d)", 2*w), "p2:dc3/×1(w1)", "p3:dc9/×1(w1)"}},
	} {
		if err := (&Builder{Failover: f}).BuildPrinted("work", c.es, nil, c.d).CLA.ValidateAll(); err != nil {
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
		t.Fatalf("naming leasehold's own datacenter and naming none share the key %q (a configuration change would move them)", d1.Key())
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
