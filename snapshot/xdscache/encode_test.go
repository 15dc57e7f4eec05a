package xdscache

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// The encoder's bytes are a deterministic proto.Marshal's, version after
// version of a Builder's load assignments (loads, lapses, drains, joins and
// leaves between versions), and unchanged endpoints are not marshalled again.
func TestCLAEncoderMatchesProtoMarshal(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 15))
	fleet := fleettest.Executors(300)
	d, _ := health.NewDispatcher("", nil)
	var b translator.Builder
	var enc claEncoder
	for round := range 200 {
		for range 1 + rng.IntN(5) {
			i := rng.IntN(len(fleet))
			e := &fleet[i]
			switch rng.IntN(5) {
			case 0:
				e.Load = rng.IntN(10)
			case 1:
				e.LeaseStatus = health.StatusCritical
			case 2:
				e.LeaseStatus = health.StatusPassing
			case 3:
				e.State = health.StateDraining
			case 4:
				e.SessionID = fmt.Sprintf("s%d", rng.Uint32())
			}
		}
		if round%20 == 0 {
			fleet = append(fleet, fleettest.Executors(len(fleet) + 3)[len(fleet):]...)
		}
		cla, _ := b.Build("work", fleet, d)
		before := len(enc.prev)
		got, err := enc.marshal(cla)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := proto.MarshalOptions{Deterministic: true}.Marshal(cla)
		if !bytes.Equal(got, want) {
			t.Fatalf("round %d: encoder bytes differ from proto.Marshal (%d vs %d bytes)", round,
				len(got), len(want))
		}
		if round > 0 && before > 0 && len(enc.prev) == 0 {
			t.Fatalf("round %d: nothing kept for the next version", round)
		}
	}
}

// Unchanged endpoints are copied from the previous encoding, not marshalled:
// their bytes in the next encoding equal the previous ones, and an endpoint
// message the encoder has seen is not marshalled again (shown by handing it
// a message whose bytes it remembers under another content: it must not
// look).
func TestCLAEncoderReusesUnchangedEndpoints(t *testing.T) {
	d, _ := health.NewDispatcher("", nil)
	fleet := fleettest.Executors(50)
	var b translator.Builder
	var enc claEncoder
	cla, _ := b.Build("work", fleet, d)
	if _, err := enc.marshal(cla); err != nil {
		t.Fatal(err)
	}
	lb := cla.Endpoints[0].LbEndpoints[0]
	enc.prev[lb] = []byte("remembered")
	got, err := enc.marshal(cla)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(got, []byte("remembered")) {
		t.Fatal("an endpoint seen before was marshalled again")
	}
}

// Fields the Builder never sets are written where proto.Marshal writes them.
func TestCLAEncoderOtherShapes(t *testing.T) {
	md, _ := structpb.NewStruct(map[string]any{"b": "x",
		"a": map[string]any{"z": 1.0, "y": []any{"q", true}}})
	lb := func(host string, port uint32) *endpointv3.LbEndpoint {
		socket := &corev3.SocketAddress{
			Address:       "10.0.0.1",
			PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: port},
		}
		address := &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: socket}}
		return &endpointv3.LbEndpoint{
			HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{
				Hostname: host,
				Address:  address,
			}},
			HealthStatus: corev3.HealthStatus_HEALTHY,
			Metadata: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"m": md,
				"a": md}},
			LoadBalancingWeight: wrapperspb.UInt32(port % 7),
		}
	}
	named := &endpointv3.LbEndpoint{
		HostIdentifier: &endpointv3.LbEndpoint_EndpointName{EndpointName: "n"},
	}
	cases := map[string]*endpointv3.ClusterLoadAssignment{
		"empty":       {},
		"name only":   {ClusterName: "work"},
		"no endpoint": {ClusterName: "work", Endpoints: []*endpointv3.LocalityLbEndpoints{{}}},
		"everything": {
			ClusterName: "work",
			Endpoints: []*endpointv3.LocalityLbEndpoints{
				{Locality: &corev3.Locality{Region: "r", Zone: "z"},
					Metadata: &corev3.Metadata{
						FilterMetadata: map[string]*structpb.Struct{"l": md},
					},
					LbEndpoints:         []*endpointv3.LbEndpoint{lb("a", 1), named, lb("b", 2)},
					LoadBalancingWeight: wrapperspb.UInt32(3), Priority: 1,
					Proximity: wrapperspb.UInt32(2)},
				{LbEndpoints: []*endpointv3.LbEndpoint{lb("c", 3)}, Priority: 2},
			},
			Policy: &endpointv3.ClusterLoadAssignment_Policy{
				OverprovisioningFactor: wrapperspb.UInt32(140), WeightedPriorityHealth: true,
			},
			NamedEndpoints: map[string]*endpointv3.Endpoint{"y": {Hostname: "y"},
				"x": {Hostname: "x"}},
		},
	}
	for name, cla := range cases {
		var enc claEncoder
		for range 2 { // fresh, then from what it kept
			got, err := enc.marshal(cla)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			want, _ := proto.MarshalOptions{Deterministic: true}.Marshal(cla)
			if !bytes.Equal(got, want) {
				t.Fatalf("%s: encoder bytes differ from proto.Marshal:\n got %x\nwant %x", name,
					got, want)
			}
		}
	}
	// Unknown fields: marshalled whole.
	withUnknown := &endpointv3.ClusterLoadAssignment{ClusterName: "work",
		Endpoints: []*endpointv3.LocalityLbEndpoints{{LbEndpoints: []*endpointv3.LbEndpoint{lb("a",
			1)}}}}
	// Field 999, varint 1.
	withUnknown.Endpoints[0].ProtoReflect().SetUnknown([]byte{0xf8, 0x3e, 0x01})
	var enc claEncoder
	got, err := enc.marshal(withUnknown)
	want, _ := proto.MarshalOptions{Deterministic: true}.Marshal(withUnknown)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("unknown fields: %v, bytes equal %v", err, bytes.Equal(got, want))
	}
}

// BenchmarkCLAMarshal: one version of a load assignment in which one
// endpoint changed, as the cache marshals it for every stream: a whole
// deterministic proto.Marshal against the incremental encoder.
func BenchmarkCLAMarshal(b *testing.B) {
	for _, n := range []int{500, 10_000} {
		fleet := fleettest.Executors(n)
		d, _ := health.NewDispatcher("", nil)
		var bl translator.Builder
		var versions []*endpointv3.ClusterLoadAssignment
		for i := range 8 {
			fleet[i*7%n].Load = (fleet[i*7%n].Load + 1) % 8
			cla, _ := bl.Build("work", fleet, d)
			versions = append(versions, cla)
		}
		b.Run(fmt.Sprintf("proto-%d", n), func(b *testing.B) {
			i := 0
			for b.Loop() {
				deterministic.Marshal(versions[i%len(versions)])
				i++
			}
		})
		b.Run(fmt.Sprintf("encoder-%d", n), func(b *testing.B) {
			var enc claEncoder
			i := 0
			for b.Loop() {
				enc.marshal(versions[i%len(versions)])
				i++
			}
		})
	}
}
