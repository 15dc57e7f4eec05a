// Package xdscache is the cache the xDS server serves from: the snapshots
// the syncer publishes per constraint set, the state-of-the-world watches
// answered per resource, the forms of endpoint metadata derived per
// dispatcher (forms.go), and how a dispatcher's node maps to its group
// (node.go).
package xdscache

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// Cache is the cache the xDS server serves from: state-of-the-world
// watches are answered per resource by sotwCache (a response carries only the
// resources the client lacks, so a change of one task type never resends the
// others'); delta watches and REST fetches by go-control-plane's
// SnapshotCache, which already versions each resource by content hash.
// Dispatchers asking for compact endpoint metadata are served from a group
// of their own, derived from their constraint set's (forms).
type Cache struct {
	sotw  *sotwCache
	delta cache.SnapshotCache
	forms formCache
}

var _ cache.Cache = (*Cache)(nil)

// New returns an empty cache; dispatchers' nodes are grouped by constraint
// set (GroupOf).
func New() *Cache {
	return &Cache{
		sotw: newSotwCache(GroupOf),
		// ads=false: go-control-plane's ADS mode never answers a request
		// for a subset of a type's names, and gRPC clients ask for exact names.
		delta: cache.NewSnapshotCache(false, nodeGroups{}, nil),
	}
}

// nodeGroups is GroupOf as go-control-plane's NodeHash.
type nodeGroups struct{}

func (nodeGroups) ID(node *corev3.Node) string { return GroupOf(node) }

// Snapshot is the snapshot set last for group.
func (c *Cache) Snapshot(group string) (*cache.Snapshot, bool) { return c.sotw.snapshot(group) }

// formCache is what derived groups are made from; the zero value is ready.
// A form, once asked for, is derived at every publication of its constraint
// set until the set is cleared (at most two forms per set). mu is held
// across the caches' updates so a form is never derived from an older
// snapshot than the one set last; the delta cache's sends under it do not
// block (a delta stream's channel holds more responses than it can have
// watches).
type formCache struct {
	mu    sync.Mutex
	bases map[string]groupSnapshot                   // constraint set → its latest snapshot
	used  map[string]map[EndpointMetadata]*formState // constraint set → forms asked for
}

type groupSnapshot struct {
	snap     *cache.Snapshot
	versions map[string]map[string]string
}

func (c *Cache) CreateWatch(req *cache.Request, sub cache.Subscription, out chan cache.Response) (func(), error) {
	if err := c.useForm(context.Background(), req.GetNode()); err != nil {
		return nil, err
	}
	return c.sotw.CreateWatch(req, sub, out)
}

func (c *Cache) CreateDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription, out chan cache.DeltaResponse) (func(), error) {
	if err := c.useForm(context.Background(), req.GetNode()); err != nil {
		return nil, err
	}
	return c.delta.CreateDeltaWatch(req, sub, out)
}

func (c *Cache) Fetch(ctx context.Context, req *cache.Request) (cache.Response, error) {
	if err := c.useForm(ctx, req.GetNode()); err != nil {
		return nil, err
	}
	return c.delta.Fetch(ctx, req)
}

// useForm makes sure the group of a node asking for compact endpoint
// metadata is derived, now and on every later publication of its
// constraint set.
func (c *Cache) useForm(ctx context.Context, node *corev3.Node) error {
	if f, err := EndpointMetadataOf(node); err != nil || f == MetadataFull {
		return nil // the default, or refused by the server before it asks
	}
	base, f := splitFormGroup(GroupOf(node))
	if f == MetadataFull {
		return nil // invalid constraints ("invalid"): the server refuses them first
	}
	c.forms.mu.Lock()
	defer c.forms.mu.Unlock()
	if c.forms.used[base][f] != nil {
		return nil
	}
	if c.forms.used == nil {
		c.forms.used = map[string]map[EndpointMetadata]*formState{}
	}
	if c.forms.used[base] == nil {
		c.forms.used[base] = map[EndpointMetadata]*formState{}
	}
	fs := &formState{form: f}
	c.forms.used[base][f] = fs
	if p, ok := c.forms.bases[base]; ok {
		return c.setForm(ctx, base, fs, p)
	}
	return nil
}

// Set publishes a group's snapshot, and the forms derived from it;
// versions holds each resource's content version by type URL and name.
func (c *Cache) Set(ctx context.Context, group string, snap *cache.Snapshot, versions map[string]map[string]string) error {
	c.forms.mu.Lock()
	defer c.forms.mu.Unlock()
	if err := c.delta.SetSnapshot(ctx, group, snap); err != nil {
		return err
	}
	c.sotw.set(group, snap, versions)
	p := groupSnapshot{snap: snap, versions: versions}
	if c.forms.bases == nil {
		c.forms.bases = map[string]groupSnapshot{}
	}
	c.forms.bases[group] = p
	var errs []error
	for _, fs := range c.forms.used[group] {
		errs = append(errs, c.setForm(ctx, group, fs, p))
	}
	return errors.Join(errs...)
}

// setForm publishes fs's form of p; c.forms.mu is held.
func (c *Cache) setForm(ctx context.Context, base string, fs *formState, p groupSnapshot) error {
	snap, versions := fs.derive(p.snap, p.versions)
	group := FormGroup(base, fs.form)
	if err := c.delta.SetSnapshot(ctx, group, snap); err != nil {
		return fmt.Errorf("%s: %w", group, err)
	}
	c.sotw.set(group, snap, versions)
	return nil
}

