package translator

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

func TestShardCount(t *testing.T) {
	for _, tt := range []struct{ n, size, want int }{
		{0, 1000, 1}, {1000, 1000, 1}, {1001, 1000, 2}, {2000, 1000, 2}, {2001, 1000, 3},
		{10000, 1000, 10}, {10000, 0, 1}, {10000, -1, 1}, {5, 1, 5},
	} {
		if got := ShardCount(tt.n, tt.size); got != tt.want {
			t.Errorf("ShardCount(%d, %d) = %d, want %d", tt.n, tt.size, got, tt.want)
		}
	}
}

// An executor's shard is a function of its instance id and the count alone
// (pinned here: every replica and every release must agree), the shards are
// even, and growing the count by one moves only what the new shard takes.
func TestShardOfIsStableEvenAndMovesFewWhenTheCountGrows(t *testing.T) {
	if ShardOf("exec-1", 1) != 0 || ShardOf("exec-1", 0) != 0 {
		t.Fatal("one shard (or none) is shard 0")
	}
	pinned := map[string]int{}
	for i := range 8 {
		pinned[fmt.Sprintf("exec-%d", i)] = ShardOf(fmt.Sprintf("exec-%d", i), 10)
	}
	want := map[string]int{"exec-0": 6, "exec-1": 1, "exec-2": 3, "exec-3": 6, "exec-4": 1,
		"exec-5": 1, "exec-6": 7, "exec-7": 9}
	for id, s := range want {
		if pinned[id] != s {
			t.Errorf("ShardOf(%q, 10) = %d, pinned %d: shards must not move between releases",
				id, pinned[id], s)
		}
	}
	const ids = 20000
	for _, n := range []int{2, 3, 7, 10, 16} {
		counts := make([]int, n)
		moved := 0
		for i := range ids {
			id := fmt.Sprintf("exec-%d", i)
			s := ShardOf(id, n)
			if s < 0 || s >= n {
				t.Fatalf("ShardOf(%q, %d) = %d: out of range", id, n, s)
			}
			counts[s]++
			if next := ShardOf(id, n+1); next != s {
				if next != n {
					t.Fatalf("%q moved from shard %d to %d when the count grew to %d: only to "+
						"the new shard", id, s, next, n+1)
				}
				moved++
			}
		}
		for s, c := range counts {
			if mean := float64(ids) / float64(n); math.Abs(float64(c)-mean) > 0.06*mean {
				t.Errorf("%d shards: shard %d holds %d of %d (mean %.0f)", n, s, c, ids, mean)
			}
		}
		if share, ideal := float64(moved)/ids, 1/float64(n+1); math.Abs(share-ideal) > 0.2*ideal {
			t.Errorf("%d → %d shards moved %.3f of the executors, want ~%.3f", n, n+1, share,
				ideal)
		}
	}
}

// Route weights follow capacity on a grid of ShardWeightStep steps: within a
// half step of it, monotone, 0 only for none, and a move of 1% changes a
// weight only where it crosses a step.
func TestShardWeightFollowsCapacityInSteps(t *testing.T) {
	if ShardWeight(0) != 0 {
		t.Fatal("an empty shard must weigh 0")
	}
	prev, changes := uint32(0), 0
	for c := uint64(1); c < 2_000_000; c = c*101/100 + 1 {
		w := ShardWeight(c)
		if w == 0 || w < prev {
			t.Fatalf("ShardWeight(%d) = %d after %d: not monotone and positive", c, w, prev)
		}
		// Half a step in log space, plus the rounding to a whole weight.
		if rel := math.Abs(float64(w)-float64(c)) / float64(c); rel > ShardWeightStep/2+0.5/float64(c) {
			t.Fatalf("ShardWeight(%d) = %d: %.3f off, more than half a step", c, w, rel)
		}
		if c > 1000 && w != prev {
			changes++
		}
		prev = w
	}
	// From 1,000 to 2,000,000 in 1% moves (~760 of them) the weight changes
	// about once per 5% step (~156 times), not at every move.
	if changes > 200 {
		t.Fatalf("weight changed %d times over ~760 moves of 1%%: not held within a step",
			changes)
	}
}

