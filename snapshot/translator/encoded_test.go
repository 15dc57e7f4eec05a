package translator

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
	"unsafe"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// endpointMessage is the endpoint of e as a message, written out field by
// field: what an encoded endpoint must parse to.
func endpointMessage(e health.Executor, status corev3.HealthStatus) *endpointv3.LbEndpoint {
	str := func(s string) *structpb.Value {
		return &structpb.Value{Kind: &structpb.Value_StringValue{StringValue: s}}
	}
	return &endpointv3.LbEndpoint{
		HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{
			Address: &corev3.Address{Address: &corev3.Address_SocketAddress{
				SocketAddress: &corev3.SocketAddress{Protocol: corev3.SocketAddress_TCP,
					Address:       e.Address,
					PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: uint32(e.Port)}}}},
			Hostname: e.InstanceID,
		}},
		HealthStatus:        status,
		LoadBalancingWeight: wrapperspb.UInt32(uint32(min(max(e.Capacity, 1), 128))),
		Metadata: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			"leasehold": {Fields: map[string]*structpb.Value{"instance_id": str(e.InstanceID),
				"session_id": str(e.SessionID), "version": str(e.Version)}},
		}},
	}
}

// A Builder's load assignments, over hundreds of random changes across
// datacenters and shards, parse (as a client parses the wire) to exactly the
// message written out field by field: every endpoint its executor's, with
// nothing left unknown, valid for Envoy; LbEndpoints reads the same
// endpoints in process. And no load assignment handed out changes after
// later builds, though their endpoints' encodings are shared.
func TestEncodedLoadAssignmentsParseAsTheirMessages(t *testing.T) {
	r := rand.New(rand.NewPCG(41, 43))
	dcs := []string{"dc1", "dc2"}
	d, _ := health.NewDispatcher("", nil)
	es := fleettest.Executors(120)
	for i := range es {
		es[i].Datacenter = dcs[i%2]
	}
	type handed struct {
		cla  *endpointv3.ClusterLoadAssignment
		wire []byte
	}
	var kept []handed
	bl := &Builder{Failover: Failover{Local: "dc1", Order: dcs}, Shards: 3}
	for step := range 300 {
		for range 1 + r.IntN(3) {
			mutateAcrossDatacenters(r, &es, dcs)
		}
		if step%50 == 49 {
			bl.Shards = 1 + r.IntN(4)
		}
		byEndpoint := map[string]health.Executor{}
		for _, e := range es {
			byEndpoint[fmt.Sprintf("%s|%s|%s|%d", e.InstanceID, e.SessionID, e.Address, e.Port)] = e
		}
		for _, sh := range bl.BuildPrinted("work", es, nil, d).Shards {
			wire := marshal(t, sh.CLA)
			kept = append(kept, handed{sh.CLA, wire})
			parsed := &endpointv3.ClusterLoadAssignment{}
			if err := proto.Unmarshal(wire, parsed); err != nil {
				t.Fatalf("step %d, %s: %v", step, sh.Name, err)
			}
			want := &endpointv3.ClusterLoadAssignment{ClusterName: sh.Name}
			for i, loc := range sh.CLA.GetEndpoints() {
				if len(loc.LbEndpoints) != 0 {
					t.Fatalf("step %d, %s: locality %d holds endpoints as messages", step,
						sh.Name, i)
				}
				lbs, err := LbEndpoints(loc)
				if err != nil {
					t.Fatalf("step %d, %s: %v", step, sh.Name, err)
				}
				w := &endpointv3.LocalityLbEndpoints{Locality: loc.Locality,
					LoadBalancingWeight: loc.LoadBalancingWeight, Priority: loc.Priority}
				for _, lb := range lbs {
					sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
					k := fmt.Sprintf("%s|%s|%s|%d", lb.GetEndpoint().GetHostname(),
						lb.GetMetadata().GetFilterMetadata()["leasehold"].GetFields()["session_id"].
							GetStringValue(), sa.GetAddress(), sa.GetPortValue())
					e, ok := byEndpoint[k]
					if !ok {
						t.Fatalf("step %d, %s: endpoint %s is no executor's", step, sh.Name, k)
					}
					w.LbEndpoints = append(w.LbEndpoints, endpointMessage(e, lb.GetHealthStatus()))
				}
				want.Endpoints = append(want.Endpoints, w)
			}
			if !proto.Equal(parsed, want) {
				t.Fatalf("step %d, %s: the wire parses to\n%v\nwant\n%v", step, sh.Name,
					parsed, want)
			}
			if !proto.Equal(Expand(sh.CLA), want) {
				t.Fatalf("step %d, %s: Expand differs from the wire", step, sh.Name)
			}
			if err := parsed.ValidateAll(); err != nil {
				t.Fatalf("step %d, %s: %v", step, sh.Name, err)
			}
			if n := proto.Size(want); n != len(wire) {
				t.Fatalf("step %d, %s: %d bytes on the wire, the message is %d", step,
					sh.Name, len(wire), n)
			}
		}
	}
	for i, h := range kept {
		if !bytes.Equal(marshal(t, h.cla), h.wire) {
			t.Fatalf("load assignment %d (%s) changed after it was handed out", i,
				h.cla.GetClusterName())
		}
	}
}

