package xdscache

import (
	"context"
	"strings"
	"testing"
	"unsafe"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/stream/v3"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	"github.com/leasehold/leasehold/snapshot/translator"
)

func endpointsSnapshot(t *testing.T, names ...string) *cache.Snapshot {
	t.Helper()
	var res []types.Resource
	for _, n := range names {
		res = append(res, translator.Endpoints(n, nil, health.Dispatcher{}))
	}
	snap, err := cache.NewSnapshot("v", map[resource.Type][]types.Resource{resource.EndpointType: res})
	if err != nil {
		t.Fatal(err)
	}
	return snap
}

// Versions that do not name exactly the snapshot's resources are refused,
// naming the first difference: a watch would otherwise be skipped for a
// change the versions do not show.
func TestSetRefusesVersionsThatDoNotNameItsResources(t *testing.T) {
	c := New()
	for _, tc := range []struct {
		name     string
		snap     []string
		versions map[string]map[string]string
		want     string
	}{
		{"a resource without a version", []string{"a", "b"},
			map[string]map[string]string{resource.EndpointType: {"a": "1"}}, `"b" has no content version`},
		{"a version without a resource", []string{"a"},
			map[string]map[string]string{resource.EndpointType: {"a": "1", "x": "1"}},
			`"x", which the snapshot does not hold`},
		{"a type no snapshot serves", []string{"a"},
			map[string]map[string]string{resource.EndpointType: {"a": "1"}, "type.example/x": {"x": "1"}},
			"type.example/x, which a snapshot does not serve"},
	} {
		err := c.Set(context.Background(), "g", endpointsSnapshot(t, tc.snap...), tc.versions)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error saying %s", tc.name, err, tc.want)
		}
	}
	if err := c.Set(context.Background(), "g", endpointsSnapshot(t, "a"),
		map[string]map[string]string{resource.EndpointType: {"a": "1"}}); err != nil {
		t.Fatalf("matching versions refused: %v", err)
	}
}

// The cache keeps its own copy of the versions it was given: a caller that
// changes its map after Set cannot hide the next publication's change from
// the watches (the comparison would see none, and a lapse would stay routed).
func TestAPublicationsVersionsCannotBeChangedAfterSet(t *testing.T) {
	c := New()
	node := &corev3.Node{Id: "n"}
	group := GroupOf(node)
	versions := map[string]map[string]string{resource.EndpointType: {"a": "1"}}
	if err := c.Set(context.Background(), group, endpointsSnapshot(t, "a"), versions); err != nil {
		t.Fatal(err)
	}
	sub := stream.NewSotwSubscription([]string{"a"}, false)
	sub.SetReturnedResources(map[string]string{"a": "1"})
	out := make(chan cache.Response, 1)
	if _, err := c.CreateWatch(&cache.Request{Node: node, TypeUrl: resource.EndpointType,
		ResourceNames: []string{"a"}, VersionInfo: "v", ResponseNonce: "1"}, &sub, out); err != nil {
		t.Fatal(err)
	}
	select {
	case <-out:
		t.Fatal("an up-to-date watch was answered")
	default:
	}
	versions[resource.EndpointType]["a"] = "2" // the caller reuses its map
	if err := c.Set(context.Background(), group, endpointsSnapshot(t, "a"), versions); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-out:
		if got := r.GetReturnedResources()["a"]; got != "2" {
			t.Fatalf("answered with a at %q, want 2", got)
		}
	default:
		t.Fatal("the watch of a was not answered when a changed from 1 to 2")
	}
}