func TestShardedRouteWeighsShardsAndNeverSumsToZero(t *testing.T) {
	r := ShardedRoute("work", []uint32{10, 0, 30}, dd)
	wc := r.GetVirtualHosts()[0].GetRoutes()[0].GetRoute().GetWeightedClusters()
	if len(wc.GetClusters()) != 3 {
		t.Fatalf("weighted clusters %v: want the three shards", wc)
	}
	for i, want := range []uint32{10, 0, 30} {
		c := wc.GetClusters()[i]
		if c.GetName() != ShardName("work", i, 3) || c.GetWeight().GetValue() != want {
			t.Fatalf("cluster %d: %v, want %s weight %d", i, c, ShardName("work", i, 3), want)
		}
	}
	// Envoy's own rules (PGV) accept the route and a shard's cluster.
	if err := r.ValidateAll(); err != nil {
		t.Fatalf("sharded route: %v", err)
	}
	if err := Cluster(ShardName("work", 1, 3), health.DefaultLBPolicy, dd).ValidateAll(); err != nil {
		t.Fatalf("a shard's cluster: %v", err)
	}
	empty := ShardedRoute("work", []uint32{0, 0}, dd)
	if err := empty.ValidateAll(); err != nil {
		t.Fatalf("sharded route, every shard empty: %v", err)
	}
	for _, c := range empty.GetVirtualHosts()[0].GetRoutes()[0].GetRoute().GetWeightedClusters().
		GetClusters() {
		if c.GetWeight().GetValue() == 0 {
			t.Fatal("every shard empty: weights summing to 0 are NACKed by grpc-go and Envoy")
		}
	}
	if one := ShardedRoute("work", []uint32{7}, dd); Version(one) != Version(Route("work",
		dd)) {
		t.Fatal("one shard is the task's plain route")
	}
	if TaskOf(ShardName("work", 3, 4)) != "work" || TaskOf("work") != "work" {
		t.Fatal("TaskOf does not undo ShardName")
	}
	fleettest.ProtoGolden(t, "route-sharded.json", ShardedRoute("transcode", []uint32{21, 0, 34}, dd))
}

// A sharded build sends what one unsharded build sends — split by ShardOf,
// one endpoint per socket across all shards — and stays equal to a fresh
// build over hundreds of random changes, the shard count changing too; a
// shard a change does not touch is the previous build's message.
func TestShardedBuilderIncrementalEqualsFresh(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 5))
	failover := Failover{Local: "dc1", Order: []string{"dc1", "dc2"}}
	d, _ := health.NewDispatcher("", nil)
	es := fleettest.Executors(300)
	for i := range es {
		es[i].Datacenter = failover.Order[i%2]
	}
	shards := 4
	bl := &Builder{Failover: failover, Shards: shards}
	prev := bl.BuildPrinted("work", es, nil, d)
	for step := range 400 {
		for range 1 + r.IntN(3) {
			mutate(r, &es)
		}
		if step%97 == 96 {
			shards = 2 + r.IntN(5)
		}
		bl.Shards = shards
		got := bl.BuildPrinted("work", es, nil, d)
		want := (&Builder{Failover: failover, Shards: shards}).BuildPrinted("work", es, nil, d)
		if len(got.Shards) != shards || len(want.Shards) != shards {
			t.Fatalf("step %d: %d shards, fresh %d, want %d", step, len(got.Shards),
				len(want.Shards), shards)
		}
		whole := &endpointv3.ClusterLoadAssignment{ClusterName: "work"}
		for i, sh := range got.Shards {
			if sh.Name != ShardName("work", i, shards) || sh.CLA.GetClusterName() != sh.Name {
				t.Fatalf("step %d: shard %d named %q (assignment %q)", step, i, sh.Name,
					sh.CLA.GetClusterName())
			}
			if !bytes.Equal(marshal(t, sh.CLA), marshal(t, want.Shards[i].CLA)) ||
				sh.Version != want.Shards[i].Version {
				t.Fatalf("step %d: shard %d differs from a fresh build", step, i)
			}
			if sh.Capacity != want.Shards[i].Capacity || sh.Rank != want.Shards[i].Rank {
				t.Fatalf("step %d: shard %d serves %d at rank %d, a fresh build says %d at %d",
					step, i, sh.Capacity, sh.Rank, want.Shards[i].Capacity, want.Shards[i].Rank)
			}
			for _, loc := range Expand(sh.CLA).GetEndpoints() {
				for _, lb := range loc.GetLbEndpoints() {
					if s := ShardOf(lb.GetEndpoint().GetHostname(), shards); s != i {
						t.Fatalf("step %d: %s in shard %d, ShardOf says %d", step,
							lb.GetEndpoint().GetHostname(), i, s)
					}
				}
				whole.Endpoints = append(whole.Endpoints, loc)
			}
			if !got.Restarted && len(prev.Shards) == shards &&
				prev.Shards[i].Version == sh.Version && prev.Shards[i].CLA != sh.CLA {
				t.Fatalf("step %d: shard %d unchanged but rebuilt: a push for nothing", step, i)
			}
		}
		if err := sendsWhatDecideRoutes(whole, es, d); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		wiresHold(t, got.Shards, prev.Shards)
		ref := RemovesOrDrainsAcross(loadsOf(prev.Shards), loadsOf(got.Shards))
		if !got.Restarted && got.RemovesOrDrains != ref {
			t.Fatalf("step %d: RemovesOrDrains %v, comparing the shards says %v", step,
				got.RemovesOrDrains, ref)
		}
		prev = got
	}
}

