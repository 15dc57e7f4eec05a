package translator

import (
	"bytes"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
	"unsafe"

	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// A Builder that reuses across hundreds of random changes (loads, lapses,
// drains, new sessions, versions, labels, joins and leaves, reordering) must
// give exactly what a fresh build gives: the same message and version, and
// the same removal verdict as comparing the two load assignments.
func TestBuilderIncrementalEqualsFresh(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 11))
	failover := Failover{Local: "dc1", Order: []string{"dc1", "dc2", "dc3"}}
	for _, dc := range []struct {
		version    string
		labels     map[string]string
		datacenter string
	}{
		{"", nil, ""}, {">=1.2.0", nil, ""}, {"", map[string]string{"zone": "a"}, ""},
		{"", nil, "dc2"},
	} {
		d, err := health.NewDispatcher(dc.version, dc.labels)
		if err != nil {
			t.Fatal(err)
		}
		d = d.InDatacenter(dc.datacenter)
		es := fleettest.Executors(200)
		if dc.datacenter != "" {
			for i := range es {
				es[i].Datacenter = failover.Order[i%3]
			}
		}
		bl := &Builder{Failover: failover}
		prev := bl.BuildPrinted("work", es, nil, d)
		for step := range 400 {
			for range 1 + r.IntN(4) {
				mutate(r, &es)
			}
			if r.IntN(5) == 0 {
				r.Shuffle(len(es), func(i, j int) { es[i], es[j] = es[j], es[i] })
			}
			got := bl.BuildPrinted("work", es, nil, d)
			want := (&Builder{Failover: failover}).BuildPrinted("work", es, nil, d)
			if !bytes.Equal(marshal(t, got.CLA), marshal(t, want.CLA)) {
				t.Fatalf("%s step %d: incremental load assignment differs from a fresh build",
					d.Key(), step)
			}
			if err := sendsWhatDecideRoutes(got.CLA, es, d); err != nil {
				t.Fatalf("%s step %d: %v", d.Key(), step, err)
			}
			if got.Version != want.Version {
				t.Fatalf("%s step %d: version %s, fresh %s", d.Key(), step, got.Version,
					want.Version)
			}
			wiresHold(t, got.Shards, prev.Shards)
			if ref := RemovesOrDrainsBetween(prev.CLA, got.CLA); got.RemovesOrDrains != ref {
				t.Fatalf("%s step %d: RemovesOrDrains %v, comparing the assignments says %v",
					d.Key(), step, got.RemovesOrDrains, ref)
			}
			if got.Decided > 8*4 {
				t.Fatalf("step %d: decided %d executors afresh for at most 4 changes", step,
					got.Decided)
			}
			prev = got
		}
	}
}

func mutate(r *rand.Rand, es *[]health.Executor) {
	fleet := *es
	if len(fleet) == 0 {
		*es = fleettest.Executors(1)
		return
	}
	i := r.IntN(len(fleet))
	e := &fleet[i]
	switch r.IntN(13) {
	case 12: // every executor of a datacenter leaves at once (failover)
		if e.Datacenter != "" {
			dc := e.Datacenter
			*es = slices.DeleteFunc(fleet,
				func(x health.Executor) bool { return x.Datacenter == dc })
		}
	case 0:
		e.Load = r.IntN(10)
	case 1:
		e.LeaseStatus = []health.CheckStatus{health.StatusPassing, health.StatusCritical,
			health.StatusWarning}[r.IntN(3)]
	case 2:
		e.State = []health.State{health.StateActive, health.StateDraining}[r.IntN(2)]
	case 3:
		e.SessionID = fmt.Sprintf("s%d", r.IntN(1000))
		e.Generation++
	case 4:
		e.Version = []string{"1.0.0", "1.4.2", "2.0.0"}[r.IntN(3)]
	case 5:
		e.Labels = map[string]string{"zone": []string{"a", "b"}[r.IntN(2)]}
	case 6: // leaves
		*es = append(fleet[:i], fleet[i+1:]...)
	case 7: // joins
		n := fleettest.Executors(1)[0]
		n.InstanceID = fmt.Sprintf("new-%d", r.IntN(1e6))
		n.ServiceID = "work:" + n.InstanceID
		n.Port = r.IntN(3) + 10000
		*es = append(fleet, n)
	case 8:
		e.Port = 10000 + r.IntN(3) // collide with others' addresses
	case 9:
		e.Capacity = r.IntN(200)
	case 10: // a new session of the instance beside the old one (fencing observed), at its socket
		n := *e
		n.SessionID = fmt.Sprintf("s%d", r.IntN(1000))
		n.Generation++
		n.Node = fmt.Sprintf("n%d", r.IntN(3))
		*es = append(fleet, n)
	case 11: // another instance claims a socket in use
		n := *e
		n.InstanceID = fmt.Sprintf("dup-%d", r.IntN(1e6))
		n.ServiceID = "work:" + n.InstanceID
		*es = append(fleet, n)
	}
}