// A watch held in a form's group (a dispatcher asking for compact endpoint
// metadata) is answered by the first publication of its constraint set
// after a Clear, as a watch of the set's own group is: the set's next
// publication must derive the form again, not only a new watch of the form.
func TestAFormWatchHeldAcrossAClearIsAnsweredByTheNextPublication(t *testing.T) {
	c := New()
	base := fleettest.Node(t, map[string]any{})
	formNode := fleettest.Node(t, map[string]any{NodeMetaEndpointMetadata: string(MetadataSession)})
	group := GroupOf(base)
	publish := func(v string) {
		t.Helper()
		if err := c.Set(context.Background(), group, endpointsSnapshot(t, "a"),
			map[string]map[string]string{resource.EndpointType: {"a": v}}); err != nil {
			t.Fatal(err)
		}
	}
	publish("1")
	watch := func(nodeName string, node *corev3.Node) (chan cache.Response, func()) {
		t.Helper()
		sub := stream.NewSotwSubscription([]string{"a"}, true)
		out := make(chan cache.Response, 1)
		req := &cache.Request{Node: node, TypeUrl: resource.EndpointType, ResourceNames: []string{"a"}}
		cancel, err := c.CreateWatch(req, sub, out)
		if err != nil {
			t.Fatal(err)
		}
		r := <-out // the first request is answered
		sub.SetReturnedResources(r.GetReturnedResources())
		req2 := &cache.Request{Node: req.Node, TypeUrl: req.TypeUrl, ResourceNames: []string{"a"},
			VersionInfo: "v", ResponseNonce: "1"}
		cancel()
		out2 := make(chan cache.Response, 1)
		cancel2, err := c.CreateWatch(req2, sub, out2) // the ACK: held
		if err != nil {
			t.Fatal(err)
		}
		select {
		case r := <-out2:
			t.Fatalf("%s: an up-to-date ACK was answered %v", nodeName, r)
		default:
		}
		return out2, cancel2
	}
	full, cancelFull := watch("full", base)
	defer cancelFull()
	form, cancelForm := watch("form", formNode)
	defer cancelForm()
	c.Clear(group) // (as when the set's last stream ends while another opens)
	publish("2")   // a lapse: a's endpoints changed
	select {
	case <-full:
	default:
		t.Error("the constraint set's held watch was not answered after the Clear")
	}
	select {
	case <-form:
	default:
		t.Error("the session form's held watch was not answered by the set's publication " +
			"after a Clear: the form is never derived again until a new form watch asks")
	}
}

// A load assignment the translator marshalled (its wire) is sent as it is:
// the response's bytes are the wire's, not a copy marshalled beside it, and
// they parse as the load assignment. A wire naming a load assignment the
// snapshot does not hold is refused, naming it.
func TestAWiredLoadAssignmentIsSentAsItIs(t *testing.T) {
	c := New()
	node := &corev3.Node{Id: "n"}
	group := GroupOf(node)
	r := (&translator.Builder{}).BuildPrinted("work", fleettest.Executors(20), nil, health.Dispatcher{})
	sh := r.Shards[0]
	if len(sh.Wire) == 0 {
		t.Fatal("precondition: the translator made no wire")
	}
	snap, err := cache.NewSnapshot("v",
		map[resource.Type][]types.Resource{resource.EndpointType: {sh.CLA}})
	if err != nil {
		t.Fatal(err)
	}
	versions := map[string]map[string]string{resource.EndpointType: {sh.Name: sh.Version}}
	err = c.SetWired(context.Background(), group, snap, versions, map[string][]byte{"x": sh.Wire})
	if err == nil || !strings.Contains(err.Error(), `"x"`) {
		t.Fatalf("a wire of a load assignment not held: %v, want it refused naming x", err)
	}
	if err := c.SetWired(context.Background(), group, snap, versions,
		map[string][]byte{sh.Name: sh.Wire}); err != nil {
		t.Fatal(err)
	}
	out := make(chan cache.Response, 1)
	sub := stream.NewSotwSubscription([]string{sh.Name}, false)
	if _, err := c.CreateWatch(&cache.Request{Node: node, TypeUrl: resource.EndpointType,
		ResourceNames: []string{sh.Name}}, &sub, out); err != nil {
		t.Fatal(err)
	}
	resp, err := (<-out).GetDiscoveryResponse()
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.GetResources()) != 1 {
		t.Fatalf("%d resources, want the load assignment", len(resp.GetResources()))
	}
	got := resp.GetResources()[0].GetValue()
	if unsafe.SliceData(got) != unsafe.SliceData(sh.Wire) || len(got) != len(sh.Wire) {
		t.Fatal("the load assignment was sent as a copy, not as its wire")
	}
	var cla endpointv3.ClusterLoadAssignment
	if err := proto.Unmarshal(got, &cla); err != nil || !proto.Equal(&cla, translator.Expand(sh.CLA)) {
		t.Fatalf("the wire does not parse as the load assignment (%v)", err)
	}
}
