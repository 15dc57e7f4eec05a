package consul

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/server"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// everything is a min_consul_index no watch has reached: a refresh asked
// for it reads every refreshable watch afresh.
const everything = math.MaxUint64

// kvWorld is worldCatalog with Consul KV beside its checks, under the one
// index: the generation keys and the lapse marks, listed by prefix as Consul
// lists them (the listing's index is its newest key's — the latest KV
// write's when it is empty — however far the checks moved on; a blocking
// listing answers when a key under the prefix changes, or when its wait
// ends, with the same content). It counts the
// fresh (index-0) reads of each watch, reports bytesPer decoded bytes per
// listing (the read budget), and can hold the blocking listings of the lapse
// marks (a replica slow to hear of a mark) or the fresh generation listings.
type kvWorld struct {
	*worldCatalog
	kv       map[string]*api.KVPair // guarded by worldCatalog.mu
	bytesPer int64

	freshMu   sync.Mutex
	fresh     map[string]int
	genGate   chan struct{} // non-nil: fresh generation listings wait for it to close
	genHeld   chan struct{} // closed when one waits
	holdMarks atomic.Bool
	cancelled atomic.Int64 // blocking listings whose context was cancelled
}

var _ lapseCatalog = (*kvWorld)(nil)

func newKVWorld(index uint64, checks ...*api.HealthCheck) *kvWorld {
	return &kvWorld{
		worldCatalog: newWorld(index, checks...),
		kv:           map[string]*api.KVPair{},
		fresh:        map[string]int{},
	}
}

// put writes a key at the next index and returns it.
func (k *kvWorld) put(key, value string) uint64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.index++
	p := &api.KVPair{Key: key, Value: []byte(value), CreateIndex: k.index, ModifyIndex: k.index}
	if old, ok := k.kv[key]; ok {
		p.CreateIndex = old.CreateIndex
	}
	k.kv[key] = p
	close(k.changed)
	k.changed = make(chan struct{})
	return k.index
}

// holdFreshGenerations makes the next fresh generation listings wait until
// release is closed; held is closed when one waits.
func (k *kvWorld) holdFreshGenerations() (held, release chan struct{}) {
	k.freshMu.Lock()
	defer k.freshMu.Unlock()
	k.genGate, k.genHeld = make(chan struct{}), make(chan struct{})
	return k.genHeld, k.genGate
}

func (k *kvWorld) count(what string, index uint64) {
	if index != 0 {
		return
	}
	k.freshMu.Lock()
	k.fresh[what]++
	k.freshMu.Unlock()
}

// freshReads is how many fresh reads each watch made so far.
func (k *kvWorld) freshReads() map[string]int {
	k.freshMu.Lock()
	defer k.freshMu.Unlock()
	out := map[string]int{}
	for n, c := range k.fresh {
		out[n] = c
	}
	return out
}

func (k *kvWorld) list(
	ctx context.Context,
	prefix string,
	index uint64,
	wait time.Duration,
) (api.KVPairs, uint64, error) {
	var timeout <-chan time.Time
	if index > 0 && wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		timeout = t.C
	}
	for {
		k.mu.Lock()
		var out api.KVPairs
		var idx, all uint64 // the prefix's newest key, every key's
		for key, p := range k.kv {
			all = max(all, p.ModifyIndex)
			if strings.HasPrefix(key, prefix) {
				cp := *p
				out = append(out, &cp)
				idx = max(idx, p.ModifyIndex)
			}
		}
		// A write under the prefix wakes a blocking listing; an empty one is
		// answered with the index of the latest KV write.
		own := idx
		if idx == 0 {
			idx = max(all, 1)
		}
		ch := k.changed
		k.mu.Unlock()
		sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
		if index == 0 || own > index {
			if sizes := readSizesOf(ctx); sizes != nil {
				sizes.decoded.Add(k.bytesPer)
			}
			return out, idx, nil
		}
		select {
		case <-ctx.Done():
			k.cancelled.Add(1)
			return nil, 0, ctx.Err()
		case <-ch:
		case <-timeout:
			index = 0 // the wait is over: the same content, at once
		}
	}
}

