package consul

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math/rand/v2"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

func catalogEntry(node, instance, session string, modify uint64) *api.CatalogService {
	reg := health.Registration{
		InstanceID: instance,
		SessionID:  session,
		Generation: 1,
		Task:       "work",
		Address:    "127.0.0.1",
		Port:       9000,
		Version:    "1.0.0",
		Capacity:   2,
		State:      health.StateActive,
	}
	return &api.CatalogService{
		Node:        node,
		ServiceID:   health.ServiceID(instance, "work"),
		CreateIndex: modify,
		ModifyIndex: modify,
		ServiceMeta: reg.Meta(),
	}
}

func memberIDs(ms []health.Member) []string {
	var ids []string
	for _, m := range ms {
		ids = append(ids, m.Node+"/"+m.InstanceID+"/"+m.SessionID)
	}
	return ids
}

func TestMembershipDiffSeesEveryFieldAndDepartures(t *testing.T) {
	a := catalogEntry("n1", "a", "s1", 7)
	m := (&taskMembership{}).apply(
		"work",
		[]*api.CatalogService{a},
		[]*api.ServiceEntry{entry("work", "n1", "a", "s1", 1, "passing")},
		true,
		nil,
	)
	changed, left := m.diff([]*api.CatalogService{catalogEntry("n1", "a", "s1", 7)})
	if len(changed) != 0 || left {
		t.Fatalf("identical entries: changed %v left %v", changed, left)
	}
	// a restarted agent replays the same indexes with other content; metadata
	// values that a joined key would confuse ("x|k=v" against two keys)
	for name, mutate := range map[string]func(c *api.CatalogService){
		"meta": func(c *api.CatalogService) { c.ServiceMeta["session_id"] = "s2" },
		"joined meta": func(c *api.CatalogService) {
			c.ServiceMeta = map[string]string{"a": "x|b=y"}
		},
		"port":         func(c *api.CatalogService) { c.ServicePort++ },
		"address":      func(c *api.CatalogService) { c.ServiceAddress = "127.0.0.2" },
		"node address": func(c *api.CatalogService) { c.Address = "127.0.0.3" },
		"tags":         func(c *api.CatalogService) { c.ServiceTags = []string{"leasehold", "x"} },
		// The print is a digest: strings are length-prefixed and metadata
		// pairs hashed whole, so none of these compares equal.
		"tag split": func(c *api.CatalogService) { c.ServiceTags = []string{"lease", "hold"} },
		"tag moved": func(c *api.CatalogService) {
			c.ServiceTags = []string{""}
			c.ServiceMeta[""] = "leasehold"
		},
		"meta values swapped": func(c *api.CatalogService) {
			m := c.ServiceMeta
			m["instance_id"], m["session_id"] = m["session_id"], m["instance_id"]
		},
		"meta key into value": func(c *api.CatalogService) {
			v := c.ServiceMeta["version"]
			delete(c.ServiceMeta, "version")
			c.ServiceMeta["capacity"] += "\x00version\x00" + v
		},
		"empty meta value added": func(c *api.CatalogService) { c.ServiceMeta["zz"] = "" },
		"node address into service address": func(c *api.CatalogService) {
			c.ServiceAddress = "127.0.0.9"
			c.Address, c.ServiceAddress = c.ServiceAddress, c.Address
		},
		"create index": func(c *api.CatalogService) { c.CreateIndex++ },
		"modify index": func(c *api.CatalogService) { c.ModifyIndex++ },
	} {
		c := catalogEntry("n1", "a", "s1", 7)
		mutate(c)
		if changed, _ := m.diff([]*api.CatalogService{c}); len(changed) != 1 {
			t.Errorf("%s change not seen", name)
		}
	}
	joined := &taskMembership{
		entries: []entrySeen{{key: memberKey{"n1", "work:a"}, print: printOf(&api.CatalogService{
			Node:        "n1",
			ServiceID:   "work:a",
			ServiceMeta: map[string]string{"a": "x", "b": "y"},
		})}},
		sorted: []health.Member{{}},
	}
	joinedMeta := map[string]string{"a": "x|b=y"}
	changed, _ = joined.diff([]*api.CatalogService{{Node: "n1", ServiceID: "work:a",
		ServiceMeta: joinedMeta}})
	if len(changed) != 1 {
		t.Error("metadata {a: x, b: y} → {a: \"x|b=y\"} not seen")
	}
	if _, left := m.diff(nil); !left {
		t.Error("departure not seen")
	}
	// the same service id on another node is another member
	changed, left = m.diff([]*api.CatalogService{a, catalogEntry("n2", "a", "s2", 9)})
	if len(changed) != 1 || changed[0] != (memberKey{"n2", "work:a"}) || left {
		t.Errorf("second node: changed %v left %v", changed, left)
	}
}

