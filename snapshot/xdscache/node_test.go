package xdscache

import (
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// GroupOf's memo answers what a fresh reading does, for valid and invalid
// metadata of every kind, asked again and again; nodes it spells alike
// have the same group.
func TestGroupOfMemoIsExact(t *testing.T) {
	str := structpb.NewStringValue
	labels := func(kv ...string) *structpb.Value {
		m := map[string]*structpb.Value{}
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i]] = str(kv[i+1])
		}
		return structpb.NewStructValue(&structpb.Struct{Fields: m})
	}
	list := func(vs ...*structpb.Value) *structpb.Value {
		return structpb.NewListValue(&structpb.ListValue{Values: vs})
	}
	values := map[string][]*structpb.Value{
		"version_constraint": {nil, str(""), str(">=1.0.0"), str(" >=1.0.0 "), str(">= banana"),
			structpb.NewNumberValue(1), structpb.NewNullValue()},
		"labels": {nil, labels(), labels("zone", "eu-1"),
			labels("zone", "eu-1", "tier", "a"), labels("zone", "eu-1:2"), labels("zone:eu", "1"),
			labels("a.b", "x"),
			structpb.NewStructValue(&structpb.Struct{
				Fields: map[string]*structpb.Value{"zone": structpb.NewNumberValue(1)},
			}),
			str("zone=eu")},
		NodeMetaGrantedTasks: {nil, list(), list(str("work")), list(str("a"), str("b")),
			list(str("a,b")), list(structpb.NewNumberValue(1)), str("work")},
		NodeMetaEndpointMetadata: {nil, str("full"), str("session"), str("none"), str("compact"),
			structpb.NewBoolValue(true)},
		NodeMetaWeightedClusters: {nil, structpb.NewBoolValue(true), structpb.NewBoolValue(false),
			str("false"), structpb.NewNumberValue(0)},
	}
	var nodes []*corev3.Node
	for _, vc := range values["version_constraint"] {
		for _, l := range values["labels"] {
			for _, g := range values[NodeMetaGrantedTasks] {
				for _, f := range values[NodeMetaEndpointMetadata] {
					m := map[string]*structpb.Value{"owner": str("x")}
					for k, v := range map[string]*structpb.Value{"version_constraint": vc,
						"labels": l, NodeMetaGrantedTasks: g, NodeMetaEndpointMetadata: f} {
						if v != nil {
							m[k] = v
						}
					}
					nodes = append(nodes,
						&corev3.Node{Id: "d", Metadata: &structpb.Struct{Fields: m}})
				}
			}
		}
	}
	nodes = append(nodes, nil, &corev3.Node{Id: "no metadata"})
	byKey := map[string]string{}
	for round := range 2 {
		for _, n := range nodes {
			want := groupOf(n)
			if got := GroupOf(n); got != want {
				t.Fatalf("round %d, %v: memo says %q, fresh %q", round, n.GetMetadata(), got, want)
			}
			if key, ok := groupMemoKey(n); ok {
				if g, seen := byKey[key]; seen && g != want {
					t.Fatalf("%v: spelled as %q like a node of group %q, but its group is %q",
						n.GetMetadata(), key, g, want)
				}
				byKey[key] = want
			}
		}
	}
	megabyte := str(string(make([]byte, 1<<20)))
	huge := &corev3.Node{Id: "d", Metadata: &structpb.Struct{
		Fields: map[string]*structpb.Value{"version_constraint": megabyte},
	}}
	if _, ok := groupMemoKey(huge); ok {
		t.Fatal("a megabyte of metadata would be kept in the memo")
	}
	if len(byKey) < 100 {
		t.Fatalf("only %d nodes memoized", len(byKey))
	}
}

