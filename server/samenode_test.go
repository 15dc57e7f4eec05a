package server

import (
	"fmt"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// envoyNode is a node as Envoy sends it on every request: its id and
// metadata, and a user agent, build version and the extensions it has.
func envoyNode(meta map[string]any) *corev3.Node {
	st, _ := structpb.NewStruct(meta)
	n := &corev3.Node{Id: "envoy-1", Cluster: "dispatchers", Metadata: st, UserAgentName: "envoy",
		UserAgentVersionType: &corev3.Node_UserAgentBuildVersion{UserAgentBuildVersion: &corev3.BuildVersion{Metadata: st}}}
	for i := range 300 {
		n.Extensions = append(n.Extensions, &corev3.Extension{Name: fmt.Sprintf("envoy.filters.http.f%d", i), Category: "envoy.filters.http", TypeUrls: []string{"type.googleapis.com/x.y.Z"}})
	}
	return n
}

// The nodes sameDispatch calls the same are those sameNode would let go on
// after a full check: everything but the id and the dispatch keys may
// differ.
func TestSameDispatch(t *testing.T) {
	base := map[string]any{"version_constraint": "<2.0.0", "labels": map[string]any{"zone": "eu-1"}, "endpoint_metadata": "session", "owner": "a"}
	a := envoyNode(base)
	same := envoyNode(base)
	same.UserAgentName = "envoy-2"
	same.Extensions = same.Extensions[:10]
	same.Metadata.Fields["owner"] = structpb.NewStringValue("b")
	if !sameDispatch(a, same) {
		t.Fatal("a node differing outside the dispatch keys counted as another")
	}
	for _, k := range dispatchKeys {
		b := proto.Clone(a).(*corev3.Node)
		b.Metadata.Fields[k] = structpb.NewStringValue("other")
		if sameDispatch(a, b) {
			t.Errorf("%s changed: counted as the same", k)
		}
		delete(b.Metadata.Fields, k)
		if _, had := a.Metadata.Fields[k]; had && sameDispatch(a, b) {
			t.Errorf("%s dropped: counted as the same", k)
		}
	}
	other := proto.Clone(a).(*corev3.Node)
	other.Id = "envoy-2"
	if sameDispatch(a, other) {
		t.Error("another node id counted as the same")
	}
}

// BenchmarkSameNode: what each ACK of an Envoy dispatcher (its whole node
// on every request) costs to tell that its node is unchanged.
func BenchmarkSameNode(b *testing.B) {
	meta := map[string]any{"version_constraint": "<2.0.0", "labels": map[string]any{"zone": "eu-1"}}
	x, y := envoyNode(meta), envoyNode(meta)
	b.Run("proto.Equal", func(b *testing.B) {
		for b.Loop() {
			proto.Equal(x, y)
		}
	})
	b.Run("sameDispatch", func(b *testing.B) {
		for b.Loop() {
			sameDispatch(x, y)
		}
	})
}