func TestMembershipApplyKeepsOnlyWhatTheCatalogShows(t *testing.T) {
	nodes := []*api.CatalogService{
		catalogEntry("n1", "a", "s1", 7),
		catalogEntry("n1", "b", "s1", 7),
	}
	full := []*api.ServiceEntry{
		entry("work", "n1", "a", "s1", 1, "passing"),
		entry("work", "n1", "b", "s1", 1, "passing"),
		entry("work", "n1", "c", "s1", 1, "passing"),
	}
	m := (&taskMembership{}).apply("work", nodes, full, true, nil)
	if got := memberIDs(m.list()); !slices.Equal(got, []string{"n1/a/s1", "n1/b/s1"}) {
		t.Fatalf(
			"full read: %v (c registered after the catalog answer: read with the next one)",
			got,
		)
	}
	// b changes (new session) and the point read finds it; a is kept as read
	nodes2 := []*api.CatalogService{
		catalogEntry("n1", "a", "s1", 7),
		catalogEntry("n1", "b", "s2", 12),
	}
	changed, _ := m.diff(nodes2)
	m2 := m.apply(
		"work",
		nodes2,
		[]*api.ServiceEntry{entry("work", "n1", "b", "s2", 2, "passing")},
		false,
		changed,
	)
	if got := memberIDs(m2.list()); !slices.Equal(got, []string{"n1/a/s1", "n1/b/s2"}) {
		t.Fatalf("point read: %v", got)
	}
	// b changed again but left before its point read: left out, and read
	// again (as never read) if the catalog still shows it
	nodes3 := []*api.CatalogService{
		catalogEntry("n1", "a", "s1", 7),
		catalogEntry("n1", "b", "s3", 14),
	}
	changed, _ = m2.diff(nodes3)
	m3 := m2.apply("work", nodes3, nil, false, changed)
	if got := memberIDs(m3.list()); !slices.Equal(got, []string{"n1/a/s1"}) {
		t.Fatalf("vanished before its read: %v", got)
	}
	if changed, _ := m3.diff(nodes3); len(changed) != 1 || changed[0].serviceID != "work:b" {
		t.Fatalf("an entry never read is read next time: %v", changed)
	}
}

func TestMembershipPointReadBounds(t *testing.T) {
	m := &taskMembership{}
	keys := func(n int) []memberKey {
		var ks []memberKey
		for i := range n {
			ks = append(ks, memberKey{"n1", fmt.Sprintf("work:x%d", i)})
		}
		return ks
	}
	if !m.pointReadable(keys(1), 100) || !m.pointReadable(keys(maxPointRead), 1000) {
		t.Error("a few changes of a large task type are read alone")
	}
	if m.pointReadable(keys(maxPointRead+1), 1000) || m.pointReadable(keys(30), 100) {
		t.Error("many changes, or a quarter of the task type: read it all")
	}
	for _, id := range []string{`work:a"b`, `work:a\b`, "work:a b", "", "work:é"} {
		if m.pointReadable([]memberKey{{"n1", id}}, 100) {
			t.Errorf("%q quoted into a filter", id)
		}
	}
	injection := []string{`a" or Service.ID != "`}
	_, _, err := (apiCatalog{}).HealthService(context.Background(), "work", "leasehold", injection)
	if err == nil {
		t.Error("an id that would rewrite the filter was sent")
	}
}

