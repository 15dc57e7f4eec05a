package xdscache

import (
	"errors"
	"testing"

	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	"github.com/leasehold/leasehold/snapshot/translator"
)

func TestEndpointMetadataOfNamesTheField(t *testing.T) {
	for _, c := range []struct {
		meta map[string]any
		want EndpointMetadata
	}{
		{map[string]any{}, MetadataFull},
		{map[string]any{"endpoint_metadata": "full"}, MetadataFull},
		{map[string]any{"endpoint_metadata": "session"}, MetadataSession},
		{map[string]any{"endpoint_metadata": "none"}, MetadataNone},
	} {
		if got, err := EndpointMetadataOf(fleettest.Node(t, c.meta)); err != nil || got != c.want {
			t.Errorf("%v: %q, %v; want %q", c.meta, got, err, c.want)
		}
	}
	for _, bad := range []any{"compact", "", "NONE", 1.0, true, map[string]any{"a": "b"}} {
		node := fleettest.Node(t, map[string]any{"endpoint_metadata": bad})
		_, err := EndpointMetadataOf(node)
		var fe *health.FieldError
		if !errors.As(err, &fe) || fe.Field != "node.metadata.endpoint_metadata" {
			t.Errorf("%v: error %v, want one naming node.metadata.endpoint_metadata", bad, err)
		}
		if _, err := DispatcherOf(node); err == nil {
			t.Errorf("%v: DispatcherOf accepted it", bad)
		}
	}
	if _, err := EndpointMetadataOf(nil); err != nil {
		t.Errorf("nil node: %v", err)
	}
}

// The forms of the golden fleet: golden files, and what each keeps of an
// endpoint (everything but the metadata it drops), valid for Envoy.
func TestFormsGolden(t *testing.T) {
	d, _ := health.NewDispatcher("", nil)
	cla := translator.Endpoints("transcode", fleettest.GoldenFleet(), d)
	snap := &cache.Snapshot{}
	snap.Resources[types.Endpoint] = cache.NewResources("v", []types.Resource{cla})
	versions := map[string]map[string]string{resource.EndpointType: {"transcode": "e1"}}
	for _, f := range []EndpointMetadata{MetadataSession, MetadataNone} {
		fs := &formState{form: f}
		ds, dv := fs.derive(snap, versions)
		res := ds.GetResources(resource.EndpointType)
		got := translator.Expand(res["transcode"].(*endpointv3.ClusterLoadAssignment))
		if err := got.ValidateAll(); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		fleettest.ProtoGolden(t, "endpoints-any-"+string(f)+".json", got)
		if v := dv[resource.EndpointType]["transcode"]; v != "e1-"+string(f) {
			t.Errorf("%s: version %q", f, v)
		}
		want := translator.Expand(cla)
		if len(want.Endpoints) < 2 {
			t.Fatal("the golden fleet has one locality: localities other than the first are not " +
				"exercised")
		}
		for _, loc := range want.Endpoints {
			for _, lb := range loc.LbEndpoints {
				switch f {
				case MetadataNone:
					lb.Metadata = nil
				case MetadataSession:
					delete(lb.Metadata.FilterMetadata[translator.MetadataNamespace].Fields,
						"instance_id")
					delete(lb.Metadata.FilterMetadata[translator.MetadataNamespace].Fields,
						"version")
				}
			}
		}
		if !proto.Equal(got, want) {
			t.Errorf("%s: derived %v\nwant %v", f, got, want)
		}
		if !proto.Equal(cla, translator.Endpoints("transcode", fleettest.GoldenFleet(), d)) {
			t.Fatalf("%s: deriving modified the snapshot's message", f)
		}
		size := func(m proto.Message) int { return proto.Size(m) }
		t.Logf("%s: %d of %d bytes (%d localities)", f, size(got), size(cla), len(cla.Endpoints))
	}
}

// A derivation derives again only the load assignments whose content
// version changed; what it keeps and what it derives anew are what a
// derivation from nothing gives.
func TestADerivationKeepsWhatDidNotChange(t *testing.T) {
	d, _ := health.NewDispatcher("", nil)
	fleet := fleettest.GoldenFleet()
	build := func(task string, es []health.Executor) *endpointv3.ClusterLoadAssignment {
		return translator.Endpoints(task, es, d)
	}
	snapOf := func(a, b *endpointv3.ClusterLoadAssignment, va, vb string) (*cache.Snapshot,
		map[string]map[string]string) {
		snap := &cache.Snapshot{}
		snap.Resources[types.Endpoint] = cache.NewResources("v", []types.Resource{a, b})
		return snap, map[string]map[string]string{resource.EndpointType: {"a": va, "b": vb}}
	}
	for _, f := range []EndpointMetadata{MetadataSession, MetadataNone} {
		fs := &formState{form: f}
		first, _ := fs.derive(snapOf(build("a", fleet), build("b", fleet), "a1", "b1"))
		next, _ := fs.derive(snapOf(build("a", fleet), build("b", fleet[1:]), "a1", "b2"))
		was, now := first.GetResources(resource.EndpointType),
			next.GetResources(resource.EndpointType)
		if was["a"] != now["a"] {
			t.Errorf("%s: a load assignment whose version did not change was derived again", f)
		}
		if was["b"] == now["b"] {
			t.Fatalf("%s: a load assignment whose version changed was kept", f)
		}
		fresh, _ := (&formState{form: f}).derive(snapOf(build("a", fleet), build("b", fleet[1:]),
			"a1", "b2"))
		for _, name := range []string{"a", "b"} {
			got := now[name].(*endpointv3.ClusterLoadAssignment)
			want := fresh.GetResources(resource.EndpointType)[name].(*endpointv3.ClusterLoadAssignment)
			if !proto.Equal(translator.Expand(got), translator.Expand(want)) {
				t.Errorf("%s: %s differs from a derivation from nothing", f, name)
			}
		}
	}
}
