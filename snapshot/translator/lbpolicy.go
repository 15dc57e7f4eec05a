package translator

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

// Weighted round robin's timings. Weights come from the ORCA report each
// executor attaches to every call's trailer: grpc-go's out-of-band ORCA
// service reports at most every 30 s, too slow for a load that changes with
// each task. A new endpoint's weight counts once it has reported for 2 s
// (grpc-go's default of 10 s would keep a fresh executor unweighted for
// long), weights are recomputed every second, and a weight not refreshed for
// 10 s expires (an executor gone idle reports nothing new: its old, busy
// weight must not keep work away from it for grpc-go's default of 3 min).
const (
	wrrBlackoutPeriod   = 2 * time.Second
	wrrWeightUpdate     = time.Second
	wrrWeightExpiration = 10 * time.Second
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
		pick = policy("envoy.load_balancing_policies.least_request",
			&leastrequestv3.LeastRequest{ChoiceCount: wrapperspb.UInt32(2)})
	default:
		pick = policy("envoy.load_balancing_policies.client_side_weighted_round_robin",
			&cswrrv3.ClientSideWeightedRoundRobin{
				BlackoutPeriod:         durationpb.New(wrrBlackoutPeriod),
				WeightUpdatePeriod:     durationpb.New(wrrWeightUpdate),
				WeightExpirationPeriod: durationpb.New(wrrWeightExpiration),
			})
	}
	inner := []*clusterv3.LoadBalancingPolicy_Policy{pick}
	if pick != rr {
		inner = append(inner, rr)
	}
	outer := []*clusterv3.LoadBalancingPolicy_Policy{
		policy("envoy.load_balancing_policies.wrr_locality", &wrrlocalityv3.WrrLocality{
			EndpointPickingPolicy: &clusterv3.LoadBalancingPolicy{Policies: inner},
		}),
	}
	return &clusterv3.LoadBalancingPolicy{Policies: append(outer, inner...)}
}

func policy(name string, m proto.Message) *clusterv3.LoadBalancingPolicy_Policy {
	a, err := anypb.New(m)
	if err != nil {
		panic(err) // a fixed, valid message
	}
	return &clusterv3.LoadBalancingPolicy_Policy{
		TypedExtensionConfig: &corev3.TypedExtensionConfig{Name: name, TypedConfig: a},
	}
}
