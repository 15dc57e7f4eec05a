package xdscache

import (
	"sort"
	"sync"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// watchCache holds one snapshot per group and the open watches, state of
// the world (here) and delta (delta.go), answering each with what its
// subscription lacks. Both kinds send the same marshalled resources
// (anyMemo): a change is marshalled once, whatever the number of streams.
type watchCache struct {
	groupOf func(*corev3.Node) string

	mu      sync.Mutex
	anys    anyMemo
	snaps   map[string]*groupState
	watches watchSet[sotwWatch]
	deltas  watchSet[deltaWatch]
	nextID  int64
}

type groupState struct {
	group    string
	snap     *cache.Snapshot
	versions map[string]map[string]string // type URL → name → content version
	wires    map[string][]byte            // load assignments already marshalled, by name
	anys     *anyMemo
}

// anyMemo holds each resource marshalled once (deterministically, so every
// replica sends the same bytes) for every stream and group that sends it.
type anyMemo struct {
	byKey map[string]*anypb.Any // type URL, name, version
}

// deterministic marshals as every replica does. A load assignment costs a
// copy of its endpoints' encodings: the Builder holds them encoded
// (translator/encoded.go), so none is marshalled again.
var deterministic = proto.MarshalOptions{Deterministic: true}

// marshalled returns the resource as an Any, marshalling it only the first
// time its version is sent; c.mu is held.
func (st *groupState) marshalled(typeURL, name, version string, r proto.Message) *anypb.Any {
	key := typeURL + "\x00" + name + "\x00" + version
	if a, ok := st.anys.byKey[key]; ok {
		return a
	}
	b := st.wires[name]
	if typeURL != resource.EndpointType || b == nil {
		var err error
		if b, err = deterministic.Marshal(r); err != nil {
			return nil // validated protos always marshal
		}
	}
	// What anypb.MarshalFrom writes, without marshalling again.
	a := &anypb.Any{TypeUrl: anyURLPrefix + string(r.ProtoReflect().Descriptor().FullName()),
		Value: b}
	st.anys.byKey[key] = a
	return a
}

const anyURLPrefix = "type.googleapis.com/"

type sotwWatch struct {
	req  *cache.Request
	sub  cache.Subscription
	out  chan cache.Response
	done chan struct{} // closed when the server cancels the watch
}

// deliver hands a response to the server without ever blocking the cache: a
// full channel (an ADS stream busy in CreateWatch) gets it from a goroutine
// that gives up when the watch is cancelled (done closed).
func deliver[R any](out chan R, done <-chan struct{}, resp R) {
	select {
	case out <- resp:
	default:
		go func() {
			select {
			case out <- resp:
			case <-done:
			}
		}()
	}
}

// answered is the cancel of a watch answered at once: it only closes done.
func answered(done chan struct{}) func() {
	var once sync.Once
	return func() { once.Do(func() { close(done) }) }
}

// keep holds w, of typeURL following sub, among group's open watches (c.mu
// is held) and returns its cancel, which closes done once and forgets w.
// State-of-the-world and delta watches share it.
func keep[W any](c *watchCache, watches *watchSet[W], group string, w W, typeURL string,
	sub cache.Subscription, done chan struct{}) func() {
	c.nextID++
	id := c.nextID
	watches.add(group, id, w, typeURL, sub)
	closeDone := answered(done)
	return func() {
		closeDone()
		c.mu.Lock()
		defer c.mu.Unlock()
		watches.remove(group, id)
	}
}

func newWatchCache(groupOf func(*corev3.Node) string) *watchCache {
	return &watchCache{
		groupOf: groupOf,
		snaps:   map[string]*groupState{},
		watches: newWatchSet[sotwWatch](),
		deltas:  newWatchSet[deltaWatch](),
		anys:    anyMemo{byKey: map[string]*anypb.Any{}},
	}
}

func (c *watchCache) CreateWatch(req *cache.Request, sub cache.Subscription,
	out chan cache.Response) (func(), error) {
	group := c.groupOf(req.GetNode())
	w := sotwWatch{req: req, sub: sub, out: out, done: make(chan struct{})}
	c.mu.Lock()
	defer c.mu.Unlock()
	if st := c.snaps[group]; st != nil {
		if resp := st.respond(req, sub); resp != nil {
			deliver(w.out, w.done, resp)
			return answered(w.done), nil
		}
	}
	return keep(c, &c.watches, group, w, req.GetTypeUrl(), sub, w.done), nil
}

func (c *watchCache) set(group string, snap *cache.Snapshot, versions map[string]map[string]string,
	wires map[string][]byte) {
	st := &groupState{group: group, snap: snap, versions: versions, wires: wires, anys: &c.anys}
	c.mu.Lock()
	defer c.mu.Unlock()
	// A watch still open was not answered by the previous publication, and
	// its answer depends only on the versions of the resources it follows;
	// so only the watches following a resource that changed are asked again
	// (a lapse in one task's shard asks that shard's streams, not every
	// stream of the constraint set), found by the index of what each
	// follows (watchSet), not by walking them all.
	prev := c.snaps[group]
	c.snaps[group] = st
	c.pruneAnys()
	if prev == nil {
		c.watches.each(group, func(id int64, w sotwWatch) {
			if resp := st.respond(w.req, w.sub); resp != nil {
				deliver(w.out, w.done, resp)
				c.watches.remove(group, id)
			}
		})
		c.deltas.each(group, func(id int64, w deltaWatch) {
			if resp := st.respondDelta(w.req, w.sub); resp != nil {
				deliver(w.out, w.done, resp)
				c.deltas.remove(group, id)
			}
		})
		return
	}
	changed := changedNames(prev.versions, versions)
	for _, id := range c.watches.touched(group, changed) {
		w := c.watches.held[group][id].w
		if resp := st.respond(w.req, w.sub); resp != nil {
			deliver(w.out, w.done, resp)
			c.watches.remove(group, id)
		}
	}
	for _, id := range c.deltas.touched(group, changed) {
		w := c.deltas.held[group][id].w
		if resp := st.respondDelta(w.req, w.sub); resp != nil {
			deliver(w.out, w.done, resp)
			c.deltas.remove(group, id)
		}
	}
}

// typeChange is what changed of one type between two publications of a
// group: every resource (all: the type was served in only one of them) or
// the names whose version differs, added and removed ones included.
type typeChange struct {
	all   bool
	names map[string]struct{}
}

// changedNames is, per type URL, what changed from prev's versions to cur's.
func changedNames(prev, cur map[string]map[string]string) map[string]typeChange {
	out := map[string]typeChange{}
	for typeURL, cv := range cur {
		pv, ok := prev[typeURL]
		if !ok {
			out[typeURL] = typeChange{all: true}
			continue
		}
		var names map[string]struct{}
		note := func(name string) {
			if names == nil {
				names = map[string]struct{}{}
			}
			names[name] = struct{}{}
		}
		for name, v := range cv {
			if old, had := pv[name]; !had || old != v {
				note(name)
			}
		}
		for name := range pv {
			if _, has := cv[name]; !has {
				note(name)
			}
		}
		if names != nil {
			out[typeURL] = typeChange{names: names}
		}
	}
	for typeURL := range prev {
		if _, ok := cur[typeURL]; !ok {
			out[typeURL] = typeChange{all: true}
		}
	}
	return out
}

// touches reports whether a watch with subscription sub follows anything
// of the change: a wildcard watch follows every resource of its type. It is
// what watchSet.touched finds for all of a group's watches at once (its
// specification: the tests hold one to the other).
func (tc typeChange) touches(sub cache.Subscription) bool {
	if tc.all {
		return true
	}
	if len(tc.names) == 0 {
		return false
	}
	if sub.IsWildcard() {
		return true
	}
	subs := sub.SubscribedResources()
	if len(tc.names) <= len(subs) {
		for name := range tc.names {
			if _, ok := subs[name]; ok {
				return true
			}
		}
		return false
	}
	for name := range subs {
		if _, ok := tc.names[name]; ok {
			return true
		}
	}
	return false
}

func (c *watchCache) clear(group string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.snaps, group)
	c.pruneAnys()
}

