package server

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/leasehold/leasehold/health"
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
			info.Types[resource.EndpointType] = &TypeInfo{Subscribed: subscribed,
				Wildcard: len(subscribed) == 0}
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
	if got := x.followers["a"]; len(got) != 1 || len(got["work/shard-1"]) != 1 {
		t.Fatalf("set a's followers %v, want stream 2 of shard 1 alone", got)
	}
	x.dropStream(2)
	x.dropStream(5)
	if _, ok := x.followers["a"]; ok {
		t.Fatal("an empty set is kept")
	}
}

// The followers index is exact after any sequence of streams opening with or
// without endpoints asked for, changing what they follow (names, a wildcard,
// none) and ending: the streams a lapse waits for are those a walk of every
// stream finds.
func TestFollowersStayExactWhateverStreamsDo(t *testing.T) {
	r := rand.New(rand.NewPCG(30, 1))
	x := &XDS{streams: map[int64]*StreamInfo{}}
	x.latest = map[string]context.Context{}
	sets, names := []string{"a", "b"}, []string{"w/shard-0", "w/shard-1", "w/shard-2", "v"}
	pick := func() []string {
		var out []string
		for _, n := range names {
			if r.IntN(3) == 0 {
				out = append(out, n)
			}
		}
		return out
	}
	// walk is what a lapse of set removing load waits for, by every stream.
	walk := func(set, load string) []int64 {
		var out []int64
		for key, info := range x.streams {
			tt := info.Types[resource.EndpointType]
			if info.Group != set || tt == nil {
				continue
			}
			if tt.Wildcard || slices.Contains(tt.Subscribed, load) {
				out = append(out, key)
			}
		}
		slices.Sort(out)
		return out
	}
	for step := range 2000 {
		key := int64(r.IntN(20) - 10)
		switch op := r.IntN(4); {
		case op == 0: // a stream (re)opens, asking for endpoints or not
			info := &StreamInfo{Group: sets[r.IntN(2)], key: key, Types: map[string]*TypeInfo{}}
			if r.IntN(2) == 0 {
				names := pick()
				info.Types[resource.EndpointType] = &TypeInfo{Subscribed: names,
					Wildcard: len(names) == 0}
			}
			x.addStream(key, info)
		case op == 1:
			x.dropStream(key)
		default: // a request changes what it follows (endpoints or another type)
			info := x.streams[key]
			if info == nil {
				info = &StreamInfo{Group: sets[r.IntN(2)], key: key, Types: map[string]*TypeInfo{}}
			}
			typ := resource.EndpointType
			if r.IntN(4) == 0 {
				typ = resource.ClusterType
			}
			// as the request callbacks do, state of the world or delta
			// (names, none, "*"; subscribed and unsubscribed)
			tt := info.typeInfo(typ)
			names := pick()
			if r.IntN(5) == 0 {
				names = append(names, "*")
			}
			if r.IntN(2) == 0 {
				x.sotwRequest(info, typ, tt, names, tt.sentNonce)
			} else {
				x.deltaRequest(info, typ, tt, names, pick())
			}
		}
		for _, set := range sets {
			for _, load := range names {
				x.lapses = nil
				x.onPublish(fleet.Publication{Group: set, LapsedAt: time.Now(),
					RemovedLoads: []string{load}})
				var got []int64
				if len(x.lapses) > 0 {
					got = slices.Sorted(maps.Keys(x.lapses[0].waiting))
				}
				if want := walk(set, load); !slices.Equal(got, want) {
					t.Fatalf("step %d: a lapse of %s in set %s waits for %v, every stream's walk "+
						"finds %v", step, load, set, got, want)
				}
			}
		}
	}
}

// bareXDS is an XDS with no syncer or server behind it, for driving its
// request callbacks directly.
func bareXDS() *XDS {
	x := &XDS{subs: nopSubscriber{}, log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		streams: map[int64]*StreamInfo{}, auth: map[int64]*streamAuth{},
		conns: map[int64]streamConn{}}
	x.latest = map[string]context.Context{}
	return x
}

// nopSubscriber is a syncer that takes no notice of constraint sets.
type nopSubscriber struct{}

func (nopSubscriber) Subscribe(health.Dispatcher)   {}
func (nopSubscriber) Unsubscribe(health.Dispatcher) {}

