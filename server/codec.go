package server

import (
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	protocodec "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/anypb"
)

// Codec is the server's gRPC codec: the standard proto codec, except that a
// state-of-the-world DiscoveryResponse is encoded without copying its
// resources. The cache marshals each resource version once for every stream;
// the default codec would copy all of them into a fresh pooled buffer per
// stream and response (grpc-go's pool jumps from 32 KB to 1 MB tiers, and
// sync.Pool keeps those buffers across a GC), which made memory grow ~1 MB per
// stream. Here the response is a list of small framing pieces that reference
// the shared bytes. The encoding is byte-identical to a deterministic
// proto.Marshal (tested).
type Codec struct{ std encoding.CodecV2 }

var _ encoding.CodecV2 = Codec{}

// NewCodec returns the codec; use it with ServerOption.
func NewCodec() Codec { return Codec{std: encoding.GetCodecV2(protocodec.Name)} }

// ServerOption installs the codec on a gRPC server.
func ServerOption() grpc.ServerOption { return grpc.ForceServerCodecV2(NewCodec()) }

// Name is the standard codec's ("proto"), since the wire format is the same.
func (c Codec) Name() string { return protocodec.Name }

// Unmarshal is the standard codec's.
func (c Codec) Unmarshal(data mem.BufferSlice, v any) error { return c.std.Unmarshal(data, v) }

// Marshal encodes a DiscoveryResponse or a DeltaDiscoveryResponse by
// reference; every other message (and a response with fields leasehold
// never sets) goes to the standard codec.
func (c Codec) Marshal(v any) (mem.BufferSlice, error) {
	switch resp := v.(type) {
	case *discovery.DiscoveryResponse:
		if plainResponse(resp) {
			return encodeResponse(resp), nil
		}
	case *discovery.DeltaDiscoveryResponse:
		if plainDeltaResponse(resp) {
			return encodeDeltaResponse(resp), nil
		}
	}
	return c.std.Marshal(v)
}

// plainResponse reports whether resp holds only the fields encodeResponse
// writes. The fields are named, not asked of the message (a reflective walk
// made each send 1.6× slower with twice the allocations, as
// BenchmarkCodecMarshal showed); TestCodecCarriesEveryField walks the
// descriptors and fails when an upgrade adds a field this does not name.
func plainResponse(r *discovery.DiscoveryResponse) bool {
	if r.Canary || r.ControlPlane != nil || len(r.ResourceErrors) > 0 ||
		len(r.ProtoReflect().GetUnknown()) > 0 {
		return false
	}
	for _, a := range r.Resources {
		if a == nil || len(a.ProtoReflect().GetUnknown()) > 0 {
			return false
		}
	}
	return true
}

// encodeResponse writes fields in number order, as proto.Marshal does:
// version_info (1), resources (2, each an Any: type_url 1, value 2),
// type_url (4), nonce (5). Framing goes into one small buffer that the
// pieces slice; each Any's value is referenced, never copied.
func encodeResponse(r *discovery.DiscoveryResponse) mem.BufferSlice {
	frame := make([]byte, 0, 64+len(r.VersionInfo)+len(r.TypeUrl)+len(r.Nonce)+
		len(r.Resources)*(24+anyTypeURLLen(r)))
	out := make(mem.BufferSlice, 0, 2+2*len(r.Resources))
	start := 0
	cut := func() { // the framing written since the last cut becomes a piece
		if len(frame) > start {
			out = append(out, mem.SliceBuffer(frame[start:len(frame):len(frame)]))
			start = len(frame)
		}
	}
	frame = appendString(frame, 1, r.VersionInfo)
	for _, a := range r.Resources {
		frame = protowire.AppendTag(frame, 2, protowire.BytesType)
		frame = protowire.AppendVarint(frame, uint64(anySize(a)))
		frame = appendString(frame, 1, a.TypeUrl)
		if len(a.Value) > 0 {
			frame = protowire.AppendTag(frame, 2, protowire.BytesType)
			frame = protowire.AppendVarint(frame, uint64(len(a.Value)))
			cut()
			out = append(out, mem.SliceBuffer(a.Value))
		}
	}
	frame = appendString(frame, 4, r.TypeUrl)
	frame = appendString(frame, 5, r.Nonce)
	cut()
	return out
}

