package fleet

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// TestIncrementalBatchesEqualFullOnes feeds the same random observations
// (membership reads, non-passing sets, generation floors, node failures, bad
// metadata, cordons, rule modes, Consul forgetting its past) one at a time to
// a Syncer that decides only what each one concerns and to one that decides
// every registration on every batch, and checks after each that both hold
// the same executors, answer the same for every session and serve the same
// resources to every constraint set.
func TestIncrementalBatchesEqualFullOnes(t *testing.T) {
	for seed := range uint64(4) {
		t.Run(fmt.Sprint("seed=", seed), func(t *testing.T) { incrementalEqualsFull(t, seed, 400) })
	}
}

type twinSyncer struct {
	s      *Syncer
	obs    chan health.Observation
	groups []health.Dispatcher
}

func startTwin(t *testing.T, clock clockwork.Clock, full bool, groups []health.Dispatcher) *twinSyncer {
	s := NewSyncer(SyncConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Clock: clock})
	s.fullBatches = full
	tw := &twinSyncer{s: s, obs: make(chan health.Observation), groups: groups}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx, tw.obs); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	for _, d := range groups {
		s.Subscribe(d)
	}
	return tw
}

// send applies one observation as a batch of its own: the round trip of a
// subscription behind it returns once Run has decided it.
func (tw *twinSyncer) send(o health.Observation) {
	tw.obs <- o
	tw.s.Subscribe(tw.groups[0])
	tw.s.Unsubscribe(tw.groups[0])
}