// A stream whose first endpoints request names nothing (a wildcard, SotW or
// delta) follows every load assignment, as the request callbacks index it:
// a lapse of its set waits for it. (The index is filled by the callbacks,
// not by a StreamInfo made with its endpoints type already there.)
func TestALapseWaitsForAStreamAskingEveryEndpoint(t *testing.T) {
	x := bareXDS()
	cb := x.callbacks()
	n := node("wild", nil)
	if err := cb.StreamRequestFunc(7, &discovery.DiscoveryRequest{Node: n,
		TypeUrl: resource.EndpointType}); err != nil {
		t.Fatal(err)
	}
	if err := cb.StreamDeltaRequestFunc(8, &discovery.DeltaDiscoveryRequest{Node: n,
		TypeUrl: resource.EndpointType}); err != nil {
		t.Fatal(err)
	}
	// and one naming a load assignment, then another
	if err := cb.StreamRequestFunc(9, &discovery.DiscoveryRequest{Node: n,
		TypeUrl: resource.EndpointType, ResourceNames: []string{"other"}}); err != nil {
		t.Fatal(err)
	}
	x.mu.Lock()
	group := x.streams[7].Group
	x.mu.Unlock()
	x.onPublish(fleet.Publication{Group: group, LapsedAt: time.Now(), RemovedLoads: []string{"work"}})
	x.mu.Lock()
	defer x.mu.Unlock()
	var got []int64
	if len(x.lapses) > 0 {
		got = slices.Sorted(maps.Keys(x.lapses[0].waiting))
	}
	if want := []int64{streamKey(8, true), streamKey(7, false)}; !slices.Equal(got, want) {
		t.Fatalf("a lapse of work waits for streams %v, want the wildcards %v", got, want)
	}
}

// A lapse waits for exactly the streams go-control-plane (legacy wildcard
// on, as NewXDS serves) will push the removal to: a stream that is a
// wildcard by go-control-plane's rules follows every load assignment,
// whatever names it also subscribes; one that subscribes nothing follows
// none. Each case is a stream's endpoints requests, in order; the lapse
// removes "work".
func TestALapseWaitsForTheStreamsGoControlPlaneTreatsAsWildcard(t *testing.T) {
	sotw := func(names ...string) any {
		return &discovery.DiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNames: names}
	}
	delta := func(sub, unsub []string) any {
		return &discovery.DeltaDiscoveryRequest{TypeUrl: resource.EndpointType,
			ResourceNamesSubscribe: sub, ResourceNamesUnsubscribe: unsub}
	}
	for _, tc := range []struct {
		name string
		reqs []any
		wait bool
	}{
		// delta, legacy wildcard: a first request naming nothing stays a
		// wildcard when it later subscribes a name (stream.Subscription
		// UpdateResourceSubscriptions), until it unsubscribes "*"
		{"delta wildcard, then a name", []any{delta(nil, nil), delta([]string{"other"}, nil)}, true},
		{"delta explicit *", []any{delta([]string{"*"}, nil)}, true},
		{"delta *, and a name", []any{delta([]string{"*", "other"}, nil)}, true},
		{"delta wildcard, then a name, then * unsubscribed",
			[]any{delta(nil, nil), delta([]string{"other"}, nil), delta(nil, []string{"*"})}, false},
		{"sotw explicit *", []any{sotw("*")}, true},
		{"sotw *, and a name", []any{sotw("*", "other")}, true},
		// SotW: once a request named something, a request naming nothing
		// subscribes nothing (it is no longer a legacy wildcard)
		{"sotw a name, then nothing", []any{sotw("other"), sotw()}, false},
		{"sotw wildcard (control)", []any{sotw()}, true},
		{"sotw a name (control)", []any{sotw("other")}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := bareXDS()
			cb := x.callbacks()
			n := node("wild", nil)
			var key int64
			for _, r := range tc.reqs {
				var err error
				switch r := r.(type) {
				case *discovery.DiscoveryRequest:
					r.Node, key = n, streamKey(7, false)
					err = cb.StreamRequestFunc(7, r)
				case *discovery.DeltaDiscoveryRequest:
					r.Node, key = n, streamKey(7, true)
					err = cb.StreamDeltaRequestFunc(7, r)
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			x.mu.Lock()
			group := x.streams[key].Group
			x.mu.Unlock()
			x.onPublish(fleet.Publication{Group: group, LapsedAt: time.Now(),
				RemovedLoads: []string{"work"}})
			x.mu.Lock()
			defer x.mu.Unlock()
			var waiting []int64
			if len(x.lapses) > 0 {
				waiting = slices.Sorted(maps.Keys(x.lapses[0].waiting))
			}
			if got := slices.Contains(waiting, key); got != tc.wait {
				t.Errorf("the lapse waits for the stream: %v, want %v (followers %v)", got,
					tc.wait, x.followers[group])
			}
		})
	}
}

