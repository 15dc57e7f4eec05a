package xdscache

import (
	"fmt"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/leasehold/leasehold/health"
)

// NodeMetaGrantedTasks is the node metadata key under which the xDS server
// stamps the task types a stream's client identity is granted (a list of
// strings). The server always overwrites or removes it: a dispatcher cannot
// grant itself anything.
const NodeMetaGrantedTasks = "leasehold.granted_tasks"

// StampGrant sets (tasks non-nil) or removes (nil) the granted task types in
// node's metadata.
func StampGrant(node *corev3.Node, tasks []string) {
	if node == nil {
		return
	}
	if tasks == nil {
		if node.Metadata != nil {
			delete(node.Metadata.Fields, NodeMetaGrantedTasks)
		}
		return
	}
	vals := make([]*structpb.Value, len(tasks))
	for i, t := range tasks {
		vals[i] = structpb.NewStringValue(t)
	}
	if node.Metadata == nil {
		node.Metadata = &structpb.Struct{}
	}
	if node.Metadata.Fields == nil {
		node.Metadata.Fields = map[string]*structpb.Value{}
	}
	granted := structpb.NewListValue(&structpb.ListValue{Values: vals})
	node.Metadata.Fields[NodeMetaGrantedTasks] = granted
}

// DispatcherOf reads a dispatcher's constraint set from its xDS node
// metadata: version_constraint (string) and labels (map of strings); it also
// checks endpoint_metadata (EndpointMetadataOf), which is not part of the
// constraint set. Errors name the field.
func DispatcherOf(node *corev3.Node) (health.Dispatcher, error) {
	fields := node.GetMetadata().GetFields()
	var vc string
	if v, ok := fields[health.NodeMetaVersionConstraint]; ok {
		s, isStr := v.GetKind().(*structpb.Value_StringValue)
		if !isStr {
			return health.Dispatcher{}, &health.FieldError{Field: "node.metadata." +
				health.NodeMetaVersionConstraint,
				Reason: "must be a string such as \">=1.4.0, <2.0.0\""}
		}
		vc = s.StringValue
	}
	var labels map[string]string
	if v, ok := fields[health.NodeMetaLabels]; ok {
		st, isStruct := v.GetKind().(*structpb.Value_StructValue)
		if !isStruct {
			return health.Dispatcher{}, &health.FieldError{Field: "node.metadata." +
				health.NodeMetaLabels,
				Reason: "must be a map of label key to string value"}
		}
		labels = make(map[string]string, len(st.StructValue.GetFields()))
		for k, lv := range st.StructValue.GetFields() {
			s, isStr := lv.GetKind().(*structpb.Value_StringValue)
			if !isStr {
				return health.Dispatcher{}, &health.FieldError{Field: "node.metadata." +
					health.NodeMetaLabels + "." + k,
					Reason: "label value must be a string"}
			}
			labels[k] = s.StringValue
		}
	}
	d, err := health.NewDispatcher(vc, labels)
	if err != nil {
		return health.Dispatcher{}, fmt.Errorf("node.metadata: %w", err)
	}
	dc, err := datacenterOf(node)
	if err != nil {
		return health.Dispatcher{}, err
	}
	d = d.InDatacenter(dc)
	if _, err := EndpointMetadataOf(node); err != nil {
		return health.Dispatcher{}, err
	}
	if v, ok := fields[NodeMetaWeightedClusters]; ok {
		b, isBool := v.GetKind().(*structpb.Value_BoolValue)
		if !isBool {
			return health.Dispatcher{}, &health.FieldError{
				Field:  "node.metadata." + NodeMetaWeightedClusters,
				Reason: "must be true or false (a JSON boolean)"}
		}
		if !b.BoolValue {
			d = d.InSingleCluster()
		}
	}
	if v, ok := fields[NodeMetaGrantedTasks]; ok {
		var tasks []string
		for _, t := range v.GetListValue().GetValues() {
			tasks = append(tasks, t.GetStringValue())
		}
		if tasks == nil {
			tasks = []string{}
		}
		d = d.WithTasks(tasks)
	}
	return d, nil
}

// NodeMetaWeightedClusters is the node metadata key with which a dispatcher
// says whether it takes a route over weighted clusters (gRFC A28; default
// true). false: large task types are sent to it as one cluster each, not
// split into shards (translator.ShardCount).
const NodeMetaWeightedClusters = "weighted_clusters"

// datacenterOf is the datacenter a node says it runs in: node metadata
// "datacenter" (what leasehold bootstrap --datacenter writes; invalid:
// refused naming the field), else the node's locality region (Envoy's
// --locality-region, a gRPC bootstrap's node.locality.region) when it is a
// datacenter name — a region that is none (a cloud region such as
// "eu-west-1.prod") is not taken for one. Names are lowercased, as Consul
// spells them.
func datacenterOf(node *corev3.Node) (string, error) {
	const field = "node.metadata." + health.NodeMetaDatacenter
	v, ok := node.GetMetadata().GetFields()[health.NodeMetaDatacenter]
	if !ok {
		region := health.NormalizeDatacenter(node.GetLocality().GetRegion())
		if region == "" || health.ValidateDatacenter("", region) != nil {
			return "", nil
		}
		return region, nil
	}
	s, isStr := v.GetKind().(*structpb.Value_StringValue)
	if !isStr {
		return "", &health.FieldError{Field: field,
			Reason: "must be a string naming a Consul datacenter"}
	}
	dc := health.NormalizeDatacenter(s.StringValue)
	if err := health.ValidateDatacenter(field, dc); err != nil {
		return "", err
	}
	return dc, nil
}

