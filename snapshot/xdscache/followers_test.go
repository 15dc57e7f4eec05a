package xdscache

import (
	"context"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/config"
	"github.com/envoyproxy/go-control-plane/pkg/server/delta/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/sotw/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/stream/v3"
	"google.golang.org/grpc"
)

// The index of open watches (watchSet) reads a watch's subscription once,
// when the watch is held, on the word that go-control-plane cancels a watch
// before it changes its subscription. These streams hold it to that: real
// go-control-plane servers (state of the world, unordered and ordered ADS
// and per type; delta, ADS and per type; legacy wildcard on and off) are
// sent random requests — names, "*", none, subscribe and unsubscribe of
// "*", ACKs, stale nonces that are ignored, first requests again — while
// random publications are made; at every step each held watch's live
// subscription is still the one its index entry was made from, and no held
// watch is one the group's snapshot answers. When every stream has ended,
// no watch is left held.
func TestGoControlPlaneNeverChangesTheSubscriptionOfAHeldWatch(t *testing.T) {
	for run := range 12 {
		for _, legacy := range []bool{true, false} {
			t.Run(fmt.Sprintf("run %d legacy wildcard %v", run, legacy), func(t *testing.T) {
				heldSubscriptionsWorld(t, uint64(run), legacy)
			})
		}
	}
}

// fakeStream is a gRPC stream of requests Req and responses Resp that
// records the last nonce sent per type (state of the world and delta alike).
type fakeStream[Req any, Resp interface {
	GetTypeUrl() string
	GetNonce() string
}] struct {
	grpc.ServerStream
	ctx    context.Context
	recv   chan Req
	ended  chan struct{}
	mu     sync.Mutex
	nonces map[string]string
}

type (
	fakeSotwStream  = fakeStream[*discovery.DiscoveryRequest, *discovery.DiscoveryResponse]
	fakeDeltaStream = fakeStream[*discovery.DeltaDiscoveryRequest, *discovery.DeltaDiscoveryResponse]
)

func (s *fakeStream[Req, Resp]) Context() context.Context { return s.ctx }

func (s *fakeStream[Req, Resp]) Send(r Resp) error {
	s.mu.Lock()
	s.nonces[r.GetTypeUrl()] = r.GetNonce()
	s.mu.Unlock()
	return nil
}

func (s *fakeStream[Req, Resp]) Recv() (Req, error) {
	select {
	case r := <-s.recv:
		return r, nil
	case <-s.ctx.Done():
		var none Req
		return none, io.EOF
	}
}

