// Package translator turns decided executors and a dispatcher's constraint
// set into xDS resources: pure and deterministic (sorted output, content-hash
// versions). Its functions keep no state; a Builder keeps what one task's
// builds reuse (verdicts and endpoint encodings of unchanged executors), owned
// by its caller. It imports nothing of Consul, gRPC servers or the cache.
package translator

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sort"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasehold/leasehold/health"
)

// MetadataNamespace is the filter_metadata key of endpoint metadata.
const MetadataNamespace = "leasehold"

// Weight bounds: capacity clamped into this range.
const (
	MinWeight = 1
	MaxWeight = 128
)

// Listener is the API listener of task: what a gRPC client dialling
// xds:///<task> asks for. It routes through RDS (over ADS) to Route(task).
func Listener(task string) *listenerv3.Listener {
	router, _ := anypb.New(&routerv3.Router{})
	hcm := &hcmv3.HttpConnectionManager{
		StatPrefix: task,
		RouteSpecifier: &hcmv3.HttpConnectionManager_Rds{Rds: &hcmv3.Rds{
			ConfigSource:    adsSource(),
			RouteConfigName: task,
		}},
		HttpFilters: []*hcmv3.HttpFilter{{
			Name:       "envoy.filters.http.router",
			ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: router},
		}},
	}
	anyHCM, _ := anypb.New(hcm)
	return &listenerv3.Listener{
		Name:        task,
		ApiListener: &listenerv3.ApiListener{ApiListener: anyHCM},
	}
}

// Route is the route configuration of task: one virtual host for domain task
// sending everything to Cluster(task), with the task's dispatch policy's
// retries and deadline (dispatch.go).
func Route(task string, p health.TaskDispatch) *routev3.RouteConfiguration {
	action := &routev3.RouteAction{
		ClusterSpecifier: &routev3.RouteAction_Cluster{Cluster: task},
	}
	applyDispatch(action, p)
	return &routev3.RouteConfiguration{
		Name: task,
		VirtualHosts: []*routev3.VirtualHost{{
			Name:    task,
			Domains: []string{task},
			Routes: []*routev3.Route{{
				Match:  &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: "/"}},
				Action: &routev3.Route_Route{Route: action},
			}},
		}},
	}
}

// Cluster is the EDS (over ADS) cluster name (a task type's, or one of its
// shards': ShardName), balanced by policy lb (loadBalancingPolicy), with the
// task's dispatch policy's limit on calls in flight and ejection, and asking
// its clients to report load to leasehold (dispatch.go); its load
// assignment has the same name. Envoy forwards
// to the executors in the protocol its client spoke (HTTP/2 for gRPC work
// services, HTTP/1.1 otherwise); gRPC clients ignore the option.
func Cluster(name string, lb health.LBPolicy, p health.TaskDispatch) *clusterv3.Cluster {
	proto, _ := anypb.New(&upstreamhttpv3.HttpProtocolOptions{
		UpstreamProtocolOptions: &upstreamhttpv3.HttpProtocolOptions_UseDownstreamProtocolConfig{
			UseDownstreamProtocolConfig: &upstreamhttpv3.HttpProtocolOptions_UseDownstreamHttpConfig{
				HttpProtocolOptions:  &corev3.Http1ProtocolOptions{},
				Http2ProtocolOptions: &corev3.Http2ProtocolOptions{},
			},
		},
	})
	return &clusterv3.Cluster{
		Name: name,
		TypedExtensionProtocolOptions: map[string]*anypb.Any{
			"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": proto,
		},
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_EDS},
		EdsClusterConfig: &clusterv3.Cluster_EdsClusterConfig{EdsConfig: adsSource(),
			ServiceName: name},
		LoadBalancingPolicy: loadBalancingPolicy(lb),
		ConnectTimeout:      durationpb.New(time.Second),
		CircuitBreakers:     circuitBreakers(p.MaxRequests),
		OutlierDetection:    outlierDetection(p.Outlier),
		LrsServer:           lrsSelf(),
	}
}

func adsSource() *corev3.ConfigSource {
	return &corev3.ConfigSource{
		ConfigSourceSpecifier: &corev3.ConfigSource_Ads{Ads: &corev3.AggregatedConfigSource{}},
		ResourceApiVersion:    corev3.ApiVersion_V3,
	}
}

// Decision is the verdict on one executor for one constraint set.
type Decision struct {
	Executor health.Executor
	Verdict  health.Verdict
}