func (k *kvWorld) Generations(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (api.KVPairs, uint64, error) {
	k.count("generations", index)
	if index == 0 {
		k.freshMu.Lock()
		gate, held := k.genGate, k.genHeld
		k.genGate, k.genHeld = nil, nil
		k.freshMu.Unlock()
		if gate != nil {
			close(held)
			select {
			case <-gate:
			case <-ctx.Done():
				return nil, 0, ctx.Err()
			}
		}
	}
	return k.list(ctx, health.GenerationKeyPrefix, index, wait)
}

func (k *kvWorld) LapseMarks(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (api.KVPairs, uint64, error) {
	k.count("lapses", index)
	if index > 0 && k.holdMarks.Load() {
		<-ctx.Done()
		return nil, 0, ctx.Err()
	}
	return k.list(ctx, health.LapseMarkPrefix, index, wait)
}

func (k *kvWorld) ChecksInState(
	ctx context.Context,
	tag, state string,
	index uint64,
	wait time.Duration,
) (api.HealthChecks, uint64, error) {
	k.count(state, index)
	return k.worldCatalog.ChecksInState(ctx, tag, state, index, wait)
}

func (k *kvWorld) SerfHealth(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (api.HealthChecks, uint64, error) {
	k.count("serf", index)
	return k.worldCatalog.SerfHealth(ctx, index, wait)
}

// settledKVWorld runs a Watcher on a world where instance a's generation
// key was written at 100 and its lease check at 101, then the checks moved
// on to 106 (a busy fleet: a full executor going free and full again) while
// the keys did not; it returns once the set at 106 went out.
func settledKVWorld(t *testing.T, cfg WatchConfig) (*kvWorld, *Watcher, chan health.Observation) {
	t.Helper()
	return settledKVWorldOf(t, cfg, func(k *kvWorld) catalog { return k })
}

// settledKVWorldOf is settledKVWorld with the Watcher reading through
// catalogOf(the world).
func settledKVWorldOf(
	t *testing.T,
	cfg WatchConfig,
	catalogOf func(*kvWorld) catalog,
) (*kvWorld, *Watcher, chan health.Observation) {
	t.Helper()
	world := newKVWorld(
		99,
		&api.HealthCheck{
			Node:        "n1",
			CheckID:     health.SerfHealthCheckID,
			Status:      "passing",
			CreateIndex: 5,
			ModifyIndex: 5,
		},
	)
	world.put(health.GenerationKey("a"), "1") // 100
	world.set(leaseCheck("passing"))          // 101
	cfg.MinInterval, cfg.SlowInterval = time.Millisecond, time.Hour
	w, out := runWorld(t, catalogOf(world), cfg)
	var gens, lapses bool
	nextObs(
		t,
		out,
		"the first set, generation keys and lapse marks",
		func(o health.Observation) bool {
			gens, lapses = gens || o.Generations() != nil, lapses || o.Lapses() != nil
			return gens && lapses
		},
	)
	for i := range 5 {
		world.set(leaseCheck([]string{"warning", "passing"}[i%2])) // 102..106
	}
	nextObs(
		t,
		out,
		"the set at 106, with a's lease in state warning and n1's serfHealth",
		func(o health.Observation) bool {
			if o.NonPassing() == nil {
				return false
			}
			c, ok := checkIn(o.NonPassing(), "n1", health.CheckID("a", "s1", "work"))
			_, listed := checkIn(o.NonPassing(), "n1", health.SerfHealthCheckID)
			// the warning watch's answer (and its read of the critical checks)
			// is in, and the serfHealth listing's
			return ok && c.ModifyIndex == 106 && c.Status == health.StatusWarning && listed
		},
	)
	// The watcher counts the set current once it went out (just after).
	for deadline := time.Now().Add(5 * time.Second); w.refresh.atOf(npProgress) < 106; {
		if time.Now().After(deadline) {
			t.Fatalf(
				"the watcher holds its non-passing set current at %d, want 106",
				w.refresh.atOf(npProgress),
			)
		}
		// Polling an index the watch goroutine sets; no event to wait on.
		time.Sleep(time.Millisecond)
	}
	return world, w, out
}

// refreshOf runs a refresh for least and returns what went out until its
// marker.
func refreshOf(
	t *testing.T,
	w *Watcher,
	out chan health.Observation,
	least uint64,
) []health.Observation {
	t.Helper()
	seq, err := w.Refresh(context.Background(), least)
	if err != nil {
		t.Fatal(err)
	}
	var got []health.Observation
	nextObs(t, out, "the refresh's marker", func(o health.Observation) bool {
		got = append(got, o)
		return o.Refreshed() != nil && o.Refreshed().Seq >= seq
	})
	return got
}

// TestRefreshReadsOnlyTheWatchesBehind: with the checks at 106 and the
// generation keys and lapse marks last written at 100, a refresh for 106
// reads the two KV listings afresh and nothing else — not the critical or
// warning checks, not every node's serfHealth: only what is behind — beside
// their blocking listings, never cancelling them, and the keys then count as
// current at 106.
func TestRefreshReadsOnlyTheWatchesBehind(t *testing.T) {
	world, w, out := settledKVWorld(t, WatchConfig{})
	before := world.freshReads()
	got := refreshOf(t, w, out, 106)
	after := world.freshReads()
	for _, what := range []string{api.HealthCritical, api.HealthWarning, "serf"} {
		if n := after[what] - before[what]; n != 0 {
			t.Errorf(
				"%d fresh reads of %s for a refresh to 106, which the checks had reached",
				n,
				what,
			)
		}
	}
	for _, what := range []string{"generations", "lapses"} {
		if n := after[what] - before[what]; n != 1 {
			t.Errorf(
				"%d fresh reads of the %s for a refresh to 106 (they were at 100), want 1",
				n,
				what,
			)
		}
	}
	// The fresh reads went beside the blocking listings: Consul keeps a
	// blocking query its client left (and its connection) until its wait
	// ends, so a refresh that cancelled them spent one connection per watch
	// for 10 s.
	if n := world.cancelled.Load(); n != 0 {
		t.Errorf("the refresh cancelled %d blocking listings", n)
	}
	var gen, lapses uint64
	for _, o := range got {
		if o.Progress() != nil {
			gen, lapses = max(gen, o.Progress().Generations), max(lapses, o.Progress().Lapses)
		}
	}
	if gen < 106 || lapses < 106 {
		t.Fatalf(
			"before the marker: generation keys current at %d, lapse marks at %d, want ≥ 106 "+
				"(read after the checks' answer at 106)",
			gen,
			lapses,
		)
	}
}

// TestGenerationAnswerAfterAChecksAnswerIsCurrentAtItsIndex: the generation
// keys' listing keeps the index of their last write (100) however far the
// checks move on; an answer of it that arrives after the checks' answer at
// 106 was made by Consul at 106 or later, so it goes out as progress at 106
// at least — without any refresh. (It stayed at 100: every fencing call
// passing a checks index read the keys afresh.) The lapse marks alike.
func TestGenerationAnswerAfterAChecksAnswerIsCurrentAtItsIndex(t *testing.T) {
	_, _, out := settledKVWorld(t, WatchConfig{FastWait: 20 * time.Millisecond})
	var gen, lapses uint64
	nextObs(
		t,
		out,
		"the generation keys and lapse marks current at 106",
		func(o health.Observation) bool {
			if o.Progress() != nil {
				gen, lapses = max(gen, o.Progress().Generations), max(lapses, o.Progress().Lapses)
			}
			return gen >= 106 && lapses >= 106
		},
	)
}

// TestRefreshRoundsOneAtATime: while a round's fresh read is in flight,
// every request that comes joins the next round, and the next round reads
// only what is still behind — here nothing: twenty concurrent fencing calls
// cost one read of the generation keys, not a full round each.
func TestRefreshRoundsOneAtATime(t *testing.T) {
	world, w, out := settledKVWorld(t, WatchConfig{})
	held, release := world.holdFreshGenerations()
	before := world.freshReads()
	first, err := w.Refresh(context.Background(), 106)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-held:
	case <-time.After(5 * time.Second):
		t.Fatal("the generation keys were never read afresh")
	}
	var wg sync.WaitGroup
	var last atomic.Uint64
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			seq, _ := w.Refresh(context.Background(), 106)
			for l := last.Load(); seq > l && !last.CompareAndSwap(l, seq); l = last.Load() {
			}
		}()
	}
	wg.Wait()
	if n := last.Load(); n != first+1 {
		t.Errorf(
			"requests made during round %d were given round %d, want %d (the next one, shared)",
			first,
			n,
			first+1,
		)
	}
	close(release)
	nextObs(
		t,
		out,
		"the marker of the shared round",
		func(o health.Observation) bool {
			return o.Refreshed() != nil && o.Refreshed().Seq >= last.Load()
		},
	)
	after := world.freshReads()
	if n := after["generations"] - before["generations"]; n != 1 {
		t.Errorf("21 refresh requests for 106 read the generation keys %d times, want once", n)
	}
	for _, what := range []string{api.HealthCritical, api.HealthWarning, "serf"} {
		if n := after[what] - before[what]; n != 0 {
			t.Errorf(
				"21 refresh requests for 106 read the %s checks %d times afresh, want none (they "+
					"were at 106)",
				what,
				n,
			)
		}
	}
}