func marshal(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// sendsWhatDecideRoutes checks a load assignment against Decide: exactly the
// executors Decide routes are sent, and no socket twice.
func sendsWhatDecideRoutes(cla *endpointv3.ClusterLoadAssignment, es []health.Executor,
	d health.Dispatcher) error {
	want := map[string]bool{}
	for _, dec := range Decide(es, d) {
		if dec.Verdict.Route != health.RouteNone {
			e := dec.Executor
			want[fmt.Sprintf("%s|%s|%s|%d", e.InstanceID, e.SessionID, e.Address, e.Port)] = true
		}
	}
	got := map[string]bool{}
	sockets := map[health.Socket]bool{}
	for _, loc := range Expand(cla).GetEndpoints() {
		for _, lb := range loc.GetLbEndpoints() {
			sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
			s := health.SocketOf(sa.GetAddress(), int(sa.GetPortValue()))
			if sockets[s] {
				return fmt.Errorf("two endpoints at %s:%d", sa.GetAddress(), sa.GetPortValue())
			}
			sockets[s] = true
			md := lb.GetMetadata().GetFilterMetadata()[MetadataNamespace].GetFields()
			session := md["session_id"].GetStringValue()
			got[fmt.Sprintf("%s|%s|%s|%d", lb.GetEndpoint().GetHostname(), session, sa.GetAddress(),
				sa.GetPortValue())] = true
		}
	}
	if !maps.Equal(got, want) {
		return fmt.Errorf("sent %v, Decide routes %v", slices.Sorted(maps.Keys(got)),
			slices.Sorted(maps.Keys(want)))
	}
	return nil
}

// Two routed registrations at one socket: one is sent, by the stated rule,
// whatever the order and whether built afresh or incrementally; the other
// takes its place when it goes, and that is not a removal.
func TestBuilderDuplicateSocket(t *testing.T) {
	d, _ := health.NewDispatcher("", nil)
	es := fleettest.Executors(3)
	twin := es[1]
	// Sorts after exec-000000, before exec-000001.
	twin.InstanceID, twin.ServiceID = "exec-000000a", "work:exec-000000a"
	es = append(es, twin)
	oldSession := es[2]
	// The same instance's older session, fencing observed.
	oldSession.SessionID, oldSession.Generation = "old", 0
	es = append(es, oldSession)
	bl := &Builder{}
	r := bl.BuildPrinted("work", es, nil, d)
	if err := sendsWhatDecideRoutes(r.CLA, es, d); err != nil {
		t.Fatal(err)
	}
	sent := func(cla *endpointv3.ClusterLoadAssignment) []string {
		var out []string
		for _, lb := range Expand(cla).GetEndpoints()[0].GetLbEndpoints() {
			md := lb.GetMetadata().GetFilterMetadata()[MetadataNamespace].GetFields()
			out = append(out, lb.GetEndpoint().GetHostname()+"/"+md["session_id"].GetStringValue())
		}
		return out
	}
	if got := sent(r.CLA); !slices.Equal(got,
		[]string{"exec-000000/s", "exec-000000a/s", "exec-000002/s"}) {
		t.Fatalf("sent %v: want the lowest instance id at exec-000001's socket and the newest "+
			"session at exec-000002's", got)
	}
	for _, dec := range Decide(es, d) {
		lost := dec.Executor.InstanceID == "exec-000001" || dec.Executor.SessionID == "old"
		if lost != (dec.Verdict.Reason == health.ReasonDuplicateAddress) {
			t.Fatalf("%s/%s: %s (%s)", dec.Executor.InstanceID, dec.Executor.SessionID,
				dec.Verdict.Reason, dec.Verdict.Detail)
		}
	}
	// The winner lapses: the other claimant is sent at that socket instead.
	es[3].LeaseStatus = health.StatusCritical
	r2 := bl.BuildPrinted("work", es, nil, d)
	if got := sent(r2.CLA); !slices.Equal(got,
		[]string{"exec-000000/s", "exec-000001/s", "exec-000002/s"}) {
		t.Fatalf("after the winner lapsed: %v", got)
	}
	if !r2.RemovesOrDrains || r2.RemovesOrDrains != RemovesOrDrainsBetween(r.CLA, r2.CLA) {
		t.Fatalf("RemovesOrDrains %v: the lapsed instance's endpoint is gone", r2.RemovesOrDrains)
	}
	fresh := (&Builder{}).BuildPrinted("work", es, nil, d)
	if fresh.Version != r2.Version || !bytes.Equal(marshal(t, fresh.CLA), marshal(t, r2.CLA)) {
		t.Fatal("incremental build differs from a fresh one")
	}
	// Reversed input: the same bytes.
	slices.Reverse(es)
	if rev := (&Builder{}).BuildPrinted("work", es, nil, d); rev.Version != r2.Version ||
		!bytes.Equal(marshal(t, rev.CLA), marshal(t, r2.CLA)) {
		t.Fatal("input order changed the output")
	}
}

// A build whose content did not change hands out the previous build's load
// assignment, message and all, unsharded as in shards: the syncer keeps the
// message it has when the version is the same, and a new one would hold a
// second copy of every endpoint's encoding (the entries point into the
// newest message's buffers) for as long as the content stays unchanged.
func TestAnUnchangedUnshardedBuildIsThePreviousMessage(t *testing.T) {
	d, _ := health.NewDispatcher("", nil)
	es := fleettest.Executors(50)
	bl := &Builder{}
	before := bl.BuildPrinted("work", es, nil, d)
	es[7].Load++ // a load report: decided again, the same endpoint
	after := bl.BuildPrinted("work", es, nil, d)
	if after.Decided != 1 || after.Version != before.Version {
		t.Fatalf("precondition: decided %d, version %s → %s", after.Decided, before.Version,
			after.Version)
	}
	if after.CLA != before.CLA || after.Shards[0].CLA != before.Shards[0].CLA {
		t.Fatal("the same content was handed out as a new message")
	}
	if a, b := after.Shards[0], before.Shards[0]; a.Name != b.Name || a.Version != b.Version ||
		a.Rank != b.Rank || a.Capacity != b.Capacity || len(a.Wire) == 0 || &a.Wire[0] != &b.Wire[0] {
		t.Fatalf("shard %+v, was %+v (the same wire too)", a, b)
	}
	es[7].LeaseStatus = health.StatusCritical
	if lapsed := bl.BuildPrinted("work", es, nil, d); lapsed.CLA == before.CLA ||
		lapsed.Version == before.Version {
		t.Fatal("a lapse did not change the load assignment")
	}
}

// BuildParts over the executors cut into parts anywhere (empty parts, parts
// of one, a cut between a registration and its duplicate), with their
// prints as one list, builds what BuildPrinted of the one list builds, one
// step after another on the same Builder, sharded or not.
func TestBuildPartsEqualsOneList(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 3))
	for _, shards := range []int{1, 3} {
		es := fleettest.Executors(60)
		bl := &Builder{Shards: shards}
		for step := range 300 {
			for range 1 + r.IntN(3) {
				mutate(r, &es)
			}
			prints := make([]uint64, len(es))
			for i := range es {
				prints[i] = ExecutorPrint(&es[i])
			}
			var parts [][]health.Executor
			for rest := es; ; {
				n := r.IntN(min(len(rest), 7) + 1)
				parts = append(parts, rest[:n:n])
				if rest = rest[n:]; len(rest) == 0 {
					break
				}
			}
			if r.IntN(3) == 0 {
				parts = append(parts, nil)
			}
			got := bl.BuildParts("work", parts, prints, health.Dispatcher{})
			want := (&Builder{Shards: shards}).BuildPrinted("work", es, nil, health.Dispatcher{})
			if len(got.Shards) != len(want.Shards) {
				t.Fatalf("shards %d step %d: %d shards, one list's build %d", shards, step,
					len(got.Shards), len(want.Shards))
			}
			for i := range got.Shards {
				g, w := got.Shards[i], want.Shards[i]
				if g.Name != w.Name || g.Version != w.Version ||
					!bytes.Equal(marshal(t, g.CLA), marshal(t, w.CLA)) {
					t.Fatalf("shards %d step %d: shard %s (%s) differs from one list's %s (%s)",
						shards, step, g.Name, g.Version, w.Name, w.Version)
				}
			}
		}
	}
}