func heldSubscriptionsWorld(t *testing.T, seed uint64, legacy bool) {
	rng := rand.New(rand.NewPCG(seed, 77))
	node := &corev3.Node{Id: "n"}
	c := New()
	w := &watchWorld{t: t, rng: rng, c: c, node: node, group: GroupOf(node)}
	var opts []config.XDSOption
	if !legacy {
		opts = append(opts, sotw.DeactivateLegacyWildcard())
	}
	ctx, cancel := context.WithCancel(context.Background())
	unordered := sotw.NewServer(ctx, c, nil, opts...)
	ordered := sotw.NewServer(ctx, c, nil, append(slices.Clone(opts), sotw.WithOrderedADS())...)
	deltas := delta.NewServer(ctx, c, nil, opts...)
	types := []string{resource.EndpointType, resource.ClusterType}

	var wg sync.WaitGroup
	type sotwClient struct {
		s       *fakeSotwStream
		typeURL string // "" for ADS
	}
	type deltaClient struct {
		s       *fakeDeltaStream
		typeURL string
		first   map[string]bool
	}
	var sotws []sotwClient
	var deltaStreams []deltaClient
	for _, sc := range []struct {
		srv     sotw.Server
		typeURL string
	}{{unordered, resource.AnyType}, {ordered, resource.AnyType},
		{unordered, resource.EndpointType}, {unordered, resource.ClusterType}} {
		s := &fakeSotwStream{ctx: ctx, recv: make(chan *discovery.DiscoveryRequest), ended: make(chan struct{}),
			nonces: map[string]string{}}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := sc.srv.StreamHandler(s, sc.typeURL); err != nil {
				t.Errorf("state-of-the-world stream of %q ended: %v", sc.typeURL, err)
			}
			close(s.ended)
		}()
		typeURL := sc.typeURL
		if typeURL == resource.AnyType {
			typeURL = ""
		}
		sotws = append(sotws, sotwClient{s: s, typeURL: typeURL})
	}
	for _, typeURL := range []string{resource.AnyType, resource.EndpointType} {
		s := &fakeDeltaStream{ctx: ctx, recv: make(chan *discovery.DeltaDiscoveryRequest), ended: make(chan struct{}),
			nonces: map[string]string{}}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := deltas.DeltaStreamHandler(s, typeURL); err != nil {
				t.Errorf("delta stream of %q ended: %v", typeURL, err)
			}
			close(s.ended)
		}()
		sent := typeURL
		if typeURL == resource.AnyType {
			sent = ""
		}
		deltaStreams = append(deltaStreams, deltaClient{s: s, typeURL: sent, first: map[string]bool{}})
	}

	names := func(star bool) []string {
		var out []string
		for _, n := range worldNames {
			if rng.IntN(3) == 0 {
				out = append(out, n)
			}
		}
		if star && rng.IntN(4) == 0 {
			out = append(out, "*")
		}
		rng.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
		return out
	}
	nonce := func(mu *sync.Mutex, nonces map[string]string, typeURL string) string {
		mu.Lock()
		defer mu.Unlock()
		switch r := rng.IntN(10); {
		case r < 7:
			return nonces[typeURL]
		case r < 8:
			return ""
		default:
			return "stale-" + strconv.Itoa(rng.IntN(3))
		}
	}
	for step := range 150 {
		switch r := rng.IntN(10); {
		case r < 5:
			cl := sotws[rng.IntN(len(sotws))]
			typeURL := cl.typeURL
			if typeURL == "" {
				typeURL = types[rng.IntN(len(types))]
			}
			var ns []string
			switch rng.IntN(4) {
			case 0: // none
			case 1:
				ns = []string{"*"}
			default:
				ns = names(true)
			}
			version := ""
			if rng.IntN(4) > 0 {
				version = "v"
			}
			req := &discovery.DiscoveryRequest{Node: node, TypeUrl: cl.typeURL, ResourceNames: ns,
				VersionInfo: version, ResponseNonce: nonce(&cl.s.mu, cl.s.nonces, typeURL)}
			if cl.typeURL == "" {
				req.TypeUrl = typeURL
			}
			select {
			case cl.s.recv <- req:
			case <-cl.s.ended:
				t.Fatalf("step %d: a state-of-the-world stream ended", step)
			}
		case r < 8:
			cl := deltaStreams[rng.IntN(len(deltaStreams))]
			typeURL := cl.typeURL
			if typeURL == "" {
				typeURL = types[rng.IntN(len(types))]
			}
			req := &discovery.DeltaDiscoveryRequest{Node: node, TypeUrl: cl.typeURL,
				ResponseNonce: nonce(&cl.s.mu, cl.s.nonces, typeURL)}
			if cl.typeURL == "" {
				req.TypeUrl = typeURL
			}
			if rng.IntN(3) > 0 {
				req.ResourceNamesSubscribe = names(true)
			}
			if rng.IntN(3) == 0 {
				req.ResourceNamesUnsubscribe = names(true)
			}
			if !cl.first[typeURL] && rng.IntN(2) == 0 {
				req.InitialResourceVersions = map[string]string{}
				for _, n := range names(false) {
					req.InitialResourceVersions[n] = strconv.Itoa(rng.IntN(3))
				}
			}
			cl.first[typeURL] = true
			select {
			case cl.s.recv <- req:
			case <-cl.s.ended:
				t.Fatalf("step %d: a delta stream ended", step)
			}
		default:
			w.publishRandom()
		}
		if err := heldAsIndexed(c.watches); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
	}
	cancel()
	wg.Wait()
	if err := heldAsIndexed(c.watches); err != nil {
		t.Fatalf("after the streams ended: %v", err)
	}
	c.watches.mu.Lock()
	defer c.watches.mu.Unlock()
	if n := len(c.watches.watches.held) + len(c.watches.deltas.held); n != 0 {
		t.Fatalf("watches of %d groups left held after every stream ended", n)
	}
}

// heldAsIndexed fails when a held watch's live subscription is not the one
// its index entry was read from, or a held watch is answered by its group's
// snapshot, or the index is not the one its held entries make.
func heldAsIndexed(c *watchCache) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := indexed(&c.watches); err != nil {
		return fmt.Errorf("state of the world: %w", err)
	}
	if err := indexed(&c.deltas); err != nil {
		return fmt.Errorf("delta: %w", err)
	}
	for group, held := range c.watches.held {
		for _, h := range held {
			if err := sameSubscription(h.wild, h.names(), h.w.sub.IsWildcard(),
				h.w.sub.SubscribedResources()); err != nil {
				return fmt.Errorf("state-of-the-world watch of %s: %w", h.typeURL, err)
			}
			if st := c.snaps[group]; st != nil && st.respond(h.w.req, h.w.sub) != nil {
				return fmt.Errorf("a held state-of-the-world watch of %s is answered by the "+
					"snapshot (names %v, known %v)", h.typeURL, h.w.sub.SubscribedResources(),
					h.w.sub.ReturnedResources())
			}
		}
	}
	for group, held := range c.deltas.held {
		for _, h := range held {
			if err := sameSubscription(h.wild, h.names(), h.w.sub.IsWildcard(),
				h.w.sub.SubscribedResources()); err != nil {
				return fmt.Errorf("delta watch of %s: %w", h.typeURL, err)
			}
			if st := c.snaps[group]; st != nil && st.respondDelta(h.w.req, h.w.sub) != nil {
				return fmt.Errorf("a held delta watch of %s is answered by the snapshot "+
					"(names %v, known %v)", h.typeURL, h.w.sub.SubscribedResources(),
					h.w.sub.ReturnedResources())
			}
		}
	}
	return nil
}

