package xdscache

import (
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

func a17Node(meta map[string]any, region string) *corev3.Node {
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

// TestAttack17LocalityRegionIsNotADatacenterWithOne (fixed; failed before, MEDIUM,
// single-datacenter behaviour changed): a node's locality.region is read as
// its Consul datacenter even when leasehold watches one datacenter, and
// checked as a Consul datacenter name. An Envoy started with a region that
// is not one (--locality-region "eu-west-1.prod", "Frankfurt 1", a
// 65-character name), which leasehold at 336dbe1 ignored, now has its
// stream refused ("node.locality.region") after the upgrade — with no
// --datacenters flag in sight.
func TestAttack17LocalityRegionIsNotADatacenterWithOne(t *testing.T) {
	for _, region := range []string{"eu-west-1.prod", "Frankfurt 1", "aws:us-east-1"} {
		if _, err := DispatcherOf(a17Node(nil, region)); err != nil {
			t.Errorf("locality.region %q: stream refused: %v (accepted at 336dbe1)", region, err)
		}
		if g := GroupOf(a17Node(nil, region)); g == "invalid" {
			t.Errorf("locality.region %q: group %q", region, g)
		}
	}
}

// TestAttack17DispatcherDatacenterCase (fixed; failed before, LOW): Consul's datacenter
// names are lowercase; a dispatcher saying "DC2" (metadata or region) runs in
// dc2 but is not given dc2's executors first — it is sent the failover
// order (dc1 first, across the WAN) — and is its own constraint set.
func TestAttack17DispatcherDatacenterCase(t *testing.T) {
	lower, err := DispatcherOf(a17Node(map[string]any{"datacenter": "dc2"}, ""))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []*corev3.Node{a17Node(map[string]any{"datacenter": "DC2"}, ""), a17Node(nil, "DC2")} {
		d, err := DispatcherOf(n)
		if err != nil {
			continue // refused: fine
		}
		if d.Key() != lower.Key() {
			t.Errorf("a dispatcher in %q: key %q, not dc2's %q (its own executors are not its priority 0)", d.Datacenter, d.Key(), lower.Key())
		}
	}
}

// GroupOf (memoised) always equals the group read afresh, whatever the
// datacenter metadata and locality region say, valid or not, in any order
// of calls. (Holds.)
func TestAttack17GroupMemoDatacenter(t *testing.T) {
	metas := []map[string]any{nil, {"datacenter": "dc2"}, {"datacenter": "dc3"}, {"datacenter": ""}, {"datacenter": 7.0},
		{"datacenter": "dc2", "labels": map[string]any{"zone": "a"}}, {"datacenter": "x&tasks=y"}, {"labels": map[string]any{"datacenter": "dc2"}}}
	regions := []string{"", "dc2", "dc3", "bad.region", "x&dc=dc2"}
	seen := map[string]string{}
	for round := range 2 {
		for _, m := range metas {
			for _, r := range regions {
				n := a17Node(m, r)
				got, want := GroupOf(n), groupOf(n)
				if got != want {
					t.Fatalf("round %d meta %v region %q: GroupOf %q, afresh %q", round, m, r, got, want)
				}
				seen[want] = ""
			}
		}
	}
	// Distinct datacenters never share a group.
	if GroupOf(a17Node(nil, "dc2")) == GroupOf(a17Node(nil, "dc3")) || GroupOf(a17Node(nil, "dc2")) == GroupOf(a17Node(nil, "")) {
		t.Fatal("dispatchers of different datacenters share a group")
	}
	if GroupOf(a17Node(map[string]any{"datacenter": "dc2"}, "")) != GroupOf(a17Node(nil, "dc2")) {
		t.Fatal("metadata datacenter dc2 and region dc2 are different groups")
	}
}
