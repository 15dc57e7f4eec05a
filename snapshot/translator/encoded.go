package translator

import (
	"bytes"
	"fmt"
	"iter"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/leasehold/leasehold/health"
)

// Endpoints are held encoded. As messages, an endpoint took ~1.25 KB of
// heap (a dozen small messages and two maps for its metadata), kept as long
// as its executor stayed unchanged, next to its ~130 bytes of encoding: at
// 10,000 executors per constraint set, 17 MB that only marshalling read.
// A Builder therefore encodes each endpoint once, when its executor is
// decided, from one set of reused messages, and keeps only the bytes; the
// localities of the load assignments it makes carry their endpoints as
// those bytes, in the locality's unknown fields, as elements of
// lb_endpoints (field 2). proto.Marshal writes unknown fields as they are,
// after the known ones, so the wire holds an ordinary load assignment whose
// locality lists its endpoints after its weight and priority: protobuf
// parsers (grpc-go's, Envoy's) take fields in any order.
//
// In process, a locality's LbEndpoints field is therefore empty: read its
// endpoints with LbEndpoints, or a whole load assignment as messages with
// Expand (what tests, golden files and the admin dump read).

// Field numbers of the encoded endpoints: LocalityLbEndpoints.lb_endpoints;
// and of the localities: ClusterLoadAssignment.endpoints.
const (
	lbEndpointsField protowire.Number = 2
	localitiesField  protowire.Number = 2
)

var deterministic = proto.MarshalOptions{Deterministic: true}

// endpointEncoder encodes endpoints from one set of messages, reused from
// one endpoint to the next (a Builder's, used by one goroutine).
type endpointEncoder struct {
	lb                 endpointv3.LbEndpoint
	host               endpointv3.LbEndpoint_Endpoint
	ep                 endpointv3.Endpoint
	addr               corev3.Address
	sock               corev3.Address_SocketAddress
	sa                 corev3.SocketAddress
	port               corev3.SocketAddress_PortValue
	weight             wrapperspb.UInt32Value
	md                 corev3.Metadata
	st                 structpb.Struct
	inst, sess, ver    structpb.Value
	instS, sessS, verS structpb.Value_StringValue
	ready              bool
}

// encode appends the encoding of e's endpoint to dst: its address, the
// instance id as hostname, weight from capacity, and instance, session and
// version as metadata (what a dispatcher reports and fences on).
func (c *endpointEncoder) encode(dst []byte, e *health.Executor,
	status corev3.HealthStatus) ([]byte, error) {
	if !c.ready {
		c.inst.Kind, c.sess.Kind, c.ver.Kind = &c.instS, &c.sessS, &c.verS
		c.st.Fields = map[string]*structpb.Value{
			"instance_id": &c.inst, "session_id": &c.sess, "version": &c.ver}
		c.md.FilterMetadata = map[string]*structpb.Struct{MetadataNamespace: &c.st}
		c.sa.Protocol = corev3.SocketAddress_TCP
		c.sa.PortSpecifier = &c.port
		c.sock.SocketAddress = &c.sa
		c.addr.Address = &c.sock
		c.ep.Address = &c.addr
		c.host.Endpoint = &c.ep
		c.lb.HostIdentifier = &c.host
		c.lb.LoadBalancingWeight = &c.weight
		c.lb.Metadata = &c.md
		c.ready = true
	}
	c.instS.StringValue, c.sessS.StringValue, c.verS.StringValue =
		e.InstanceID, e.SessionID, e.Version
	c.sa.Address = e.Address
	c.port.PortValue = uint32(e.Port)
	c.ep.Hostname = e.InstanceID
	c.weight.Value = weight(*e)
	c.lb.HealthStatus = status
	out, err := deterministic.MarshalAppend(dst, &c.lb)
	if err != nil {
		return dst, fmt.Errorf("endpoint of %s: %w", e.InstanceID, err)
	}
	return out, nil
}