// TestRefreshReadsTheLapseMarksWhenBehind: a replica whose watch of the
// lapse marks has not heard of a mark written at index M (its blocking
// listing is slow) reads them afresh for a refresh to M, and the mark goes
// out before the refresh's marker: a LAPSED answer carries an index at or
// above its mark's, so a replica asked with it knows the lapse. (The lapse
// marks were not refreshed at all.)
func TestRefreshReadsTheLapseMarksWhenBehind(t *testing.T) {
	world, w, out := settledKVWorld(t, WatchConfig{})
	world.holdMarks.Store(true)
	m := world.put(health.LapseMarkKey("a", "s0"), `{"generation":1}`)
	got := refreshOf(t, w, out, m)
	for _, o := range got {
		if o.Lapses() != nil {
			for _, mark := range o.Lapses().Marks {
				if mark.InstanceID == "a" && mark.SessionID == "s0" {
					return
				}
			}
		}
	}
	t.Fatalf(
		"a refresh to %d (the lapse mark's index) ended without the mark (%d observations before "+
			"its marker)",
		m,
		len(got),
	)
}

// TestRefreshRoundsHaveTheirOwnShareOfTheReadBudget: a round is charged
// with what it read to the refreshes' share of the read budget — not to the
// generation keys' own, whose next read (a STALE) never waits for fencing's
// — and the next round that must read waits while that share is in debt.
// (A refresh was charged to the watch's budget and never waited: fencing
// calls passing min_consul_index could re-read the keys as fast as Consul
// answers.)
func TestRefreshRoundsHaveTheirOwnShareOfTheReadBudget(t *testing.T) {
	h := startWatcher(
		t,
		WatchConfig{
			MinInterval:  time.Millisecond,
			ReadRate:     1000,
			ReadBurst:    1000,
			SlowInterval: time.Hour,
		},
	)
	// the generation keys at 3, then the critical checks at 5
	h.cat.push("generations", scripted{index: 3})
	for o := h.observe(); o.Generations() == nil; o = h.observe() {
	}
	h.cat.push("nonpassing", scripted{index: 5})
	for o := h.observe(); o.NonPassing() == nil; o = h.observe() {
	}
	// (the set is vouched for only up to its serfHealth listing, here below
	// 5: round 1 may read the checks afresh too, at no cost in the fake)
	freshGenerations := func(after int64) { // a fresh read of the keys made after call after
		t.Helper()
		for c := h.cat.call(t, "generations"); c.index != 0 || c.seq <= after; {
			c = h.cat.call(t, "generations")
		}
	}
	refreshed := func(seq uint64) {
		t.Helper()
		for o := h.observe(); o.Refreshed() == nil || o.Refreshed().Seq < seq; o = h.observe() {
		}
	}

	// Round 1 reads the keys afresh: 1000 bytes against the refreshes' burst
	// of 250 (a quarter of the budget's), 3 s of debt at their 250 B/s.
	mark := h.cat.seq.Load()
	seq, _ := h.w.Refresh(context.Background(), 5)
	freshGenerations(mark)
	h.cat.push("generations/fresh", scripted{index: 3, bytes: 1000})
	refreshed(seq)
	for deadline := time.Now().Add(5 * time.Second); h.w.refreshBudget.delay() != 3*time.Second; {
		if time.Now().After(deadline) {
			t.Fatalf(
				"the refreshes' debt is %s after a read of 1000 bytes, want 3s",
				h.w.refreshBudget.delay(),
			)
		}
		// Polling a counter the watch goroutine sets; no event to wait on.
		time.Sleep(time.Millisecond)
	}
	if d := h.w.genBudget.delay(); d != 0 {
		t.Fatalf(
			"the generation keys' own budget is %s in debt after a refresh's read: their next "+
				"read of a raised generation waits for fencing's",
			d,
		)
	}

	// Round 2 (the checks moved on to 8) waits for the debt.
	h.cat.push("nonpassing", scripted{index: 8})
	for deadline := time.After(5 * time.Second); ; {
		// The critical watch pauses on the fake clock first.
		h.clock.Advance(time.Millisecond)
		select {
		case c := <-h.cat.calls:
			if c.method != "nonpassing" || c.index < 8 {
				continue
			}
		case <-time.After(5 * time.Millisecond): // then advance again
			continue
		case <-deadline:
			t.Fatal("the critical checks' answer at 8 was never taken")
		}
		break // it blocks at 8: the answer at 8 was taken
	}
	mark = h.cat.seq.Load()
	seq, _ = h.w.Refresh(context.Background(), 8)
	var advanced time.Duration
	for deadline := time.After(5 * time.Second); ; {
		h.clock.Advance(100 * time.Millisecond)
		advanced += 100 * time.Millisecond
		read := func() bool {
			for {
				select {
				case c := <-h.cat.calls:
					if c.method == "generations" && c.index == 0 && c.seq > mark {
						return true
					}
				case <-time.After(5 * time.Millisecond): // then advance again
					return false
				}
			}
		}()
		if read {
			break
		}
		select {
		case <-deadline:
			t.Fatal("round 2 never read the generation keys")
		default:
		}
	}
	if advanced < 2900*time.Millisecond {
		t.Fatalf(
			"round 2 read the generation keys after %s, while the refreshes' share was 3 s in debt",
			advanced,
		)
	}
	h.cat.push("generations/fresh", scripted{index: 3})
	refreshed(seq)
}

