package consul

import (
	"encoding/binary"
	"hash/maphash"
	"slices"
	"strings"

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
// not held twice; each entry's at is its member's place in it. The entries
// are a list sorted by key, found by binary search: with their keys'
// strings, 104 bytes a member at 10,000 members against ~150 in a map
// (BenchmarkMembershipRetained/prints).
type taskMembership struct {
	entries []entrySeen // sorted by key, one per key
	sorted  []health.Member
}

// entrySeen is a catalog entry of the last answer: its key, its print, and
// its member's place in sorted (-1: it has none yet, since the health read
// did not find it).
type entrySeen struct {
	key   memberKey
	print entryPrint
	at    int32
}

func compareKeys(a, b memberKey) int {
	if c := strings.Compare(a.node, b.node); c != 0 {
		return c
	}
	return strings.Compare(a.serviceID, b.serviceID)
}

// find is the entry of k, if the last answer had one.
func (m *taskMembership) find(k memberKey) (entrySeen, bool) {
	i, ok := slices.BinarySearchFunc(m.entries, k,
		func(e entrySeen, k memberKey) int { return compareKeys(e.key, k) })
	if !ok {
		return entrySeen{}, false
	}
	return m.entries[i], true
}

// entriesOf is the entries of a catalog answer, sorted by key (of a key
// listed twice, the last: what a map of them kept), none a member yet.
func entriesOf(nodes []*api.CatalogService) []entrySeen {
	es := make([]entrySeen, len(nodes))
	for i, n := range nodes {
		es[i] = entrySeen{key: memberKey{n.Node, n.ServiceID}, print: printOf(n), at: -1}
	}
	slices.SortStableFunc(es, func(a, b entrySeen) int { return compareKeys(a.key, b.key) })
	out := es[:0]
	for i, e := range es {
		if i+1 < len(es) && es[i+1].key == e.key {
			continue // a later listing of the same key follows
		}
		out = append(out, e)
	}
	return slices.Clip(out)
}

// entryPrint is what a member is built from of a catalog entry, kept to
// tell whether the next answer changed it: its indexes and a digest of the
// rest (addresses, port, tags, metadata). Nothing of the decoded entry is
// kept: at 10,000 members its metadata maps and tags alone held ~4 MB that
// only this comparison read. The digest is two 64-bit hashes under seeds
// drawn when the process starts, of every string length-prefixed (metadata
// values may hold any byte), so no registration can choose a change that
// compares equal.
type entryPrint struct {
	createIndex, modifyIndex uint64
	sum                      [2]uint64
}

var printSeeds = [2]maphash.Seed{maphash.MakeSeed(), maphash.MakeSeed()}

func printOf(n *api.CatalogService) entryPrint {
	p := entryPrint{createIndex: n.CreateIndex, modifyIndex: n.ModifyIndex}
	var h maphash.Hash
	for lane, seed := range printSeeds {
		h.SetSeed(seed)
		writeField(&h, n.Address)
		writeField(&h, n.ServiceAddress)
		writeLen(&h, n.ServicePort)
		writeLen(&h, len(n.ServiceTags))
		for _, t := range n.ServiceTags {
			writeField(&h, t)
		}
		writeLen(&h, len(n.ServiceMeta))
		// Map order is random: each pair is hashed alone and the sums
		// added, which no order changes.
		var meta uint64
		var e maphash.Hash
		e.SetSeed(seed)
		for k, v := range n.ServiceMeta {
			e.Reset()
			writeField(&e, k)
			writeField(&e, v)
			meta += e.Sum64()
		}
		writeLen(&h, int(meta))
		p.sum[lane] = h.Sum64()
	}
	return p
}

// writeField writes s with its length before it, so no two lists of
// strings write the same bytes.
func writeField(h *maphash.Hash, s string) {
	writeLen(h, len(s))
	h.WriteString(s)
}

func writeLen(h *maphash.Hash, n int) {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(n))
	h.Write(b[:])
}

// diff lists the entries of nodes that need reading: added, changed (any
// field a member is built from, so a restarted agent replaying the same
// indexes with other content is seen), or never read; and whether any entry
// left.
func (m *taskMembership) diff(nodes []*api.CatalogService) (changed []memberKey, left bool) {
	seen, members := 0, 0
	for _, n := range nodes {
		k := memberKey{n.Node, n.ServiceID}
		old, ok := m.find(k)
		if ok {
			seen++
			if old.at >= 0 {
				members++
			}
		}
		if !ok || old.at < 0 || old.print != printOf(n) {
			changed = append(changed, k)
		}
	}
	return changed, seen < len(m.entries) || len(m.sorted) > members
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
	next := &taskMembership{entries: entriesOf(nodes)}
	fresh := make(map[memberKey]health.Member, len(entries))
	in := interner{}
	for _, e := range entries {
		if e.Node == nil || e.Service == nil {
			continue
		}
		k := memberKey{e.Node.Node, e.Service.ID}
		if _, ok := next.find(k); ok {
			fresh[k] = member(task, e, in)
		}
	}
	stale := make(map[memberKey]bool, len(changed))
	if !readAll {
		for _, k := range changed {
			stale[k] = true
		}
	}
	// The entries are in key order, which is the members' order: an entry
	// is a member if read now, or kept from before when this read was not
	// of every member and did not re-read it.
	const notMember, readNow = -2, -1
	kept := make([]int32, len(next.entries)) // each entry's member in m.sorted, or the above
	n := 0
	for j, e := range next.entries {
		kept[j] = notMember
		if _, read := fresh[e.key]; read {
			kept[j] = readNow
		} else if was, ok := m.find(e.key); !readAll && ok && was.at >= 0 && !stale[e.key] {
			kept[j] = was.at
		}
		if kept[j] != notMember {
			n++
		}
	}
	next.sorted = make([]health.Member, 0, n)
	for j := range next.entries {
		e := &next.entries[j]
		switch kept[j] {
		case notMember:
			continue
		case readNow:
			e.at = int32(len(next.sorted))
			next.sorted = append(next.sorted, fresh[e.key])
		default:
			e.at = int32(len(next.sorted))
			next.sorted = append(next.sorted, m.sorted[kept[j]])
		}
	}
	return next
}

// list is the members sorted by node and service id. The caller must not
// write to it: the next apply reads it.
func (m *taskMembership) list() []health.Member { return m.sorted }