// A state-of-the-world request whose nonce is not the last response's is
// ignored, as go-control-plane ignores it: what the stream follows stays.
func TestAStaleRequestChangesNothingFollowed(t *testing.T) {
	x := &XDS{streams: map[int64]*StreamInfo{}}
	info := &StreamInfo{Group: "a", key: 1, Types: map[string]*TypeInfo{}}
	x.addStream(1, info)
	tt := info.typeInfo(resource.EndpointType)
	x.sotwRequest(info, resource.EndpointType, tt, []string{"w/shard-0"}, "")
	tt.watchNonce = "2" // as a response sent with nonce 2 leaves it
	x.sotwRequest(info, resource.EndpointType, tt, []string{"w/shard-1"}, "1")
	if !slices.Equal(tt.Subscribed, []string{"w/shard-0"}) || len(x.followers["a"]["w/shard-1"]) > 0 {
		t.Fatalf("a stale request moved the stream to %v (followers %v)", tt.Subscribed,
			x.followers["a"])
	}
	x.sotwRequest(info, resource.EndpointType, tt, []string{"w/shard-1"}, "2")
	if !slices.Equal(tt.Subscribed, []string{"w/shard-1"}) || len(x.followers["a"]["w/shard-1"]) != 1 {
		t.Fatalf("the current request left the stream at %v (followers %v)", tt.Subscribed,
			x.followers["a"])
	}
}

// A delta wildcard stream that subscribes names and unsubscribes them again
// keeps nothing of them: go-control-plane's own subscription marks each
// unsubscribed name "returned" until its next response replaces that map,
// but leasehold's copy never sees a response.
func TestADeltaWildcardUnsubscribingNamesHoldsNoMemoryForThem(t *testing.T) {
	x := &XDS{streams: map[int64]*StreamInfo{}}
	info := &StreamInfo{Group: "a", key: 1, Types: map[string]*TypeInfo{}}
	x.addStream(1, info)
	tt := info.typeInfo(resource.EndpointType)
	x.deltaRequest(info, resource.EndpointType, tt, nil, nil) // wildcard
	for i := range 1000 {
		n := []string{fmt.Sprintf("junk-%08d-%s", i, strings.Repeat("x", 200))}
		x.deltaRequest(info, resource.EndpointType, tt, n, nil)
		x.deltaRequest(info, resource.EndpointType, tt, nil, n)
	}
	if len(tt.Subscribed) != 0 {
		t.Fatalf("subscribed %d", len(tt.Subscribed))
	}
	if n := len(tt.sub.ReturnedResources()); n != 0 {
		t.Fatalf("after 1000 names subscribed and unsubscribed, the stream's copy of the "+
			"subscription holds %d of them (about %d KB), for as long as the stream lives", n, n*220/1024)
	}
}

// The leasehold.dispatchers gauge counts the open streams by mode, both
// modes always exported, and follows a stream that ends.
func TestTheDispatchersGaugeCountsOpenStreamsByMode(t *testing.T) {
	o := startObservedXDS(t)
	gauge := func() map[string]int64 {
		g, ok := o.metric("leasehold.dispatchers").(metricdata.Gauge[int64])
		if !ok {
			t.Fatal("leasehold.dispatchers is not exported as a gauge")
		}
		out := map[string]int64{}
		for _, dp := range g.DataPoints {
			mode, _ := dp.Attributes.Value("mode")
			out[mode.AsString()] = dp.Value
		}
		return out
	}
	if got := gauge(); !maps.Equal(got, map[string]int64{"sotw": 0, "delta": 0}) {
		t.Fatalf("no stream: %v, want both modes at 0", got)
	}
	s1 := o.ads(node("sotw-1", nil))
	s1.Subscribe(resource.EndpointType, "work")
	s1.ACK(s1.Next(), "work")
	s2 := o.ads(node("sotw-2", nil))
	s2.Subscribe(resource.EndpointType, "work")
	s2.ACK(s2.Next(), "work")
	d := o.delta(node("delta-1", nil))
	d.Subscribe(resource.EndpointType, "work")
	d.ACK(d.Next())
	if got := gauge(); !maps.Equal(got, map[string]int64{"sotw": 2, "delta": 1}) {
		t.Fatalf("two SotW streams and a delta one: %v", got)
	}
	s1.Close()
	deadline := time.Now().Add(5 * time.Second)
	for got := gauge(); got["sotw"] != 1; got = gauge() {
		if time.Now().After(deadline) {
			t.Fatalf("a SotW stream closed: %v, want sotw 1", got)
		}
		<-time.After(10 * time.Millisecond) // the gauge has no watch API
	}
	if got := gauge(); !maps.Equal(got, map[string]int64{"sotw": 1, "delta": 1}) {
		t.Fatalf("after one SotW stream closed: %v", got)
	}
}