// SameGroupInputs calls two nodes alike exactly when they differ only in
// what GroupOf does not read (other metadata, user agent, locality zone),
// and such nodes have one group: a server that lets a stream go on when it
// says so never moves the stream's watches to another group. Any key GroupOf
// reads, or the locality region, changed or dropped, is another input.
func TestSameGroupInputsMeansTheSameGroup(t *testing.T) {
	base := nodeWith(map[string]any{"version_constraint": ">=1.0.0",
		"labels": map[string]any{"zone": "eu-1"}, NodeMetaGrantedTasks: []any{"work"},
		NodeMetaEndpointMetadata: "session", "datacenter": "dc1",
		NodeMetaWeightedClusters: true, "owner": "a"}, "dc1")
	alike := proto.Clone(base).(*corev3.Node)
	alike.UserAgentName = "envoy"
	alike.Locality.Zone = "z2"
	alike.Metadata.Fields["owner"] = structpb.NewStringValue("b")
	if !SameGroupInputs(base, alike) || GroupOf(base) != GroupOf(alike) {
		t.Fatalf("nodes differing outside GroupOf's inputs: same inputs %v, groups %q and %q",
			SameGroupInputs(base, alike), GroupOf(base), GroupOf(alike))
	}
	for _, k := range groupKeys {
		changed := proto.Clone(base).(*corev3.Node)
		changed.Metadata.Fields[k] = structpb.NewStringValue("other")
		dropped := proto.Clone(base).(*corev3.Node)
		delete(dropped.Metadata.Fields, k)
		if SameGroupInputs(base, changed) || SameGroupInputs(base, dropped) {
			t.Errorf("%s changed or dropped: called the same inputs", k)
		}
	}
	region := proto.Clone(base).(*corev3.Node)
	region.Locality.Region = "dc2"
	if SameGroupInputs(base, region) {
		t.Error("another locality region: called the same inputs")
	}
}

func BenchmarkGroupOf(b *testing.B) {
	st, _ := structpb.NewStruct(map[string]any{"version_constraint": ">=1.4.0, <2.0.0",
		"labels": map[string]any{"zone": "eu-1", "tier": "gold"}})
	n := &corev3.Node{Id: "d", Metadata: st}
	b.Run("fresh", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			groupOf(n)
		}
	})
	b.Run("memo", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			GroupOf(n)
		}
	})
}

// nodeWith is a dispatcher's node with the given metadata (none when nil) and
// locality region (none when empty).
func nodeWith(meta map[string]any, region string) *corev3.Node {
	n := &corev3.Node{Id: "d"}
	if meta != nil {
		s, err := structpb.NewStruct(meta)
		if err != nil {
			panic(err)
		}
		n.Metadata = s
	}
	if region != "" {
		n.Locality = &corev3.Locality{Region: region, Zone: "z"}
	}
	return n
}

// TestLocalityRegionThatIsNoDatacenterIsIgnored: a node's locality.region is
// its Consul datacenter only when it is a datacenter name. An Envoy started
// with a region that is none (--locality-region "eu-west-1.prod",
// "Frankfurt 1", a cloud region) keeps its stream and its group, also when
// leasehold watches one datacenter and no --datacenters flag is in sight.
func TestLocalityRegionThatIsNoDatacenterIsIgnored(t *testing.T) {
	for _, region := range []string{"eu-west-1.prod", "Frankfurt 1", "aws:us-east-1"} {
		if _, err := DispatcherOf(nodeWith(nil, region)); err != nil {
			t.Errorf("locality.region %q: stream refused: %v", region, err)
		}
		if g := GroupOf(nodeWith(nil, region)); g == "invalid" {
			t.Errorf("locality.region %q: group %q", region, g)
		}
	}
}