func sameSubscription(wild bool, names []string, liveWild bool, live map[string]struct{}) error {
	if wild != liveWild {
		return fmt.Errorf("indexed as wildcard %v, its subscription is now wildcard %v", wild,
			liveWild)
	}
	if wild {
		return nil
	}
	got := slices.Sorted(maps.Keys(live))
	want := slices.Sorted(slices.Values(names))
	if !slices.Equal(got, want) {
		return fmt.Errorf("indexed following %v, its subscription now follows %v", want, got)
	}
	return nil
}

// indexed says how s's index of followers differs from the one its held
// watches make (nil when it is exact: no watch missing, none left over, no
// empty set kept).
func indexed[W any](s *watchSet[W]) error {
	want := newWatchSet[W]()
	for group, held := range s.held {
		if len(held) == 0 {
			return fmt.Errorf("group %s kept with no watch", group)
		}
		for id, h := range held {
			var sub stream.Subscription
			if h.wild {
				sub = stream.NewSotwSubscription(nil, true)
			} else {
				sub = stream.NewSotwSubscription(h.names(), false)
			}
			want.add(group, id, h.w, h.typeURL, &sub)
		}
	}
	if len(want.follow) != len(s.follow) {
		return fmt.Errorf("followers of %d groups, held watches in %d", len(s.follow),
			len(want.follow))
	}
	for group, types := range want.follow {
		if len(types) != len(s.follow[group]) {
			return fmt.Errorf("group %s: followers of %d types, held watches of %d", group,
				len(s.follow[group]), len(types))
		}
		for typeURL, f := range types {
			g := s.follow[group][typeURL]
			if g == nil || !maps.Equal(f.all, g.all) || !maps.Equal(f.wild, g.wild) ||
				!maps.EqualFunc(f.reach(), g.reach(), maps.Equal) {
				return fmt.Errorf("group %s, %s: followers %+v, held watches make %+v", group,
					typeURL, g, f)
			}
			if err := g.tidy(); err != nil {
				return fmt.Errorf("group %s, %s: %w", group, typeURL, err)
			}
		}
	}
	return nil
}

// reach is, per name, the watches following it (through their sets).
func (f *followers) reach() map[string]map[int64]struct{} {
	out := map[string]map[int64]struct{}{}
	for n, sets := range f.named {
		out[n] = map[int64]struct{}{}
		for c := range sets {
			maps.Copy(out[n], c.ids)
		}
	}
	return out
}

// tidy says what f keeps that no watch needs: a set followed by none, two
// sets of the same names, a set missing from the index of a name it holds
// or filed under another digest.
func (f *followers) tidy() error {
	seen := map[string]bool{}
	for sum, sets := range f.sets {
		for _, c := range sets {
			key := fmt.Sprint(slices.Sorted(maps.Keys(c.names)))
			switch {
			case len(c.ids) == 0:
				return fmt.Errorf("a set of %s followed by no watch is kept", key)
			case seen[key]:
				return fmt.Errorf("two sets of %s", key)
			case c.sum != sum || sumOf(c.names) != sum:
				return fmt.Errorf("the set of %s is filed under another digest", key)
			}
			seen[key] = true
			for n := range c.names {
				if _, ok := f.named[n][c]; !ok {
					return fmt.Errorf("the set of %s is not indexed under %q", key, n)
				}
			}
		}
	}
	return nil
}

