package translator

import (
	"encoding/json"
	"math/rand/v2"
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

func TestTranslateGolden(t *testing.T) {
	any, _ := health.NewDispatcher("", nil)
	strict, err := health.NewDispatcher(">=1.0.0, <2.0.0", map[string]string{"zone": "eu-1"})
	if err != nil {
		t.Fatal(err)
	}
	fleettest.ProtoGolden(t, "listener.json", Listener("transcode"))
	fleettest.ProtoGolden(t, "route.json", Route("transcode", dd))
	fleettest.ProtoGolden(t, "cluster.json", Cluster("transcode", health.DefaultLBPolicy, dd))
	for _, p := range health.LBPolicies[1:] {
		fleettest.ProtoGolden(t, "cluster-"+string(p)+".json", Cluster("transcode", p, dd))
	}
	for name, d := range map[string]health.Dispatcher{"any": any, "strict": strict} {
		cla, decisions := Endpoints("transcode", fleettest.GoldenFleet(),
			d), Decide(fleettest.GoldenFleet(), d)
		fleettest.ProtoGolden(t, "endpoints-"+name+".json", Expand(cla))
		type row struct{ Instance, Session, Route, Reason string }
		var rows []row
		for _, dec := range decisions {
			rows = append(rows,
				row{dec.Executor.InstanceID, dec.Executor.SessionID, string(dec.Verdict.Route),
					string(dec.Verdict.Reason)})
		}
		b, _ := json.MarshalIndent(rows, "", "  ")
		fleettest.Golden(t, "decisions-"+name+".json", append(b, '\n'))
	}
}

func TestTranslateIsDeterministic(t *testing.T) {
	any, _ := health.NewDispatcher("", nil)
	want := Endpoints("transcode", fleettest.GoldenFleet(), any)
	for range 20 {
		es := fleettest.GoldenFleet()
		rand.Shuffle(len(es), func(i, j int) { es[i], es[j] = es[j], es[i] })
		got := Endpoints("transcode", es, any)
		if Version(got) != Version(want) || !proto.Equal(got, want) {
			t.Fatal("input order changed the output")
		}
	}
	_, wantV := endpointsVersioned("transcode", fleettest.GoldenFleet(), any)
	for range 5 {
		es := fleettest.GoldenFleet()
		rand.Shuffle(len(es), func(i, j int) { es[i], es[j] = es[j], es[i] })
		if _, v := endpointsVersioned("transcode", es, any); v != wantV {
			t.Fatal("input order changed the content version")
		}
	}
	es := fleettest.GoldenFleet()
	es[0].Capacity++ // a weight changes
	if _, v := endpointsVersioned("transcode", es, any); v == wantV {
		t.Fatal("content version ignores weights")
	}
	es = fleettest.GoldenFleet()
	es[0].Load++ // the load is not in the resources (it travels over ORCA)
	if _, v := endpointsVersioned("transcode", es, any); v != wantV {
		t.Fatal("content version follows the load")
	}
	es = fleettest.GoldenFleet()
	es[3].State = health.StateActive // draining → healthy
	if _, v := endpointsVersioned("transcode", es, any); v == wantV {
		t.Fatal("content version ignores health status")
	}
	if Version(Listener("a")) == Version(Listener("b")) {
		t.Fatal("different resources share a version")
	}
	if a1, a2 := Listener("a"), Listener("a"); Version(a1) != Version(a2) {
		t.Fatal("version not stable")
	}
}

func TestWeightClamp(t *testing.T) {
	for _, tt := range []struct {
		capacity, load int
		want           uint32
	}{
		// The load never counts.
		{4, 1, 4}, {4, 4, 4}, {4, 9, 4}, {500, 0, 128}, {128, 0, 128}, {1, 0, 1}, {0, 0, 1},
	} {
		e := health.Executor{Registration: health.Registration{Capacity: tt.capacity},
			Load: tt.load}
		if got := weight(e); got != tt.want {
			t.Errorf("weight(cap %d, load %d) = %d, want %d", tt.capacity, tt.load, got, tt.want)
		}
	}
}

func TestConsistent(t *testing.T) {
	any, _ := health.NewDispatcher("", nil)
	cla := Endpoints("t", nil, any)
	ok := Consistent([]*listenerv3.Listener{Listener("t")},
		[]*routev3.RouteConfiguration{Route("t", dd)},
		[]*clusterv3.Cluster{Cluster("t", health.DefaultLBPolicy, dd)},
		[]*endpointv3.ClusterLoadAssignment{cla})
	if ok != nil {
		t.Fatal(ok)
	}
	if err := Consistent([]*listenerv3.Listener{Listener("t")}, nil, nil, nil); err == nil {
		t.Fatal("missing route not detected")
	}
	if err := Consistent(nil, []*routev3.RouteConfiguration{Route("t", dd)}, nil, nil); err == nil {
		t.Fatal("missing cluster not detected")
	}
	if err := Consistent(nil, nil, []*clusterv3.Cluster{Cluster("t", health.DefaultLBPolicy, dd)},
		nil); err == nil {
		t.Fatal("missing endpoints not detected")
	}
}

// dd is the default dispatch policy, which most tests' routes and clusters
// carry.
var dd = health.DefaultDispatch()
