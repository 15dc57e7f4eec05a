package snapshot

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/health"
)

var update = flag.Bool("update", false, "rewrite golden files")

func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./snapshot -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs from golden file (go test ./snapshot -update to accept):\n%s", name, got)
	}
}

func protoGolden(t *testing.T, name string, m proto.Message) {
	t.Helper()
	b, err := protojson.MarshalOptions{Multiline: true, Indent: "  "}.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	// protojson randomises whitespace between runs; normalise through encoding/json.
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatal(err)
	}
	out, _ := json.MarshalIndent(v, "", "  ")
	golden(t, name, append(out, '\n'))
}

func fleet() []health.Executor {
	mk := func(inst, sess string, gen uint64, port int, mut func(*health.Executor)) health.Executor {
		e := health.Executor{
			Registration: health.Registration{
				InstanceID: inst, SessionID: sess, Generation: gen, Task: "transcode",
				Address: "127.0.0.1", Port: port, Version: "1.4.2", Capacity: 4,
				State: health.StateActive, Labels: map[string]string{"zone": "eu-1"},
			},
			ServiceID: health.ServiceID(inst, "transcode"), Node: "node-a",
			Lease: health.StatusPassing, LeaseFound: true, NodeChecks: health.StatusPassing, Load: 1,
		}
		if mut != nil {
			mut(&e)
		}
		return e
	}
	es := []health.Executor{
		mk("exec-healthy", "s1", 1, 9001, nil),
		mk("exec-idle", "s1", 1, 9002, func(e *health.Executor) { e.Load = 0; e.Capacity = 500 }),
		mk("exec-full", "s1", 1, 9003, func(e *health.Executor) { e.Lease = health.StatusWarning; e.Load = 4 }),
		mk("exec-draining", "s1", 1, 9004, func(e *health.Executor) { e.State = health.StateDraining; e.Load = 3 }),
		mk("exec-lapsed", "s1", 1, 9005, func(e *health.Executor) { e.Lease = health.StatusCritical }),
		mk("exec-restarted", "old", 1, 9006, nil),
		mk("exec-restarted", "new", 2, 9007, func(e *health.Executor) { e.Node = "node-b" }),
		mk("exec-v2", "s1", 1, 9008, func(e *health.Executor) { e.Version = "2.0.0" }),
		mk("exec-us", "s1", 1, 9009, func(e *health.Executor) { e.Labels = map[string]string{"zone": "us-1"} }),
		mk("exec-bad", "s1", 1, 9010, func(e *health.Executor) { e.Err = errors.New("capacity \"abc\": not an integer") }),
		// A host name: Envoy would reject the whole assignment over it.
		mk("exec-dns", "s1", 1, 9011, func(e *health.Executor) { e.Address = "exec-dns.internal" }),
		// Two instances claiming one socket: the lowest instance id is sent.
		mk("exec-twin-b", "s1", 1, 9012, nil),
		mk("exec-twin-a", "s1", 1, 9012, nil),
	}
	health.Fence(es, nil)
	return es
}

func TestTranslateGolden(t *testing.T) {
	any, _ := health.NewDispatcher("", nil)
	strict, err := health.NewDispatcher(">=1.0.0, <2.0.0", map[string]string{"zone": "eu-1"})
	if err != nil {
		t.Fatal(err)
	}
	protoGolden(t, "listener.json", Listener("transcode"))
	protoGolden(t, "route.json", Route("transcode"))
	protoGolden(t, "cluster.json", Cluster("transcode", health.DefaultLBPolicy))
	for _, p := range health.LBPolicies[1:] {
		protoGolden(t, "cluster-"+string(p)+".json", Cluster("transcode", p))
	}
	for name, d := range map[string]health.Dispatcher{"any": any, "strict": strict} {
		cla, decisions := Endpoints("transcode", fleet(), d), Decide(fleet(), d)
		protoGolden(t, "endpoints-"+name+".json", cla)
		type row struct{ Instance, Session, Route, Reason string }
		var rows []row
		for _, dec := range decisions {
			rows = append(rows, row{dec.Executor.InstanceID, dec.Executor.SessionID, string(dec.Verdict.Route), string(dec.Verdict.Reason)})
		}
		b, _ := json.MarshalIndent(rows, "", "  ")
		golden(t, "decisions-"+name+".json", append(b, '\n'))
	}
}

func TestTranslateIsDeterministic(t *testing.T) {
	any, _ := health.NewDispatcher("", nil)
	want := Endpoints("transcode", fleet(), any)
	for range 20 {
		es := fleet()
		rand.Shuffle(len(es), func(i, j int) { es[i], es[j] = es[j], es[i] })
		got := Endpoints("transcode", es, any)
		if Version(got) != Version(want) || !proto.Equal(got, want) {
			t.Fatal("input order changed the output")
		}
	}
	_, wantV := EndpointsVersioned("transcode", fleet(), any)
	for range 5 {
		es := fleet()
		rand.Shuffle(len(es), func(i, j int) { es[i], es[j] = es[j], es[i] })
		if _, v := EndpointsVersioned("transcode", es, any); v != wantV {
			t.Fatal("input order changed the content version")
		}
	}
	es := fleet()
	es[0].Capacity++ // a weight changes
	if _, v := EndpointsVersioned("transcode", es, any); v == wantV {
		t.Fatal("content version ignores weights")
	}
	es = fleet()
	es[0].Load++ // the load is not in the resources (it travels over ORCA)
	if _, v := EndpointsVersioned("transcode", es, any); v != wantV {
		t.Fatal("content version follows the load")
	}
	es = fleet()
	es[3].State = health.StateActive // draining → healthy
	if _, v := EndpointsVersioned("transcode", es, any); v == wantV {
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
		{4, 1, 4}, {4, 4, 4}, {4, 9, 4}, {500, 0, 128}, {128, 0, 128}, {1, 0, 1}, {0, 0, 1}, // the load never counts
	} {
		e := health.Executor{Registration: health.Registration{Capacity: tt.capacity}, Load: tt.load}
		if got := Weight(e); got != tt.want {
			t.Errorf("Weight(cap %d, load %d) = %d, want %d", tt.capacity, tt.load, got, tt.want)
		}
	}
}

func TestConsistent(t *testing.T) {
	any, _ := health.NewDispatcher("", nil)
	cla := Endpoints("t", nil, any)
	ok := Consistent([]*listenerv3.Listener{Listener("t")}, []*routev3.RouteConfiguration{Route("t")}, []*clusterv3.Cluster{Cluster("t", health.DefaultLBPolicy)}, []*endpointv3.ClusterLoadAssignment{cla})
	if ok != nil {
		t.Fatal(ok)
	}
	if err := Consistent([]*listenerv3.Listener{Listener("t")}, nil, nil, nil); err == nil {
		t.Fatal("missing route not detected")
	}
	if err := Consistent(nil, []*routev3.RouteConfiguration{Route("t")}, nil, nil); err == nil {
		t.Fatal("missing cluster not detected")
	}
	if err := Consistent(nil, nil, []*clusterv3.Cluster{Cluster("t", health.DefaultLBPolicy)}, nil); err == nil {
		t.Fatal("missing endpoints not detected")
	}
}
