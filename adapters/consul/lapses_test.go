package consul

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

// lapseRetention is the retention the pruning tests run with: serve's.
const lapseRetention = 73 * time.Hour

// registerSession registers instance's session for task on node straight
// into c's catalog (a registration the pruner must find wherever it is).
func registerSession(t *testing.T, c *api.Client, node, task, instance, session string) {
	t.Helper()
	reg := health.Registration{InstanceID: instance, SessionID: session, Generation: 1, Task: task,
		Address: "127.0.0.1", Port: 9400, Version: "1.0.0", Capacity: 1, State: health.StateActive}
	_, err := c.Catalog().Register(&api.CatalogRegistration{
		Node: node, Address: "127.0.0.1", SkipNodeUpdate: true,
		Service: &api.AgentService{
			ID:      health.ServiceID(instance, task),
			Service: task,
			Tags:    []string{health.DefaultTag},
			Address: "127.0.0.1",
			Port:    9400,
			Meta:    reg.Meta(),
		},
		Check: &api.AgentCheck{
			Node:      node,
			CheckID:   health.CheckID(instance, session, task),
			Name:      "lease",
			ServiceID: health.ServiceID(instance, task),
			Status:    api.HealthCritical,
		},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
}

// deregisterSession removes instance's registration for task from node.
func deregisterSession(t *testing.T, c *api.Client, node, task, instance string) {
	t.Helper()
	_, err := c.Catalog().Deregister(&api.CatalogDeregistration{Node: node,
		ServiceID: health.ServiceID(instance, task)}, nil)
	if err != nil {
		t.Fatal(err)
	}
}

// newPruner is a LapseRecorder on clock, as serve's (73 h).
func newPruner(c *api.Client, clock clockwork.Clock, datacenters ...string) *LapseRecorder {
	return NewLapseRecorder(
		c,
		LapseRecorderConfig{Retention: lapseRetention, Datacenters: datacenters, Clock: clock},
	)
}

// recordLapse records x/s1's lapse (task work) with r and writes it.
func recordLapse(t *testing.T, r *LapseRecorder) {
	t.Helper()
	r.Record(
		health.Executor{
			Registration: health.Registration{
				InstanceID: "x",
				SessionID:  "s1",
				Generation: 1,
				Task:       "work",
			},
		},
	)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if !r.flush(ctx) {
		t.Fatal("lapse mark not written")
	}
}

// prune runs one prune of r and fails the test on an error.
func prune(t *testing.T, r *LapseRecorder) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.Prune(ctx); err != nil {
		t.Fatalf("prune: %v", err)
	}
}

// markIn reads x/s1's mark in c's datacenter dc (nil: there is none).
func markIn(t *testing.T, c *api.Client, dc string) (*api.KVPair, health.LapseMark) {
	t.Helper()
	p, _, err := c.KV().Get(health.LapseMarkKey("x", "s1"), &api.QueryOptions{Datacenter: dc})
	if err != nil {
		t.Fatal(err)
	}
	if p == nil {
		return nil, health.LapseMark{}
	}
	m, err := health.ParseLapseMark(p.Key, p.Value)
	if err != nil {
		t.Fatal(err)
	}
	return p, m
}

// wantMark fails unless x/s1's mark is there with unregistered time want.
func wantMark(t *testing.T, c *api.Client, dc string, want time.Duration, when string) *api.KVPair {
	t.Helper()
	p, m := markIn(t, c, dc)
	if p == nil {
		t.Fatalf("%s: x/s1's lapse mark pruned", when)
	}
	if m.Unregistered() != want {
		t.Fatalf(
			"%s: x/s1's mark %s counts %v unregistered, want %v",
			when,
			p.Value,
			m.Unregistered(),
			want,
		)
	}
	return p
}

// wantNoMark fails while x/s1's mark is there.
func wantNoMark(t *testing.T, c *api.Client, dc, when string) {
	t.Helper()
	if p, _ := markIn(t, c, dc); p != nil {
		t.Fatalf("%s: x/s1's lapse mark %s still there", when, p.Value)
	}
}

// A lapse mark is kept for as long as its session has a registration in
// the catalog — in any task (not only the one it lapsed in), on any node
// —, however long ago the lapse was; the retention counts from when the
// last registration went: 73 h of prunes that found none.
func TestPruneKeepsTheMarkWhileItsSessionIsRegistered(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	registerSession(t, c, "node-a", "work", "x", "s1")
	registerSession(t, c, "node-b", "batch", "x", "s1")
	clock := clockwork.NewFakeClock()
	r := newPruner(c, clock)
	recordLapse(t, r)

	for range 4 {
		prune(t, r)
		wantMark(t, c, "", 0, "registered in two tasks")
		clock.Advance(50 * time.Hour)
	}
	deregisterSession(t, c, "node-a", "work", "x") // where it lapsed: gone
	prune(t, r)
	clock.Advance(100 * time.Hour)
	prune(t, r)
	wantMark(t, c, "", 0, "registered in another task, 350 h after its lapse")

	deregisterSession(t, c, "node-b", "batch", "x")
	prune(t, r) // the first prune that finds it unregistered: counting starts
	wantMark(t, c, "", 0, "just unregistered")
	clock.Advance(72 * time.Hour)
	prune(t, r)
	wantMark(t, c, "", 72*time.Hour, "72 h unregistered")
	clock.Advance(59 * time.Minute)
	prune(t, r)
	wantMark(t, c, "", 72*time.Hour+59*time.Minute, "72 h 59 min unregistered")
	clock.Advance(time.Minute)
	prune(t, r)
	wantNoMark(t, c, "", "73 h unregistered")
}

// A session registered again (its node came back before Consul reaped it)
// starts the retention over: the time counted before is forgotten.
func TestPruneStartsTheRetentionOverWhenTheSessionRegistersAgain(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	registerSession(t, c, "node-a", "work", "x", "s1")
	clock := clockwork.NewFakeClock()
	r := newPruner(c, clock)
	recordLapse(t, r)
	deregisterSession(t, c, "node-a", "work", "x")
	prune(t, r)
	clock.Advance(60 * time.Hour)
	prune(t, r)
	wantMark(t, c, "", 60*time.Hour, "60 h unregistered")

	registerSession(t, c, "node-a", "work", "x", "s1")
	prune(t, r)
	wantMark(t, c, "", 0, "registered again")
	deregisterSession(t, c, "node-a", "work", "x")
	prune(t, r)
	clock.Advance(60 * time.Hour)
	prune(t, r)
	wantMark(t, c, "", 60*time.Hour, "60 h unregistered again (120 h in all)")
	clock.Advance(13 * time.Hour)
	prune(t, r)
	wantNoMark(t, c, "", "73 h unregistered since it last was")
}

// Two replicas prune the same mark, taking turns, one's wall clock 10 h
// ahead of the other's and of the one that stamped the lapse: the mark
// goes after 73 h of real time unregistered, not earlier (no wall clock
// compared with another's, no interval counted twice) and not later.
func TestPruneCountsOnceWhateverTheReplicasAndTheirClocks(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	registerSession(t, c, "node-a", "work", "x", "s1")
	start := time.Now()
	clockA, clockB := clockwork.NewFakeClockAt(
		start,
	), clockwork.NewFakeClockAt(
		start.Add(10*time.Hour),
	)
	ra, rb := newPruner(c, clockA), newPruner(c, clockB)
	recordLapse(t, ra)
	deregisterSession(t, c, "node-a", "work", "x")

	prune(t, ra)
	prune(t, rb)
	for h := 1; ; h++ {
		clockA.Advance(time.Hour)
		clockB.Advance(time.Hour)
		first, second := ra, rb
		if h%2 == 0 {
			first, second = rb, ra
		}
		prune(t, first)
		prune(t, second)
		if h < 73 {
			wantMark(
				t,
				c,
				"",
				time.Duration(h)*time.Hour,
				"unregistered for "+time.Duration(h*int(time.Hour)).String(),
			)
			continue
		}
		wantNoMark(t, c, "", "unregistered for 73 h")
		return
	}
}

// Marks are kept when the catalog cannot be read: here the token may
// write the marks but read no service, so the pruner cannot tell whether
// their sessions are registered.
func TestPruneRemovesNothingWhenTheCatalogCannotBeRead(t *testing.T) {
	a := consultest.Start(t, consultest.Options{ACLManagementToken: aclRoot})
	root := a.Client()
	c := clientWith(t, a, "marks-only", `key_prefix "leasehold/lapsed/" { policy = "write" }`)
	clock := clockwork.NewFakeClock()
	r := newPruner(c, clock)
	recordLapse(t, r) // x/s1 has no registration at all
	for range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := r.Prune(ctx)
		cancel()
		if err == nil || !strings.Contains(err.Error(), "nothing pruned") {
			t.Fatalf("prune without catalog rights: %v, want nothing pruned", err)
		}
		wantMark(t, root, "", 0, "catalog unreadable")
		clock.Advance(100 * time.Hour)
	}
}

