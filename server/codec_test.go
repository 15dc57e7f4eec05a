package server

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/translator"
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
	cla := translator.Endpoints("work", nil, health.Dispatcher{})
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

// TestCodecCarriesEveryField walks DiscoveryResponse's descriptor (and that
// of the Any resources it holds): a response with any one field set encodes
// byte for byte as proto.Marshal does, so no field — one a go-control-plane
// upgrade adds included — is ever dropped by the zero-copy encoding.
func TestCodecCarriesEveryField(t *testing.T) {
	base := func() *discovery.DiscoveryResponse {
		return &discovery.DiscoveryResponse{VersionInfo: "v1", TypeUrl: "t", Nonce: "n", Resources: []*anypb.Any{
			{TypeUrl: "type.googleapis.com/x", Value: []byte("abc")}, {TypeUrl: "type.googleapis.com/x", Value: []byte("de")},
		}}
	}
	check := func(what string, resp *discovery.DiscoveryResponse) {
		t.Helper()
		want, err := proto.MarshalOptions{Deterministic: true}.Marshal(resp)
		if err != nil {
			t.Fatal(err)
		}
		got, err := NewCodec().Marshal(resp)
		if err != nil {
			t.Fatal(err)
		}
		if b := got.Materialize(); !bytes.Equal(b, want) {
			t.Errorf("%s: the codec wrote %d bytes, proto.Marshal %d: a field is dropped or misplaced", what, len(b), len(want))
		}
	}
	fields := base().ProtoReflect().Descriptor().Fields()
	for i := range fields.Len() {
		resp := base()
		setField(t, resp.ProtoReflect(), fields.Get(i))
		check("DiscoveryResponse."+string(fields.Get(i).Name()), resp)
	}
	anyFields := (&anypb.Any{}).ProtoReflect().Descriptor().Fields()
	for i := range anyFields.Len() {
		resp := base()
		resp.Resources[1] = &anypb.Any{}
		setField(t, resp.Resources[1].ProtoReflect(), anyFields.Get(i))
		check("Any."+string(anyFields.Get(i).Name()), resp)
	}
	if fields.Len() < 7 || anyFields.Len() != 2 {
		t.Fatalf("walked %d and %d fields: the descriptors were not read", fields.Len(), anyFields.Len())
	}
}

// setField gives fd a value that proto.Marshal writes (not its zero value).
func setField(t *testing.T, m protoreflect.Message, fd protoreflect.FieldDescriptor) {
	t.Helper()
	switch {
	case fd.IsList():
		l := m.Mutable(fd).List()
		if fd.Kind() == protoreflect.MessageKind {
			l.Append(l.NewElement())
		} else {
			l.Append(scalar(t, fd))
		}
	case fd.IsMap():
		t.Fatalf("%s: map fields are not expected here", fd.FullName())
	case fd.Kind() == protoreflect.MessageKind:
		m.Set(fd, m.NewField(fd)) // an empty message is present and written
	default:
		m.Set(fd, scalar(t, fd))
	}
}

func scalar(t *testing.T, fd protoreflect.FieldDescriptor) protoreflect.Value {
	switch fd.Kind() {
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(true)
	case protoreflect.StringKind:
		return protoreflect.ValueOfString("x")
	case protoreflect.BytesKind:
		return protoreflect.ValueOfBytes([]byte("x"))
	case protoreflect.EnumKind:
		return protoreflect.ValueOfEnum(1)
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return protoreflect.ValueOfInt32(1)
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return protoreflect.ValueOfInt64(1)
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return protoreflect.ValueOfUint32(1)
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return protoreflect.ValueOfUint64(1)
	case protoreflect.FloatKind:
		return protoreflect.ValueOfFloat32(1)
	case protoreflect.DoubleKind:
		return protoreflect.ValueOfFloat64(1)
	}
	t.Fatalf("%s: kind %s not handled", fd.FullName(), fd.Kind())
	return protoreflect.Value{}
}

// BenchmarkCodecMarshal is one response of 10 resources through the codec
// (what each stream pays per push besides the transport).
func BenchmarkCodecMarshal(b *testing.B) {
	resp := &discovery.DiscoveryResponse{VersionInfo: "e0123456789abcdef", TypeUrl: "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment", Nonce: "42"}
	for range 10 {
		resp.Resources = append(resp.Resources, &anypb.Any{TypeUrl: resp.TypeUrl, Value: make([]byte, 4096)})
	}
	c := NewCodec()
	b.ReportAllocs()
	for b.Loop() {
		out, err := c.Marshal(resp)
		if err != nil {
			b.Fatal(err)
		}
		out.Free()
	}
}

