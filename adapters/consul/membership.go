package consul

import (
	"maps"
	"slices"
	"sort"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// maxPointRead is the most registrations one membership change re-reads by
// service id; past it (or past a quarter of the task type) the whole task
// type is read, which is then about as cheap.
const maxPointRead = 32

type memberKey struct{ node, serviceID string }

// taskMembership is what a task watch knows of its task type: the catalog
// entries of its last catalog answer and the members read for them. A
// catalog answer (one blocking query, which heartbeats do not wake) says which
// entries were added or changed; only those are re-read with their checks,
// so a registration or a deregistration costs one catalog listing, not also
// a health listing of every member. Consul 1.13 has no delta reads: the
// catalog listing itself stays whole (the read budget paces it).
//
// The members are kept once, as the sorted list the watch sends: the
// syncer keeps that same list (never written once built), so a member is
// not held twice; at is each member's place in it.
type taskMembership struct {
	entries map[memberKey]entryPrint
	sorted  []health.Member
	at      map[memberKey]int32
}

// entryPrint is what a member is built from of a catalog entry, kept to
// tell whether the next answer changed it. The rest of the decoded entry
// (node metadata, tagged addresses, proxy and Connect settings: most of its
// bytes) is not kept: at 10,000 members whole entries held megabytes that
// nothing read. Tags and metadata are the decoded slice and map, not copies.
type entryPrint struct {
	createIndex, modifyIndex uint64
	address, serviceAddress  string
	servicePort              int
	tags                     []string
	meta                     map[string]string
}

func printOf(n *api.CatalogService) entryPrint {
	return entryPrint{createIndex: n.CreateIndex, modifyIndex: n.ModifyIndex,
		address: n.Address, serviceAddress: n.ServiceAddress, servicePort: n.ServicePort,
		tags: n.ServiceTags, meta: n.ServiceMeta}
}

// diff lists the entries of nodes that need reading: added, changed (any
// field a member is built from, so a restarted agent replaying the same
// indexes with other content is seen), or never read; and whether any entry
// left.
func (m *taskMembership) diff(nodes []*api.CatalogService) (changed []memberKey, left bool) {
	seen := 0
	for _, n := range nodes {
		k := memberKey{n.Node, n.ServiceID}
		old, ok := m.entries[k]
		if ok {
			seen++
		}
		if _, read := m.at[k]; !ok || !read || !sameEntry(old, printOf(n)) {
			changed = append(changed, k)
		}
	}
	return changed, seen < len(m.entries) || len(m.at) > seen
}

// sameEntry compares what a member is built from, field by field (no joined
// keys: metadata values may hold any byte).
// (The node and service id are the entry's key.)
func sameEntry(a, b entryPrint) bool {
	return a.createIndex == b.createIndex && a.modifyIndex == b.modifyIndex &&
		a.address == b.address && a.serviceAddress == b.serviceAddress &&
		a.servicePort == b.servicePort &&
		slices.Equal(a.tags, b.tags) &&
		maps.Equal(a.meta, b.meta)
}

// pointReadable reports whether the changed entries are few enough, and
// their ids plain enough to quote in a filter, to re-read them alone.
func (m *taskMembership) pointReadable(changed []memberKey, total int) bool {
	if len(changed) > maxPointRead || len(changed)*4 > total {
		return false
	}
	for _, k := range changed {
		if !plainID(k.serviceID) {
			return false
		}
	}
	return true
}

func plainID(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		letter := r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z'
		if !(letter || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.' || r == ':') {
			return false
		}
	}
	return true
}

// serviceIDs are the distinct service ids of keys, sorted.
func serviceIDs(keys []memberKey) []string {
	ids := make([]string, 0, len(keys))
	for _, k := range keys {
		ids = append(ids, k.serviceID)
	}
	slices.Sort(ids)
	return slices.Compact(ids)
}

// apply builds the membership after a catalog answer (nodes) and the health
// entries read for it: of every member when readAll, else of the changed
// ones (entries of other members in the answer are fresher reads of
// unchanged members and are taken too). Members exist only for entries of
// this catalog answer: one that registered after it is read on the next
// catalog answer, which Consul sends at once; a changed one the read did not
// find (it left meanwhile) is left out.
func (m *taskMembership) apply(
	task string,
	nodes []*api.CatalogService,
	entries []*api.ServiceEntry,
	readAll bool,
	changed []memberKey,
) *taskMembership {
	next := &taskMembership{entries: make(map[memberKey]entryPrint, len(nodes))}
	for _, n := range nodes {
		next.entries[memberKey{n.Node, n.ServiceID}] = printOf(n)
	}
	fresh := make(map[memberKey]health.Member, len(entries))
	for _, e := range entries {
		if e.Node == nil || e.Service == nil {
			continue
		}
		k := memberKey{e.Node.Node, e.Service.ID}
		if _, ok := next.entries[k]; ok {
			fresh[k] = member(task, e)
		}
	}
	stale := make(map[memberKey]bool, len(changed))
	if !readAll {
		for _, k := range changed {
			stale[k] = true
		}
	}
	keys := make([]memberKey, 0, len(next.entries))
	for k := range next.entries {
		_, read := fresh[k]
		_, kept := m.at[k]
		if read || (!readAll && kept && !stale[k]) {
			keys = append(keys, k)
		}
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].node != keys[j].node {
			return keys[i].node < keys[j].node
		}
		return keys[i].serviceID < keys[j].serviceID
	})
	next.sorted = make([]health.Member, len(keys))
	next.at = make(map[memberKey]int32, len(keys))
	for i, k := range keys {
		if mem, ok := fresh[k]; ok {
			next.sorted[i] = mem
		} else {
			next.sorted[i] = m.sorted[m.at[k]]
		}
		next.at[k] = int32(i)
	}
	return next
}

// list is the members sorted by node and service id. The caller must not
// write to it: the next apply reads it.
func (m *taskMembership) list() []health.Member { return m.sorted }
