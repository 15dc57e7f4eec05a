package xdscache

import (
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
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
		"version_constraint":     {nil, str(""), str(">=1.0.0"), str(" >=1.0.0 "), str(">= banana"), structpb.NewNumberValue(1), structpb.NewNullValue()},
		"labels":                 {nil, labels(), labels("zone", "eu-1"), labels("zone", "eu-1", "tier", "a"), labels("zone", "eu-1:2"), labels("zone:eu", "1"), labels("a.b", "x"), structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{"zone": structpb.NewNumberValue(1)}}), str("zone=eu")},
		NodeMetaGrantedTasks:     {nil, list(), list(str("work")), list(str("a"), str("b")), list(str("a,b")), list(structpb.NewNumberValue(1)), str("work")},
		NodeMetaEndpointMetadata: {nil, str("full"), str("session"), str("none"), str("compact"), structpb.NewBoolValue(true)},
	}
	var nodes []*corev3.Node
	for _, vc := range values["version_constraint"] {
		for _, l := range values["labels"] {
			for _, g := range values[NodeMetaGrantedTasks] {
				for _, f := range values[NodeMetaEndpointMetadata] {
					m := map[string]*structpb.Value{"owner": str("x")}
					for k, v := range map[string]*structpb.Value{"version_constraint": vc, "labels": l, NodeMetaGrantedTasks: g, NodeMetaEndpointMetadata: f} {
						if v != nil {
							m[k] = v
						}
					}
					nodes = append(nodes, &corev3.Node{Id: "d", Metadata: &structpb.Struct{Fields: m}})
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
					t.Fatalf("%v: spelled as %q like a node of group %q, but its group is %q", n.GetMetadata(), key, g, want)
				}
				byKey[key] = want
			}
		}
	}
	huge := &corev3.Node{Id: "d", Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{"version_constraint": str(string(make([]byte, 1<<20)))}}}
	if _, ok := groupMemoKey(huge); ok {
		t.Fatal("a megabyte of metadata would be kept in the memo")
	}
	if len(byKey) < 100 {
		t.Fatalf("only %d nodes memoized", len(byKey))
	}
}

func BenchmarkGroupOf(b *testing.B) {
	st, _ := structpb.NewStruct(map[string]any{"version_constraint": ">=1.4.0, <2.0.0", "labels": map[string]any{"zone": "eu-1", "tier": "gold"}})
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
