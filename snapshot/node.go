package snapshot

import (
	"fmt"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
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
	node.Metadata.Fields[NodeMetaGrantedTasks] = structpb.NewListValue(&structpb.ListValue{Values: vals})
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
			return health.Dispatcher{}, &health.FieldError{Field: "node.metadata." + health.NodeMetaVersionConstraint, Reason: "must be a string such as \">=1.4.0, <2.0.0\""}
		}
		vc = s.StringValue
	}
	var labels map[string]string
	if v, ok := fields[health.NodeMetaLabels]; ok {
		st, isStruct := v.GetKind().(*structpb.Value_StructValue)
		if !isStruct {
			return health.Dispatcher{}, &health.FieldError{Field: "node.metadata." + health.NodeMetaLabels, Reason: "must be a map of label key to string value"}
		}
		labels = make(map[string]string, len(st.StructValue.GetFields()))
		for k, lv := range st.StructValue.GetFields() {
			s, isStr := lv.GetKind().(*structpb.Value_StringValue)
			if !isStr {
				return health.Dispatcher{}, &health.FieldError{Field: "node.metadata." + health.NodeMetaLabels + "." + k, Reason: "label value must be a string"}
			}
			labels[k] = s.StringValue
		}
	}
	d, err := health.NewDispatcher(vc, labels)
	if err != nil {
		return health.Dispatcher{}, fmt.Errorf("node.metadata: %w", err)
	}
	if _, err := EndpointMetadataOf(node); err != nil {
		return health.Dispatcher{}, err
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

// GroupOf is the cache group of a node: dispatchers with equal constraint
// sets and endpoint metadata share one (a form other than full is derived
// from the constraint set's snapshot by the cache). Invalid metadata maps
// to a group that never has a snapshot (the server refuses such streams
// before they ask).
func GroupOf(node *corev3.Node) string {
	d, err := DispatcherOf(node)
	if err != nil {
		return "invalid"
	}
	f, _ := EndpointMetadataOf(node) // valid: DispatcherOf checked it
	return formGroup(d.Key(), f)
}