// GroupOf is the cache group of a node: dispatchers with equal constraint
// sets and endpoint metadata share one (a form other than full is derived
// from the constraint set's snapshot by the cache). Invalid metadata maps
// to a group that never has a snapshot (the server refuses such streams
// before they ask).
func GroupOf(node *corev3.Node) string {
	key, ok := groupMemoKey(node)
	if ok {
		if g, hit := groupMemo.load(key); hit {
			return g
		}
	}
	g := groupOf(node)
	if ok {
		groupMemo.store(key, g)
	}
	return g
}

// groupOf is GroupOf read afresh.
func groupOf(node *corev3.Node) string {
	d, err := DispatcherOf(node)
	if err != nil {
		return "invalid"
	}
	f, _ := EndpointMetadataOf(node) // valid: DispatcherOf checked it
	return formGroup(d.Key(), f)
}

// groupMemo remembers GroupOf by the metadata values it reads (it is a pure
// function of them): the cache asks for the group of every request of every
// stream, every ACK, and reading a constraint set afresh cost ~17 µs and 29
// allocations each time. Bounded: it starts over past groupMemoMax entries.
var groupMemo memo

// At most groupMemoMax entries of keys up to groupMemoKeyMax bytes.
const groupMemoMax, groupMemoKeyMax = 4096, 1024

type memo struct {
	m atomic.Pointer[sync.Map]
	n atomic.Int64
}

func (c *memo) load(key string) (string, bool) {
	m := c.m.Load()
	if m == nil {
		return "", false
	}
	v, ok := m.Load(key)
	if !ok {
		return "", false
	}
	return v.(string), true
}

func (c *memo) store(key, group string) {
	m := c.m.Load()
	if m == nil || c.n.Add(1) > groupMemoMax {
		m = &sync.Map{}
		c.m.Store(m)
		c.n.Store(1)
	}
	m.Store(key, group)
}

// groupKeys are the node metadata keys GroupOf reads (and the locality
// region, spelled after them).
var groupKeys = [...]string{health.NodeMetaVersionConstraint, health.NodeMetaLabels,
	NodeMetaGrantedTasks, NodeMetaEndpointMetadata, health.NodeMetaDatacenter,
	NodeMetaWeightedClusters}

// SameGroupInputs reports whether two nodes give GroupOf the same inputs:
// equal values (or absence) under every metadata key it reads, and the same
// locality region. Nodes that do are in one group; nodes that do not may be
// in two (a server checks such a node afresh: a stream whose watches moved
// to a group its syncer never publishes would never be answered again).
func SameGroupInputs(a, b *corev3.Node) bool {
	if a.GetLocality().GetRegion() != b.GetLocality().GetRegion() {
		return false
	}
	fa, fb := a.GetMetadata().GetFields(), b.GetMetadata().GetFields()
	for _, k := range groupKeys {
		va, oka := fa[k]
		vb, okb := fb[k]
		if oka != okb || (oka && !proto.Equal(va, vb)) {
			return false
		}
	}
	return true
}

// groupMemoKey spells out the values GroupOf reads, each length-prefixed;
// false for a value of a kind it does not spell (GroupOf then reads it
// afresh, and refuses what is invalid).
func groupMemoKey(node *corev3.Node) (string, bool) {
	fields := node.GetMetadata().GetFields()
	b := make([]byte, 0, 64)
	str := func(s string) {
		b = strconv.AppendInt(b, int64(len(s)), 10)
		b = append(b, ':')
		b = append(b, s...)
	}
	for _, k := range groupKeys {
		v, present := fields[k]
		switch x := v.GetKind().(type) {
		case nil:
			if present {
				return "", false
			}
			b = append(b, '-')
		case *structpb.Value_StringValue:
			b = append(b, 's')
			str(x.StringValue)
		case *structpb.Value_BoolValue:
			b = append(b, 'b')
			b = strconv.AppendBool(b, x.BoolValue)
		case *structpb.Value_StructValue:
			m := x.StructValue.GetFields()
			keys := make([]string, 0, len(m))
			for lk, lv := range m {
				if _, isStr := lv.GetKind().(*structpb.Value_StringValue); !isStr {
					return "", false
				}
				keys = append(keys, lk)
			}
			sort.Strings(keys)
			b = append(b, 'm')
			for _, lk := range keys {
				str(lk)
				str(m[lk].GetStringValue())
			}
		case *structpb.Value_ListValue:
			b = append(b, 'l')
			for _, e := range x.ListValue.GetValues() {
				s, isStr := e.GetKind().(*structpb.Value_StringValue)
				if !isStr {
					return "", false
				}
				str(s.StringValue)
			}
		default:
			return "", false
		}
		b = append(b, ';')
	}
	str(node.GetLocality().GetRegion()) // the datacenter, when metadata does not say it
	if len(b) > groupMemoKeyMax {
		return "", false // a hostile node must not pin megabytes in the memo
	}
	return string(b), true
}