// Marks written by older versions ({"generation", "at", "tasks"} only)
// are read: counted from the first prune that finds their session
// unregistered, not from their "at" (years ago here), and rewritten with
// everything they held, also fields this version does not know. A mark
// whose value cannot be read is kept as it is.
func TestPruneReadsMarksOfOlderVersions(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	old := `{"generation":4,"at":"2020-01-02T03:04:05Z","tasks":["work"],"future":"kept"}`
	for key, v := range map[string]string{health.LapseMarkKey("x", "s1"): old,
		health.LapseMarkKey("y", "s1"): "not json"} {
		if _, err := c.KV().Put(&api.KVPair{Key: key, Value: []byte(v)}, nil); err != nil {
			t.Fatal(err)
		}
	}
	clock := clockwork.NewFakeClock()
	r := newPruner(c, clock)
	prune(t, r)
	wantMark(t, c, "", 0, "an older version's mark, lapsed years ago")
	clock.Advance(72 * time.Hour)
	prune(t, r)
	p := wantMark(t, c, "", 72*time.Hour, "72 h unregistered")
	for _, field := range []string{`"generation":4`, `"at":"2020-01-02T03:04:05Z"`,
		`"tasks":["work"]`, `"future":"kept"`} {
		if !strings.Contains(string(p.Value), field) {
			t.Errorf("rewritten as %s: %s lost", p.Value, field)
		}
	}
	clock.Advance(time.Hour)
	prune(t, r)
	wantNoMark(t, c, "", "73 h unregistered")
	if q, _, err := c.KV().Get(health.LapseMarkKey("y", "s1"), nil); err != nil || q == nil ||
		string(q.Value) != "not json" {
		t.Fatalf("the unreadable mark: %v %v, want kept as it was", q, err)
	}
}

