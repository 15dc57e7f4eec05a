package translator

import (
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/leasehold/leasehold/health"
)

// endpointBatch allocates the messages of n endpoints in a few slices
// instead of ~20 small objects per endpoint: a full build of a large fleet
// is dominated by allocation otherwise. Only the two metadata maps remain
// per endpoint.
type endpointBatch struct {
	lbs     []endpointv3.LbEndpoint
	hostIDs []endpointv3.LbEndpoint_Endpoint
	eps     []endpointv3.Endpoint
	addrs   []corev3.Address
	sockets []corev3.Address_SocketAddress
	sas     []corev3.SocketAddress
	ports   []corev3.SocketAddress_PortValue
	weights []wrapperspb.UInt32Value
	mds     []corev3.Metadata
	structs []structpb.Struct
	values  []structpb.Value
	strs    []structpb.Value_StringValue
	i       int
}

func newEndpointBatch(n int) *endpointBatch {
	return &endpointBatch{
		lbs:     make([]endpointv3.LbEndpoint, n),
		hostIDs: make([]endpointv3.LbEndpoint_Endpoint, n),
		eps:     make([]endpointv3.Endpoint, n),
		addrs:   make([]corev3.Address, n),
		sockets: make([]corev3.Address_SocketAddress, n),
		sas:     make([]corev3.SocketAddress, n),
		ports:   make([]corev3.SocketAddress_PortValue, n),
		weights: make([]wrapperspb.UInt32Value, n),
		mds:     make([]corev3.Metadata, n),
		structs: make([]structpb.Struct, n),
		values:  make([]structpb.Value, 3*n),
		strs:    make([]structpb.Value_StringValue, 3*n),
	}
}

// lbEndpoint is the endpoint of e: its address, the instance id as
// hostname, weight from spare capacity, and instance, session and version as
// metadata (what a dispatcher reports and fences on).
func (b *endpointBatch) lbEndpoint(e *health.Executor,
	status corev3.HealthStatus) *endpointv3.LbEndpoint {
	i := b.i
	b.i++
	str := func(k int, s string) *structpb.Value {
		b.strs[3*i+k].StringValue = s
		v := &b.values[3*i+k]
		v.Kind = &b.strs[3*i+k]
		return v
	}
	st := &b.structs[i]
	st.Fields = map[string]*structpb.Value{
		"instance_id": str(0, e.InstanceID),
		"session_id":  str(1, e.SessionID),
		"version":     str(2, e.Version),
	}
	md := &b.mds[i]
	md.FilterMetadata = map[string]*structpb.Struct{MetadataNamespace: st}
	sa := &b.sas[i]
	sa.Protocol = corev3.SocketAddress_TCP
	sa.Address = e.Address
	b.ports[i].PortValue = uint32(e.Port)
	sa.PortSpecifier = &b.ports[i]
	b.sockets[i].SocketAddress = sa
	addr := &b.addrs[i]
	addr.Address = &b.sockets[i]
	ep := &b.eps[i]
	ep.Address = addr
	ep.Hostname = e.InstanceID
	b.hostIDs[i].Endpoint = ep
	w := &b.weights[i]
	w.Value = weight(*e)
	lb := &b.lbs[i]
	lb.HostIdentifier = &b.hostIDs[i]
	lb.HealthStatus = status
	lb.LoadBalancingWeight = w
	lb.Metadata = md
	return lb
}
