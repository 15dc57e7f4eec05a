package snapshot

import (
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	cswrrv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/client_side_weighted_round_robin/v3"
	leastrequestv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/least_request/v3"
	roundrobinv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/round_robin/v3"
	wrrlocalityv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/wrr_locality/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/leasehold/leasehold/health"
)

// ORCA timings of weighted round robin: executors report their load out of
// band every second; a new endpoint's weight counts once it has reported for
// two seconds (grpc-go's default of ten would keep a fresh executor
// unweighted for long), and weights are recomputed every second.
const (
	orcaReportingPeriod = time.Second
	orcaBlackoutPeriod  = 2 * time.Second
	orcaWeightUpdate    = time.Second
)

// loadBalancingPolicy is a cluster's policy as a list clients walk in
// order, taking the first they support (Envoy and gRPC, gRFC A52): the
// chosen policy inside gRPC's wrr_locality (it weighs localities, the
// endpoint picking happens inside), the same for Envoy (which has no
// wrr_locality and weighs localities itself), then round robin for clients
// that know neither.
func loadBalancingPolicy(p health.LBPolicy) *clusterv3.LoadBalancingPolicy {
	rr := policy("envoy.load_balancing_policies.round_robin", &roundrobinv3.RoundRobin{})
	var pick *clusterv3.LoadBalancingPolicy_Policy
	switch p {
	case health.LBRoundRobin:
		pick = rr
	case health.LBLeastRequest:
		pick = policy("envoy.load_balancing_policies.least_request", &leastrequestv3.LeastRequest{ChoiceCount: wrapperspb.UInt32(2)})
	default:
		pick = policy("envoy.load_balancing_policies.client_side_weighted_round_robin", &cswrrv3.ClientSideWeightedRoundRobin{
			EnableOobLoadReport: wrapperspb.Bool(true),
			OobReportingPeriod:  durationpb.New(orcaReportingPeriod),
			BlackoutPeriod:      durationpb.New(orcaBlackoutPeriod),
			WeightUpdatePeriod:  durationpb.New(orcaWeightUpdate),
		})
	}
	inner := []*clusterv3.LoadBalancingPolicy_Policy{pick}
	if pick != rr {
		inner = append(inner, rr)
	}
	outer := []*clusterv3.LoadBalancingPolicy_Policy{
		policy("envoy.load_balancing_policies.wrr_locality", &wrrlocalityv3.WrrLocality{EndpointPickingPolicy: &clusterv3.LoadBalancingPolicy{Policies: inner}}),
	}
	return &clusterv3.LoadBalancingPolicy{Policies: append(outer, inner...)}
}

func policy(name string, m proto.Message) *clusterv3.LoadBalancingPolicy_Policy {
	a, err := anypb.New(m)
	if err != nil {
		panic(err) // a fixed, valid message
	}
	return &clusterv3.LoadBalancingPolicy_Policy{TypedExtensionConfig: &corev3.TypedExtensionConfig{Name: name, TypedConfig: a}}
}