// A mark is kept while its session has a registration in another of the
// datacenters (marks fence a session in every datacenter), and pruned
// after the retention once it has none anywhere.
func TestPruneKeepsTheMarkWhileItsSessionIsRegisteredInAnotherDatacenter(t *testing.T) {
	dc1 := consultest.Start(t, consultest.Options{Datacenter: "dc1"})
	dc2 := consultest.Start(t, consultest.Options{Datacenter: "dc2", FederateWith: dc1})
	c := dc1.Client()
	consultest.WaitFor(t, 30*time.Second, "dc2 read through dc1", func() bool {
		_, _, err := c.Catalog().Services(&api.QueryOptions{Datacenter: "dc2"})
		return err == nil
	})
	registerSession(t, dc2.Client(), "node-b", "work", "x", "s1")
	clock := clockwork.NewFakeClock()
	r := newPruner(c, clock, "dc1", "dc2")
	m := health.LapseMark{
		InstanceID: "x",
		SessionID:  "s1",
		Generation: 1,
		At:         clock.Now().UTC(),
		Tasks:      []string{"work"},
	}
	_, err := c.KV().Put(&api.KVPair{Key: health.LapseMarkKey("x", "s1"), Value: m.Value()},
		&api.WriteOptions{Datacenter: "dc1"})
	if err != nil {
		t.Fatal(err)
	}
	prune(t, r)
	clock.Advance(100 * time.Hour)
	prune(t, r)
	wantMark(t, c, "dc1", 0, "registered in dc2")

	deregisterSession(t, dc2.Client(), "node-b", "work", "x")
	prune(t, r)
	clock.Advance(lapseRetention)
	prune(t, r)
	wantNoMark(t, c, "dc1", "unregistered everywhere for 73 h")
}