// TestDispatcherDatacenterIsCaseInsensitive: Consul's datacenter names are
// lowercase; a dispatcher saying "DC2" (in its metadata or its region) runs in
// dc2, so it is dc2's constraint set, given dc2's executors first (or
// refused), not sent the failover order as a set of its own.
func TestDispatcherDatacenterIsCaseInsensitive(t *testing.T) {
	lower, err := DispatcherOf(nodeWith(map[string]any{"datacenter": "dc2"}, ""))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []*corev3.Node{nodeWith(map[string]any{"datacenter": "DC2"}, ""),
		nodeWith(nil, "DC2")} {
		d, err := DispatcherOf(n)
		if err != nil {
			continue // refused: fine
		}
		if d.Key() != lower.Key() {
			t.Errorf("a dispatcher in %q: key %q, not dc2's %q (its own executors are not its "+
				"priority 0)", d.Datacenter, d.Key(), lower.Key())
		}
	}
}

// TestGroupMemoFollowsTheDatacenter: GroupOf (memoised) always equals the
// group read afresh, whatever the datacenter metadata and locality region say,
// valid or not, in any order of calls; distinct datacenters never share a
// group, and the same datacenter said either way is one group.
func TestGroupMemoFollowsTheDatacenter(t *testing.T) {
	metas := []map[string]any{nil, {"datacenter": "dc2"}, {"datacenter": "dc3"}, {"datacenter": ""},
		{"datacenter": 7.0},
		{"datacenter": "dc2", "labels": map[string]any{"zone": "a"}}, {"datacenter": "x&tasks=y"},
		{"labels": map[string]any{"datacenter": "dc2"}}}
	regions := []string{"", "dc2", "dc3", "bad.region", "x&dc=dc2"}
	seen := map[string]string{}
	for round := range 2 {
		for _, m := range metas {
			for _, r := range regions {
				n := nodeWith(m, r)
				got, want := GroupOf(n), groupOf(n)
				if got != want {
					t.Fatalf("round %d meta %v region %q: GroupOf %q, afresh %q", round, m, r, got,
						want)
				}
				seen[want] = ""
			}
		}
	}
	// Distinct datacenters never share a group.
	if GroupOf(nodeWith(nil, "dc2")) == GroupOf(nodeWith(nil, "dc3")) ||
		GroupOf(nodeWith(nil, "dc2")) == GroupOf(nodeWith(nil, "")) {
		t.Fatal("dispatchers of different datacenters share a group")
	}
	if GroupOf(nodeWith(map[string]any{"datacenter": "dc2"}, "")) != GroupOf(nodeWith(nil, "dc2")) {
		t.Fatal("metadata datacenter dc2 and region dc2 are different groups")
	}
}

// weighted_clusters: false makes a dispatcher a constraint set of its own
// that takes each task type as one cluster; true or absent changes nothing;
// anything but a boolean is refused naming the field.
func TestWeightedClustersMetadata(t *testing.T) {
	node := func(v *structpb.Value) *corev3.Node {
		n := &corev3.Node{Id: "d", Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{}}}
		if v != nil {
			n.Metadata.Fields[NodeMetaWeightedClusters] = v
		}
		return n
	}
	plain, err := DispatcherOf(node(nil))
	if err != nil || plain.SingleCluster {
		t.Fatalf("no weighted_clusters: %v, %v", plain, err)
	}
	if d, err := DispatcherOf(node(structpb.NewBoolValue(true))); err != nil ||
		d.Key() != plain.Key() {
		t.Fatalf("weighted_clusters: true is the default: %v, %v", d.Key(), err)
	}
	single, err := DispatcherOf(node(structpb.NewBoolValue(false)))
	if err != nil || !single.SingleCluster || single.Key() == plain.Key() {
		t.Fatalf("weighted_clusters: false: %+v, %v (key %q)", single, err, single.Key())
	}
	if GroupOf(node(structpb.NewBoolValue(false))) == GroupOf(node(nil)) {
		t.Fatal("a single-cluster dispatcher shares the group of one that takes shards")
	}
	_, err = DispatcherOf(node(structpb.NewStringValue("false")))
	if err == nil || !strings.Contains(err.Error(), "node.metadata."+NodeMetaWeightedClusters) {
		t.Fatalf("weighted_clusters: \"false\" (a string): %v, want an error naming the field", err)
	}
}
