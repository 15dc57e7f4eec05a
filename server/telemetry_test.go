package server

import (
	"context"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/leasehold/leasehold/snapshot/fleet"
)

// A lapse's publication waits only for the streams of its own constraint
// set that follow a load assignment it changed (or all of them, as a
// wildcard); a stream that ended is no longer looked at.
func TestALapseWaitsOnlyForItsSetsStreamsThatFollowIt(t *testing.T) {
	x := &XDS{streams: map[int64]*StreamInfo{}}
	x.latest = map[string]context.Context{}
	add := func(key int64, set string, eds bool, subscribed ...string) {
		info := &StreamInfo{Group: set, key: key, Types: map[string]*TypeInfo{}}
		if eds {
			info.Types[resource.EndpointType] = &TypeInfo{Subscribed: subscribed}
		}
		x.addStream(key, info)
	}
	add(1, "a", true, "work/shard-0")
	add(2, "a", true, "work/shard-1")  // follows another shard
	add(3, "b", true, "work/shard-0")  // another constraint set
	add(4, "a", true)                  // a wildcard
	add(5, "a", false)                 // no endpoints asked for
	add(-1, "a", true, "work/shard-0") // the delta stream of the same number
	waiting := func() []int64 {
		t.Helper()
		x.lapses = nil
		x.onPublish(fleet.Publication{Group: "a", LapsedAt: time.Now(),
			RemovedLoads: []string{"work/shard-0"}})
		if len(x.lapses) == 0 {
			return nil
		}
		return slices.Sorted(maps.Keys(x.lapses[0].waiting))
	}
	if got := waiting(); !slices.Equal(got, []int64{-1, 1, 4}) {
		t.Fatalf("waiting for streams %v, want -1, 1 and 4", got)
	}
	x.dropStream(1)
	x.dropStream(-1)
	if got := waiting(); !slices.Equal(got, []int64{4}) {
		t.Fatalf("after streams 1 and -1 ended: waiting for %v, want 4", got)
	}
	x.dropStream(4)
	if got := waiting(); got != nil {
		t.Fatalf("no stream of set a follows shard 0: waiting for %v", got)
	}
	if _, ok := x.bySet["a"]; !ok || len(x.bySet["a"]) != 2 {
		t.Fatalf("set a holds %v, want streams 2 and 5", x.bySet["a"])
	}
	x.dropStream(2)
	x.dropStream(5)
	if _, ok := x.bySet["a"]; ok {
		t.Fatal("an empty set is kept")
	}
}
