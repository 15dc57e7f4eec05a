package server

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot"
)

// The zero-copy encoding must be exactly what proto.Marshal writes, for
// every shape of response the cache sends (empty, one, many resources of
// any size, empty fields).
func TestCodecMatchesProtoMarshal(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	c := NewCodec()
	for i := range 300 {
		resp := &discovery.DiscoveryResponse{TypeUrl: "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"}
		if r.IntN(4) > 0 {
			resp.VersionInfo = fmt.Sprintf("e%016x", r.Uint64())
		}
		if r.IntN(4) > 0 {
			resp.Nonce = fmt.Sprint(r.IntN(1e6))
		}
		if r.IntN(10) == 0 {
			resp.TypeUrl = ""
		}
		for range r.IntN(6) {
			v := make([]byte, r.IntN(3)*r.IntN(70_000))
			for k := range v {
				v[k] = byte(r.Uint32())
			}
			a := &anypb.Any{Value: v}
			if r.IntN(8) > 0 {
				a.TypeUrl = resp.TypeUrl
			}
			resp.Resources = append(resp.Resources, a)
		}
		want, err := proto.MarshalOptions{Deterministic: true}.Marshal(resp)
		if err != nil {
			t.Fatal(err)
		}
		got, err := c.Marshal(resp)
		if err != nil {
			t.Fatal(err)
		}
		if b := got.Materialize(); !bytes.Equal(b, want) {
			t.Fatalf("case %d: zero-copy encoding differs from proto.Marshal (%d vs %d bytes)", i, len(b), len(want))
		}
		back := &discovery.DiscoveryResponse{}
		if err := c.Unmarshal(got, back); err != nil || !proto.Equal(back, resp) {
			t.Fatalf("case %d: round trip: %v", i, err)
		}
	}
}

// A real load assignment is referenced, not copied: the encoded pieces share
// the cache's bytes.
func TestCodecReferencesResourceBytes(t *testing.T) {
	cla := snapshot.Endpoints("work", nil, health.Dispatcher{})
	a, err := anypb.New(cla)
	if err != nil {
		t.Fatal(err)
	}
	a.Value = append(a.Value, make([]byte, 4096)...) // large enough to find by address
	resp := &discovery.DiscoveryResponse{VersionInfo: "v1", TypeUrl: a.TypeUrl, Nonce: "1", Resources: []*anypb.Any{a}}
	got, err := NewCodec().Marshal(resp)
	if err != nil {
		t.Fatal(err)
	}
	shared := false
	for _, piece := range got {
		if b := piece.ReadOnlyData(); len(b) == len(a.Value) && &b[0] == &a.Value[0] {
			shared = true
		}
	}
	if !shared {
		t.Fatal("the resource's bytes were copied into the response")
	}
}

// Other messages, and responses with fields the cache never sets, take the
// standard codec and still encode correctly.
func TestCodecFallsBack(t *testing.T) {
	c := NewCodec()
	for _, m := range []proto.Message{
		&corev3.Node{Id: "d1", Cluster: "c"},
		&discovery.DiscoveryResponse{VersionInfo: "1", Canary: true},
		&discovery.DiscoveryResponse{VersionInfo: "1", ControlPlane: &corev3.ControlPlane{Identifier: "x"}},
	} {
		got, err := c.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		back := m.ProtoReflect().New().Interface()
		if err := c.Unmarshal(got, back); err != nil || !proto.Equal(back, m) {
			t.Fatalf("%T: round trip failed: %v", m, err)
		}
	}
}
