package translator

import (
	"math"
	"strconv"
	"strings"

	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/leasehold/leasehold/health"
)

// Sharding: a load assignment is one xDS resource, so every change of a task
// type resends all of its endpoints to every stream of the task (state of
// the world and delta alike). Past a few thousand endpoints that is most of
// a lapse's cost: at 10,000 a lapse resends ~1.2 MB per stream. A large task
// type is therefore split into shards, each its own cluster and load
// assignment, behind one route whose weighted_clusters (gRFC A28; Envoy the
// same) weigh the shards by their capacity. A lapse then resends one shard.
//
// Everything here is a pure function of the task's registrations, so every
// replica shards alike: the count from how many there are, an executor's
// shard from its instance id alone.

// ShardSeparator joins a task type's name and a shard's number. Task type
// names hold only letters, digits and '-' (health.ValidateTask), so a shard's
// name is never another task's.
const ShardSeparator = "/shard-"

// ShardCount is how many shards a task type of n instances is split into
// with at most size instances per shard: 1 (not sharded) when n is at most
// size or size is 0 or less (sharding off), else ⌈n/size⌉. The syncer counts
// the instances its registrations name, not the endpoints a constraint set
// routes, so every constraint set of a task has the same shards and names,
// and not the registrations, of which an instance moving to another node
// holds two for a moment.
func ShardCount(n, size int) int {
	if size <= 0 || n <= size {
		return 1
	}
	return (n + size - 1) / size
}

// ShardOf is the shard of instance id among n: a jump consistent hash
// (Lamping and Veach, 2014) of the id, so when n grows to n+1 only the
// executors that the new shard takes move (1/(n+1) of them), and a session
// of an instance stays in its shard.
func ShardOf(instanceID string, n int) int {
	if n <= 1 {
		return 0
	}
	key := mix64(fnv64a([]byte(instanceID)))
	var b, j int64 = -1, 0
	for j < int64(n) {
		b = j
		key = key*2862933555777941757 + 1
		j = int64(float64(b+1) * (float64(int64(1)<<31) / float64((key>>33)+1)))
	}
	return int(b)
}

// ShardName is the cluster and load assignment name of shard i of task's n
// shards: the task's own name when it is not sharded.
func ShardName(task string, i, n int) string {
	if n <= 1 {
		return task
	}
	return task + ShardSeparator + strconv.Itoa(i)
}

// TaskOf is the task type a cluster or load assignment name belongs to (a
// shard's, or the task's own).
func TaskOf(name string) string {
	if i := strings.Index(name, ShardSeparator); i >= 0 {
		return name[:i]
	}
	return name
}

// ShardWeightStep is the relative step by which a shard's route weight
// follows its capacity: weights lie on a geometric grid of 5% steps, so a
// shard's weight changes only when its capacity crosses a step. A lapse or a
// registration moves a shard of hundreds of executors by well under a step,
// and so costs no route update; a shard emptied (weight 0) always does. The
// grid is a pure function of the capacity, so replicas agree.
const ShardWeightStep = 0.05

// ShardWeight is the route weight of a shard of routed capacity c (the sum
// of the weights of the HEALTHY endpoints it serves from: Shard): 0 for none, else c
// rounded to the nearest point of the grid. Ten thousand executors of
// capacity 128 weigh at most ~1.3 million, far from the uint32 total
// grpc-go accepts.
func ShardWeight(c uint64) uint32 {
	if c == 0 {
		return 0
	}
	k := math.Round(math.Log(float64(c)) / math.Log1p(ShardWeightStep))
	w := math.Round(math.Pow(1+ShardWeightStep, k))
	return uint32(min(max(w, 1), math.MaxUint32/1024))
}