// touched finds exactly the watches typeChange.touches says a change
// touches (each once), for random watches and changes: wildcard and named,
// of several types, a type changed whole or by names.
func TestTouchedIsWhatTouchesSays(t *testing.T) {
	r := rand.New(rand.NewPCG(4, 30))
	types := []string{resource.EndpointType, resource.ClusterType, resource.RouteType}
	for run := range 500 {
		s := newWatchSet[sotwWatch]()
		subs := map[int64]cache.Subscription{}
		typeOf := map[int64]string{}
		for id := range int64(r.IntN(12)) {
			var named []string
			for _, n := range worldNames {
				if r.IntN(3) == 0 {
					named = append(named, n)
				}
			}
			sub := stream.NewSotwSubscription(named, r.IntN(4) == 0 && len(named) == 0)
			typeURL := types[r.IntN(len(types))]
			s.add("g", id, sotwWatch{}, typeURL, &sub)
			subs[id], typeOf[id] = &sub, typeURL
		}
		changed := map[string]typeChange{}
		for _, typeURL := range types {
			switch r.IntN(4) {
			case 0:
				changed[typeURL] = typeChange{all: true}
			case 1:
				names := map[string]struct{}{}
				for _, n := range append(worldNames, "other") {
					if r.IntN(3) == 0 {
						names[n] = struct{}{}
					}
				}
				changed[typeURL] = typeChange{names: names}
			}
		}
		got := s.touched("g", changed)
		var want []int64
		for id, sub := range subs {
			if changed[typeOf[id]].touches(sub) {
				want = append(want, id)
			}
		}
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Fatalf("run %d: touched %v, touches says %v (changed %+v)", run, got, want, changed)
		}
	}
}

// A lapse's publication at 1,000 streams of one constraint set over 10 task
// types, 100 streams on each task's 4 shards: which open watches it asks
// again. "walk" is the way before the index (every watch's subscription
// asked, typeChange.touches), the floor the index is measured against in
// the same run; "index" is watchSet.touched.
func BenchmarkTouchedByALapse(b *testing.B) {
	s := newWatchSet[sotwWatch]()
	subs := map[int64]cache.Subscription{}
	var id int64
	for task := range 10 {
		var names []string
		for shard := range 4 {
			names = append(names, fmt.Sprintf("task-%d/shard-%d", task, shard))
		}
		for range 100 {
			sub := stream.NewSotwSubscription(names, false)
			s.add("g", id, sotwWatch{}, resource.EndpointType, &sub)
			subs[id] = &sub
			id++
		}
	}
	changed := map[string]typeChange{resource.EndpointType: {
		names: map[string]struct{}{"task-3/shard-2": {}}}}
	b.Run("walk", func(b *testing.B) {
		for b.Loop() {
			n := 0
			s.each("g", func(id int64, _ sotwWatch) {
				if changed[resource.EndpointType].touches(subs[id]) {
					n++
				}
			})
			if n != 100 {
				b.Fatalf("%d touched", n)
			}
		}
	})
	b.Run("index", func(b *testing.B) {
		for b.Loop() {
			if n := len(s.touched("g", changed)); n != 100 {
				b.Fatalf("%d touched", n)
			}
		}
	})
}

// What holding and cancelling one watch costs (each ACK does both) for a
// stream following a task's 40 shards, among 100 such watches: "map" is the
// keeping before the index (a watch by id alone), the floor in the same run.
func BenchmarkHoldAndCancelAWatch(b *testing.B) {
	var names []string
	for shard := range 40 {
		names = append(names, fmt.Sprintf("work/shard-%d", shard))
	}
	sub := stream.NewSotwSubscription(names, false)
	b.Run("map", func(b *testing.B) {
		held := map[string]map[int64]sotwWatch{"g": {}}
		for id := range int64(100) {
			held["g"][id] = sotwWatch{}
		}
		id := int64(100)
		for b.Loop() {
			held["g"][id] = sotwWatch{}
			delete(held["g"], id)
			id++
		}
	})
	b.Run("index", func(b *testing.B) {
		s := newWatchSet[sotwWatch]()
		for id := range int64(100) {
			s.add("g", id, sotwWatch{}, resource.EndpointType, &sub)
		}
		id := int64(100)
		for b.Loop() {
			s.add("g", id, sotwWatch{}, resource.EndpointType, &sub)
			s.remove("g", id)
			id++
		}
	})
}

// Two name sets whose digests collide stay two sets: a watch is filed with
// the set of exactly its names, never with another that shares its digest.
func TestNameSetsWithOneDigestStayApart(t *testing.T) {
	f := &followers{sets: map[uint64][]*nameSet{}, named: map[string]map[*nameSet]struct{}{}}
	mine := map[string]struct{}{"work/shard-0": {}, "work/shard-1": {}}
	decoy := &nameSet{sum: sumOf(mine), names: map[string]struct{}{"a": {}, "b": {}},
		ids: map[int64]struct{}{1: {}}}
	f.sets[decoy.sum] = []*nameSet{decoy}
	if c := f.setOf(mine); c == decoy || !maps.Equal(c.names, mine) {
		t.Fatalf("names %v filed with the set of %v", slices.Sorted(maps.Keys(mine)),
			slices.Sorted(maps.Keys(c.names)))
	}
	if len(f.sets[decoy.sum]) != 2 {
		t.Fatalf("%d sets under the digest, want the decoy and mine", len(f.sets[decoy.sum]))
	}
}