// Decide returns the verdict on every executor for constraint set d, sorted
// by node and service id (for explain views and logs): what Builder sends,
// duplicate-address exclusions included.
func Decide(executors []health.Executor, d health.Dispatcher, observe ...health.Reason) []Decision {
	verdicts := make([]health.Verdict, len(executors))
	for i, e := range executors {
		verdicts[i] = health.EligibleObserving(e, d, observe)
	}
	health.ExcludeDuplicates(executors, verdicts)
	decisions := make([]Decision, 0, len(executors))
	for i, e := range executors {
		decisions = append(decisions, Decision{Executor: e, Verdict: verdicts[i]})
	}
	sort.Slice(decisions, func(i, j int) bool {
		a, b := &decisions[i].Executor, &decisions[j].Executor
		if a.Node != b.Node {
			return a.Node < b.Node
		}
		return a.ServiceID < b.ServiceID
	})
	return decisions
}

// Endpoints decides every executor of task for constraint set d and builds
// the load assignment: eligible executors HEALTHY, draining ones DRAINING,
// weights from capacity. Executors must all serve task; the output is
// sorted, so equal inputs give byte-identical resources. Its localities hold
// their endpoints encoded (encoded.go): in process, read them with
// LbEndpoints or Expand, not GetLbEndpoints.
func Endpoints(task string, executors []health.Executor,
	d health.Dispatcher) *endpointv3.ClusterLoadAssignment {
	cla, _ := endpointsVersioned(task, executors, d)
	return cla
}

// endpointsVersioned is Endpoints with the content version of the result,
// computed from the decided inputs rather than by marshalling: the load
// assignment is a pure function of them, so equal inputs give equal versions
// on every replica, at a fraction of the cost.
func endpointsVersioned(task string, executors []health.Executor,
	d health.Dispatcher) (*endpointv3.ClusterLoadAssignment, string) {
	return (&Builder{}).Build(task, executors, d)
}

// weight is the endpoint weight of e: its capacity, clamped to
// MinWeight..MaxWeight — a static prior for clients that weigh endpoints by
// it (Envoy's round robin and least request). Not the spare capacity: the
// load in Consul is minutes old (a check's output-only change waits for
// check_update_interval); current load goes to dispatchers over ORCA
// (weighted round robin), and "full" through the check's status.
func weight(e health.Executor) uint32 {
	return uint32(min(max(e.Capacity, MinWeight), MaxWeight))
}

// Version is the content hash of a resource: equal resources have equal
// versions on every replica.
func Version(m proto.Message) string {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		// Only invalid UTF-8 fails, and names are validated.
		panic(fmt.Sprintf("marshal %T: %v", m, err))
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}

// Consistent checks that the resources of a set of tasks reference each
// other: every listener's route, every route's cluster and every cluster's
// endpoints exist.
func Consistent(listeners []*listenerv3.Listener, routes []*routev3.RouteConfiguration,
	clusters []*clusterv3.Cluster, loads []*endpointv3.ClusterLoadAssignment) error {
	names := func(n int, name func(int) string) map[string]bool {
		m := make(map[string]bool, n)
		for i := range n {
			m[name(i)] = true
		}
		return m
	}
	routeNames := names(len(routes), func(i int) string { return routes[i].GetName() })
	clusterNames := names(len(clusters), func(i int) string { return clusters[i].GetName() })
	loadNames := names(len(loads), func(i int) string { return loads[i].GetClusterName() })
	for _, l := range listeners {
		hcm := &hcmv3.HttpConnectionManager{}
		if err := l.GetApiListener().GetApiListener().UnmarshalTo(hcm); err != nil {
			return fmt.Errorf("listener %s: %w", l.GetName(), err)
		}
		if r := hcm.GetRds().GetRouteConfigName(); !routeNames[r] {
			return fmt.Errorf("listener %s references missing route %q", l.GetName(), r)
		}
	}
	for _, r := range routes {
		for _, vh := range r.GetVirtualHosts() {
			for _, rt := range vh.GetRoutes() {
				for _, c := range RouteClusters(rt) {
					if !clusterNames[c] {
						return fmt.Errorf("route %s references missing cluster %q", r.GetName(), c)
					}
				}
			}
		}
	}
	for _, c := range clusters {
		if s := c.GetEdsClusterConfig().GetServiceName(); !loadNames[s] {
			return fmt.Errorf("cluster %s references missing endpoints %q", c.GetName(), s)
		}
	}
	return nil
}

// fnv64a is the 64-bit FNV-1a hash (hash/fnv without the allocation).
func fnv64a(b []byte) uint64 {
	h := uint64(14695981039346656037)
	for _, c := range b {
		h ^= uint64(c)
		h *= 1099511628211
	}
	return h
}
