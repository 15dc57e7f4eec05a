package translator

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"reflect"
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
		statuses := []health.CheckStatus{health.StatusPassing, health.StatusWarning,
			health.StatusCritical, "", "maintenance"}
		versions := []string{"1.0.0", "1.5.2", "2.0.0", "0.9.0-rc.1", "garbage"}
		var es []health.Executor
		addresses := []string{"10.0.0.0", "10.0.0.1", "::ffff:10.0.0.1", "10.0.0.3",
			"exec.internal"}
		for i := range int(n) {
			e := health.Executor{
				Registration: health.Registration{
					InstanceID: fmt.Sprintf("i%d", rng.IntN(8)),
					SessionID:  fmt.Sprintf("s%d", rng.IntN(3)),
					Generation: uint64(rng.IntN(4) + 1),
					Task:       "work",
					Address:    addresses[rng.IntN(len(addresses))],
					Port:       9000 + i%4 + rng.IntN(2),
					Version:    versions[rng.IntN(len(versions))],
					Capacity:   rng.IntN(300),
					State: []health.State{health.StateActive,
						health.StateDraining}[rng.IntN(2)],
				},
				ServiceID:   fmt.Sprintf("work:i%d-%d", i, rng.IntN(3)),
				Node:        fmt.Sprintf("n%d", rng.IntN(3)),
				LeaseStatus: statuses[rng.IntN(len(statuses))], LeaseFound: rng.IntN(5) > 0,
				NodeChecks: statuses[rng.IntN(3)], Load: rng.IntN(400),
				LapseSeen: rng.IntN(10) == 0,
			}
			if rng.IntN(10) == 0 {
				e.Err = fmt.Errorf("bad metadata")
			}
			es = append(es, e)
		}
		health.Fence(es, nil)
		cla, version := endpointsVersioned("work", es, d)
		if err := Consistent([]*listenerv3.Listener{Listener("work")},
			[]*routev3.RouteConfiguration{Route("work", dd)},
			[]*clusterv3.Cluster{Cluster("work", health.DefaultLBPolicy, dd)},
			[]*endpointv3.ClusterLoadAssignment{cla}); err != nil {
			t.Fatal(err)
		}
		routable := map[string]bool{}
		for _, e := range es {
			if v := health.Eligible(e, d); v.Route != health.RouteNone {
				routable[fmt.Sprintf("%s|%s|%d", e.InstanceID, e.Address, e.Port)] = true
			}
		}
		for _, loc := range Expand(cla).GetEndpoints() {
			if loc.GetLoadBalancingWeight().GetValue() == 0 {
				t.Fatal("locality weight 0: grpc-go would ignore it")
			}
			for _, lb := range loc.GetLbEndpoints() {
				sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
				key := fmt.Sprintf("%s|%s|%d", lb.GetEndpoint().GetHostname(), sa.GetAddress(),
					sa.GetPortValue())
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
		for _, loc := range Expand(cla).GetEndpoints() {
			for _, lb := range loc.GetLbEndpoints() {
				a := lb.GetEndpoint().GetAddress().GetSocketAddress().GetAddress()
				if net.ParseIP(a) == nil {
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

// FuzzExecutorPrint: two executors decoded from the fuzz input
// (executorFromFuzz) share a print exactly when every field decisions depend
// on is equal, so executors whose verdicts differ for some constraint set
// never share one (a shared print reuses the other's decision).
func FuzzExecutorPrint(f *testing.F) {
	// Seeds in testdata/fuzz/FuzzExecutorPrint: pairs that shared a print
	// when strings were NUL-terminated (the label example first).
	f.Fuzz(func(t *testing.T, da, db []byte) {
		a, b := executorFromFuzz(da), executorFromFuzz(db)
		same := decisionFieldsEqual(a, b)
		printsEqual := ExecutorPrint(&a) == ExecutorPrint(&b)
		if same && !printsEqual {
			t.Fatalf("equal executors have different prints:\n%+v\n%+v", a, b)
		}
		if !printsEqual {
			return
		}
		if !same {
			t.Fatalf("different executors share a print:\n%+v\n%+v", a, b)
		}
		for _, d := range fuzzDispatchers(a, b) {
			if va, vb := health.Eligible(a, d), health.Eligible(b, d); !reflect.DeepEqual(va, vb) {
				t.Fatalf("executors sharing a print are decided differently for %s: %+v vs %+v",
					d.Key(), va, vb)
			}
		}
	})
}

// executorFromFuzz is healthyExecutor changed by the operations in data: a
// byte naming a field, then its value (a string is a length byte and that
// many bytes, a number one byte; a flag is toggled). Unknown bytes are
// skipped.
func executorFromFuzz(data []byte) health.Executor {
	e := healthyExecutor()
	next := func() byte {
		if len(data) == 0 {
			return 0
		}
		c := data[0]
		data = data[1:]
		return c
	}
	str := func() string {
		n := min(int(next()), len(data))
		s := string(data[:n])
		data = data[n:]
		return s
	}
	num := func() uint64 { return uint64(next()) }
	ops := map[byte]func(){
		'N': func() { e.Node = str() },
		'D': func() { e.Datacenter = str() },
		'S': func() { e.ServiceID = str() },
		'i': func() { e.InstanceID = str() },
		's': func() { e.SessionID = str() },
		'g': func() { e.Generation = num() },
		't': func() { e.Task = str() },
		'a': func() { e.Address = str() },
		'p': func() { e.Port = int(num()) },
		'v': func() { e.Version = str() },
		'c': func() { e.Capacity = int(num()) },
		'z': func() { e.State = health.State(str()) },
		'l': func() {
			if e.Labels == nil {
				e.Labels = map[string]string{}
			}
			k := str()
			e.Labels[k] = str()
		},
		'r': func() { e.Replaces = append(e.Replaces, str()) },
		'e': func() { e.Err = errors.New(str()) },
		'F': func() { e.LeaseFound = !e.LeaseFound },
		'L': func() { e.LeaseStatus = health.CheckStatus(str()) },
		'n': func() { e.NodeChecks = health.CheckStatus(str()) },
		'o': func() { e.Other = health.CheckStatus(str()) },
		'd': func() { e.Load = int(num()) },
		'f': func() { e.Fenced = !e.Fenced },
		'w': func() { e.NewerSessionID = str() },
		'W': func() { e.NewerGeneration = num() },
		'x': func() { e.LapseSeen = !e.LapseSeen },
		'R': func() { e.Reach = health.Reach(num() % 3) },
		'X': func() { e.ReachDetail = str() },
		'k': func() { e.NodeFailed = !e.NodeFailed },
		'C': func() { e.CreateIndex = num() },
		'I': func() { e.LeaseCreateIndex = num() },
		'K': func() { e.CordonID = str() },
		'Q': func() { e.CordonReason = str() },
		'H': func() { e.CordonHeld = str() },
	}
	for len(data) > 0 {
		if op, ok := ops[next()]; ok {
			op()
		}
	}
	return e
}

// decisionFieldsEqual compares every field of two executors that decisions
// depend on (errors by their message).
func decisionFieldsEqual(a, b health.Executor) bool {
	if (a.Err == nil) != (b.Err == nil) || (a.Err != nil && a.Err.Error() != b.Err.Error()) {
		return false
	}
	a.Err, b.Err = nil, nil
	for _, e := range []*health.Executor{&a, &b} {
		if len(e.Labels) == 0 {
			e.Labels = nil
		}
		if len(e.Replaces) == 0 {
			e.Replaces = nil
		}
	}
	return reflect.DeepEqual(a, b)
}

// fuzzDispatchers are constraint sets that tell a's and b's fields apart: any
// version, a version range, and each label of either as a selector.
func fuzzDispatchers(a, b health.Executor) []health.Dispatcher {
	var ds []health.Dispatcher
	add := func(c string, labels map[string]string) {
		if d, err := health.NewDispatcher(c, labels); err == nil {
			ds = append(ds, d)
		}
	}
	add("", nil)
	add(">=1.0.0, <2.0.0", nil)
	for _, e := range []health.Executor{a, b} {
		for k, v := range e.Labels {
			add("", map[string]string{k: v})
		}
	}
	return ds
}