// ShardedRoute is task's route over its shards, weighted by weights[i]
// (ShardWeights). A shard of weight 0 is left out of
// the clients' pick (grpc-go skips it; Envoy never picks it); when every
// shard weighs 0 (nothing routable) each weighs 1 instead, since grpc-go
// refuses a route whose weights sum to 0 and Envoy one whose weights do:
// the calls then fail as they would on one empty cluster. With one shard it
// is Route(task, p). The dispatch policy p applies to the route as a whole.
func ShardedRoute(task string, weights []uint32,
	p health.TaskDispatch) *routev3.RouteConfiguration {
	r := Route(task, p)
	if len(weights) <= 1 {
		return r
	}
	var total uint64
	for _, w := range weights {
		total += uint64(w)
	}
	wc := &routev3.WeightedCluster{Clusters: make([]*routev3.WeightedCluster_ClusterWeight,
		len(weights))}
	for i, w := range weights {
		if total == 0 {
			w = 1
		}
		wc.Clusters[i] = &routev3.WeightedCluster_ClusterWeight{
			Name: ShardName(task, i, len(weights)), Weight: wrapperspb.UInt32(w)}
	}
	action := r.VirtualHosts[0].Routes[0].GetRoute()
	action.ClusterSpecifier = &routev3.RouteAction_WeightedClusters{WeightedClusters: wc}
	return r
}

// RouteClusters are the clusters a route sends to: its cluster, or every
// cluster of its weighted_clusters.
func RouteClusters(r *routev3.Route) []string {
	a := r.GetRoute()
	if wc := a.GetWeightedClusters(); wc != nil {
		names := make([]string, 0, len(wc.GetClusters()))
		for _, c := range wc.GetClusters() {
			names = append(names, c.GetName())
		}
		return names
	}
	return []string{a.GetCluster()}
}

// assembleShards makes the load assignment of every shard whose endpoints
// changed in this build (every shard after a restart) and keeps the
// previous build's for the others: a lapse re-assembles one shard.
func (bl *Builder) assembleShards(task string, b *build, d health.Dispatcher,
	restarted bool) []Shard {
	n := bl.shards
	dirty := make([]bool, n)
	if restarted || len(bl.prev) != n {
		for i := range dirty {
			dirty[i] = true
		}
	} else {
		for _, list := range [][]*entry{b.fresh, b.gone, b.losers, b.prevLosers} {
			for _, en := range list {
				dirty[en.shard] = true
			}
		}
	}
	parts := make([][]*entry, n)
	sent := make([]int, n)
	for _, en := range b.sorted {
		if dirty[en.shard] {
			parts[en.shard] = append(parts[en.shard], en)
			if !en.lost {
				sent[en.shard]++
			}
		}
	}
	shards := make([]Shard, n)
	for i := range shards {
		if !dirty[i] {
			shards[i] = bl.prev[i]
			continue
		}
		a := bl.assemble(ShardName(task, i, n), parts[i], sent[i], d)
		if len(bl.prev) == n && bl.prev[i].Version == a.version {
			shards[i] = bl.prev[i] // the same content: the same message
			continue
		}
		rank, capacity := a.serving(bl.Failover, d.Datacenter)
		cla, wire := a.message()
		shards[i] = Shard{Name: a.name, CLA: cla, Version: a.version, Rank: rank,
			Capacity: capacity, Wire: wire}
	}
	return shards
}

// ShardWeights are the route weights of a task's shards: each shard's
// capacity on the ShardWeight grid if it serves from the best-placed
// datacenter any shard serves from, else 0. A shard without executors in the
// dispatcher's own datacenter would otherwise draw its share to another
// while the own one has healthy executors in other shards: failover stays
// per task, as without shards.
func ShardWeights(shards []Shard) []uint32 {
	best := -1
	for _, sh := range shards {
		if sh.Rank >= 0 && (best < 0 || sh.Rank < best) {
			best = sh.Rank
		}
	}
	weights := make([]uint32, len(shards))
	for i, sh := range shards {
		if sh.Rank == best && best >= 0 {
			weights[i] = ShardWeight(sh.Capacity)
		}
	}
	return weights
}

// shardsVersion is the content version of a sharded build as a whole: a
// hash of its shards' versions in order.
func shardsVersion(shards []Shard) string {
	var b []byte
	for _, sh := range shards {
		b = append(append(b, sh.Version...), 0)
	}
	return "s" + strconv.FormatUint(mix64(fnv64a(b)), 16)
}
