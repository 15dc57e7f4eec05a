package translator

import (
	"strings"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// goldenPolicies are the dispatch policies with golden files: the default,
// none at all, and everything set.
func goldenPolicies(t *testing.T) map[string]health.TaskDispatch {
	t.Helper()
	r, err := health.ParseRollout([]byte(`{"dispatch":{"tasks":{
		"full":{"retry":{"on":["UNAVAILABLE"],"num_retries":4,
				"backoff":{"base":"50ms","max":"2s"}},
			"max_requests":16,"deadline":"90s",
			"outlier":{"failure_percentage":{"threshold":40,"minimum_hosts":2,"request_volume":10},
				"consecutive_failures":3,"interval":"5s","base_ejection_time":"20s",
				"max_ejection_percent":50}},
		"none":{"retry":{"num_retries":0}},
		"eject":{"outlier":{}}}}}`))
	if err != nil {
		t.Fatal(err)
	}
	return map[string]health.TaskDispatch{"default": health.DefaultDispatch(),
		"full": r.DispatchOf("full"), "none": r.DispatchOf("none"), "eject": r.DispatchOf("eject")}
}

// Each policy's route and cluster match their golden files and pass
// Envoy's own validation rules (PGV), sharded routes too.
func TestDispatchPolicyGolden(t *testing.T) {
	for name, p := range goldenPolicies(t) {
		r, c := Route("transcode", p), Cluster("transcode", health.DefaultLBPolicy, p)
		sharded := ShardedRoute("transcode", []uint32{3, 5}, p)
		for what, m := range map[string]interface{ ValidateAll() error }{"route": r,
			"cluster": c, "sharded route": sharded} {
			if err := m.ValidateAll(); err != nil {
				t.Errorf("%s policy, %s: %v", name, what, err)
			}
		}
		fleettest.ProtoGolden(t, "route-dispatch-"+name+".json", r)
		fleettest.ProtoGolden(t, "cluster-dispatch-"+name+".json", c)
	}
}

// What is emitted is what grpc-go's xDS client accepts and applies
// (internal/xds/xdsclient/xdsresource: num_retries >= 1, base > 0, a
// retry_on it knows; the DEFAULT-priority threshold; success rate off and
// failure percentage enforced; lrs_server self), checked field by field.
func TestDispatchPolicyIsWhatGRPCApplies(t *testing.T) {
	ps := goldenPolicies(t)
	full := ps["full"]
	a := Route("work", full).GetVirtualHosts()[0].GetRoutes()[0].GetRoute()
	rp := a.GetRetryPolicy()
	if rp.GetRetryOn() != "unavailable" || rp.GetNumRetries().GetValue() != 4 ||
		rp.GetRetryBackOff().GetBaseInterval().AsDuration() != 50*time.Millisecond ||
		rp.GetRetryBackOff().GetMaxInterval().AsDuration() != 2*time.Second {
		t.Errorf("retry policy %v", rp)
	}
	if msd := a.GetMaxStreamDuration(); msd.GetGrpcTimeoutHeaderMax().AsDuration() != 90*time.Second ||
		msd.GetMaxStreamDuration().AsDuration() != 90*time.Second {
		t.Errorf("max stream duration %v", msd)
	}
	def := Route("work", ps["default"]).GetVirtualHosts()[0].GetRoutes()[0].GetRoute()
	if got := def.GetRetryPolicy().GetRetryOn(); got != "unavailable,resource-exhausted" {
		t.Errorf("default retry_on %q", got)
	}
	if def.GetMaxStreamDuration() != nil {
		t.Error("the default policy sets a deadline")
	}
	// grpc-go refuses num_retries 0: no retries is no retry policy.
	if rp := Route("work", ps["none"]).GetVirtualHosts()[0].GetRoutes()[0].GetRoute().
		GetRetryPolicy(); rp != nil {
		t.Errorf("no retries: retry policy %v", rp)
	}

	c := Cluster("work", health.DefaultLBPolicy, full)
	th := c.GetCircuitBreakers().GetThresholds()
	if len(th) != 1 || th[0].GetPriority() != corev3.RoutingPriority_DEFAULT ||
		th[0].GetMaxRequests().GetValue() != 16 {
		t.Errorf("circuit breakers %v", c.GetCircuitBreakers())
	}
	od := c.GetOutlierDetection()
	if od.GetEnforcingSuccessRate() == nil || od.GetEnforcingSuccessRate().GetValue() != 0 {
		t.Error("success-rate ejection is not turned off (both clients enable it when unset)")
	}
	if od.GetEnforcingFailurePercentage().GetValue() != 100 ||
		od.GetFailurePercentageThreshold().GetValue() != 40 ||
		od.GetFailurePercentageMinimumHosts().GetValue() != 2 ||
		od.GetFailurePercentageRequestVolume().GetValue() != 10 ||
		od.GetMaxEjectionPercent().GetValue() != 50 ||
		od.GetInterval().AsDuration() != 5*time.Second ||
		od.GetBaseEjectionTime().AsDuration() != 20*time.Second {
		t.Errorf("outlier detection %v", od)
	}
	if od.GetConsecutive_5Xx().GetValue() != 3 || od.GetEnforcingConsecutive_5Xx().GetValue() != 100 {
		t.Errorf("consecutive failures (Envoy): %v", od)
	}
	// Ejection without consecutive_failures turns Envoy's default
	// consecutive_5xx (5, enforced) off.
	if e := Cluster("work", health.DefaultLBPolicy, ps["eject"]).GetOutlierDetection(); e.
		GetEnforcingConsecutive_5Xx() == nil || e.GetEnforcingConsecutive_5Xx().GetValue() != 0 {
		t.Errorf("ejection without consecutive failures: %v", e)
	}
	for name, p := range ps {
		c := Cluster("work", health.DefaultLBPolicy, p)
		if c.GetLrsServer().GetSelf() == nil {
			t.Errorf("%s: lrs_server is not self: %v", name, c.GetLrsServer())
		}
		if (p.MaxRequests == 0) != (c.GetCircuitBreakers() == nil) {
			t.Errorf("%s: circuit breakers %v for max_requests %d", name, c.GetCircuitBreakers(),
				p.MaxRequests)
		}
		if (p.Outlier == nil) != (c.GetOutlierDetection() == nil) {
			t.Errorf("%s: outlier detection %v for %v", name, c.GetOutlierDetection(), p.Outlier)
		}
	}
}

// Content versions follow the policy: every policy its own route and
// cluster versions, the same policy the same versions (on every replica:
// the bytes are deterministic), and a task's policy never in another
// task's resources.
func TestDispatchPolicyChangesTheContentVersion(t *testing.T) {
	seenR, seenC := map[string]string{}, map[string]string{}
	for name, p := range goldenPolicies(t) {
		rv, cv := Version(Route("work", p)), Version(Cluster("work", health.DefaultLBPolicy, p))
		if rv != Version(Route("work", p)) || cv != Version(Cluster("work",
			health.DefaultLBPolicy, p)) {
			t.Fatalf("%s: versions not stable", name)
		}
		if other, dup := seenR[rv]; dup && name != "eject" && other != "eject" {
			t.Errorf("%s and %s share route version %s", name, other, rv)
		}
		if other, dup := seenC[cv]; dup && !(name == "none" || other == "none") {
			t.Errorf("%s and %s share cluster version %s", name, other, cv)
		}
		seenR[rv], seenC[cv] = name, name
	}
}

func routeAction(r *routev3.RouteConfiguration) *routev3.RouteAction {
	return r.GetVirtualHosts()[0].GetRoutes()[0].GetRoute()
}

// A sharded route carries the policy too.
func TestShardedRouteCarriesTheDispatchPolicy(t *testing.T) {
	full := goldenPolicies(t)["full"]
	a := routeAction(ShardedRoute("work", []uint32{1, 2, 3}, full))
	if a.GetWeightedClusters() == nil || a.GetRetryPolicy().GetNumRetries().GetValue() != 4 ||
		a.GetMaxStreamDuration() == nil {
		t.Fatalf("sharded route action %v", a)
	}
	for _, c := range []*clusterv3.Cluster{Cluster(ShardName("work", 0, 3),
		health.DefaultLBPolicy, full)} {
		if !strings.HasPrefix(c.GetName(), "work/shard-") || c.GetCircuitBreakers() == nil {
			t.Fatalf("shard cluster %v", c)
		}
	}
}

// A policy at the edge of every bound the rules accept passes Envoy's PGV
// rules and Envoy's own cross-field check of outlier detection
// (base_ejection_time no more than max_ejection_time, 300 s when unset).
func TestDispatchPolicyAtEveryBoundIsValid(t *testing.T) {
	r, err := health.ParseRollout([]byte(`{"dispatch":{"tasks":{"work":{
		"retry":{"num_retries":4,"backoff":{"base":"1m","max":"1m"}},
		"max_requests":1048576,"deadline":"24h",
		"outlier":{"failure_percentage":{"threshold":1,"minimum_hosts":10000,
			"request_volume":1048576},"consecutive_failures":1000,"interval":"1h",
			"base_ejection_time":"5m","max_ejection_percent":100}}}}}`))
	if err != nil {
		t.Fatal(err)
	}
	p := r.DispatchOf("work")
	rt, c := Route("work", p), Cluster("work", health.DefaultLBPolicy, p)
	if err := rt.ValidateAll(); err != nil {
		t.Errorf("route: %v", err)
	}
	if err := c.ValidateAll(); err != nil {
		t.Errorf("cluster: %v", err)
	}
	od := c.GetOutlierDetection()
	maxEjection := 300 * time.Second
	if m := od.GetMaxEjectionTime(); m != nil {
		maxEjection = m.AsDuration()
	}
	if od.GetBaseEjectionTime().AsDuration() > maxEjection {
		t.Errorf("base_ejection_time %s over max_ejection_time %s: Envoy refuses the cluster",
			od.GetBaseEjectionTime().AsDuration(), maxEjection)
	}
}