// probingKVWorld is a kvWorld that also answers the index of its latest KV
// write, as apiCatalog.KVIndex reads it from Consul.
type probingKVWorld struct {
	*kvWorld
	probes atomic.Int64
}

var _ kvIndexCatalog = (*probingKVWorld)(nil)

func (p *probingKVWorld) KVIndex(context.Context) (uint64, bool, error) {
	p.probes.Add(1)
	p.mu.Lock()
	defer p.mu.Unlock()
	idx := uint64(1)
	for _, kv := range p.kv {
		idx = max(idx, kv.ModifyIndex)
	}
	return idx, true, nil
}

// TestRefreshAsksWhetherAKVWriteFollowedBeforeReadingTheListings: with the
// checks at 106 and no KV write since 100, a refresh for 106 reads neither
// the generation keys nor the lapse marks: one small read (the index of the
// latest KV write, 100) tells that their answers are still current, and
// they count as current at 106. Once a key is written (107) a refresh reads
// the listings it cannot vouch for any more.
func TestRefreshAsksWhetherAKVWriteFollowedBeforeReadingTheListings(t *testing.T) {
	var probing *probingKVWorld
	world, w, out := settledKVWorldOf(t, WatchConfig{}, func(k *kvWorld) catalog {
		probing = &probingKVWorld{kvWorld: k}
		return probing
	})
	before := world.freshReads()
	got := refreshOf(t, w, out, 106)
	after := world.freshReads()
	for _, what := range []string{api.HealthCritical, api.HealthWarning, "serf", "generations",
		"lapses"} {
		if n := after[what] - before[what]; n != 0 {
			t.Errorf(
				"%d fresh reads of %s for a refresh to 106 with no KV write since 100",
				n,
				what,
			)
		}
	}
	if n := probing.probes.Load(); n != 1 {
		t.Errorf("%d reads of the latest KV write's index, want 1", n)
	}
	var gen, lapses uint64
	for _, o := range got {
		if o.Progress() != nil {
			gen, lapses = max(gen, o.Progress().Generations), max(lapses, o.Progress().Lapses)
		}
	}
	if gen < 106 || lapses < 106 {
		t.Fatalf(
			"before the marker: generation keys current at %d, lapse marks at %d, want ≥ 106",
			gen,
			lapses,
		)
	}

	// 107: the lapse marks cannot be vouched for past 106 any more.
	world.put(health.GenerationKey("b"), "1")
	before = world.freshReads()
	refreshOf(t, w, out, 107)
	after = world.freshReads()
	if n := after["lapses"] - before["lapses"]; n != 1 {
		t.Errorf(
			"%d fresh reads of the lapse marks for a refresh to 107 after a KV write at 107, "+
				"want 1",
			n,
		)
	}
}