// setEncoded makes loc carry the entries' endpoints, encoded, and points
// each entry's encoding into loc's (so one copy of each is kept: the
// entries' own allocations are dropped once every load assignment holding
// them is).
func setEncoded(loc *endpointv3.LocalityLbEndpoints, ens []*entry) {
	size := 0
	for _, en := range ens {
		size += protowire.SizeTag(lbEndpointsField) + protowire.SizeBytes(len(en.lb))
	}
	buf := make([]byte, 0, size)
	for _, en := range ens {
		buf = protowire.AppendTag(buf, lbEndpointsField, protowire.BytesType)
		buf = protowire.AppendVarint(buf, uint64(len(en.lb)))
		buf = append(buf, en.lb...)
	}
	pointInto(loc, ens, buf)
}

// pointInto makes loc carry raw (its entries' endpoints, encoded, as
// setEncoded lays them out) and points each entry's encoding into it.
func pointInto(loc *endpointv3.LocalityLbEndpoints, ens []*entry, raw []byte) {
	at := 0
	for _, en := range ens {
		at += protowire.SizeTag(lbEndpointsField) + protowire.SizeVarint(uint64(len(en.lb)))
		en.lb = raw[at : at+len(en.lb) : at+len(en.lb)] // raw is never appended to
		at += len(en.lb)
	}
	loc.ProtoReflect().SetUnknown(protoreflect.RawFields(raw))
}

// wireOf marshals cla (whose localities locs made) as the cache would, and
// points the localities' encoded endpoints, and their entries' encodings,
// into the result: a load assignment's endpoints are then held once, in the
// bytes its streams are sent, not once encoded and once again marshalled
// (at 10,000 executors ~1.3 MB per constraint set). proto.Marshal writes a
// message's unknown fields last, as they are, so each locality's wire ends
// with its encoded endpoints; a wire that does not (no marshalling known
// writes one) is returned nil, everything left as it was, and the cache
// marshals the load assignment itself.
func wireOf(cla *endpointv3.ClusterLoadAssignment, locs []*locality) []byte {
	wire, err := deterministic.Marshal(cla)
	if err != nil || len(locs) != len(cla.GetEndpoints()) {
		return nil
	}
	raws := make([][]byte, 0, len(locs))
	for rest := wire; len(rest) > 0; {
		num, typ, n := protowire.ConsumeTag(rest)
		if n < 0 {
			return nil
		}
		rest = rest[n:]
		n = protowire.ConsumeFieldValue(num, typ, rest)
		if n < 0 {
			return nil
		}
		if num == localitiesField && typ == protowire.BytesType {
			v, _ := protowire.ConsumeBytes(rest)
			i := len(raws)
			if i == len(locs) {
				return nil
			}
			raw := cla.GetEndpoints()[i].ProtoReflect().GetUnknown()
			if !bytes.HasSuffix(v, raw) {
				return nil
			}
			raws = append(raws, v[len(v)-len(raw):len(v):len(v)])
		}
		rest = rest[n:]
	}
	if len(raws) != len(locs) {
		return nil
	}
	for i, raw := range raws {
		pointInto(cla.GetEndpoints()[i], locs[i].ens, raw)
	}
	return wire
}

// LbEndpoints is loc's endpoints as messages: those it holds as messages,
// then those it holds encoded, in the order the wire has them (a Builder's
// load assignments hold all of theirs encoded). The error names an
// encoding that does not parse.
func LbEndpoints(loc *endpointv3.LocalityLbEndpoints) ([]*endpointv3.LbEndpoint, error) {
	out := append([]*endpointv3.LbEndpoint(nil), loc.GetLbEndpoints()...)
	if loc == nil {
		return out, nil
	}
	b := []byte(loc.ProtoReflect().GetUnknown())
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, fmt.Errorf("locality %s: %w", loc.GetLocality().GetRegion(),
				protowire.ParseError(n))
		}
		b = b[n:]
		m := protowire.ConsumeFieldValue(num, typ, b)
		if m < 0 {
			return nil, fmt.Errorf("locality %s: %w", loc.GetLocality().GetRegion(),
				protowire.ParseError(m))
		}
		if num == lbEndpointsField && typ == protowire.BytesType {
			v, _ := protowire.ConsumeBytes(b[:m])
			lb := &endpointv3.LbEndpoint{}
			if err := proto.Unmarshal(v, lb); err != nil {
				return nil, fmt.Errorf("locality %s, endpoint %d: %w",
					loc.GetLocality().GetRegion(), len(out), err)
			}
			out = append(out, lb)
		}
		b = b[m:]
	}
	return out, nil
}