func incrementalEqualsFull(t *testing.T, seed uint64, steps int) {
	r := rand.New(rand.NewPCG(seed, 42))
	var groups []health.Dispatcher
	for _, vc := range []string{"", ">=1.1.0"} {
		d, err := health.NewDispatcher(vc, nil)
		if err != nil {
			t.Fatal(err)
		}
		groups = append(groups, d)
	}
	labelled, err := health.NewDispatcher("", map[string]string{"zone": "a"})
	if err != nil {
		t.Fatal(err)
	}
	groups = append(groups, labelled)
	clock := clockwork.NewFakeClock()
	inc, full := startTwin(t, clock, false, groups), startTwin(t, clock, true, groups)
	send := func(o health.Observation) {
		inc.send(o)
		full.send(o)
	}

	tasks := []string{"alpha", "beta", "gamma"}
	nodes := []string{"n0", "n1", "n2", "n3"}
	index := uint64(1)
	next := func() uint64 { index++; return index }
	serf := map[string]health.CheckState{}
	for _, n := range nodes {
		serf[n] = health.CheckState{Node: n, CheckID: health.SerfHealthCheckID, Status: health.StatusPassing, CreateIndex: 1, ModifyIndex: 1}
	}
	members := map[string][]health.Member{}
	randomMember := func(task string) health.Member {
		inst := fmt.Sprintf("i%d", r.IntN(12))
		gen := uint64(1 + r.IntN(4))
		sess := fmt.Sprintf("s%d", gen+uint64(r.IntN(2))*10)
		node := nodes[r.IntN(len(nodes))]
		status := []health.CheckStatus{health.StatusPassing, health.StatusPassing, health.StatusWarning, health.StatusCritical}[r.IntN(4)]
		m := fleettest.Member(task, inst, sess, gen, 9000+r.IntN(6), []string{"1.0.0", "1.2.0"}[r.IntN(2)], status, next())
		m.Node, m.Checks[1].Node = node, node
		m.Checks[0] = serf[node]
		if r.IntN(2) == 0 {
			m.Labels = map[string]string{"zone": []string{"a", "b"}[r.IntN(2)]}
		}
		if r.IntN(15) == 0 {
			m.Err = errors.New("capacity: not an integer")
		}
		if r.IntN(10) == 0 { // another check of the service
			m.Checks = append(m.Checks, health.CheckState{Node: node, CheckID: "http:" + inst, ServiceID: m.ServiceID, Status: health.StatusWarning, ModifyIndex: index})
		}
		return m
	}
	send(health.Observation{Tasks: &health.TaskList{Index: next(), Tasks: tasks}})
	send(health.Observation{Generations: &health.Generations{Index: next()}})
	send(health.Observation{NonPassing: &health.NonPassing{Index: next()}})
	for _, task := range tasks {
		for range 6 {
			members[task] = append(members[task], randomMember(task))
		}
		send(health.Observation{Members: &health.TaskMembers{Task: task, Index: next(), Members: members[task]}})
	}

	for step := range steps {
		var o health.Observation
		switch k := r.IntN(20); {
		case k < 6: // a membership read: someone joins, leaves or restarts
			task := tasks[r.IntN(len(tasks))]
			ms := append([]health.Member(nil), members[task]...)
			switch {
			case len(ms) > 0 && r.IntN(3) == 0:
				i := r.IntN(len(ms))
				ms = append(ms[:i:i], ms[i+1:]...)
			case r.IntN(10) == 0:
				ms = nil // the task type is gone
			default:
				ms = append(ms, randomMember(task))
			}
			for i := range ms { // serfHealth as read now
				ms[i].Checks = append([]health.CheckState(nil), ms[i].Checks...)
				ms[i].Checks[0] = serf[ms[i].Node]
			}
			members[task] = ms
			o.Members = &health.TaskMembers{Task: task, Index: next(), Members: ms, Gone: len(ms) == 0}
		case k < 14: // the non-passing set: leases, loads, nodes
			np := health.NonPassing{Index: next()}
			if r.IntN(4) == 0 {
				n := nodes[r.IntN(len(nodes))]
				c := serf[n]
				c.Status = []health.CheckStatus{health.StatusPassing, health.StatusCritical}[r.IntN(2)]
				c.ModifyIndex = np.Index
				serf[n] = c
			}
			for _, n := range nodes {
				np.Checks = append(np.Checks, serf[n])
			}
			for _, task := range tasks {
				for _, m := range members[task] {
					if r.IntN(4) != 0 {
						continue
					}
					c := m.Checks[1]
					c.Status = []health.CheckStatus{health.StatusWarning, health.StatusCritical, health.StatusWarning}[r.IntN(3)]
					c.Output, c.ModifyIndex = fmt.Sprintf("load=%d", r.IntN(5)), np.Index-uint64(r.IntN(2))
					np.Checks = append(np.Checks, c)
				}
			}
			o.NonPassing = &np
		case k < 16:
			floor := map[string]uint64{}
			for i := range 12 {
				if r.IntN(3) == 0 {
					floor[fmt.Sprintf("i%d", i)] = uint64(1 + r.IntN(5))
				}
			}
			o.Generations = &health.Generations{Index: next(), Keys: fleettest.Keys(floor)}
		case k < 17:
			raw := map[string][]byte{}
			if r.IntN(2) == 0 {
				raw["c1"] = fmt.Appendf(nil, `{"id":"c1","instance_id":"i%d","reason":"test","by":"op","at":"2026-12-01T00:00:00Z"}`, r.IntN(12))
			}
			o.Cordons = &health.CordonSet{Index: next(), Raw: raw}
		case k < 18:
			raw := []byte(`{"modes":[{"rule":"capacity","mode":"observe"}]}`)
			if r.IntN(2) == 0 {
				raw = nil
			}
			o.Rules = &health.RulesSource{Source: "consul-kv:leasehold/control/rules", Raw: raw}
		case k < 19:
			o.Contact = &health.Contact{OK: true, IndexWentBack: true}
		default:
			clock.Advance(time.Duration(r.IntN(12*60)) * time.Minute)
			o.NonPassing = &health.NonPassing{Index: next(), Checks: nil}
			for _, n := range nodes {
				o.NonPassing.Checks = append(o.NonPassing.Checks, serf[n])
			}
		}
		send(o)
		if err := sameDecisions(inc, full); err != nil {
			t.Fatalf("step %d (%+v): %v", step, o, err)
		}
	}
}