// instantCatalog is an idle Consul: a query at index 0 is answered at once,
// a blocking query (index > 0) waits out its wait time (or its context), as
// Consul does when nothing changes. It counts the fresh (index-0) reads of
// the non-passing checks and the generation keys.
type instantCatalog struct {
	freshNP, freshGen atomic.Int64
}

func (c *instantCatalog) block(ctx context.Context, index uint64, wait time.Duration) error {
	if index == 0 {
		return nil
	}
	if wait <= 0 {
		wait = time.Minute
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func (c *instantCatalog) Services(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (map[string][]string, uint64, error) {
	if err := c.block(ctx, index, wait); err != nil {
		return nil, 0, err
	}
	return map[string][]string{"consul": nil, "work": {"leasehold"}}, 10, nil
}

func (c *instantCatalog) ServiceNodes(
	ctx context.Context,
	task, tag string,
	index uint64,
	wait time.Duration,
) ([]*api.CatalogService, uint64, error) {
	if err := c.block(ctx, index, wait); err != nil {
		return nil, 0, err
	}
	return []*api.CatalogService{
		{Node: "n1", ServiceID: health.ServiceID("x", "work"), CreateIndex: 30, ModifyIndex: 30,
			ServiceMeta: map[string]string{health.MetaSessionID: "s1"}},
	}, 30, nil
}

func (c *instantCatalog) HealthService(
	ctx context.Context,
	task, tag string,
	_ []string,
) ([]*api.ServiceEntry, uint64, error) {
	reg := health.Registration{
		InstanceID: "x",
		SessionID:  "s1",
		Generation: 1,
		Task:       "work",
		Address:    "127.0.0.1",
		Port:       9001,
		Version:    "1.0.0",
		Capacity:   4,
		State:      health.StateActive,
	}
	return []*api.ServiceEntry{{
		Node: &api.Node{Node: "n1", Address: "127.0.0.1"},
		Service: &api.AgentService{
			ID:          health.ServiceID("x", "work"),
			Service:     "work",
			Tags:        []string{"leasehold"},
			Address:     "127.0.0.1",
			Port:        9001,
			Meta:        reg.Meta(),
			CreateIndex: 30,
			ModifyIndex: 30,
		},
		Checks: api.HealthChecks{
			{
				Node:        "n1",
				CheckID:     health.SerfHealthCheckID,
				Status:      api.HealthPassing,
				CreateIndex: 5,
				ModifyIndex: 5,
			},
			{
				Node:        "n1",
				CheckID:     health.CheckID("x", "s1", "work"),
				ServiceID:   health.ServiceID("x", "work"),
				Status:      api.HealthPassing,
				Output:      "load=0",
				CreateIndex: 30,
				ModifyIndex: 30,
			},
		},
	}}, 30, nil
}

func (c *instantCatalog) ChecksInState(
	ctx context.Context,
	tag, state string,
	index uint64,
	wait time.Duration,
) (api.HealthChecks, uint64, error) {
	if index == 0 && state == api.HealthCritical {
		c.freshNP.Add(1)
	}
	if err := c.block(ctx, index, wait); err != nil {
		return nil, 0, err
	}
	return nil, 31, nil
}

func (c *instantCatalog) SerfHealth(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (api.HealthChecks, uint64, error) {
	if err := c.block(ctx, index, wait); err != nil {
		return nil, 0, err
	}
	return api.HealthChecks{
		{
			Node:        "n1",
			CheckID:     health.SerfHealthCheckID,
			Status:      api.HealthPassing,
			CreateIndex: 5,
			ModifyIndex: 5,
		},
	}, 31, nil
}

func (c *instantCatalog) NodeSerf(ctx context.Context, node string) (*api.HealthCheck, error) {
	return &api.HealthCheck{
		Node:        node,
		CheckID:     health.SerfHealthCheckID,
		Status:      api.HealthPassing,
		CreateIndex: 5,
		ModifyIndex: 5,
	}, nil
}

func (c *instantCatalog) Generations(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (api.KVPairs, uint64, error) {
	if index == 0 {
		c.freshGen.Add(1)
	}
	if err := c.block(ctx, index, wait); err != nil {
		return nil, 0, err
	}
	return api.KVPairs{
		{Key: health.GenerationKey("x"), Value: []byte("1"), ModifyIndex: 29},
	}, 29, nil
}

// TestConcurrentRefreshesEachGetTheirMarker: Refresh calls made together
// (fencing requests arriving at once, every one with a min_consul_index, as
// examples/dispatcher sends them) each get a Refreshed marker at least as high
// as the sequence number they were given, soon, on an idle Consul. A marker
// lost to two calls interleaving would have the later caller wait out its
// request's deadline and answer UNKNOWN, although the watches did read Consul
// afresh after it began.
func TestConcurrentRefreshesEachGetTheirMarker(t *testing.T) {
	cat := &instantCatalog{}
	out := make(chan health.Observation, 64)
	w := newWatcher(
		cat,
		WatchConfig{
			MinInterval: time.Millisecond,
			Logger:      slog.New(slog.NewTextHandler(io.Discard, nil)),
			Out:         out,
		},
	)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)
	var mu sync.Mutex
	var marker uint64
	markerChanged := make(chan struct{}, 1)
	go func() {
		for o := range out {
			if o.Refreshed() != nil {
				mu.Lock()
				marker = max(marker, o.Refreshed().Seq)
				mu.Unlock()
				select {
				case markerChanged <- struct{}{}:
				default:
				}
			}
		}
	}()
	waitMarker := func(want uint64, d time.Duration) bool {
		deadline := time.After(d)
		for {
			mu.Lock()
			got := marker
			mu.Unlock()
			if got >= want {
				return true
			}
			select {
			case <-markerChanged:
			case <-deadline:
				return false
			}
		}
	}
	for burst := 0; burst < 3000; burst++ {
		var wg sync.WaitGroup
		var highest atomic.Uint64
		for range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				seq, _ := w.Refresh(ctx, everything)
				for h := highest.Load(); seq > h && !highest.CompareAndSwap(h,
					seq); h = highest.Load() {
				}
			}()
		}
		wg.Wait()
		if !waitMarker(highest.Load(), 2*time.Second) {
			mu.Lock()
			got := marker
			mu.Unlock()
			t.Fatalf(
				"burst %d: Refresh returned seq %d, but after 2 s (no further Refresh) the "+
					"highest Refreshed marker is %d: "+
					"the caller of %d waits out its deadline and answers UNKNOWN (%d fresh "+
					"non-passing reads, %d fresh generation reads so far)",
				burst,
				highest.Load(),
				got,
				highest.Load(),
				cat.freshNP.Load(),
				cat.freshGen.Load(),
			)
		}
	}
}

// TestConcurrentFencingRequestsWithAMinIndexAnswerCurrent is the same through
// the fencing API, wired as `leasehold serve` wires it (Watcher.Refresh):
// every CheckSession call of a burst for a CURRENT session, each with a
// min_consul_index the view has not reached, on an idle and healthy Consul, is
// answered CURRENT, none UNKNOWN ("reading Consul afresh did not finish in
// time").
func TestConcurrentFencingRequestsWithAMinIndexAnswerCurrent(t *testing.T) {
	cat := &instantCatalog{}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	obs := make(chan health.Observation, 64)
	w := newWatcher(cat, WatchConfig{MinInterval: time.Millisecond, Logger: log, Out: obs})
	syncer := fleet.NewSyncer(fleet.SyncConfig{Logger: log})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); w.Run(ctx) }()
	go func() { defer wg.Done(); syncer.Run(ctx, obs) }()
	defer func() { cancel(); wg.Wait() }()
	f := server.NewFencing(
		syncer,
		func(string) time.Time { return w.FreshAsOf() },
		server.FencingOptions{
			Refresh: func(ctx context.Context, _ string, atLeast uint64) (uint64,
				error) {
				return w.Refresh(ctx, atLeast)
			},
		},
	)

	deadline := time.Now().Add(5 * time.Second)
	for v := syncer.View(); !v.Synced; v = syncer.View() {
		if time.Now().After(deadline) {
			t.Fatal("never synced")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The dispatcher's min index: any index above what the checks and the
	// generation keys last changed at (here: the membership's, 30).
	const minIndex = 30
	const perBurst = 16
	for burst := 0; burst < 3000; burst++ {
		var unknown atomic.Int64
		var slowest atomic.Int64
		var rg sync.WaitGroup
		start := make(chan struct{})
		for range perBurst {
			rg.Add(1)
			go func() {
				defer rg.Done()
				<-start
				rctx, rcancel := context.WithTimeout(context.Background(), time.Second)
				defer rcancel()
				start := time.Now()
				r, err := f.CheckSession(
					rctx,
					&leaseholdv1.CheckSessionRequest{
						InstanceId:     "x",
						SessionId:      "s1",
						MinConsulIndex: minIndex,
					},
				)
				took := time.Since(start)
				for s := slowest.Load(); int64(took) > s && !slowest.CompareAndSwap(s,
					int64(took)); s = slowest.Load() {
				}
				if err != nil || r.State != leaseholdv1.SessionState_CURRENT {
					unknown.Add(1)
					t.Logf(
						"burst %d: %v %v after %s",
						burst,
						r.GetState(),
						r.GetDetail(),
						took.Round(time.Millisecond),
					)
				}
			}()
		}
		close(start)
		rg.Wait()
		if n := unknown.Load(); n > 0 {
			t.Fatalf(
				"burst %d: %d of %d concurrent fencing requests for a CURRENT session on an "+
					"idle, healthy Consul were not answered CURRENT (slowest %s): a Refresh kick "+
					"was lost",
				burst,
				n,
				perBurst,
				time.Duration(slowest.Load()).Round(time.Millisecond),
			)
		}
	}
}

func (c *instantCatalog) GenerationKeys(context.Context, []string) (api.KVPairs, error) {
	return nil, nil
}

// TestRefreshListsEveryNodeSerfHealthOnce: a Refresh lists every node's
// serfHealth (a scan of every check in the datacenter) once, the serf watch's
// fresh read. The fast watches' fresh reads are made beside their blocking
// queries, which go on: no cancelled query counts as a failure, so no gap
// opens and no second listing is taken under the fast path's lock.
func TestRefreshListsEveryNodeSerfHealthOnce(t *testing.T) {
	world := newWorld(
		99,
		&api.HealthCheck{
			Node:        "n1",
			CheckID:     health.SerfHealthCheckID,
			Status:      "passing",
			CreateIndex: 5,
			ModifyIndex: 5,
		},
	)
	world.set(leaseCheck("passing"))
	fw := newFaulty(world)
	w, out := runWorld(t, fw, WatchConfig{MinInterval: time.Millisecond, SlowInterval: time.Hour})
	nextObs(t, out, "first set", func(o health.Observation) bool { return o.NonPassing() != nil })
	time.Sleep(100 * time.Millisecond)
	const n = 5
	before := fw.serfCalls.Load()
	for i := 0; i < n; i++ {
		seq, _ := w.Refresh(context.Background(), everything)
		nextObs(
			t,
			out,
			"refreshed",
			func(o health.Observation) bool { return o.Refreshed() != nil && o.Refreshed().Seq >= seq },
		)
	}
	per := float64(fw.serfCalls.Load()-before) / n
	t.Logf("serfHealth listings per Refresh: %.1f", per)
	if per > 1.5 {
		t.Errorf(
			"each Refresh lists every node's serfHealth %.1f times (the serf watch's fresh read "+
				"is one; the rest come from the gap a cancelled blocking query opens)",
			per,
		)
	}
}

// TestRefreshWhoseFreshReadFailsIsAnsweredByTheNextRead: a refresh request
// taken by a watch whose fresh read then fails is not lost: the watch's next
// successful read, after its back-off, answers it, so fencing waiting on it
// hears as soon as Consul answers again instead of at its deadline.
func TestRefreshWhoseFreshReadFailsIsAnsweredByTheNextRead(t *testing.T) {
	world := newWorld(
		99,
		&api.HealthCheck{
			Node:        "n1",
			CheckID:     health.SerfHealthCheckID,
			Status:      "passing",
			CreateIndex: 5,
			ModifyIndex: 5,
		},
	)
	world.set(leaseCheck("passing"))
	fw := newFaulty(world)
	w, out := runWorld(
		t,
		fw,
		WatchConfig{
			MinInterval:  time.Millisecond,
			SlowInterval: time.Hour,
			MaxBackoff:   50 * time.Millisecond,
		},
	)
	nextObs(t, out, "first set", func(o health.Observation) bool { return o.NonPassing() != nil })
	fw.mu.Lock()
	fw.failFresh[api.HealthCritical] = 1
	fw.mu.Unlock()
	seq, _ := w.Refresh(context.Background(), everything)
	nextObs(
		t,
		out,
		"refreshed after the failed fresh read",
		func(o health.Observation) bool { return o.Refreshed() != nil && o.Refreshed().Seq >= seq },
	)
	fw.mu.Lock()
	defer fw.mu.Unlock()
	if fw.failFresh[api.HealthCritical] != 0 {
		t.Fatal("the injected failure was never hit: the test proves nothing")
	}
}

// refreshOnAnswer is a world whose blocking critical answer, once armed,
// arrives once a Refresh's fresh read of the critical checks began: the
// answer was on its way, then the refresh came.
type refreshOnAnswer struct {
	*worldCatalog
	w     *Watcher
	armed atomic.Bool
	fresh chan struct{} // a fresh read of the critical checks began
}

func (r *refreshOnAnswer) ChecksInState(
	ctx context.Context,
	tag, state string,
	index uint64,
	wait time.Duration,
) (api.HealthChecks, uint64, error) {
	if index == 0 && state == api.HealthCritical {
		select {
		case r.fresh <- struct{}{}:
		default:
		}
	}
	cs, idx, err := r.worldCatalog.ChecksInState(ctx, tag, state, index, wait)
	if err == nil && index > 0 && state == api.HealthCritical &&
		r.armed.CompareAndSwap(true, false) {
		select { // an earlier fresh read (the warning watch's) says nothing
		case <-r.fresh:
		default:
		}
		r.w.Refresh(context.Background(), everything)
		select {
		case <-r.fresh:
		case <-ctx.Done():
		}
	}
	return cs, idx, err
}

// TestRefreshDuringAnAnswerLosesNothing: a Refresh comes while the blocking
// query's answer is on its way; what that answer carried (a lapse) still goes
// out. The blocking query goes on beside the fresh read, never cancelled by
// it: an answer sent under a cancelled context could be dropped, and the fresh
// read, finding the same set, would send only progress, so the lapse would
// never be reported.
func TestRefreshDuringAnAnswerLosesNothing(t *testing.T) {
	world := newWorld(
		99,
		&api.HealthCheck{
			Node:        "n1",
			CheckID:     health.SerfHealthCheckID,
			Status:      "passing",
			CreateIndex: 5,
			ModifyIndex: 5,
		},
	)
	world.set(leaseCheck("passing"))
	cat := &refreshOnAnswer{worldCatalog: world, fresh: make(chan struct{}, 1)}
	w, out := runWorld(t, cat, WatchConfig{MinInterval: time.Millisecond, SlowInterval: time.Hour})
	cat.w = w // read only once armed (below): the atomic orders it
	nextObs(t, out, "first set", func(o health.Observation) bool { return o.NonPassing() != nil })
	for i := range 20 {
		status := []string{"critical", "passing"}[i%2]
		cat.armed.Store(true)
		world.set(leaseCheck(status))
		nextObs(
			t,
			out,
			fmt.Sprintf("round %d: a's lease %s", i, status),
			func(o health.Observation) bool {
				if o.NonPassing() == nil {
					return false
				}
				c, ok := checkIn(o.NonPassing(), "n1", health.CheckID("a", "s1", "work"))
				return (status == "critical") == (ok && c.Status == health.StatusCritical)
			},
		)
	}
}