// TestWatcherRereadsOnlyChangedMembers: after the first read of every member,
// a catalog change re-reads the changed registrations alone (by service id),
// and a departure reads nothing but the catalog.
func TestWatcherRereadsOnlyChangedMembers(t *testing.T) {
	h := startWatcher(t, WatchConfig{MinInterval: time.Millisecond, ReadRate: -1})
	h.cat.call(t, "services")
	h.cat.push("services", scripted{index: 5, services: map[string][]string{"work": {"leasehold"}}})
	h.cat.call(t, "nodes")
	var nodes []*api.CatalogService
	var entries []*api.ServiceEntry
	for i := range 8 {
		id := fmt.Sprintf("x%d", i)
		nodes = append(nodes, catalogEntry("n1", id, "s1", 7))
		entries = append(entries, entry("work", "n1", id, "s1", 1, "passing"))
	}
	h.cat.push("nodes/work", scripted{index: 8, nodes: nodes})
	h.cat.push("health/work", scripted{index: 8, entries: entries})
	if c := h.cat.call(t, "health"); c.ids != nil {
		t.Fatalf("first read by ids %v, want every member", c.ids)
	}
	members := func() []health.Member {
		for {
			if o := h.observe(); o.Members() != nil {
				return o.Members().Members
			}
		}
	}
	if got := members(); len(got) != 8 {
		t.Fatalf("%d members", len(got))
	}
	// x3 restarts under s2, x5 leaves
	nodes2 := slices.Clone(nodes)
	nodes2[3] = catalogEntry("n1", "x3", "s2", 12)
	nodes2 = slices.Delete(nodes2, 5, 6)
	entries2 := slices.Clone(entries)
	entries2[3] = entry("work", "n1", "x3", "s2", 2, "passing")
	h.clock.Advance(time.Second)
	h.cat.push("nodes/work", scripted{index: 12, nodes: nodes2})
	h.cat.push("health/work", scripted{index: 12, entries: entries2})
	if c := h.cat.call(t, "health"); !slices.Equal(c.ids, []string{"work:x3"}) {
		t.Fatalf("re-read ids %v, want [work:x3]", c.ids)
	}
	got := memberIDs(members())
	if len(got) != 7 || !slices.Contains(got, "n1/x3/s2") || slices.Contains(got, "n1/x5/s1") ||
		!slices.Contains(got, "n1/x4/s1") {
		t.Fatalf("members after the change: %v", got)
	}
	// x6 leaves: the catalog answer alone says so
	nodes3 := slices.DeleteFunc(
		slices.Clone(nodes2),
		func(c *api.CatalogService) bool { return c.ServiceID == "work:x6" },
	)
	h.clock.Advance(time.Second)
	h.cat.push("nodes/work", scripted{index: 13, nodes: nodes3})
	if got := memberIDs(members()); len(got) != 6 || slices.Contains(got, "n1/x6/s1") {
		t.Fatalf("members after a departure: %v", got)
	}
	for {
		select {
		case c := <-h.cat.calls:
			if c.method == "health" {
				t.Fatalf("a departure re-read members: %+v", c)
			}
			continue
		default:
		}
		break
	}
}

