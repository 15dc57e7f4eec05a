package xdscache

import (
	"fmt"

	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Field numbers the encoder splices: ClusterLoadAssignment.endpoints and
// LocalityLbEndpoints.lb_endpoints.
const (
	claEndpointsField   = 2
	localityLbEndpoints = 2
)

// claEncoder writes one load assignment's versions, byte for byte as a
// deterministic proto.Marshal does, reusing the encoding of every endpoint
// message it wrote for the previous version. The Builder keeps the message
// of an unchanged executor (endpoint messages are immutable once built), so
// a new version costs a copy of the unchanged endpoints' bytes plus the
// marshalling of the changed ones — not a marshal of the whole assignment,
// which at 10,000 endpoints took ~48 ms, before the first stream could be
// sent anything. It keeps slices of the previous encoding only (no copies).
type claEncoder struct {
	prev map[*endpointv3.LbEndpoint][]byte
}

var deterministic = proto.MarshalOptions{Deterministic: true}

// marshal encodes cla; messages of a shape it does not splice (unknown
// fields, nil elements) are marshalled whole.
func (c *claEncoder) marshal(cla *endpointv3.ClusterLoadAssignment) ([]byte, error) {
	if !spliceable(cla) {
		c.prev = nil
		return deterministic.Marshal(cla)
	}
	next := make(map[*endpointv3.LbEndpoint][]byte, len(c.prev)+8)
	top, err := shellOf(cla, claEndpointsField)
	if err != nil {
		return nil, err
	}
	locs := make([]locEncoding, len(cla.Endpoints))
	size := len(top.before) + len(top.after)
	for i, loc := range cla.Endpoints {
		l := &locs[i]
		if l.shell, err = shellOf(loc, localityLbEndpoints); err != nil {
			return nil, err
		}
		l.lbs = make([][]byte, len(loc.LbEndpoints))
		for j, lb := range loc.LbEndpoints {
			b, ok := c.prev[lb]
			if !ok {
				if b, err = deterministic.Marshal(lb); err != nil {
					return nil, fmt.Errorf("endpoint %s: %w", lb.GetEndpoint().GetHostname(), err)
				}
			}
			l.lbs[j] = b
			l.size += protowire.SizeTag(localityLbEndpoints) + protowire.SizeBytes(len(b))
		}
		l.size += len(l.shell.before) + len(l.shell.after)
		size += protowire.SizeTag(claEndpointsField) + protowire.SizeBytes(l.size)
	}
	out := make([]byte, 0, size)
	out = append(out, top.before...)
	for i, loc := range cla.Endpoints {
		l := &locs[i]
		out = protowire.AppendTag(out, claEndpointsField, protowire.BytesType)
		out = protowire.AppendVarint(out, uint64(l.size))
		out = append(out, l.shell.before...)
		for j, lb := range loc.LbEndpoints {
			out = protowire.AppendTag(out, localityLbEndpoints, protowire.BytesType)
			out = protowire.AppendVarint(out, uint64(len(l.lbs[j])))
			start := len(out)
			out = append(out, l.lbs[j]...)
			next[lb] = out[start:len(out):len(out)] // out is never appended to past size
		}
		out = append(out, l.shell.after...)
	}
	out = append(out, top.after...)
	c.prev = next
	return out, nil
}

type locEncoding struct {
	shell shell
	lbs   [][]byte
	size  int // of the LocalityLbEndpoints message
}

// shell is a message's encoding without one repeated field: the fields
// numbered below it and those above it (proto.Marshal writes known fields
// in number order, so the repeated field's elements go between the two).
type shell struct{ before, after []byte }

// shellOf marshals m without field num (every other field is shared, not
// copied, and m is not modified).
func shellOf(m proto.Message, num protoreflect.FieldNumber) (shell, error) {
	b, err := deterministic.Marshal(shallowWithout(m, num))
	if err != nil {
		return shell{}, err
	}
	cut := 0
	for cut < len(b) {
		n, typ, k := protowire.ConsumeTag(b[cut:])
		if k < 0 {
			return shell{}, protowire.ParseError(k)
		}
		if n > num {
			break
		}
		v := protowire.ConsumeFieldValue(n, typ, b[cut+k:])
		if v < 0 {
			return shell{}, protowire.ParseError(v)
		}
		cut += k + v
	}
	return shell{before: b[:cut], after: b[cut:]}, nil
}

// spliceable reports whether cla can be written by splicing: no unknown
// fields where the encoder cuts (proto.Marshal writes them last) and no nil
// elements in the lists it writes itself.
func spliceable(cla *endpointv3.ClusterLoadAssignment) bool {
	if len(cla.ProtoReflect().GetUnknown()) > 0 {
		return false
	}
	for _, loc := range cla.Endpoints {
		if loc == nil || len(loc.ProtoReflect().GetUnknown()) > 0 {
			return false
		}
		for _, lb := range loc.LbEndpoints {
			if lb == nil {
				return false
			}
		}
	}
	return true
}
