package translator

import (
	"slices"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// ZoneLabel is the executor label that names its zone: executors of one
// datacenter with different zones are in localities of their own (same
// priority, weighted by how many endpoints each has).
const ZoneLabel = "zone"

// Failover orders the datacenters for a dispatcher: its own first (priority
// 0), then the others in Order, then any other (by name). Priorities are
// given to the datacenters that have endpoints only, counted from 0 without
// gaps (grpc-go rejects a load assignment that skips one), so a dispatcher
// whose datacenter has no eligible executor is sent the next one's at
// priority 0.
type Failover struct {
	Local string   // the datacenter of a dispatcher that names none: leasehold's own
	Order []string // the watched datacenters, in failover order (--datacenters)
}

// rank is dc's place in the order for a dispatcher in dispatcherDC.
func (f Failover) rank(dispatcherDC, dc string) int {
	if dispatcherDC == "" {
		dispatcherDC = f.Local
	}
	if dc == dispatcherDC {
		return 0
	}
	r := 1
	for _, o := range f.Order {
		if o == dc {
			return r
		}
		if o != dispatcherDC {
			r++
		}
	}
	return r
}

func (f Failover) equal(g Failover) bool {
	return f.Local == g.Local &&
		slices.Equal(f.Order, g.Order)
}

// locality is one (datacenter, zone) of a build, its endpoints in order,
// with its priority and weight once laid out.
type locality struct {
	id       int32
	rank     int
	ens      []*entry
	priority uint32
	weight   uint32
	healthy  uint64 // the sum of its HEALTHY endpoints' weights
	localityName
}

// layoutLocalities puts routed entries (sorted: by datacenter and zone
// first) into localities with priorities and weights, in priority order; it
// returns them with a digest of the layout (each locality's place, priority
// and weight) and the order-independent sums of the endpoints' digests (sum,
// xor), for the content version (one pass over the endpoints). Nothing is
// encoded: a build whose version did not change keeps its message.
func layoutLocalities(sorted []*entry, n int, names []localityName, f Failover,
	dispatcherDC string) (_ []*locality, layout, sum, xor uint64) {
	var locs []*locality
	// One array: each locality's entries are a part of it.
	all := make([]*entry, 0, n)
	start := 0
	for _, en := range sorted {
		if en.lost {
			continue
		}
		if len(locs) == 0 || locs[len(locs)-1].id != en.loc {
			if len(locs) > 0 {
				locs[len(locs)-1].ens = all[start:len(all):len(all)]
				start = len(all)
			}
			name := names[en.loc]
			locs = append(locs,
				&locality{id: en.loc, localityName: name, rank: f.rank(dispatcherDC, name.dc)})
		}
		all = append(all, en)
		if en.status == corev3.HealthStatus_HEALTHY { // draining ones take no new work
			locs[len(locs)-1].healthy += uint64(en.weight)
		}
		m := mix64(en.digest)
		sum += m
		xor ^= mix64(m ^ en.digest)
	}
	if len(locs) > 0 {
		locs[len(locs)-1].ens = all[start:len(all):len(all)]
	}
	// By priority, then by name: the same on every replica.
	slices.SortFunc(locs, func(a, b *locality) int {
		if a.rank != b.rank {
			return a.rank - b.rank
		}
		if a.dc != b.dc {
			return strings.Compare(a.dc, b.dc)
		}
		return strings.Compare(a.zone, b.zone)
	})
	perPriority := map[uint32]int{}
	var priority uint32
	for i, l := range locs {
		if i > 0 && (l.rank != locs[i-1].rank || l.dc != locs[i-1].dc) {
			priority++
		}
		l.priority = priority
		perPriority[priority]++
	}
	// layout stays 0 for one locality without names: the content alone versions it
	for _, l := range locs {
		// grpc-go ignores a locality whose weight is 0 or unset. Alone at
		// its priority a locality weighs 1; zones sharing one weigh the sum
		// of their endpoints' weights, so gRPC's wrr_locality shares work
		// as one locality would (Envoy weighs localities only when asked).
		l.weight = 1
		if perPriority[l.priority] > 1 {
			l.weight = uint32(min(max(l.healthy, 1), 1<<31))
		}
		b := []byte(l.dc + "\x00" + l.zone + "\x00")
		b = strconv.AppendUint(b, uint64(l.priority), 10)
		b = append(b, 0)
		b = strconv.AppendUint(b, uint64(l.weight), 10)
		if len(locs) > 1 || l.dc != "" || l.zone != "" {
			layout = mix64(layout ^ fnv64a(b))
		}
	}
	return locs, layout, sum, xor
}

// localityMessages are the localities as sent, their endpoints encoded.
func localityMessages(locs []*locality) []*endpointv3.LocalityLbEndpoints {
	out := make([]*endpointv3.LocalityLbEndpoints, len(locs))
	for i, l := range locs {
		out[i] = &endpointv3.LocalityLbEndpoints{
			Locality:            &corev3.Locality{Region: l.dc, Zone: l.zone},
			Priority:            l.priority,
			LoadBalancingWeight: wrapperspb.UInt32(l.weight),
		}
		setEncoded(out[i], l.ens)
	}
	return out
}