// TestCheckAddedToAnUnchangedMemberIsReadWithTheNextChange: an operator
// puts node n1 in maintenance (`consul maint -enable` adds the critical node
// check _node_maintenance; no catalog entry changes). The non-passing set
// carries the new check at once; once the task type changes (another
// executor registers), Join of every member, the unchanged ones too, with
// that set sees the node critical, so none stays routed.
func TestCheckAddedToAnUnchangedMemberIsReadWithTheNextChange(t *testing.T) {
	h := startWatcher(t, WatchConfig{MinInterval: time.Millisecond, SlowInterval: time.Hour})
	h.cat.call(t, "services")
	h.cat.push(
		"services",
		scripted{index: 5, services: map[string][]string{"work": {"leasehold"}, "consul": nil}},
	)
	h.cat.call(t, "nodes")
	var nodes []*api.CatalogService
	var entries []*api.ServiceEntry
	for i, inst := range []string{"a", "c", "d", "e"} {
		nodes = append(nodes, catalogEntry("n1", inst, "s1", uint64(7+i)))
		entries = append(entries, entry("work", "n1", inst, "s1", 1, "passing"))
	}
	h.cat.push("nodes/work", scripted{index: 10, nodes: nodes})
	h.cat.push("health/work", scripted{index: 10, entries: entries})
	for o := h.observe(); o.Members() == nil; o = h.observe() {
	}
	// n1 goes into maintenance at 11
	maint := &api.HealthCheck{
		Node:        "n1",
		CheckID:     "_node_maintenance",
		Status:      "critical",
		CreateIndex: 11,
		ModifyIndex: 11,
	}
	h.cat.push("nonpassing", scripted{index: 11, checks: api.HealthChecks{maint}})
	var np *health.NonPassing
	for np == nil {
		np = h.observe().NonPassing()
	}
	// churn: b registers at 12; Consul's health read now shows a with the
	// maintenance check too
	withMaint := func(e *api.ServiceEntry) *api.ServiceEntry {
		c := *e
		c.Checks = append(api.HealthChecks{maint}, e.Checks...)
		return &c
	}
	nodes2 := append(append([]*api.CatalogService{}, nodes...), catalogEntry("n1", "b", "s1", 12))
	var entries2 []*api.ServiceEntry
	withB := append(append([]*api.ServiceEntry{}, entries...), entry("work", "n1", "b", "s1", 1,
		"passing"))
	for _, e := range withB {
		entries2 = append(entries2, withMaint(e))
	}
	h.advance(10 * time.Millisecond)
	h.cat.push("nodes/work", scripted{index: 12, nodes: nodes2})
	h.cat.push("health/work", scripted{index: 12, entries: entries2})
	var members []health.Member
	for members == nil {
		if o := h.observe(); o.Members() != nil && len(o.Members().Members) == 5 {
			members = o.Members().Members
		}
	}
	set := health.NewNonPassingSet(*np)
	for _, m := range members {
		if e := health.Join(m, set); e.NodeChecks != health.StatusCritical {
			t.Errorf(
				"%s on n1 (in maintenance since 11): node checks %q after the task type was "+
					"re-read at 12 — routed",
				m.ServiceID,
				e.NodeChecks,
			)
		}
	}
}

// BenchmarkMembershipRetained reports the heap a task watch keeps per member
// of a catalog answer of 10,000 entries as Consul 1.13 writes them (node
// metadata, tagged addresses, service metadata), decoded as the watch
// decodes them: "whole" keeps the decoded entries, "prints" what the watch
// keeps of them (its membership's entries: key, print and member's place).
func BenchmarkMembershipRetained(b *testing.B) {
	const n = 10000
	entries := make([]*api.CatalogService, n)
	for i := range entries {
		inst := fmt.Sprintf("x%05d", i)
		entries[i] = &api.CatalogService{ID: "node-id", Node: fmt.Sprintf("n%02d", i%10),
			Address: "127.0.0.1", Datacenter: "dc1",
			TaggedAddresses: map[string]string{"lan": "127.0.0.1", "lan_ipv4": "127.0.0.1",
				"wan": "127.0.0.1", "wan_ipv4": "127.0.0.1"},
			NodeMeta:  map[string]string{"consul-network-segment": ""},
			ServiceID: "work:" + inst, ServiceName: "work", ServiceAddress: "127.0.0.1",
			ServicePort: 20000 + i, ServiceTags: []string{"leasehold"},
			ServiceMeta: map[string]string{"instance_id": inst, "session_id": "s1",
				"generation": "1", "version": "1.0.0", "capacity": "8", "state": "active"},
			ServiceTaggedAddresses: map[string]api.ServiceAddress{
				"lan_ipv4": {Address: "127.0.0.1", Port: 20000 + i},
				"wan_ipv4": {Address: "127.0.0.1", Port: 20000 + i}},
			ServiceWeights: api.Weights{Passing: 1, Warning: 1},
			CreateIndex:    uint64(i + 10), ModifyIndex: uint64(i + 10)}
	}
	body, err := json.Marshal(entries)
	if err != nil {
		b.Fatal(err)
	}
	for _, keep := range []string{"whole", "prints"} {
		b.Run(keep, func(b *testing.B) {
			var per float64
			for range b.N {
				before := fleettest.HeapAfterGC()
				var decoded []*api.CatalogService
				if err := json.Unmarshal(body, &decoded); err != nil {
					b.Fatal(err)
				}
				var kept any = decoded
				if keep == "prints" {
					// The membership's entries (no health read: no members).
					kept = (&taskMembership{}).apply("work", decoded, nil, true, nil)
					decoded = nil
				} else {
					whole := make(map[memberKey]*api.CatalogService, n)
					for _, e := range decoded {
						whole[memberKey{e.Node, e.ServiceID}] = e
					}
					kept = whole
				}
				per = float64(fleettest.HeapAfterGC()-before) / n
				runtime.KeepAlive(kept)
			}
			b.ReportMetric(per, "B/member")
		})
	}
}

