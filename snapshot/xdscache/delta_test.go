package xdscache

import (
	"context"
	"slices"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/stream/v3"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// deltaFixture publishes load assignments named by task, versioned as
// given, into one constraint set's group.
type deltaFixture struct {
	t     *testing.T
	c     *Cache
	group string
	node  *corev3.Node
}

func newDeltaFixture(t *testing.T) *deltaFixture {
	node := &corev3.Node{Id: "d1"}
	return &deltaFixture{t: t, c: New(), group: GroupOf(node), node: node}
}

// set publishes one load assignment per name at its version.
func (f *deltaFixture) set(versions map[string]string) {
	f.t.Helper()
	var res []types.Resource
	for name := range versions {
		res = append(res, translator.Endpoints(name, nil, health.Dispatcher{}))
	}
	snap, err := cache.NewSnapshot("v", map[resource.Type][]types.Resource{resource.EndpointType: res})
	if err != nil {
		f.t.Fatal(err)
	}
	if err := f.c.Set(context.Background(), f.group, snap,
		map[string]map[string]string{resource.EndpointType: versions}); err != nil {
		f.t.Fatal(err)
	}
}

// watch opens a delta watch for sub and returns what it answers at once
// (nil: nothing until the next change).
func (f *deltaFixture) watch(sub *stream.Subscription, nonce string) *discovery.DeltaDiscoveryResponse {
	f.t.Helper()
	out := make(chan cache.DeltaResponse, 1)
	cancel, err := f.c.CreateDeltaWatch(&cache.DeltaRequest{Node: f.node,
		TypeUrl: resource.EndpointType, ResponseNonce: nonce}, sub, out)
	if err != nil {
		f.t.Fatal(err)
	}
	defer cancel()
	select {
	case r := <-out:
		d, err := r.GetDeltaDiscoveryResponse()
		if err != nil {
			f.t.Fatal(err)
		}
		sub.SetReturnedResources(r.GetNextVersionMap())
		return d
	default: // the cache answers within CreateDeltaWatch, or at the next Set
		return nil
	}
}

func names(r *discovery.DeltaDiscoveryResponse) []string {
	var out []string
	for _, res := range r.GetResources() {
		out = append(out, res.GetName()+"@"+res.GetVersion())
	}
	return out
}

// A named delta subscription gets the resources it lacks, sorted, at their
// content versions; then only what changed; then the removal of what is
// gone; an up-to-date client gets nothing until the next change.
func TestDeltaWatchSendsWhatChangedAndWhatWent(t *testing.T) {
	f := newDeltaFixture(t)
	f.set(map[string]string{"b": "1", "a": "1", "c": "1"})
	sub := new(stream.NewDeltaSubscription([]string{"a", "b", "missing"}, nil, nil, false))
	r := f.watch(sub, "")
	if got := names(r); !slices.Equal(got, []string{"a@1", "b@1"}) {
		t.Fatalf("first answer %v: want a@1, b@1 (what it asked for that exists, sorted)", got)
	}
	if r := f.watch(sub, "1"); r != nil {
		t.Fatalf("an up-to-date client was answered %v", names(r))
	}
	f.set(map[string]string{"a": "2", "b": "1", "c": "2"})
	if got := names(f.watch(sub, "2")); !slices.Equal(got, []string{"a@2"}) {
		t.Fatalf("after a changed: %v, want a@2 alone", got)
	}
	f.set(map[string]string{"a": "2", "c": "2"})
	r = f.watch(sub, "3")
	if len(r.GetResources()) != 0 || !slices.Equal(r.GetRemovedResources(), []string{"b"}) {
		t.Fatalf("after b went: %v removing %v, want only b removed", names(r),
			r.GetRemovedResources())
	}
}

// A wildcard subscription gets every resource, and the first request is
// answered even when there is nothing (Envoy waits for it).
func TestDeltaWildcardWatch(t *testing.T) {
	f := newDeltaFixture(t)
	f.set(map[string]string{})
	sub := new(stream.NewDeltaSubscription(nil, nil, nil, true))
	if r := f.watch(sub, ""); r == nil || len(r.GetResources()) != 0 {
		t.Fatalf("the first wildcard request: %v, want an empty answer", r)
	}
	f.set(map[string]string{"x": "1", "y": "1"})
	if got := names(f.watch(sub, "1")); !slices.Equal(got, []string{"x@1", "y@1"}) {
		t.Fatalf("wildcard: %v, want x@1, y@1", got)
	}
	f.set(map[string]string{"y": "1"})
	if r := f.watch(sub, "2"); !slices.Equal(r.GetRemovedResources(), []string{"x"}) {
		t.Fatalf("wildcard after x went: removed %v, want x", r.GetRemovedResources())
	}
}

// Every delta stream, and every state-of-the-world stream, of a group is
// sent the same marshalled bytes: a change is marshalled once, not once per
// stream (go-control-plane's SnapshotCache marshalled per response).
func TestDeltaAndSotwStreamsShareTheMarshalledBytes(t *testing.T) {
	f := newDeltaFixture(t)
	f.set(map[string]string{"a": "1"})
	r1 := f.watch(new(stream.NewDeltaSubscription([]string{"a"}, nil, nil, false)), "")
	r2 := f.watch(new(stream.NewDeltaSubscription([]string{"a"}, nil, nil, false)), "")
	out := make(chan cache.Response, 1)
	if _, err := f.c.CreateWatch(&cache.Request{Node: f.node, TypeUrl: resource.EndpointType,
		ResourceNames: []string{"a"}}, stream.NewSotwSubscription([]string{"a"}, false),
		out); err != nil {
		t.Fatal(err)
	}
	s, err := (<-out).GetDiscoveryResponse()
	if err != nil {
		t.Fatal(err)
	}
	a1, a2 := r1.GetResources()[0].GetResource(), r2.GetResources()[0].GetResource()
	if a1 != a2 || a1 != s.GetResources()[0] {
		t.Fatal("streams of one group were sent separately marshalled copies of one resource")
	}
}
