package xdscache

import (
	"crypto/sha256"
	"encoding/hex"
	"sort"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// NodeMetaEndpointMetadata is the node metadata key with which a dispatcher
// chooses what its endpoints carry as metadata (EndpointMetadata).
const NodeMetaEndpointMetadata = "endpoint_metadata"

// EndpointMetadata is what the endpoints of a dispatcher's load assignments
// carry under filter_metadata.leasehold. Metadata is ~70% of an endpoint's
// bytes, and every state-of-the-world push resends a task's whole
// assignment to every stream, so a dispatcher that reads less of it can ask
// for less.
type EndpointMetadata string

const (
	// MetadataFull sends instance_id, session_id and version (the default).
	MetadataFull EndpointMetadata = "full"
	// MetadataSession sends session_id only, what a dispatcher fences on: the
	// instance id is the endpoint's hostname, and the version satisfies
	// the dispatcher's own constraint.
	MetadataSession EndpointMetadata = "session"
	// MetadataNone sends no metadata (a gRPC client does not hand endpoint
	// metadata to the application; the executor's own answer can name its
	// session, as the example dispatcher's does).
	MetadataNone EndpointMetadata = "none"
)

// EndpointMetadataOf reads a node's endpoint_metadata (default full); the
// error names the field.
func EndpointMetadataOf(node *corev3.Node) (EndpointMetadata, error) {
	v, ok := node.GetMetadata().GetFields()[NodeMetaEndpointMetadata]
	if !ok {
		return MetadataFull, nil
	}
	s, isStr := v.GetKind().(*structpb.Value_StringValue)
	if isStr {
		switch f := EndpointMetadata(s.StringValue); f {
		case MetadataFull, MetadataSession, MetadataNone:
			return f, nil
		}
	}
	fe := &health.FieldError{Field: "node.metadata." + NodeMetaEndpointMetadata,
		Reason: `must be one of "full", "session", "none"`}
	if isStr {
		fe.Value = truncate(s.StringValue, 64)
	}
	return "", fe
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// formGroupSep joins a constraint set's key and a form other than full into
// the cache group of its dispatchers ('&' is escaped inside a key's fields).
const formGroupSep = "&" + NodeMetaEndpointMetadata + "="

// formGroup is the cache group of the dispatchers of constraint set base
// (its key) asking for form f.
func formGroup(base string, f EndpointMetadata) string {
	if f == MetadataFull {
		return base
	}
	return base + formGroupSep + string(f)
}

// splitFormGroup is the inverse of formGroup.
func splitFormGroup(group string) (string, EndpointMetadata) {
	if i := strings.LastIndex(group, formGroupSep); i >= 0 {
		return group[:i], EndpointMetadata(group[i+len(formGroupSep):])
	}
	return group, MetadataFull
}

// formState derives one form's snapshots of one constraint set. It keeps
// the load assignments it derived last, by name, with the content version
// they were derived from: a change derives only the load assignments that
// changed (at 10,000 executors, the shard of a lapse).
type formState struct {
	form    EndpointMetadata
	derived map[string]derivedLoad
}

type derivedLoad struct {
	version string
	cla     *endpointv3.ClusterLoadAssignment
}

// derive is snap in this form: the same listeners, routes and clusters;
// load assignments whose endpoints carry the form's metadata, versioned
// "<content version>-<form>" (so a form's bytes never share a version with
// another's, and every replica derives the same).
func (fs *formState) derive(snap *cache.Snapshot,
	versions map[string]map[string]string) (*cache.Snapshot, map[string]map[string]string) {
	out := make(map[string]map[string]string, len(versions))
	for typeURL, vs := range versions {
		out[typeURL] = vs
	}
	eds := make(map[string]string, len(versions[resource.EndpointType]))
	for name, v := range versions[resource.EndpointType] {
		eds[name] = v + "-" + string(fs.form)
	}
	out[resource.EndpointType] = eds
	next := make(map[string]derivedLoad, len(fs.derived))
	d := &cache.Snapshot{VersionMap: out}
	for typ := range types.UnknownType {
		url, err := cache.GetResponseTypeURL(typ)
		if err != nil {
			continue
		}
		items := snap.GetResources(url)
		res := make([]types.Resource, 0, len(items))
		for _, r := range items {
			if cla, ok := r.(*endpointv3.ClusterLoadAssignment); ok {
				name := cla.GetClusterName()
				v := versions[resource.EndpointType][name]
				was, seen := fs.derived[name]
				if !seen || v == "" || was.version != v {
					was = derivedLoad{version: v, cla: fs.cla(cla)}
				}
				next[name] = was
				r = was.cla
			}
			res = append(res, r)
		}
		d.Resources[typ] = cache.NewResources(TypeVersion(out[url]), res)
	}
	fs.derived = next
	return d, out
}

// Field numbers the derivation copies around: ClusterLoadAssignment.endpoints
// and LocalityLbEndpoints.lb_endpoints.
const (
	claEndpointsField   = 2
	localityLbEndpoints = 2
)

// cla is a copy of cla whose endpoints carry the form's metadata, encoded
// as the Builder's are (translator.SetEncoded); every other field is
// shared. A locality whose endpoints do not parse (none of a Builder's) is
// kept whole: more metadata than asked for, rather than no endpoints.
//
// The endpoints are rewritten on the wire (wireForm): parsed into messages
// and marshalled again, a removal at 500 endpoints spent ~1.7 ms here before
// its push, and a form's fan-out took twice its floor's time
// (BenchmarkFanOut; BENCHMARKS.md, "A form derived on the wire"). A
// locality whose encodings do not scan as a Builder writes them goes
// through the messages (messageForm).
func (fs *formState) cla(cla *endpointv3.ClusterLoadAssignment) *endpointv3.ClusterLoadAssignment {
	out := shallowWithout(cla, claEndpointsField).(*endpointv3.ClusterLoadAssignment)
	out.Endpoints = make([]*endpointv3.LocalityLbEndpoints, len(cla.Endpoints))
	for i, loc := range cla.Endpoints {
		if enc, ok := fs.wireForm(loc); ok {
			l := shallowWithout(loc, localityLbEndpoints).(*endpointv3.LocalityLbEndpoints)
			translator.SetEncoded(l, enc)
			out.Endpoints[i] = l
			continue
		}
		out.Endpoints[i] = fs.messageForm(loc)
	}
	return out
}

// wireForm is each of loc's endpoints in the form, written from its
// encoding: every field but the metadata copied as it is, and in the session
// form the metadata rewritten to hold session_id alone, where it was.
// Marshalling writes a message's fields in one order (Go's: by number, a
// oneof's last), so an encoding a Builder marshalled, with a field dropped
// or rewritten in place, is what marshalling the endpoint's message in the
// form writes (TestTheWireFormIsTheMessageForm).
// ok is false when an encoding does not scan as a Builder's does.
func (fs *formState) wireForm(loc *endpointv3.LocalityLbEndpoints) ([][]byte, bool) {
	lbs, ok := translator.EncodedLbEndpoints(loc)
	if !ok {
		return nil, false
	}
	size := 0
	for _, lb := range lbs {
		size += len(lb)
	}
	buf := make([]byte, 0, size) // a form is never longer than its source
	enc := make([][]byte, len(lbs))
	for j, lb := range lbs {
		at := len(buf)
		if buf, ok = fs.lbWire(buf, lb); !ok {
			return nil, false
		}
		enc[j] = buf[at:len(buf):len(buf)]
	}
	return enc, true
}

// lbWire appends lb (an LbEndpoint's encoding) in the form to dst.
func (fs *formState) lbWire(dst, lb []byte) ([]byte, bool) {
	seen := false
	for f, scanned := range translator.WireFields(lb) {
		switch {
		case !scanned:
			return dst, false
		case f.Num != lbMetadataField:
			dst = append(dst, f.Raw...)
		case f.Type != protowire.BytesType || seen: // one metadata, as a Builder writes it
			return dst, false
		default:
			seen = true
			if fs.form == MetadataSession {
				sess, found, ok := sessionValue(f.Value)
				if !ok {
					return dst, false
				}
				if found {
					dst = appendSessionMetadata(dst, sess)
				}
			}
		}
	}
	return dst, true
}

// Field numbers of the metadata's wire: Metadata.filter_metadata, a map
// entry's key and value, Struct.fields.
const (
	filterMetadataField = 1
	mapKeyField         = 1
	mapValueField       = 2
	structFieldsField   = 1
)

// sessionValue is the encoding of the session_id Value under the leasehold
// namespace of md (a Metadata's encoding); found is false when it has none,
// ok false when md does not scan as a Builder writes it (a key twice, an
// entry without its value).
func sessionValue(md []byte) (sess []byte, found, ok bool) {
	ns, found, ok := mapValue(md, filterMetadataField, translator.MetadataNamespace)
	if !found || !ok {
		return nil, found, ok
	}
	return mapValue(ns, structFieldsField, "session_id")
}

// mapValue is the value's encoding of the entry of key in the map field num
// of msg (an encoding).
func mapValue(msg []byte, num protowire.Number, key string) (val []byte, found, ok bool) {
	for f, scanned := range translator.WireFields(msg) {
		switch {
		case !scanned:
			return nil, false, false
		case f.Num != num:
			continue
		case f.Type != protowire.BytesType:
			return nil, false, false
		}
		k, v, hasV, eok := mapEntry(f.Value)
		if !eok {
			return nil, false, false
		}
		if string(k) == key { // compared, not converted: no allocation
			if found || !hasV {
				return nil, false, false
			}
			val, found = v, true
		}
	}
	return val, found, true
}

// mapEntry is a map entry's key (a string) and value (an encoding).
func mapEntry(entry []byte) (key, val []byte, hasVal, ok bool) {
	hasKey := false
	for f, scanned := range translator.WireFields(entry) {
		switch {
		case !scanned || f.Type != protowire.BytesType:
			return nil, nil, false, false
		case f.Num == mapKeyField && !hasKey:
			key, hasKey = f.Value, true
		case f.Num == mapValueField && !hasVal:
			val, hasVal = f.Value, true
		default:
			return nil, nil, false, false
		}
	}
	return key, val, hasVal, hasKey
}

// appendSessionMetadata appends an LbEndpoint's metadata field holding
// session_id (sess, a Value's encoding) alone under leasehold's namespace:
// Metadata{filter_metadata: {leasehold: Struct{fields: {session_id: sess}}}},
// each length computed first so that it is written in place.
func appendSessionMetadata(dst, sess []byte) []byte {
	const key = "session_id"
	ns := translator.MetadataNamespace
	tag := protowire.SizeTag(1) // every field here is 1, 2 or 3: one byte
	field := tag + protowire.SizeBytes(len(key)) + tag + protowire.SizeBytes(len(sess))
	st := tag + protowire.SizeBytes(field)
	entry := tag + protowire.SizeBytes(len(ns)) + tag + protowire.SizeBytes(st)
	md := tag + protowire.SizeBytes(entry)
	dst = openField(dst, lbMetadataField, md)
	dst = openField(dst, filterMetadataField, entry)
	dst = append(openField(dst, mapKeyField, len(ns)), ns...)
	dst = openField(dst, mapValueField, st)
	dst = openField(dst, structFieldsField, field)
	dst = append(openField(dst, mapKeyField, len(key)), key...)
	return append(openField(dst, mapValueField, len(sess)), sess...)
}

// openField appends the tag and length of a bytes field num of n bytes, which
// follow.
func openField(dst []byte, num protowire.Number, n int) []byte {
	return protowire.AppendVarint(protowire.AppendTag(dst, num, protowire.BytesType), uint64(n))
}

// messageForm is loc in the form through its endpoints' messages.
func (fs *formState) messageForm(loc *endpointv3.LocalityLbEndpoints) *endpointv3.LocalityLbEndpoints {
	lbs, err := translator.LbEndpoints(loc)
	if err != nil {
		return loc
	}
	l := shallowWithout(loc, localityLbEndpoints).(*endpointv3.LocalityLbEndpoints)
	enc := make([][]byte, len(lbs))
	for j, lb := range lbs {
		if enc[j], err = deterministic.Marshal(fs.lb(lb)); err != nil {
			return loc
		}
	}
	translator.SetEncoded(l, enc)
	return l
}

// lbMetadataField is LbEndpoint.metadata.
const lbMetadataField = 3

// lb is lb with the form's metadata.
func (fs *formState) lb(lb *endpointv3.LbEndpoint) *endpointv3.LbEndpoint {
	out := shallowWithout(lb, lbMetadataField).(*endpointv3.LbEndpoint)
	if fs.form != MetadataSession {
		return out
	}
	md := lb.GetMetadata().GetFilterMetadata()[translator.MetadataNamespace].GetFields()
	if sess, ok := md["session_id"]; ok {
		out.Metadata = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			translator.MetadataNamespace: {Fields: map[string]*structpb.Value{"session_id": sess}},
		}}
	}
	return out
}

// shallowWithout is a new message of m's type sharing every field of m but
// field num (and m's unknown fields); m is not modified.
func shallowWithout(m proto.Message, num protoreflect.FieldNumber) proto.Message {
	src := m.ProtoReflect()
	dst := src.New()
	src.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if fd.Number() != num {
			dst.Set(fd, v)
		}
		return true
	})
	if u := src.GetUnknown(); len(u) > 0 {
		dst.SetUnknown(u)
	}
	return dst.Interface()
}

// TypeVersion hashes the names and content versions of a type's resources.
func TypeVersion(each map[string]string) string {
	parts := make([]string, 0, len(each))
	for name, v := range each {
		parts = append(parts, name+"="+v)
	}
	sort.Strings(parts)
	sum := sha256.Sum256([]byte(strings.Join(parts, ";")))
	return hex.EncodeToString(sum[:8])
}
