package fleet

import (
	"fmt"
	"testing"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// The delta cache's per-resource versions are the translator's content
// versions, set with the snapshot: a change alters the version of the
// resources it changed and of no other, and go-control-plane never has to
// marshal and hash the group to find out.
func TestDeltaVersionsAreContentVersions(t *testing.T) {
	h := startSyncer(t)
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("a", "b")
	h.members("a", fleettest.Member("a", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing, 5))
	h.members("b", fleettest.Member("b", "y", "s1", 1, 9002, "1.0.0", health.StatusPassing, 6))
	h.nonPassing() // the fleet is read: one publish with both tasks
	before := h.publish().snap
	vm := before.VersionMap
	for _, typ := range []string{resource.ListenerType, resource.RouteType, resource.ClusterType, resource.EndpointType} {
		if len(vm[typ]) != 2 || vm[typ]["a"] == "" || vm[typ]["b"] == "" {
			t.Fatalf("%s versions %v, want one per task", typ, vm[typ])
		}
	}
	if err := before.ConstructVersionMap(); err != nil || fmt.Sprint(before.VersionMap) != fmt.Sprint(vm) {
		t.Fatalf("ConstructVersionMap replaced the content versions: %v", err)
	}
	h.members("a") // x leaves task a: a removal, published at once
	after := h.publish().snap.VersionMap
	if after[resource.EndpointType]["a"] == vm[resource.EndpointType]["a"] {
		t.Fatal("task a's endpoints changed but kept their version")
	}
	if after[resource.EndpointType]["b"] != vm[resource.EndpointType]["b"] || after[resource.ClusterType]["a"] != vm[resource.ClusterType]["a"] {
		t.Fatal("an unchanged resource got a new version: delta clients would be sent it again")
	}
}

// BenchmarkDeltaVersionMap is what a change cost go-control-plane per
// group while a delta client was connected (marshal and hash every
// resource: here one load assignment of 1,000 endpoints), against the
// versions set with the snapshot.
func BenchmarkDeltaVersionMap(b *testing.B) {
	execs := make([]health.Executor, 1000)
	for i := range execs {
		execs[i] = health.Join(fleettest.Member("work", fmt.Sprintf("e%d", i), "s1", 1, 10000+i, "1.0.0", health.StatusPassing, 5), nil)
	}
	cla := (&translator.Builder{}).BuildPrinted("work", execs, nil, health.Dispatcher{}).CLA
	for _, bc := range []struct {
		name     string
		versions func() map[string]map[string]string
	}{
		{"hash every resource", func() map[string]map[string]string { return nil }},
		{"content versions set", func() map[string]map[string]string {
			return map[string]map[string]string{resource.EndpointType: {"work": "v1"}}
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for range b.N {
				s := &cache.Snapshot{VersionMap: bc.versions()}
				s.Resources[types.Endpoint] = cache.NewResources("v", []types.Resource{cla})
				if err := s.ConstructVersionMap(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