// Delta responses too are encoded by reference, exactly as proto.Marshal
// writes them, for any shape (empty fields, empty names and values, many
// resources, removals).
func TestCodecMatchesProtoMarshalForDelta(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	c := NewCodec()
	typeURL := "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
	for i := range 300 {
		resp := &discovery.DeltaDiscoveryResponse{TypeUrl: typeURL}
		if r.IntN(4) > 0 {
			resp.SystemVersionInfo = fmt.Sprintf("e%016x", r.Uint64())
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
			res := &discovery.Resource{Resource: &anypb.Any{Value: v}}
			if r.IntN(8) > 0 {
				res.Resource.TypeUrl = typeURL
			}
			if r.IntN(8) > 0 {
				res.Name = fmt.Sprintf("work/shard-%d", r.IntN(100))
			}
			if r.IntN(8) > 0 {
				res.Version = fmt.Sprintf("%016x", r.Uint64())
			}
			resp.Resources = append(resp.Resources, res)
		}
		for range r.IntN(3) {
			resp.RemovedResources = append(resp.RemovedResources, fmt.Sprint("gone-", r.IntN(3)))
		}
		if r.IntN(10) == 0 {
			resp.RemovedResources = append(resp.RemovedResources, "")
		}
		want, err := proto.MarshalOptions{Deterministic: true}.Marshal(resp)
		if err != nil {
			t.Fatal(err)
		}
		if !plainDeltaResponse(resp) {
			t.Fatalf("case %d: a response of the fields the cache sets is not plain", i)
		}
		got, err := c.Marshal(resp)
		if err != nil {
			t.Fatal(err)
		}
		if b := got.Materialize(); !bytes.Equal(b, want) {
			t.Fatalf("case %d: zero-copy delta encoding differs from proto.Marshal (%d vs %d "+
				"bytes)", i, len(b), len(want))
		}
		back := &discovery.DeltaDiscoveryResponse{}
		if err := c.Unmarshal(got, back); err != nil || !proto.Equal(back, resp) {
			t.Fatalf("case %d: round trip: %v", i, err)
		}
	}
}

// A delta response's resources are referenced, not copied.
func TestCodecReferencesDeltaResourceBytes(t *testing.T) {
	a := &anypb.Any{TypeUrl: "type.googleapis.com/x", Value: make([]byte, 4096)}
	resp := &discovery.DeltaDiscoveryResponse{TypeUrl: a.TypeUrl, Nonce: "1",
		Resources: []*discovery.Resource{{Name: "work", Version: "v1", Resource: a}}}
	got, err := NewCodec().Marshal(resp)
	if err != nil {
		t.Fatal(err)
	}
	for _, piece := range got {
		if b := piece.ReadOnlyData(); len(b) == len(a.Value) && &b[0] == &a.Value[0] {
			return
		}
	}
	t.Fatal("the resource's bytes were copied into the delta response")
}

// TestCodecCarriesEveryDeltaField is TestCodecCarriesEveryField for delta:
// DeltaDiscoveryResponse, Resource and Any, each field set alone, encode
// byte for byte as proto.Marshal does (a field the encoder does not write
// must make the response take the standard codec).
func TestCodecCarriesEveryDeltaField(t *testing.T) {
	base := func() *discovery.DeltaDiscoveryResponse {
		return &discovery.DeltaDiscoveryResponse{SystemVersionInfo: "v1", TypeUrl: "t", Nonce: "n",
			RemovedResources: []string{"old"},
			Resources: []*discovery.Resource{
				{Name: "a", Version: "1", Resource: &anypb.Any{TypeUrl: "type.googleapis.com/x",
					Value: []byte("abc")}},
				{Name: "b", Version: "2", Resource: &anypb.Any{TypeUrl: "type.googleapis.com/x",
					Value: []byte("de")}},
			}}
	}
	check := func(what string, resp *discovery.DeltaDiscoveryResponse) {
		t.Helper()
		want, err := proto.MarshalOptions{Deterministic: true}.Marshal(resp)
		if err != nil {
			t.Fatal(err)
		}
		got, err := NewCodec().Marshal(resp)
		if err != nil {
			t.Fatal(err)
		}
		if b := got.Materialize(); !bytes.Equal(b, want) {
			t.Errorf("%s: the codec wrote %d bytes, proto.Marshal %d: a field is dropped or "+
				"misplaced", what, len(b), len(want))
		}
	}
	fields := base().ProtoReflect().Descriptor().Fields()
	for i := range fields.Len() {
		resp := base()
		setField(t, resp.ProtoReflect(), fields.Get(i))
		check("DeltaDiscoveryResponse."+string(fields.Get(i).Name()), resp)
	}
	resFields := (&discovery.Resource{}).ProtoReflect().Descriptor().Fields()
	for i := range resFields.Len() {
		resp := base()
		resp.Resources[1] = &discovery.Resource{}
		setField(t, resp.Resources[1].ProtoReflect(), resFields.Get(i))
		check("Resource."+string(resFields.Get(i).Name()), resp)
	}
	anyFields := (&anypb.Any{}).ProtoReflect().Descriptor().Fields()
	for i := range anyFields.Len() {
		resp := base()
		resp.Resources[1].Resource = &anypb.Any{}
		setField(t, resp.Resources[1].Resource.ProtoReflect(), anyFields.Get(i))
		check("Any."+string(anyFields.Get(i).Name()), resp)
	}
	if fields.Len() < 8 || resFields.Len() < 8 || anyFields.Len() != 2 {
		t.Fatalf("walked %d, %d and %d fields: the descriptors were not read", fields.Len(),
			resFields.Len(), anyFields.Len())
	}
}