// lapseOf is instance's session s1 lapsing in task.
func lapseOf(instance, task string) health.Executor {
	return health.Executor{Registration: health.Registration{
		InstanceID: instance, SessionID: "s1", Generation: 1, Task: task}}
}

// awaitMarks waits (blocking queries) until c holds n lapse marks, and
// returns them by key.
func awaitMarks(t *testing.T, c *api.Client, n int) map[string]*api.KVPair {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var index uint64
	for {
		pairs, meta, err := c.KV().List(health.LapseMarkPrefix,
			(&api.QueryOptions{WaitIndex: index, WaitTime: 5 * time.Second}).WithContext(ctx))
		if err != nil {
			t.Fatalf("%d lapse marks awaited: %v", n, err)
		}
		if len(pairs) >= n {
			byKey := map[string]*api.KVPair{}
			for _, p := range pairs {
				byKey[p.Key] = p
			}
			return byKey
		}
		index = meta.LastIndex
	}
}

// The marks of lapses seen within the gather are written together, one
// transaction of up to 64 (Consul's limit) at a time, and not before the
// gather ends: 69 sessions are two transactions, so their marks carry two
// creation indexes. A mark another replica wrote first stays as it is (its
// check-and-set failing rolled the first transaction back; it is written
// again without it), and a session recorded twice (two task types) is one
// mark, its first.
func TestMarksSeenTogetherAreWrittenInOneTransaction(t *testing.T) {
	c := consultest.Start(t).Client()
	theirs := health.LapseMark{InstanceID: "x5", SessionID: "s1", Generation: 1,
		At: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), Tasks: []string{"theirs"}}
	theirKey := health.LapseMarkKey("x5", "s1")
	if _, err := c.KV().Put(&api.KVPair{Key: theirKey, Value: theirs.Value()}, nil); err != nil {
		t.Fatal(err)
	}
	clock := clockwork.NewFakeClock()
	r := NewLapseRecorder(c, LapseRecorderConfig{Clock: clock, Gather: time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() { cancel(); <-done }()
	for i := range 69 {
		r.Record(lapseOf(fmt.Sprintf("x%d", i), "work"))
	}
	r.Record(lapseOf("x7", "other"))

	bctx, bcancel := context.WithTimeout(ctx, 10*time.Second)
	defer bcancel()
	if err := clock.BlockUntilContext(bctx, 2); err != nil { // the prune ticker and the gather
		t.Fatalf("the recorder does not gather: %v", err)
	}
	if pairs, _, err := c.KV().List(health.LapseMarkPrefix, nil); err != nil || len(pairs) != 1 {
		t.Fatalf("%d marks (%v) before the gather ended, want only the one already there",
			len(pairs), err)
	}
	clock.Advance(time.Second)
	marks := awaitMarks(t, c, 69)
	if len(marks) != 69 {
		t.Fatalf("%d marks, want 69", len(marks))
	}
	created := map[uint64]int{}
	for key, p := range marks {
		if key == theirKey {
			continue
		}
		created[p.CreateIndex]++
		m, err := health.ParseLapseMark(p.Key, p.Value)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(m.Tasks, []string{"work"}) {
			t.Errorf("%s records tasks %v, want the first recorded, [work]", key, m.Tasks)
		}
	}
	if len(created) != 2 {
		t.Errorf("68 marks written in %d transactions (%v), want 2 (63 and 5)", len(created),
			created)
	}
	if p := marks[theirKey]; string(p.Value) != string(theirs.Value()) {
		t.Errorf("the mark another replica wrote is now %s, want it as it was (%s)", p.Value,
			theirs.Value())
	}
}

// Marks still gathering when the recorder stops are written as it stops;
// with a negative gather a mark is written at once (the fake clock never
// moves).
func TestMarksAreWrittenAtStopAndAtOnceWithoutAGather(t *testing.T) {
	c := consultest.Start(t).Client()
	clock := clockwork.NewFakeClock()
	r := NewLapseRecorder(c, LapseRecorderConfig{Clock: clock, Gather: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	r.Record(lapseOf("a", "work"))
	bctx, bcancel := context.WithTimeout(ctx, 10*time.Second)
	defer bcancel()
	if err := clock.BlockUntilContext(bctx, 2); err != nil {
		t.Fatalf("the recorder does not gather: %v", err)
	}
	cancel()
	<-done
	if p, _, err := c.KV().Get(health.LapseMarkKey("a", "s1"), nil); err != nil || p == nil {
		t.Fatalf("a's mark not written as the recorder stopped (%v)", err)
	}

	r = NewLapseRecorder(c, LapseRecorderConfig{Clock: clock, Gather: -1})
	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	go func() { done <- r.Run(ctx) }()
	r.Record(lapseOf("b", "work"))
	awaitMarks(t, c, 2)
	cancel()
	<-done
}

// A mark Consul refuses (a rule denying its key) holds back no other: the
// marks queued before and after it are written, it stays queued and counts
// as failed, and once the rule allows it a later flush writes it.
func TestAMarkConsulRefusesHoldsBackNoOther(t *testing.T) {
	a := consultest.Start(t, consultest.Options{ACLManagementToken: aclRoot})
	c := clientWith(t, a, "deny-one", `key_prefix "leasehold/lapsed/" { policy = "write" }
key_prefix "leasehold/lapsed/bad/" { policy = "deny" }`)
	r := NewLapseRecorder(c, LapseRecorderConfig{Gather: -1})
	for _, inst := range []string{"good1", "bad", "good2"} {
		r.Record(lapseOf(inst, "work"))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if r.flush(ctx) {
		t.Fatal("a flush with a mark refused reported every mark written")
	}
	root := a.Client()
	for _, inst := range []string{"good1", "good2"} {
		if p, _, err := root.KV().Get(health.LapseMarkKey(inst, "s1"), nil); err != nil || p == nil {
			t.Errorf("%s's mark not written (%v): the refused one held it back", inst, err)
		}
	}
	r.mu.Lock()
	queued := slices.Clone(r.queue)
	r.mu.Unlock()
	if len(queued) != 1 || queued[0].InstanceID != "bad" {
		t.Fatalf("queued after the flush: %+v, want bad's mark alone", queued)
	}
	p, _, err := root.ACL().PolicyCreate(&api.ACLPolicy{Name: "allow-bad",
		Rules: `key_prefix "leasehold/lapsed/bad/" { policy = "write" }`}, nil)
	if err != nil {
		t.Fatal(err)
	}
	tok, _, err := root.ACL().TokenCreate(&api.ACLToken{
		Policies: []*api.ACLTokenPolicyLink{{ID: p.ID}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	r.kv = clientOf(t, a, tok.SecretID)
	if !r.flush(ctx) {
		t.Fatal("bad's mark not written once allowed")
	}
	if p, _, err := root.KV().Get(health.LapseMarkKey("bad", "s1"), nil); err != nil || p == nil {
		t.Fatalf("bad's mark not written once allowed (%v)", err)
	}
}