// EncodedLbEndpoints is each of loc's endpoints as its encoding (an
// LbEndpoint's), in wire order, sharing loc's bytes (not to be written); ok
// is false when loc holds endpoints as messages too, or its encodings do not
// scan.
func EncodedLbEndpoints(loc *endpointv3.LocalityLbEndpoints) (lbs [][]byte, ok bool) {
	if len(loc.GetLbEndpoints()) > 0 {
		return nil, false
	}
	for f, scanned := range WireFields(loc.ProtoReflect().GetUnknown()) {
		if !scanned {
			return nil, false
		}
		if f.Num == lbEndpointsField && f.Type == protowire.BytesType {
			lbs = append(lbs, f.Value)
		}
	}
	return lbs, true
}

// WireField is one field of an encoding: its number and wire type, the
// field as encoded (Raw: tag and value) and, for a bytes field, its
// contents (Value, without the length; nil for other types). Both share the
// encoding's bytes.
type WireField struct {
	Num        protowire.Number
	Type       protowire.Type
	Raw, Value []byte
}

// WireFields yields each field of b in order, and then, if the rest of b
// does not scan (a tag or value cut short or malformed), a zero field with
// false.
func WireFields(b []byte) iter.Seq2[WireField, bool] {
	return func(yield func(WireField, bool) bool) {
		for len(b) > 0 {
			num, typ, n := protowire.ConsumeTag(b)
			if n < 0 {
				yield(WireField{}, false)
				return
			}
			m := protowire.ConsumeFieldValue(num, typ, b[n:])
			if m < 0 {
				yield(WireField{}, false)
				return
			}
			f := WireField{Num: num, Type: typ, Raw: b[:n+m]}
			if typ == protowire.BytesType {
				f.Value, _ = protowire.ConsumeBytes(b[n : n+m])
			}
			if !yield(f, true) {
				return
			}
			b = b[n+m:]
		}
	}
}

// Expand is cla with every endpoint as a message (a copy: cla is not
// modified), by marshalling and parsing it again; nil for nil. It panics if
// cla does not marshal or parse, which a load assignment of this package
// always does.
func Expand(cla *endpointv3.ClusterLoadAssignment) *endpointv3.ClusterLoadAssignment {
	if cla == nil {
		return nil
	}
	b, err := deterministic.Marshal(cla)
	if err != nil {
		panic(fmt.Sprintf("load assignment %s: %v", cla.GetClusterName(), err))
	}
	out := &endpointv3.ClusterLoadAssignment{}
	if err := proto.Unmarshal(b, out); err != nil {
		panic(fmt.Sprintf("load assignment %s: %v", cla.GetClusterName(), err))
	}
	return out
}

// SetEncoded makes loc carry lbs, each an endpoint's encoding (LbEndpoint),
// in place of the endpoints it carried as messages or encoded; its other
// fields, unknown ones too, are kept. lbs is copied.
func SetEncoded(loc *endpointv3.LocalityLbEndpoints, lbs [][]byte) {
	loc.LbEndpoints = nil
	var rest []byte
	b := []byte(loc.ProtoReflect().GetUnknown())
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			break // not ours to mend: the rest is dropped with the endpoints
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			break
		}
		if num != lbEndpointsField || typ != protowire.BytesType {
			rest = append(rest, b[:n+m]...)
		}
		b = b[n+m:]
	}
	size := len(rest)
	for _, lb := range lbs {
		size += protowire.SizeTag(lbEndpointsField) + protowire.SizeBytes(len(lb))
	}
	buf := make([]byte, 0, size)
	for _, lb := range lbs {
		buf = protowire.AppendTag(buf, lbEndpointsField, protowire.BytesType)
		buf = protowire.AppendBytes(buf, lb)
	}
	loc.ProtoReflect().SetUnknown(protoreflect.RawFields(append(buf, rest...)))
}
