// Package envoy holds the Envoy bootstrap example; its test keeps it valid.
package envoy

import (
	"encoding/json"
	"os"
	"strings"
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	wrrlocalityv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/wrr_locality/v3"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/translator"
	"github.com/leasehold/leasehold/snapshot/xdscache"
)

// The example parses into Envoy's bootstrap proto with every field known,
// passes Envoy's proto validation, asks leasehold for clusters over ADS,
// routes to the cluster leasehold serves for its task, and carries node
// metadata leasehold accepts.
func TestEnvoyBootstrapIsValid(t *testing.T) {
	for _, f := range []string{"envoy.yaml", "envoy-mtls.yaml"} {
		t.Run(f, func(t *testing.T) { checkBootstrap(t, f) })
	}
}

func checkBootstrap(t *testing.T, file string) *bootstrapv3.Bootstrap {
	raw, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var doc any
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	js, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	b := &bootstrapv3.Bootstrap{}
	if err := protojson.Unmarshal(js, b); err != nil {
		t.Fatalf("%s is not an Envoy v3 bootstrap: %v", file, err)
	}
	if err := b.ValidateAll(); err != nil {
		t.Fatalf("Envoy's validation rejects %s: %v", file, err)
	}
	if b.GetDynamicResources().GetCdsConfig().GetAds() == nil {
		t.Error("clusters must come over ADS")
	}
	ads := b.GetDynamicResources().GetAdsConfig().GetGrpcServices()
	if len(ads) != 1 || ads[0].GetEnvoyGrpc().GetClusterName() != "leasehold" {
		t.Fatalf("ADS must use the static cluster leasehold, got %v", ads)
	}
	var xds bool
	for _, c := range b.GetStaticResources().GetClusters() {
		if c.GetName() == "leasehold" {
			xds = c.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"] != nil
		}
	}
	if !xds {
		t.Error("the leasehold cluster must speak HTTP/2 (gRPC)")
	}

	// The listener routes to the task's cluster as leasehold names it.
	hcm := &hcmv3.HttpConnectionManager{}
	if err := b.GetStaticResources().GetListeners()[0].GetFilterChains()[0].GetFilters()[0].GetTypedConfig().UnmarshalTo(hcm); err != nil {
		t.Fatal(err)
	}
	want := translator.Cluster("work", health.DefaultLBPolicy, health.DefaultDispatch()).GetName()
	if got := hcm.GetRouteConfig().GetVirtualHosts()[0].GetRoutes()[0].GetRoute().GetCluster(); got != want {
		t.Errorf("route goes to cluster %q, leasehold serves %q", got, want)
	}

	// The node metadata is what leasehold validates for a dispatcher.
	n := b.GetNode()
	d, err := xdscache.DispatcherOf(n)
	if err != nil {
		t.Fatalf("leasehold would refuse this node: %v", err)
	}
	if d.VersionConstraint == "" || !strings.Contains(d.Key(), "zone") {
		t.Errorf("constraints lost: %+v", d)
	}
	if _, err := health.NewDispatcher(d.VersionConstraint, d.Labels); err != nil {
		t.Error(err)
	}
	if strings.Contains(file, "mtls") {
		for _, c := range b.GetStaticResources().GetClusters() {
			if c.GetName() != "leasehold" {
				continue
			}
			tc := &tlsv3.UpstreamTlsContext{}
			if err := c.GetTransportSocket().GetTypedConfig().UnmarshalTo(tc); err != nil {
				t.Fatalf("the leasehold cluster has no TLS transport socket: %v", err)
			}
			if len(tc.GetCommonTlsContext().GetTlsCertificates()) != 1 || tc.GetCommonTlsContext().GetValidationContext().GetTrustedCa() == nil {
				t.Error("mTLS needs a client certificate and a trusted CA")
			}
		}
	}
	return b
}

// What leasehold sends Envoy passes Envoy's own validation.
func TestServedResourcesPassEnvoyValidation(t *testing.T) {
	for _, p := range health.LBPolicies {
		c := translator.Cluster("work", p, health.DefaultDispatch())
		if err := c.ValidateAll(); err != nil {
			t.Errorf("cluster (%s): %v", p, err)
		}
		validatePolicies(t, string(p), c.GetLoadBalancingPolicy())
	}
	es := []health.Executor{
		{Registration: health.Registration{InstanceID: "e1", SessionID: "s1", Generation: 1, Task: "work", Address: "127.0.0.1", Port: 9001, Version: "1.4.0", Capacity: 4, State: health.StateActive},
			ServiceID: "work:e1", Node: "n1", LeaseStatus: health.StatusPassing, LeaseFound: true, NodeChecks: health.StatusPassing},
		{Registration: health.Registration{InstanceID: "e2", SessionID: "s2", Generation: 1, Task: "work", Address: "127.0.0.1", Port: 9002, Version: "1.4.0", Capacity: 4, State: health.StateDraining},
			ServiceID: "work:e2", Node: "n1", LeaseStatus: health.StatusPassing, LeaseFound: true, NodeChecks: health.StatusPassing},
	}
	cla := translator.Expand(translator.Endpoints("work", es, health.Dispatcher{}))
	if n := len(cla.GetEndpoints()[0].GetLbEndpoints()); n != 2 {
		t.Fatalf("want 2 endpoints (one HEALTHY, one DRAINING), got %d", n)
	}
	if err := cla.ValidateAll(); err != nil {
		t.Errorf("endpoints: %v", err)
	}
}

// validatePolicies validates every load-balancing policy of a list with
// Envoy's rules, nested lists (wrr_locality's) too: a cluster's own
// validation does not look inside its typed extension configs.
func validatePolicies(t *testing.T, where string, lb *clusterv3.LoadBalancingPolicy) {
	t.Helper()
	if len(lb.GetPolicies()) == 0 {
		t.Errorf("%s: no load-balancing policy", where)
	}
	for i, p := range lb.GetPolicies() {
		m, err := p.GetTypedExtensionConfig().GetTypedConfig().UnmarshalNew()
		if err != nil {
			t.Errorf("%s: policy %d (%s): %v", where, i, p.GetTypedExtensionConfig().GetName(), err)
			continue
		}
		if v, ok := m.(interface{ ValidateAll() error }); !ok {
			t.Errorf("%s: policy %d: %T has no Envoy validation", where, i, m)
		} else if err := v.ValidateAll(); err != nil {
			t.Errorf("%s: policy %d (%s): %v", where, i, p.GetTypedExtensionConfig().GetName(), err)
		}
		if w, ok := m.(*wrrlocalityv3.WrrLocality); ok {
			validatePolicies(t, where+"/wrr_locality", w.GetEndpointPickingPolicy())
		}
	}
}
