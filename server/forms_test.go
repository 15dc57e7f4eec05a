package server

import (
	"bytes"
	"testing"

	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/leasehold/leasehold/internal/adstest"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// Dispatchers of one constraint set asking for each endpoint metadata form
// get that form, over gRPC, from two replicas byte for byte; a lapse reaches
// every form; /debug/dispatchers shows each stream's form.
func TestEndpointMetadataFormsOverGRPC(t *testing.T) {
	replicas := []*fixture{startXDS(t), startXDS(t)}
	forms := []string{"full", "session", "none"}
	fields := map[string]int{"full": 3, "session": 1, "none": 0}
	first := map[string][]*discovery.DiscoveryResponse{}
	streams := map[string]*adstest.Client{}
	for _, f := range replicas {
		for _, form := range forms {
			a := f.ads(node("d-"+form, map[string]any{"endpoint_metadata": form}))
			a.Subscribe(resource.EndpointType, "work")
			r := a.Next()
			first[form] = append(first[form], r)
			if f == replicas[0] {
				streams[form] = a
			}
		}
	}
	for _, form := range forms {
		a, b := first[form][0], first[form][1]
		if a.VersionInfo != b.VersionInfo ||
			!bytes.Equal(a.Resources[0].Value, b.Resources[0].Value) {
			t.Fatalf("%s: replicas disagree", form)
		}
		cla := &endpointv3.ClusterLoadAssignment{}
		if err := a.Resources[0].UnmarshalTo(cla); err != nil {
			t.Fatal(err)
		}
		for _, lb := range cla.Endpoints[0].LbEndpoints {
			md := lb.GetMetadata().GetFilterMetadata()[translator.MetadataNamespace]
			if n := len(md.GetFields()); n != fields[form] {
				t.Fatalf("%s: %d metadata fields on %s, want %d",
					form, n, lb.GetEndpoint().GetHostname(), fields[form])
			}
		}
		if got := hosts(t, a, "work"); len(got) != 2 {
			t.Fatalf("%s: hosts %v", form, got)
		}
		streams[form].ACK(a, "work")
	}
	if first["full"][0].VersionInfo == first["none"][0].VersionInfo {
		t.Fatal("two forms share a version")
	}
	replicas[0].lapseB()
	for _, form := range forms {
		r := streams[form].Next()
		if got := hosts(t, r, "work"); len(got) != 1 || got[0] != "a" {
			t.Fatalf("%s: after the lapse %v", form, got)
		}
	}
	x := replicas[0].xds
	seen := map[string]string{}
	for _, s := range x.Dispatchers() {
		seen[s.NodeID] = s.EndpointMetadata
	}
	for _, form := range forms {
		if seen["d-"+form] != form {
			t.Fatalf("/debug/dispatchers: %v", seen)
		}
	}
}