func sameDecisions(a, b *twinSyncer) error {
	va, vb := a.s.View(), b.s.View()
	ea, eb := va.Executors(), vb.Executors()
	if len(ea) != len(eb) {
		return fmt.Errorf("%d executors, the full batch %d", len(ea), len(eb))
	}
	for i := range ea {
		x, y := ea[i], eb[i]
		if (x.Err == nil) != (y.Err == nil) {
			return fmt.Errorf("executor %d: error %v, the full batch %v", i, x.Err, y.Err)
		}
		x.Err, y.Err = nil, nil
		if !reflect.DeepEqual(x, y) {
			return fmt.Errorf("executor %d:\n%+v\nthe full batch:\n%+v", i, x, y)
		}
	}
	// The per-instance session index against one built from the whole view
	// (Run is idle after send's round trip: its history can be read).
	var past []health.PastSession
	for _, ps := range a.s.history.m {
		past = append(past, ps...)
	}
	whole := health.IndexSessions(ea, past)
	for i := range 12 {
		for g := range 6 {
			for _, sess := range []string{fmt.Sprintf("s%d", g), fmt.Sprintf("s%d", g+10)} {
				inst := fmt.Sprintf("i%d", i)
				x, y := va.Sessions().Check(inst, sess), vb.Sessions().Check(inst, sess)
				if !reflect.DeepEqual(x, y) {
					return fmt.Errorf("session %s/%s: %+v, the full batch %+v", inst, sess, x, y)
				}
				if w := whole.Check(inst, sess); !reflect.DeepEqual(x, w) {
					return fmt.Errorf("session %s/%s: %+v, indexed whole %+v", inst, sess, x, w)
				}
			}
		}
	}
	for _, d := range a.groups {
		sa, okA := a.s.Snapshot(d.Key())
		sb, okB := b.s.Snapshot(d.Key())
		if okA != okB {
			return fmt.Errorf("group %s: snapshot %v, the full batch %v", d.Key(), okA, okB)
		}
		if !okA {
			continue
		}
		for _, typ := range []types.ResponseType{types.Endpoint, types.Cluster} {
			if x, y := sa.Resources[typ].Version, sb.Resources[typ].Version; x != y {
				return fmt.Errorf("group %s type %d: version %s, the full batch %s", d.Key(), typ, x, y)
			}
		}
	}
	return nil
}

// TestBatchCountsWhatChanged: the change span's counts and lapses come from
// what each batch touched.
func TestBatchCountsWhatChanged(t *testing.T) {
	s := NewSyncer(SyncConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	ctx := context.Background()
	a := fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 3)
	b := fleettest.Member("work", "b", "s1", 1, 9002, "1.0.0", health.StatusPassing, 4)
	c := fleettest.Member("work", "c", "s1", 1, 9003, "1.0.0", health.StatusPassing, 5)
	d := fleettest.Member("work", "d", "s1", 1, 9004, "1.0.0", health.StatusPassing, 6)
	b2 := b
	b2.Version = "1.1.0"
	type want struct {
		added, changed, removed, lapses int
		tasks                           []string
	}
	check := func(name string, w want) {
		t.Helper()
		r := s.decideChanges(ctx)
		got := want{r.diff.added, r.diff.changed, r.diff.removed, len(r.lapses), r.changed}
		if !reflect.DeepEqual(got, w) {
			t.Fatalf("%s: %+v, want %+v", name, got, w)
		}
	}
	s.members[fleetKey{task: "work"}] = &health.TaskMembers{Task: "work", Index: 7, Members: []health.Member{a, b, c}}
	check("first read", want{added: 3, tasks: []string{"work"}})
	s.members[fleetKey{task: "work"}] = &health.TaskMembers{Task: "work", Index: 8, Members: []health.Member{a, b2, d}}
	check("b changed, c left, d joined", want{added: 1, changed: 1, removed: 1, tasks: []string{"work"}})
	lapse := a.Checks[1]
	lapse.Status, lapse.ModifyIndex = health.StatusCritical, 9
	s.dc("").np = health.NewNonPassingSet(health.NonPassing{Index: 9, Checks: []health.CheckState{lapse}})
	check("a lapsed", want{changed: 1, lapses: 1, tasks: []string{"work"}})
	s.dc("").np = health.NewNonPassingSet(health.NonPassing{Index: 10, Checks: []health.CheckState{lapse}})
	check("nothing new", want{})
	delete(s.members, fleetKey{task: "work"})
	check("the task went", want{removed: 3, tasks: []string{"work"}})
}