// holds reports whether group has an open watch.
func (c *watchCache) holds(group string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.watches.held[group]) > 0 || len(c.deltas.held[group]) > 0
}

// pruneAnys forgets marshalled resources no group serves any more; c.mu is held.
func (c *watchCache) pruneAnys() {
	if len(c.anys.byKey) < 64 {
		return
	}
	live := map[string]bool{}
	for _, st := range c.snaps {
		for typeURL, vs := range st.versions {
			for name, v := range vs {
				live[typeURL+"\x00"+name+"\x00"+v] = true
			}
		}
	}
	for k := range c.anys.byKey {
		if !live[k] {
			delete(c.anys.byKey, k)
		}
	}
}

// snapshot returns a group's current snapshot.
func (c *watchCache) snapshot(group string) (*cache.Snapshot, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.snaps[group]
	if st == nil {
		return nil, false
	}
	return st.snap, true
}

// respond builds the response a watch needs now, or nil if the client
// already has everything it subscribed to. The response's version_info is
// the type's content version (equal on every replica); each resource's
// returned version is its own content hash, so only changed resources are
// sent for types that allow partial responses (EDS, RDS); listeners and
// clusters are always sent whole, as the protocol requires.
func (st *groupState) respond(req *cache.Request, sub cache.Subscription) cache.Response {
	typeURL := req.GetTypeUrl()
	versions, ok := st.versions[typeURL]
	if !ok {
		return nil // a type leasehold does not serve: never answered
	}
	typeVersion := st.snap.GetVersion(typeURL)
	resources := st.snap.GetResourcesAndTTL(typeURL)
	known := sub.ReturnedResources()
	var wanted []string
	if sub.IsWildcard() {
		for name := range resources {
			wanted = append(wanted, name)
		}
	} else {
		for name := range sub.SubscribedResources() {
			if _, ok := resources[name]; ok {
				wanted = append(wanted, name)
			}
		}
	}
	sort.Strings(wanted)
	var changed []string
	for _, name := range wanted {
		if known[name] != versions[name] {
			changed = append(changed, name)
		}
	}
	wantedSet := make(map[string]bool, len(wanted))
	for _, n := range wanted {
		wantedSet[n] = true
	}
	removed := false
	for name := range known {
		if !wantedSet[name] {
			removed = true
		}
	}
	full := cache.ResourceRequiresFullStateInSotw(typeURL)
	initial := req.GetVersionInfo() == ""
	// (A client failing over from another replica is answered too, with the
	// same version and bytes it had: the server pruned what it knows when it
	// unsubscribed, so "knows nothing" cannot be told apart from "has it".)
	if len(changed) == 0 && !(full && removed) && !(initial && len(known) == 0) {
		return nil
	}
	send := changed
	if full {
		send = wanted
	}
	// After this response the client holds every wanted resource at its
	// current version (the unchanged ones it already had).
	returned := make(map[string]string, len(wanted))
	for _, name := range wanted {
		returned[name] = versions[name]
	}
	out := &discovery.DiscoveryResponse{VersionInfo: typeVersion, TypeUrl: typeURL}
	for _, name := range send {
		if a := st.marshalled(typeURL, name, versions[name], resources[name].Resource); a != nil {
			out.Resources = append(out.Resources, a)
		}
	}
	return &cache.PassthroughResponse{Request: req, DiscoveryResponse: out,
		ReturnedResources: returned}
}