// The list a watch sent is the syncer's from then on: the next answer builds
// a new one and leaves it as it was.
func TestMembershipListSentIsNeverWritten(t *testing.T) {
	nodes := []*api.CatalogService{catalogEntry("n1", "a", "s1", 7),
		catalogEntry("n1", "b", "s1", 7)}
	m := (&taskMembership{}).apply("work", nodes,
		[]*api.ServiceEntry{entry("work", "n1", "a", "s1", 1, "passing"),
			entry("work", "n1", "b", "s1", 1, "passing")}, true, nil)
	sent := m.list()
	before := memberIDs(sent)
	nodes2 := []*api.CatalogService{catalogEntry("n1", "a", "s1", 7),
		catalogEntry("n1", "b", "s2", 8)}
	changed, _ := m.diff(nodes2)
	m2 := m.apply("work", nodes2,
		[]*api.ServiceEntry{entry("work", "n1", "b", "s2", 2, "passing")}, false, changed)
	if got := memberIDs(sent); !slices.Equal(got, before) {
		t.Fatalf("the list sent became %v, was %v", got, before)
	}
	if got := memberIDs(m2.list()); !slices.Equal(got, []string{"n1/a/s1", "n1/b/s2"}) {
		t.Fatalf("next list %v", got)
	}
}

// mapMembership is the membership as a map of entries, as it was kept
// before the entries became a sorted list: the specification the list is
// held to (TestMembershipListMatchesTheMapItReplaced).
type mapMembership struct {
	entries map[memberKey]entrySeen
	sorted  []health.Member
}