// A lapse in one shard changes that shard alone: the others are the same
// messages with the same versions, so no stream of theirs is pushed.
func TestALapseChangesOnlyItsShard(t *testing.T) {
	d, _ := health.NewDispatcher("", nil)
	es := fleettest.Executors(2000)
	bl := &Builder{Shards: 8}
	before := bl.BuildPrinted("work", es, nil, d)
	es[17].LeaseStatus = health.StatusCritical
	after := bl.BuildPrinted("work", es, nil, d)
	lapsed := ShardOf(es[17].InstanceID, 8)
	for i := range after.Shards {
		same := after.Shards[i].CLA == before.Shards[i].CLA &&
			after.Shards[i].Version == before.Shards[i].Version
		if i == lapsed && same {
			t.Fatalf("the lapsed executor's shard %d did not change", i)
		}
		if i != lapsed && !same {
			t.Fatalf("shard %d changed for a lapse in shard %d", i, lapsed)
		}
	}
	if !after.RemovesOrDrains {
		t.Fatal("a lapse is a removal: it must be published at once")
	}
	if after.Shards[lapsed].Capacity >= before.Shards[lapsed].Capacity {
		t.Fatal("the lapsed shard's capacity did not fall")
	}
}

// Two instances claiming one socket in different shards: only the first
// claim is sent, as without shards.
func TestShardsSendOneEndpointPerSocketAcrossShards(t *testing.T) {
	d, _ := health.NewDispatcher("", nil)
	es := fleettest.Executors(40)
	var other int
	for i := 1; i < len(es); i++ {
		if ShardOf(es[i].InstanceID, 4) != ShardOf(es[0].InstanceID, 4) {
			other = i
			break
		}
	}
	dup := es[other]
	dup.Address, dup.Port = es[0].Address, es[0].Port
	dup.CreateIndex = es[0].CreateIndex + 1000 // the later claim
	es[other] = dup
	res := (&Builder{Shards: 4}).BuildPrinted("work", es, nil, d)
	n := 0
	for _, sh := range res.Shards {
		for _, loc := range Expand(sh.CLA).GetEndpoints() {
			for _, lb := range loc.GetLbEndpoints() {
				sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
				if sa.GetAddress() == es[0].Address && int(sa.GetPortValue()) == es[0].Port {
					n++
					if lb.GetEndpoint().GetHostname() != es[0].InstanceID {
						t.Fatalf("socket sent for %s, the later claim", lb.GetEndpoint().GetHostname())
					}
				}
			}
		}
	}
	if n != 1 {
		t.Fatalf("socket sent %d times across shards, want once", n)
	}
}

// Every shard's resources hang together: the route's weighted clusters, one
// cluster and one load assignment per shard.
func TestShardedResourcesAreConsistent(t *testing.T) {
	d, _ := health.NewDispatcher("", nil)
	res := (&Builder{Shards: 3}).BuildPrinted("work", fleettest.Executors(90), nil, d)
	weights := ShardWeights(res.Shards)
	var clusters []*clusterv3.Cluster
	var loads []*endpointv3.ClusterLoadAssignment
	for _, sh := range res.Shards {
		clusters = append(clusters, Cluster(sh.Name, health.DefaultLBPolicy, dd))
		loads = append(loads, sh.CLA)
	}
	if err := Consistent([]*listenerv3.Listener{Listener("work")},
		[]*routev3.RouteConfiguration{ShardedRoute("work", weights, dd)}, clusters,
		loads); err != nil {
		t.Fatal(err)
	}
	if err := Consistent([]*listenerv3.Listener{Listener("work")},
		[]*routev3.RouteConfiguration{ShardedRoute("work", weights, dd)}, clusters[:2],
		loads[:2]); err == nil {
		t.Fatal("a route to a missing shard not detected")
	}
}

