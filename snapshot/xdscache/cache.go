// Package xdscache is the cache the xDS server serves from: the snapshots
// the syncer publishes per constraint set, the state-of-the-world and delta
// watches answered per resource (watches.go, delta.go), the forms of endpoint metadata derived per
// dispatcher (forms.go), and how a dispatcher's node maps to its group
// (node.go).
package xdscache

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
)

// Cache is the cache the xDS server serves from: state-of-the-world and
// delta watches are answered per resource by watchCache (a response carries
// only the resources the client lacks, so a change of one task type never
// resends the others', and each resource version is marshalled once for
// every stream); REST fetches by go-control-plane's SnapshotCache, given the
// content versions. Dispatchers asking for compact endpoint metadata are
// served from a group of their own, derived from their constraint set's
// (forms).
type Cache struct {
	watches *watchCache
	fetch   cache.SnapshotCache
	forms   formCache
}

var _ cache.Cache = (*Cache)(nil)

// New returns an empty cache; dispatchers' nodes are grouped by constraint
// set (GroupOf).
func New() *Cache {
	return &Cache{
		watches: newWatchCache(GroupOf),
		// ads=false: go-control-plane's ADS mode never answers a request
		// for a subset of a type's names, and gRPC clients ask for exact names.
		fetch: cache.NewSnapshotCache(false, nodeGroups{}, nil),
	}
}

// nodeGroups is GroupOf as go-control-plane's NodeHash.
type nodeGroups struct{}

func (nodeGroups) ID(node *corev3.Node) string { return GroupOf(node) }

// Snapshot is the snapshot set last for group.
func (c *Cache) Snapshot(group string) (*cache.Snapshot, bool) { return c.watches.snapshot(group) }

// formCache is what derived groups are made from; the zero value is ready.
// A form, once asked for, is derived at every publication of its constraint
// set until the set is cleared (at most two forms per set). mu is held
// across the caches' updates so a form is never derived from an older
// snapshot than the one set last; the watches' sends under it never block
// (deliver, watches.go).
type formCache struct {
	mu    sync.Mutex
	bases map[string]groupSnapshot                   // constraint set → its latest snapshot
	used  map[string]map[EndpointMetadata]*formState // constraint set → forms asked for
}

type groupSnapshot struct {
	snap     *cache.Snapshot
	versions map[string]map[string]string
}

func (c *Cache) CreateWatch(req *cache.Request, sub cache.Subscription,
	out chan cache.Response) (func(), error) {
	if err := c.useForm(context.Background(), req.GetNode()); err != nil {
		return nil, err
	}
	return c.watches.CreateWatch(req, sub, out)
}

func (c *Cache) CreateDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription,
	out chan cache.DeltaResponse) (func(), error) {
	if err := c.useForm(context.Background(), req.GetNode()); err != nil {
		return nil, err
	}
	return c.watches.CreateDeltaWatch(req, sub, out)
}

func (c *Cache) Fetch(ctx context.Context, req *cache.Request) (cache.Response, error) {
	if err := c.useForm(ctx, req.GetNode()); err != nil {
		return nil, err
	}
	return c.fetch.Fetch(ctx, req)
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
// versions holds each resource's content version by type URL and name, for
// exactly the resources snap holds (else Set refuses it, naming the first
// difference). The cache compares the next publication's versions with
// these to ask only the watches of what changed, so it keeps its own copy.
func (c *Cache) Set(ctx context.Context, group string, snap *cache.Snapshot,
	versions map[string]map[string]string) error {
	return c.SetWired(ctx, group, snap, versions, nil)
}

// SetWired is Set with load assignments already marshalled: wires holds, by
// name, a load assignment of snap marshalled deterministically (as the
// cache would marshal it; translator.Shard.Wire), which the group's streams
// are then sent as it is. A wire naming no load assignment of snap is
// refused.
func (c *Cache) SetWired(ctx context.Context, group string, snap *cache.Snapshot,
	versions map[string]map[string]string, wires map[string][]byte) error {
	if err := versionsMatch(snap, versions); err != nil {
		return fmt.Errorf("snapshot of %s: %w", group, err)
	}
	for name := range wires {
		if _, ok := versions[resource.EndpointType][name]; !ok {
			return fmt.Errorf("snapshot of %s: a wire of load assignment %q, which it does not hold",
				group, name)
		}
	}
	versions = cloneVersions(versions)
	c.forms.mu.Lock()
	defer c.forms.mu.Unlock()
	if err := c.fetch.SetSnapshot(ctx, group, snap); err != nil {
		return err
	}
	c.watches.set(group, snap, versions, wires)
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
	group := formGroup(base, fs.form)
	if err := c.fetch.SetSnapshot(ctx, group, snap); err != nil {
		return fmt.Errorf("%s: %w", group, err)
	}
	c.watches.set(group, snap, versions, nil)
	return nil
}

// Clear drops a group and the forms derived from it. A form with a watch
// still held stays in use: the group's next publication derives it again
// and answers that watch, as it answers the group's own (no new watch of
// the form may come to derive it).
func (c *Cache) Clear(group string) {
	c.forms.mu.Lock()
	defer c.forms.mu.Unlock()
	for f := range c.forms.used[group] {
		fg := formGroup(group, f)
		c.fetch.ClearSnapshot(fg)
		c.watches.clear(fg)
		if c.watches.holds(fg) {
			c.forms.used[group][f] = &formState{form: f}
		} else {
			delete(c.forms.used[group], f)
		}
	}
	if len(c.forms.used[group]) == 0 {
		delete(c.forms.used, group)
	}
	delete(c.forms.bases, group)
	c.fetch.ClearSnapshot(group)
	c.watches.clear(group)
}

// versionsMatch reports the first resource that snap holds and versions
// does not name, or the reverse: a watch would be skipped for a change it
// cannot be told of.
func versionsMatch(snap *cache.Snapshot, versions map[string]map[string]string) error {
	for typ := range snap.Resources {
		url, err := cache.GetResponseTypeURL(types.ResponseType(typ))
		if err != nil {
			return err
		}
		items := snap.Resources[typ].Items
		vs := versions[url]
		for name := range items {
			if _, ok := vs[name]; !ok {
				return fmt.Errorf("%s %q has no content version", url, name)
			}
		}
		if len(vs) != len(items) {
			for name := range vs {
				if _, ok := items[name]; !ok {
					return fmt.Errorf("content version of %s %q, which the snapshot does not hold",
						url, name)
				}
			}
		}
	}
	for url, vs := range versions {
		if len(vs) > 0 && !knownType(url) {
			return fmt.Errorf("content versions of %s, which a snapshot does not serve", url)
		}
	}
	return nil
}

// knownType reports whether url is a type a snapshot holds.
func knownType(url string) bool {
	for typ := range types.UnknownType {
		if u, err := cache.GetResponseTypeURL(typ); err == nil && u == url {
			return true
		}
	}
	return false
}

// cloneVersions copies versions (a group holds a few hundred resources at
// most: shards, not endpoints), so that no caller can change what the next
// publication is compared with.
func cloneVersions(versions map[string]map[string]string) map[string]map[string]string {
	out := make(map[string]map[string]string, len(versions))
	for url, vs := range versions {
		out[url] = maps.Clone(vs)
		if out[url] == nil {
			out[url] = map[string]string{}
		}
	}
	return out
}