func appendString(b []byte, num protowire.Number, s string) []byte {
	if s == "" {
		return b // proto3 does not write empty scalars
	}
	b = protowire.AppendTag(b, num, protowire.BytesType)
	return protowire.AppendString(b, s)
}

func anySize(a *anypb.Any) int {
	n := 0
	if a.TypeUrl != "" {
		n += protowire.SizeTag(1) + protowire.SizeBytes(len(a.TypeUrl))
	}
	if len(a.Value) > 0 {
		n += protowire.SizeTag(2) + protowire.SizeBytes(len(a.Value))
	}
	return n
}

func anyTypeURLLen(r *discovery.DiscoveryResponse) int {
	if len(r.Resources) == 0 {
		return 0
	}
	return len(r.Resources[0].TypeUrl)
}

// plainDeltaResponse is plainResponse for delta: the response and each of
// its resources hold only the fields encodeDeltaResponse writes (named, for
// the same reason; TestCodecCarriesEveryDeltaField is the guard).
func plainDeltaResponse(r *discovery.DeltaDiscoveryResponse) bool {
	if r.ControlPlane != nil || len(r.RemovedResourceNames) > 0 || len(r.ResourceErrors) > 0 ||
		len(r.ProtoReflect().GetUnknown()) > 0 {
		return false
	}
	for _, res := range r.Resources {
		if res == nil || res.Resource == nil || res.ResourceName != nil ||
			len(res.Aliases) > 0 || res.Ttl != nil || res.CacheControl != nil ||
			res.Metadata != nil || len(res.ProtoReflect().GetUnknown()) > 0 ||
			len(res.Resource.ProtoReflect().GetUnknown()) > 0 {
			return false
		}
	}
	return true
}

// encodeDeltaResponse writes fields in number order, as proto.Marshal does:
// system_version_info (1), resources (2, each a Resource: version 1,
// resource 2 — an Any: type_url 1, value 2 —, name 3), type_url (4), nonce
// (5), removed_resources (6). As encodeResponse, each Any's value is
// referenced, never copied.
func encodeDeltaResponse(r *discovery.DeltaDiscoveryResponse) mem.BufferSlice {
	size := 64 + len(r.SystemVersionInfo) + len(r.TypeUrl) + len(r.Nonce)
	for _, res := range r.Resources {
		size += 32 + len(res.Version) + len(res.Name) + len(res.Resource.TypeUrl)
	}
	for _, n := range r.RemovedResources {
		size += 8 + len(n)
	}
	frame := make([]byte, 0, size)
	out := make(mem.BufferSlice, 0, 2+2*len(r.Resources))
	start := 0
	cut := func() {
		if len(frame) > start {
			out = append(out, mem.SliceBuffer(frame[start:len(frame):len(frame)]))
			start = len(frame)
		}
	}
	frame = appendString(frame, 1, r.SystemVersionInfo)
	for _, res := range r.Resources {
		a := res.Resource
		n := anySize(a)
		inner := protowire.SizeTag(2) + protowire.SizeBytes(n)
		if res.Version != "" {
			inner += protowire.SizeTag(1) + protowire.SizeBytes(len(res.Version))
		}
		if res.Name != "" {
			inner += protowire.SizeTag(3) + protowire.SizeBytes(len(res.Name))
		}
		frame = protowire.AppendTag(frame, 2, protowire.BytesType)
		frame = protowire.AppendVarint(frame, uint64(inner))
		frame = appendString(frame, 1, res.Version)
		frame = protowire.AppendTag(frame, 2, protowire.BytesType)
		frame = protowire.AppendVarint(frame, uint64(n))
		frame = appendString(frame, 1, a.TypeUrl)
		if len(a.Value) > 0 {
			frame = protowire.AppendTag(frame, 2, protowire.BytesType)
			frame = protowire.AppendVarint(frame, uint64(len(a.Value)))
			cut()
			out = append(out, mem.SliceBuffer(a.Value))
		}
		frame = appendString(frame, 3, res.Name)
	}
	frame = appendString(frame, 4, r.TypeUrl)
	frame = appendString(frame, 5, r.Nonce)
	for _, name := range r.RemovedResources {
		// A repeated string writes every element, empty ones too.
		frame = protowire.AppendTag(frame, 6, protowire.BytesType)
		frame = protowire.AppendString(frame, name)
	}
	cut()
	return out
}
