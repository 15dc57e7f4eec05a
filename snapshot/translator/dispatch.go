package translator

import (
	"strings"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	previoushostsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/retry/host/previous_hosts/v3"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/leasehold/leasehold/health"
)

// The dispatch policy (health.TaskDispatch) as the xDS fields every client
// leasehold serves applies: grpc-go's xdsresource reads retry_policy
// (retry_on, num_retries >= 1, retry_back_off with base > 0),
// max_stream_duration (grpc_timeout_header_max first), the DEFAULT-priority
// circuit_breakers threshold's max_requests, outlier_detection (gRFC A50:
// success rate and failure percentage only) and lrs_server (self only);
// Envoy reads the same fields and, besides, consecutive_5xx and
// retry_host_predicate.

// hostSelectionAttempts is how often Envoy picks again to find an executor
// the call has not tried yet (gRPC clients pick anew on each attempt).
const hostSelectionAttempts = 5

// retryPolicy is the route's retries: nil when the policy retries never (a
// num_retries of 0 is refused by grpc-go, and no policy means no retries).
// The codes go out in Envoy's and gRFC A44's spelling ("unavailable",
// "resource-exhausted").
func retryPolicy(p health.TaskDispatch) *routev3.RetryPolicy {
	if p.NumRetries == 0 || len(p.RetryOn) == 0 {
		return nil
	}
	codes := make([]string, len(p.RetryOn))
	for i, c := range p.RetryOn {
		codes[i] = strings.ReplaceAll(strings.ToLower(c), "_", "-")
	}
	prev, err := anypb.New(&previoushostsv3.PreviousHostsPredicate{})
	if err != nil {
		panic(err) // a fixed, valid message
	}
	return &routev3.RetryPolicy{
		RetryOn:    strings.Join(codes, ","),
		NumRetries: wrapperspb.UInt32(uint32(p.NumRetries)),
		RetryBackOff: &routev3.RetryPolicy_RetryBackOff{
			BaseInterval: durationpb.New(p.BackoffBase),
			MaxInterval:  durationpb.New(p.BackoffMax),
		},
		// Envoy retries on another executor than those the call tried.
		RetryHostPredicate: []*routev3.RetryPolicy_RetryHostPredicate{{
			Name: "envoy.retry_host_predicates.previous_hosts",
			ConfigType: &routev3.RetryPolicy_RetryHostPredicate_TypedConfig{
				TypedConfig: prev},
		}},
		HostSelectionRetryMaxAttempts: hostSelectionAttempts,
	}
}

// maxStreamDuration is the route's deadline (nil: none): gRPC clients take
// grpc_timeout_header_max as the call's timeout (a shorter deadline of the
// caller's own still wins, gRFC A31); Envoy caps a call's grpc-timeout at it
// and ends a call without one after max_stream_duration.
func maxStreamDuration(d time.Duration) *routev3.RouteAction_MaxStreamDuration {
	if d <= 0 {
		return nil
	}
	return &routev3.RouteAction_MaxStreamDuration{
		MaxStreamDuration:    durationpb.New(d),
		GrpcTimeoutHeaderMax: durationpb.New(d),
	}
}

// applyDispatch sets the policy's retries and deadline on a route action.
func applyDispatch(a *routev3.RouteAction, p health.TaskDispatch) {
	a.RetryPolicy = retryPolicy(p)
	a.MaxStreamDuration = maxStreamDuration(p.Deadline)
}

// circuitBreakers is the cluster's limit on calls in flight (nil: the
// clients' own default of 1024).
func circuitBreakers(n int) *clusterv3.CircuitBreakers {
	if n <= 0 {
		return nil
	}
	return &clusterv3.CircuitBreakers{Thresholds: []*clusterv3.CircuitBreakers_Thresholds{{
		Priority:    corev3.RoutingPriority_DEFAULT,
		MaxRequests: wrapperspb.UInt32(uint32(n)),
	}}}
}

// outlierDetection is the cluster's ejection (nil: none). Success-rate
// ejection is turned off (both clients enable it when its enforcement is
// unset); failure-percentage ejection is on (both leave it off when its
// enforcement is unset), and consecutive_5xx only when the policy asks
// (Envoy enables it at 5 when unset; gRPC clients never read it).
func outlierDetection(o *health.Ejection) *clusterv3.OutlierDetection {
	if o == nil {
		return nil
	}
	od := &clusterv3.OutlierDetection{
		Interval:                       durationpb.New(o.Interval),
		BaseEjectionTime:               durationpb.New(o.BaseEjectionTime),
		MaxEjectionPercent:             wrapperspb.UInt32(uint32(o.MaxEjectionPercent)),
		EnforcingSuccessRate:           wrapperspb.UInt32(0),
		FailurePercentageThreshold:     wrapperspb.UInt32(uint32(o.FailurePercentage)),
		EnforcingFailurePercentage:     wrapperspb.UInt32(100),
		FailurePercentageMinimumHosts:  wrapperspb.UInt32(uint32(o.MinimumHosts)),
		FailurePercentageRequestVolume: wrapperspb.UInt32(uint32(o.RequestVolume)),
		EnforcingConsecutive_5Xx:       wrapperspb.UInt32(0),
	}
	if o.ConsecutiveFailures > 0 {
		od.Consecutive_5Xx = wrapperspb.UInt32(uint32(o.ConsecutiveFailures))
		od.EnforcingConsecutive_5Xx = wrapperspb.UInt32(100)
	}
	return od
}

// lrsSelf asks the cluster's clients to report their load (calls per
// locality and outcome) to the xDS server they came from (gRFC A27).
func lrsSelf() *corev3.ConfigSource {
	return &corev3.ConfigSource{
		ConfigSourceSpecifier: &corev3.ConfigSource_Self{Self: &corev3.SelfConfigSource{}},
		ResourceApiVersion:    corev3.ApiVersion_V3,
	}
}