// LbEndpoints reads endpoints held as messages and encoded, in wire order,
// past unknown fields of other numbers; SetEncoded replaces both kinds and
// keeps the rest; an encoding that does not parse is an error naming the
// locality.
func TestLbEndpointsReadsBothKindsAndSetEncodedReplacesThem(t *testing.T) {
	es := fleettest.Executors(3)
	msg := func(i int) *endpointv3.LbEndpoint {
		return endpointMessage(es[i], corev3.HealthStatus_HEALTHY)
	}
	enc := func(i int) []byte { return marshal(t, msg(i)) }
	foreign := protowire.AppendVarint(protowire.AppendTag(nil, 99, protowire.VarintType), 7)
	loc := &endpointv3.LocalityLbEndpoints{Locality: &corev3.Locality{Region: "dc1"},
		LbEndpoints: []*endpointv3.LbEndpoint{msg(0)}}
	var raw []byte
	raw = append(raw, foreign...)
	raw = protowire.AppendBytes(protowire.AppendTag(raw, 2, protowire.BytesType), enc(1))
	loc.ProtoReflect().SetUnknown(protoreflect.RawFields(raw))
	hosts := func(lbs []*endpointv3.LbEndpoint) string {
		var h []string
		for _, lb := range lbs {
			h = append(h, lb.GetEndpoint().GetHostname())
		}
		return strings.Join(h, ",")
	}
	got, err := LbEndpoints(loc)
	if err != nil || hosts(got) != es[0].InstanceID+","+es[1].InstanceID {
		t.Fatalf("LbEndpoints: %s, %v", hosts(got), err)
	}
	SetEncoded(loc, [][]byte{enc(2), enc(0)})
	got, err = LbEndpoints(loc)
	if err != nil || hosts(got) != es[2].InstanceID+","+es[0].InstanceID {
		t.Fatalf("after SetEncoded: %s, %v", hosts(got), err)
	}
	if u := loc.ProtoReflect().GetUnknown(); !bytes.HasSuffix(u, foreign) {
		t.Fatalf("SetEncoded dropped the other unknown field: %x", u)
	}
	parsed := &endpointv3.LocalityLbEndpoints{}
	if err := proto.Unmarshal(marshal(t, loc), parsed); err != nil ||
		hosts(parsed.LbEndpoints) != hosts(got) {
		t.Fatalf("the wire parses to %s, %v", hosts(parsed.LbEndpoints), err)
	}
	bad := &endpointv3.LocalityLbEndpoints{Locality: &corev3.Locality{Region: "dc7"}}
	bad.ProtoReflect().SetUnknown(protoreflect.RawFields(
		protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), []byte{0xff})))
	if _, err := LbEndpoints(bad); err == nil || !strings.Contains(err.Error(), "dc7") {
		t.Fatalf("a broken encoding: %v", err)
	}
	if Expand(nil) != nil {
		t.Fatal("Expand(nil) is not nil")
	}
}

// wiresHold checks what a Shard's Wire promises: it is its load assignment
// marshalled as every replica and the cache marshal it, its localities'
// encoded endpoints lie in it (the endpoints are held once), and a wire is
// never written — the previous build's wires still marshal their messages,
// though the entries now point into newer ones.
func wiresHold(t *testing.T, shards ...[]Shard) {
	t.Helper()
	for _, list := range shards {
		for _, sh := range list {
			if sh.CLA == nil {
				continue
			}
			if !bytes.Equal(sh.Wire, marshal(t, sh.CLA)) {
				t.Fatalf("shard %s: its wire is not its load assignment marshalled", sh.Name)
			}
			for i, loc := range sh.CLA.GetEndpoints() {
				if raw := loc.ProtoReflect().GetUnknown(); len(raw) > 0 && !within(raw, sh.Wire) {
					t.Fatalf("shard %s: locality %d's endpoints are a copy beside the wire",
						sh.Name, i)
				}
			}
		}
	}
}

// within reports whether part's bytes are inside whole's.
func within(part, whole []byte) bool {
	p, w := uintptr(unsafe.Pointer(unsafe.SliceData(part))), uintptr(unsafe.Pointer(unsafe.SliceData(whole)))
	return p >= w && p+uintptr(len(part)) <= w+uintptr(len(whole))
}

// WireFields yields each field of an encoding with its raw bytes and, for a
// bytes field, its contents; then one false for a rest that does not scan;
// and stops when asked.
func TestWireFieldsYieldEachFieldThenWhetherTheRestScans(t *testing.T) {
	b := protowire.AppendTag(nil, 1, protowire.VarintType)
	b = protowire.AppendVarint(b, 300)
	first := len(b)
	b = protowire.AppendTag(b, 2, protowire.BytesType)
	b = protowire.AppendString(b, "abc")
	type got struct {
		num        protowire.Number
		raw, value string
		ok         bool
	}
	scan := func(b []byte, stopAfter int) []got {
		var out []got
		for f, ok := range WireFields(b) {
			out = append(out, got{f.Num, string(f.Raw), string(f.Value), ok})
			if len(out) == stopAfter {
				break
			}
		}
		return out
	}
	want := []got{{1, string(b[:first]), "", true}, {2, string(b[first:]), "abc", true}}
	if g := scan(b, 0); !reflect.DeepEqual(g, want) {
		t.Errorf("whole: %+v, want %+v", g, want)
	}
	if g := scan(b, 1); !reflect.DeepEqual(g, want[:1]) {
		t.Errorf("stopped after one: %+v", g)
	}
	cut := append(append([]byte(nil), b...), 0x1a, 0x05, 0x01) // field 3: 5 bytes, 1 there
	if g := scan(cut, 0); !reflect.DeepEqual(g, append(want[:2:2], got{})) {
		t.Errorf("cut short: %+v, want the two fields then a false", g)
	}
	if g := scan(nil, 0); len(g) != 0 {
		t.Errorf("nothing: %+v", g)
	}
}