// A Builder holds an entry per executor for as long as the executor is
// unchanged: 192 bytes (an allocation size class of its own), its sort key
// and socket read from what it holds, not held again.
func TestAnEntryIsHeldInOneSizeClass(t *testing.T) {
	if n := unsafe.Sizeof(entry{}); n > 192 {
		t.Fatalf("an entry is %d bytes, want at most 192", n)
	}
}

// The Builder counts a socket's claims by a sum of it. Sums that collide —
// here every socket's — only make sockets look contested: which endpoint is
// sent for a socket is still decided by the sockets themselves, so over
// random changes (sockets claimed twice among them) the load assignment is
// the one a Builder whose sums never collide makes.
func TestCollidingSocketSumsChangeNothing(t *testing.T) {
	keep := socketSum
	defer func() { socketSum = keep }()
	collide := func(health.Socket) uint64 { return 7 }
	r := rand.New(rand.NewPCG(5, 9))
	d, err := health.NewDispatcher("", nil)
	if err != nil {
		t.Fatal(err)
	}
	es := fleettest.Executors(120)
	colliding, apart := &Builder{}, &Builder{}
	for step := range 300 {
		for range 1 + r.IntN(3) {
			mutate(r, &es)
		}
		socketSum = collide
		got := colliding.BuildPrinted("work", es, nil, d)
		socketSum = keep
		want := apart.BuildPrinted("work", es, nil, d)
		if !bytes.Equal(marshal(t, got.CLA), marshal(t, want.CLA)) || got.Version != want.Version {
			t.Fatalf("step %d: with every socket sum colliding the load assignment differs", step)
		}
		if got.RemovesOrDrains != want.RemovesOrDrains {
			t.Fatalf("step %d: removes %v with colliding sums, %v without", step,
				got.RemovesOrDrains, want.RemovesOrDrains)
		}
	}
}
