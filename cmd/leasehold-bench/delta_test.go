package main

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	xdsserver "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc"

	"github.com/leasehold/leasehold/snapshot/translator"
)

// Delta streams subscribe to a task's shards by name, keep each shard's
// endpoints when another alone is resent, drop a removed resource's, and
// client 0 keeps what it got for the floor (which serves state of the
// world).
func TestDeltaStreamsFollowEachShard(t *testing.T) {
	s0, s1 := translator.ShardName(task, 0, 2), translator.ShardName(task, 1, 2)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	snaps := cache.NewSnapshotCache(false, cache.IDHash{}, nil)
	const streams = 3
	set := func(version string, shards map[string][]string) {
		t.Helper()
		var res []types.Resource
		for name, ids := range shards {
			cla := &endpointv3.ClusterLoadAssignment{}
			if err := named(t, version, name, ids).Resources[0].UnmarshalTo(cla); err != nil {
				t.Fatal(err)
			}
			res = append(res, cla)
		}
		s, err := cache.NewSnapshot(version, map[resource.Type][]types.Resource{
			resource.EndpointType: res})
		if err != nil {
			t.Fatal(err)
		}
		for i := range streams {
			if err := snaps.SetSnapshot(ctx, fmt.Sprintf("bench-%d", i), s); err != nil {
				t.Fatal(err)
			}
		}
	}
	set("1", map[string][]string{s0: {"a", "b"}, s1: {"c", "d"}})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	discovery.RegisterAggregatedDiscoveryServiceServer(g, xdsserver.NewServer(ctx, snaps, nil))
	go g.Serve(lis)
	defer g.Stop()
	ds, err := startDeltaDispatchers(ctx, lis.Addr().String(), streams, []string{task},
		map[string]int{task: 2}, *streamsPerConn)
	if err != nil {
		t.Fatal(err)
	}
	holds := func(want ...string) func(string, map[string]bool) bool {
		return func(_ string, set map[string]bool) bool {
			if len(set) != len(want) {
				return false
			}
			for _, h := range want {
				if !set[h] {
					return false
				}
			}
			return true
		}
	}
	if err := ds.awaitAll(holds("a", "b", "c", "d"), 10*time.Second); err != nil {
		t.Fatal("starting state:", err)
	}
	ds.startCapture()
	set("2", map[string][]string{s0: {"a", "b"}, s1: {"c"}}) // d lapses: shard 1 alone is resent
	if err := ds.awaitAll(holds("a", "b", "c"), 10*time.Second); err != nil {
		t.Fatalf("after shard 1 alone was resent, a client must hold a, b, c: %v", err)
	}
	if ds.goneFromAll("d").IsZero() {
		t.Fatal("d's departure was not stamped")
	}
	set("3", map[string][]string{s1: {"c"}}) // shard 0 removed
	if err := ds.awaitAll(holds("c"), 10*time.Second); err != nil {
		t.Fatalf("after shard 0 was removed, a client must hold c alone: %v", err)
	}
	base, since := ds.stopCapture()
	if base == nil || len(base.Resources) != 2 || len(since) == 0 {
		t.Fatalf("client 0 kept a base of %v and %d responses: want both shards and the "+
			"responses since", base, len(since))
	}
	plan, err := planFloor(base, since)
	if err != nil {
		t.Fatal(err)
	}
	if len(plan.removed) == 0 || plan.removed[0] != "d" {
		t.Fatalf("the floor's plan from delta responses removes %v first: want d", plan.removed)
	}
}