func loadsOf(shards []Shard) []*endpointv3.ClusterLoadAssignment {
	out := make([]*endpointv3.ClusterLoadAssignment, len(shards))
	for i, sh := range shards {
		out[i] = sh.CLA
	}
	return out
}

// Failover stays per task: with three executors in the dispatcher's own
// datacenter and 3,000 in another, spread over four shards, no route weight
// goes to a shard that would serve from the other datacenter — unsharded,
// every call goes to the own datacenter's executors. Once none is healthy
// there, the shards weigh what they serve from the next.
func TestShardedFailoverKeepsTheOwnDatacenterFirst(t *testing.T) {
	failover := Failover{Local: "dc1", Order: []string{"dc1", "dc2"}}
	d, _ := health.NewDispatcher("", nil)
	d = d.InDatacenter("dc1")
	var es []health.Executor
	for i := range 3 {
		es = append(es, dcExecutor("dc1", "", fmt.Sprintf("local-%d", i), 10000+i))
	}
	for i := range 3000 {
		es = append(es, dcExecutor("dc2", "", fmt.Sprintf("remote-%d", i), 20000+i))
	}
	n := ShardCount(len(es), 1000)
	res := (&Builder{Failover: failover, Shards: n}).BuildPrinted("work", es, nil, d)
	weights := ShardWeights(res.Shards)
	var total uint64
	for i, sh := range res.Shards {
		total += uint64(weights[i])
		if weights[i] > 0 && sh.Rank != 0 {
			t.Fatalf("shard %d serves from rank %d (dc2) and weighs %d while dc1 has healthy "+
				"executors", i, sh.Rank, weights[i])
		}
	}
	if total == 0 {
		t.Fatal("no shard weighs anything: the own datacenter's executors get no calls")
	}
	for i := range 3 {
		es[i].LeaseStatus = health.StatusCritical // dc1 lapses whole
	}
	res = (&Builder{Failover: failover, Shards: n}).BuildPrinted("work", es, nil, d)
	weights = ShardWeights(res.Shards)
	for i, sh := range res.Shards {
		if sh.Rank != 1 || weights[i] == 0 {
			t.Fatalf("dc1 gone: shard %d serves from rank %d, weighs %d; want dc2's", i, sh.Rank,
				weights[i])
		}
	}
}

// A shard weighs the capacity its executors can still take: the sum of its
// HEALTHY endpoints' weights, not a count of endpoints, and nothing for a
// draining executor (it takes no new work). A shard whose executors all
// drain weighs 0 in the route, so no call is picked for it.
func TestAShardWeighsTheCapacityItsHealthyExecutorsCanTake(t *testing.T) {
	d, _ := health.NewDispatcher("", nil)
	es := fleettest.Executors(120)
	for i := range es {
		es[i].Capacity = 2 + 3*(i%7) // unequal: a count of endpoints is not their capacity
		es[i].Load = i % 2
		if ShardOf(es[i].InstanceID, 4) == 0 || i%5 == 0 {
			es[i].State = health.StateDraining // all of shard 0, and some elsewhere
		}
	}
	res := (&Builder{Shards: 4}).BuildPrinted("work", es, nil, d)
	weights := ShardWeights(res.Shards)
	counted := false
	for i, sh := range res.Shards {
		var healthy uint64
		n, draining := 0, 0
		for _, loc := range Expand(sh.CLA).GetEndpoints() {
			for _, lb := range loc.GetLbEndpoints() {
				switch lb.GetHealthStatus() {
				case corev3.HealthStatus_HEALTHY:
					healthy += uint64(lb.GetLoadBalancingWeight().GetValue())
					n++
				case corev3.HealthStatus_DRAINING:
					draining++
				}
			}
		}
		if sh.Capacity != healthy {
			t.Errorf("shard %d: capacity %d, its healthy endpoints' weights sum to %d", i,
				sh.Capacity, healthy)
		}
		if healthy != uint64(n) {
			counted = true
		}
		if i == 0 && (draining == 0 || n != 0 || weights[0] != 0) {
			t.Errorf("shard 0, every executor draining: %d healthy, %d draining, weight %d; "+
				"want 0 healthy and weight 0", n, draining, weights[0])
		}
		if i > 0 && (draining == 0 || weights[i] != ShardWeight(healthy)) {
			t.Errorf("shard %d: %d draining, weight %d; want some draining and weight %d", i,
				draining, weights[i], ShardWeight(healthy))
		}
	}
	if !counted {
		t.Fatal("every endpoint weighs 1: the test cannot tell capacity from a count")
	}
}