func (m *mapMembership) diff(nodes []*api.CatalogService) (changed []memberKey, left bool) {
	seen, members := 0, 0
	for _, n := range nodes {
		k := memberKey{n.Node, n.ServiceID}
		old, ok := m.entries[k]
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

func (m *mapMembership) apply(task string, nodes []*api.CatalogService,
	entries []*api.ServiceEntry, readAll bool, changed []memberKey) *mapMembership {
	next := &mapMembership{entries: map[memberKey]entrySeen{}}
	for _, n := range nodes {
		next.entries[memberKey{n.Node, n.ServiceID}] = entrySeen{print: printOf(n), at: -1}
	}
	fresh := map[memberKey]health.Member{}
	in := interner{}
	for _, e := range entries {
		if e.Node == nil || e.Service == nil {
			continue
		}
		k := memberKey{e.Node.Node, e.Service.ID}
		if _, ok := next.entries[k]; ok {
			fresh[k] = member(task, e, in)
		}
	}
	stale := map[memberKey]bool{}
	if !readAll {
		for _, k := range changed {
			stale[k] = true
		}
	}
	var keys []memberKey
	for k := range next.entries {
		_, read := fresh[k]
		was, ok := m.entries[k]
		if read || (!readAll && ok && was.at >= 0 && !stale[k]) {
			keys = append(keys, k)
		}
	}
	slices.SortFunc(keys, compareKeys)
	next.sorted = make([]health.Member, len(keys))
	for i, k := range keys {
		if mem, ok := fresh[k]; ok {
			next.sorted[i] = mem
		} else {
			next.sorted[i] = m.sorted[m.entries[k].at]
		}
		e := next.entries[k]
		e.at = int32(i)
		next.entries[k] = e
	}
	return next
}

// Random catalog answers (entries added, changed by a new session, gone,
// none at all, listed in any order and now and then twice anywhere) and
// health reads (of every member or of the changed ones and some others,
// each read with its own status and generation, missing some, with an
// entry of no service): the list of entries diffs, finds and builds the
// members exactly as the map did. Unchanged entries keep their indexes, so
// members are kept from before, and a fresher read of one is taken.
func TestMembershipListMatchesTheMapItReplaced(t *testing.T) {
	keys := []memberKey{}
	for _, n := range []string{"n1", "n2", "n10", "N3", ""} {
		for _, inst := range []string{"a", "b", "c"} {
			keys = append(keys, memberKey{n, health.ServiceID(inst, "work")})
		}
	}
	instOf := func(k memberKey) string { return strings.TrimPrefix(k.serviceID, "work:") }
	statuses := []string{"passing", "warning", "critical"}
	for seed := range uint64(300) {
		rng := rand.New(rand.NewPCG(seed, 9))
		list, spec := &taskMembership{}, &mapMembership{}
		session, modify := map[memberKey]string{}, map[memberKey]uint64{}
		for step := range 15 {
			var nodes []*api.CatalogService
			empty := rng.IntN(8) == 0
			for _, k := range keys {
				if empty || rng.IntN(4) == 0 {
					continue // not in this answer
				}
				if session[k] == "" || rng.IntN(5) == 0 {
					session[k], modify[k] = fmt.Sprintf("s%d", step), uint64(step+1)
				}
				nodes = append(nodes, catalogEntry(k.node, instOf(k), session[k], modify[k]))
			}
			rng.Shuffle(len(nodes), func(i, j int) { nodes[i], nodes[j] = nodes[j], nodes[i] })
			for d := rng.IntN(3); d > 0 && len(nodes) > 0; d-- {
				// The same key listed twice, anywhere, with other content.
				dup := *nodes[rng.IntN(len(nodes))]
				dup.ServiceMeta = maps.Clone(dup.ServiceMeta)
				dup.ServiceMeta["extra"] = fmt.Sprint(step, d)
				at := rng.IntN(len(nodes) + 1)
				nodes = append(nodes[:at], append([]*api.CatalogService{&dup}, nodes[at:]...)...)
			}
			changed, left := list.diff(nodes)
			wantChanged, wantLeft := spec.diff(nodes)
			if !slices.Equal(changed, wantChanged) || left != wantLeft {
				t.Fatalf("seed %d step %d: diff %v %v, the map's %v %v", seed, step,
					changed, left, wantChanged, wantLeft)
			}
			readAll := rng.IntN(3) == 0
			var entries []*api.ServiceEntry
			read := func(k memberKey) {
				if rng.IntN(8) != 0 { // now and then gone before the health read
					entries = append(entries, entry("work", k.node, instOf(k), session[k],
						1+rng.IntN(3), statuses[rng.IntN(3)]))
				}
			}
			if readAll {
				for _, k := range keys {
					read(k)
				}
			} else {
				for _, k := range changed {
					read(k)
				}
				for i := rng.IntN(4); i > 0; i-- {
					read(keys[rng.IntN(len(keys))]) // fresher reads of unchanged ones
				}
			}
			entries = append(entries, &api.ServiceEntry{Node: &api.Node{Node: "n1"}}) // no service
			list = list.apply("work", nodes, entries, readAll, changed)
			spec = spec.apply("work", nodes, entries, readAll, changed)
			if !reflect.DeepEqual(list.list(), spec.sorted) {
				t.Fatalf("seed %d step %d: members %v, the map's %v", seed, step,
					memberIDs(list.list()), memberIDs(spec.sorted))
			}
			if len(list.entries) != len(spec.entries) {
				t.Fatalf("seed %d step %d: %d entries, the map's %d", seed, step,
					len(list.entries), len(spec.entries))
			}
			for i, e := range list.entries {
				if i > 0 && compareKeys(list.entries[i-1].key, e.key) >= 0 {
					t.Fatalf("seed %d step %d: entries out of order at %d: %v", seed, step, i,
						e.key)
				}
				if want, ok := spec.entries[e.key]; !ok || want.print != e.print || want.at != e.at {
					t.Fatalf("seed %d step %d: entry %v %+v, the map's %+v (%v)", seed, step,
						e.key, e, want, ok)
				}
			}
			for _, k := range keys {
				got, ok := list.find(k)
				want, wantOK := spec.entries[k]
				if ok != wantOK || ok && (got.print != want.print || got.at != want.at) {
					t.Fatalf("seed %d step %d: find(%v) = %+v %v, the map's %+v %v", seed,
						step, k, got, ok, want, wantOK)
				}
			}
		}
	}
}