// Clear drops a group and the forms derived from it.
func (c *Cache) Clear(group string) {
	c.forms.mu.Lock()
	defer c.forms.mu.Unlock()
	for f := range c.forms.used[group] {
		c.delta.ClearSnapshot(FormGroup(group, f))
		c.sotw.clear(FormGroup(group, f))
	}
	delete(c.forms.used, group)
	delete(c.forms.bases, group)
	c.delta.ClearSnapshot(group)
	c.sotw.clear(group)
}

// sotwCache holds one snapshot per group and the open state-of-the-world
// watches, answering each with what its subscription lacks.
type sotwCache struct {
	groupOf func(*corev3.Node) string

	mu      sync.Mutex
	anys    anyMemo
	snaps   map[string]*groupState
	watches map[string]map[int64]sotwWatch
	nextID  int64
}

type groupState struct {
	group    string
	snap     *cache.Snapshot
	versions map[string]map[string]string // type URL → name → content version
	anys     *anyMemo
}

// anyMemo holds each resource marshalled once (deterministically, so every
// replica sends the same bytes) for every stream and group that sends it.
type anyMemo struct {
	byKey map[string]*anypb.Any // type URL, name, version
	// Load assignments are encoded incrementally: one encoder per group and
	// name, since each group's Builder keeps its own endpoint messages.
	encoders map[string]*claEncoder
}

// marshalled returns the resource as an Any, marshalling it only the first
// time its version is sent; c.mu is held.
func (st *groupState) marshalled(typeURL, name, version string, r proto.Message) *anypb.Any {
	key := typeURL + "\x00" + name + "\x00" + version
	if a, ok := st.anys.byKey[key]; ok {
		return a
	}
	var b []byte
	var err error
	if cla, ok := r.(*endpointv3.ClusterLoadAssignment); ok {
		ek := st.group + "\x00" + name
		enc := st.anys.encoders[ek]
		if enc == nil {
			enc = &claEncoder{}
			st.anys.encoders[ek] = enc
		}
		b, err = enc.marshal(cla)
	} else {
		b, err = deterministic.Marshal(r)
	}
	if err != nil {
		return nil // validated protos always marshal
	}
	// What anypb.MarshalFrom writes, without marshalling again.
	a := &anypb.Any{TypeUrl: anyURLPrefix + string(r.ProtoReflect().Descriptor().FullName()), Value: b}
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
// that gives up when the watch is cancelled.
func (w sotwWatch) deliver(resp cache.Response) {
	select {
	case w.out <- resp:
	default:
		go func() {
			select {
			case w.out <- resp:
			case <-w.done:
			}
		}()
	}
}

func newSotwCache(groupOf func(*corev3.Node) string) *sotwCache {
	return &sotwCache{groupOf: groupOf, snaps: map[string]*groupState{}, watches: map[string]map[int64]sotwWatch{}, anys: anyMemo{byKey: map[string]*anypb.Any{}, encoders: map[string]*claEncoder{}}}
}

func (c *sotwCache) CreateWatch(req *cache.Request, sub cache.Subscription, out chan cache.Response) (func(), error) {
	group := c.groupOf(req.GetNode())
	w := sotwWatch{req: req, sub: sub, out: out, done: make(chan struct{})}
	var once sync.Once
	c.mu.Lock()
	defer c.mu.Unlock()
	if st := c.snaps[group]; st != nil {
		if resp := st.respond(req, sub); resp != nil {
			w.deliver(resp)
			return func() { once.Do(func() { close(w.done) }) }, nil
		}
	}
	c.nextID++
	id := c.nextID
	if c.watches[group] == nil {
		c.watches[group] = map[int64]sotwWatch{}
	}
	c.watches[group][id] = w
	return func() {
		once.Do(func() { close(w.done) })
		c.mu.Lock()
		defer c.mu.Unlock()
		delete(c.watches[group], id)
	}, nil
}

func (c *sotwCache) set(group string, snap *cache.Snapshot, versions map[string]map[string]string) {
	st := &groupState{group: group, snap: snap, versions: versions, anys: &c.anys}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.snaps[group] = st
	c.forgetEncoders(group, versions[resource.EndpointType])
	c.pruneAnys()
	for id, w := range c.watches[group] {
		if resp := st.respond(w.req, w.sub); resp != nil {
			w.deliver(resp)
			delete(c.watches[group], id)
		}
	}
}

func (c *sotwCache) clear(group string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.snaps, group)
	c.forgetEncoders(group, nil)
	c.pruneAnys()
}

// forgetEncoders drops the encoders of group's load assignments that its
// snapshot no longer has (all of them for versions nil); c.mu is held.
func (c *sotwCache) forgetEncoders(group string, versions map[string]string) {
	for k := range c.anys.encoders {
		g, name, _ := strings.Cut(k, "\x00")
		if _, ok := versions[name]; g == group && !ok {
			delete(c.anys.encoders, k)
		}
	}
}

// pruneAnys forgets marshalled resources no group serves any more; c.mu is held.
func (c *sotwCache) pruneAnys() {
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
func (c *sotwCache) snapshot(group string) (*cache.Snapshot, bool) {
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
	return &cache.PassthroughResponse{Request: req, DiscoveryResponse: out, ReturnedResources: returned}
}
