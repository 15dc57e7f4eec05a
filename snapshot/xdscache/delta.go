package xdscache

import (
	"sort"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
)

// Delta (incremental) watches are answered from the same snapshots and the
// same marshalled resources as state-of-the-world ones. go-control-plane's
// SnapshotCache marshalled every resource it sent once per stream (its
// RawDeltaResponse marshals lazily, per response): a lapse in a task type of
// 500 executors cost 100 delta streams 100 marshals of the same load
// assignment, and leasehold's part of lapse → stop was 3× the state of the
// world's in the same harness (BENCHMARKS.md, "Like with like").

type deltaWatch struct {
	req  *cache.DeltaRequest
	sub  cache.Subscription
	out  chan cache.DeltaResponse
	done chan struct{} // closed when the server cancels the watch
}

func (c *watchCache) CreateDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription,
	out chan cache.DeltaResponse) (func(), error) {
	group := c.groupOf(req.GetNode())
	w := deltaWatch{req: req, sub: sub, out: out, done: make(chan struct{})}
	c.mu.Lock()
	defer c.mu.Unlock()
	if st := c.snaps[group]; st != nil {
		if resp := st.respondDelta(req, sub); resp != nil {
			deliver(w.out, w.done, resp)
			return answered(w.done), nil
		}
	}
	return keep(c, &c.deltas, group, w, req.GetTypeUrl(), sub, w.done), nil
}

// respondDelta builds the delta response a watch needs now, or nil if the
// client holds every resource it subscribed to at its current version. As
// go-control-plane's: a wildcard subscription gets every resource of the
// type and the removal of those it had that are gone; a named one gets its
// names that changed and the removal of those it had that are gone; the
// first wildcard request is answered even when empty (Envoy waits for it).
// Resources and removals are sorted by name; each resource's version is
// its content version, equal on every replica.
func (st *groupState) respondDelta(
	req *cache.DeltaRequest, sub cache.Subscription,
) cache.DeltaResponse {
	typeURL := req.GetTypeUrl()
	versions := st.versions[typeURL]
	resources := st.snap.GetResourcesAndTTL(typeURL)
	known := sub.ReturnedResources()
	next := map[string]string{}
	var changed, removed []string
	if sub.IsWildcard() {
		for name := range resources {
			next[name] = versions[name]
			if v, ok := known[name]; !ok || v != versions[name] {
				changed = append(changed, name)
			}
		}
		for name := range known {
			if _, ok := resources[name]; !ok {
				removed = append(removed, name)
			}
		}
	} else {
		for name := range sub.SubscribedResources() {
			v, had := known[name]
			if _, ok := resources[name]; ok {
				next[name] = versions[name]
				if !had || v != versions[name] {
					changed = append(changed, name)
				}
			} else if had {
				removed = append(removed, name)
			}
		}
	}
	if len(changed) == 0 && len(removed) == 0 &&
		!(sub.IsWildcard() && req.GetResponseNonce() == "") {
		return nil
	}
	sort.Strings(changed)
	sort.Strings(removed)
	out := &discovery.DeltaDiscoveryResponse{SystemVersionInfo: st.snap.GetVersion(typeURL),
		TypeUrl: typeURL, RemovedResources: removed}
	for _, name := range changed {
		a := st.marshalled(typeURL, name, versions[name], resources[name].Resource)
		if a == nil {
			continue
		}
		out.Resources = append(out.Resources,
			&discovery.Resource{Name: name, Version: versions[name], Resource: a})
	}
	return &cache.DeltaPassthroughResponse{DeltaRequest: req, DeltaDiscoveryResponse: out,
		NextVersionMap: next}
}
