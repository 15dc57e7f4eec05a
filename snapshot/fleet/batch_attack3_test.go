package fleet

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"reflect"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// Third adversarial pass on the incremental syncer (issue 15, item 3): a
// wider random generator than TestIncrementalBatchesEqualFullOnes, driven
// synchronously (apply, then one recompute per batch, several observations
// coalesced into one batch), comparing the incremental syncer with a full
// one on executors, every session answer, served versions and the internal
// per-session state, and checking that a session once answered LAPSED is
// never CURRENT or routed again.

// a3Syncer is a Syncer driven without Run: observations are applied and
// decided in the test goroutine, so batches can coalesce at will.
type a3Syncer struct {
	s *Syncer
}

func a3New(t *testing.T, clock clockwork.Clock, full bool, groups []health.Dispatcher) *a3Syncer {
	s := NewSyncer(SyncConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Clock: clock})
	s.fullBatches = full
	ctx := context.Background()
	for _, d := range groups {
		s.subscribe(ctx, subscription{d: d, add: true})
	}
	s.publishView()
	return &a3Syncer{s: s}
}

// batch applies observations as one batch, as Run coalesces them.
func (a *a3Syncer) batch(obs ...health.Observation) {
	content := false
	for _, o := range obs {
		a.s.batchStart = time.Now()
		content = a.s.apply(o) || content
	}
	if content {
		a.s.recompute(context.Background())
	}
	a.s.publishProgress()
}

type a3Proc struct {
	inst, sess string
	gen        uint64
	version    string
	capacity   int
	labels     map[string]string
	state      health.State
	err        error
}

type a3Member struct {
	task     string
	proc     *a3Proc
	node     string
	port     int
	create   uint64 // service and lease check CreateIndex
	other    bool   // carries another service check
	maint    bool   // the node carries a node-level maintenance check
	noChecks bool   // read without any check
	noLease  bool   // the lease check is missing
	dupe     bool   // listed twice in one read
	badHere  bool   // this registration alone carries bad metadata
	genDelta uint64 // this registration carries another generation than its session's others (contract broken)
}

type a3World struct {
	t       *testing.T
	r       *rand.Rand
	index   uint64
	tasks   []string
	nodes   []string
	procs   []*a3Proc
	members map[string][]*a3Member // by task
	gone    map[string]bool        // task type gone
	truth   map[[2]string]health.CheckState
	old     map[[2]string]health.CheckState // an older copy of truth, for stale reads
	npIndex uint64
	safety  bool // clock advances stay far below the history retention
}

func (w *a3World) next() uint64 { w.index++; return w.index }

func (w *a3World) setCheck(c health.CheckState) { w.truth[[2]string{c.Node, c.CheckID}] = c }

func (w *a3World) newProc() *a3Proc {
	r := w.r
	inst := fmt.Sprintf("i%d", r.IntN(8))
	// At most 8 sessions per instance when checking that lapses are final:
	// the history remembers 8 per instance (README), a lapsed one forgotten
	// only after 8 newer lapsed ones.
	gens, variants := 6, 3
	if w.safety {
		gens, variants = 4, 2
	}
	gen := uint64(1 + r.IntN(gens))
	p := &a3Proc{inst: inst, sess: fmt.Sprintf("s%d", gen+10*uint64(r.IntN(variants))), gen: gen,
		version: []string{"1.0.0", "1.2.0", "2.0.0"}[r.IntN(3)], capacity: 1 + r.IntN(4), state: health.StateActive}
	if r.IntN(8) == 0 {
		p.state = health.StateDraining
	}
	if r.IntN(2) == 0 {
		p.labels = map[string]string{"zone": []string{"a", "b"}[r.IntN(2)]}
	}
	switch r.IntN(25) {
	case 0: // orders (instance, session, generation valid), but not routed
		p.err = health.FieldErrors{{Field: health.MetaCapacity, Value: "x", Reason: "not an integer"}}
	case 1: // cannot even be ordered
		p.err = health.FieldErrors{{Field: health.MetaInstanceID, Value: "", Reason: "required"}}
		p.inst = ""
	case 2:
		p.err = errors.New("unparsable")
	}
	w.procs = append(w.procs, p)
	return p
}

func (w *a3World) pickProc() *a3Proc {
	if len(w.procs) == 0 || w.r.IntN(3) == 0 {
		return w.newProc()
	}
	return w.procs[w.r.IntN(len(w.procs))]
}

func (w *a3World) addMember(task string) {
	r := w.r
	p := w.pickProc()
	m := &a3Member{task: task, proc: p, node: w.nodes[r.IntN(len(w.nodes))], port: 9000 + r.IntN(5), create: w.next(),
		other: r.IntN(6) == 0, maint: r.IntN(8) == 0, noChecks: r.IntN(40) == 0, noLease: r.IntN(30) == 0, dupe: r.IntN(30) == 0,
		badHere: r.IntN(30) == 0}
	if r.IntN(30) == 0 {
		m.genDelta = 1
	}
	leaseID := health.CheckID(p.inst, p.sess, task)
	if _, ok := w.truth[[2]string{m.node, leaseID}]; !ok || r.IntN(2) == 0 {
		st := []health.CheckStatus{health.StatusPassing, health.StatusPassing, health.StatusWarning, health.StatusCritical}[r.IntN(4)]
		w.setCheck(health.CheckState{Node: m.node, CheckID: leaseID, ServiceID: health.ServiceID(p.inst, task), Status: st,
			Output: "load=" + strconv.Itoa(r.IntN(4)), CreateIndex: m.create, ModifyIndex: m.create})
	}
	if m.other {
		id := "http:" + p.inst + ":" + task
		w.setCheck(health.CheckState{Node: m.node, CheckID: id, ServiceID: health.ServiceID(p.inst, task),
			Status: []health.CheckStatus{health.StatusPassing, health.StatusWarning}[r.IntN(2)], CreateIndex: m.create, ModifyIndex: m.create})
	}
	if m.maint {
		if _, ok := w.truth[[2]string{m.node, "_node_maintenance"}]; !ok {
			w.setCheck(health.CheckState{Node: m.node, CheckID: "_node_maintenance", Status: health.StatusPassing, CreateIndex: m.create, ModifyIndex: m.create})
		}
	}
	w.members[task] = append(w.members[task], m)
}

// read is a task's membership as Consul lists it now (or, stale, from
// older check states).
func (w *a3World) read(task string, stale bool) health.TaskMembers {
	tm := health.TaskMembers{Task: task, Index: w.next()}
	truth := w.truth
	if stale && w.old != nil {
		truth = w.old
	}
	get := func(node, id string) (health.CheckState, bool) {
		c, ok := truth[[2]string{node, id}]
		if !ok && stale {
			c, ok = w.truth[[2]string{node, id}]
		}
		return c, ok
	}
	for _, m := range w.members[task] {
		p := m.proc
		reg := health.Registration{InstanceID: p.inst, SessionID: p.sess, Generation: p.gen, Task: task, Address: "10.0.0." + m.node[1:],
			Port: m.port, Version: p.version, Capacity: p.capacity, State: p.state, Labels: p.labels}
		reg.Generation += m.genDelta
		hm := health.Member{Executor: health.Executor{Registration: reg, ServiceID: health.ServiceID(p.inst, task), Node: m.node, CreateIndex: m.create, Err: p.err}}
		if m.badHere && hm.Err == nil {
			hm.Err = health.FieldErrors{{Field: health.MetaVersion, Value: "x", Reason: "not a semantic version"}}
		}
		if !m.noChecks {
			if c, ok := get(m.node, health.SerfHealthCheckID); ok {
				hm.Checks = append(hm.Checks, c)
			}
			if m.maint {
				if c, ok := get(m.node, "_node_maintenance"); ok {
					hm.Checks = append(hm.Checks, c)
				}
			}
			if !m.noLease {
				if c, ok := get(m.node, health.CheckID(p.inst, p.sess, task)); ok {
					hm.Checks = append(hm.Checks, c)
				}
			}
			if m.other {
				if c, ok := get(m.node, "http:"+p.inst+":"+task); ok {
					hm.Checks = append(hm.Checks, c)
				}
			}
		}
		tm.Members = append(tm.Members, hm)
		if m.dupe {
			tm.Members = append(tm.Members, hm)
		}
	}
	sort.SliceStable(tm.Members, func(i, j int) bool {
		a, b := tm.Members[i], tm.Members[j]
		if a.Node != b.Node {
			return a.Node < b.Node
		}
		return a.ServiceID < b.ServiceID
	})
	return tm
}

// nonPassing is the fast path's answer now: every non-passing check and
// every serfHealth (and, as odd input, sometimes an entry modified after
// the answer's own index, or an index below the last one).
func (w *a3World) nonPassing() health.NonPassing {
	np := health.NonPassing{Index: w.next()}
	if w.r.IntN(25) == 0 && w.npIndex > 3 { // Consul restarted: its index went back
		np.Index = w.npIndex - uint64(1+w.r.IntN(3))
	}
	w.npIndex = np.Index
	for _, k := range w.keys() {
		c := w.truth[k]
		if c.Status == health.StatusPassing && c.CheckID != health.SerfHealthCheckID {
			continue
		}
		if w.r.IntN(30) == 0 {
			c.ModifyIndex = np.Index + uint64(1+w.r.IntN(3)) // odd: modified after the answer
		}
		np.Checks = append(np.Checks, c)
	}
	return np
}

// keys are the checks in order.
func (w *a3World) keys() [][2]string {
	keys := slices.Collect(maps.Keys(w.truth))
	slices.SortFunc(keys, func(a, b [2]string) int {
		if a[0] != b[0] {
			return strings.Compare(a[0], b[0])
		}
		return strings.Compare(a[1], b[1])
	})
	return keys
}

// mutate changes the world's checks a little.
func (w *a3World) mutate() {
	r := w.r
	if r.IntN(3) == 0 {
		w.old = maps.Clone(w.truth)
	}
	for _, k := range w.keys() { // in order: the run is the same for a seed
		c := w.truth[k]
		if r.IntN(6) != 0 {
			continue
		}
		switch {
		case c.CheckID == health.SerfHealthCheckID:
			switch r.IntN(6) {
			case 0:
				c.Status, c.Output = health.StatusCritical, "Agent not live or unreachable"
			case 1, 2:
				c.Status, c.Output = health.StatusPassing, "Agent alive and reachable"
			case 3: // the node was reaped and joined again
				c.Status, c.CreateIndex = health.StatusPassing, w.index+1
			default:
				continue
			}
		case c.CheckID == "_node_maintenance":
			c.Status = []health.CheckStatus{health.StatusPassing, health.StatusCritical}[r.IntN(2)]
		default:
			c.Status = []health.CheckStatus{health.StatusPassing, health.StatusWarning, health.StatusCritical, "maintenance"}[r.IntN(4)]
			c.Output = "load=" + strconv.Itoa(r.IntN(5))
			if r.IntN(3) == 0 {
				c.Output = "TTL expired"
			}
		}
		c.ModifyIndex = w.next()
		w.truth[k] = c
	}
}

func (w *a3World) observation(clock *clockwork.FakeClock) (health.Observation, bool) {
	r := w.r
	var o health.Observation
	switch k := r.IntN(40); {
	case k < 12: // a membership read
		task := w.tasks[r.IntN(len(w.tasks))]
		switch {
		case w.gone[task]:
			w.gone[task] = false
			for range 1 + r.IntN(3) {
				w.addMember(task)
			}
		case len(w.members[task]) > 0 && r.IntN(3) == 0:
			i := r.IntN(len(w.members[task]))
			w.members[task] = slices.Delete(slices.Clone(w.members[task]), i, i+1)
		case r.IntN(15) == 0:
			w.members[task], w.gone[task] = nil, true
			return health.Observation{Members: &health.TaskMembers{Task: task, Index: w.next(), Gone: true}}, true
		case len(w.members[task]) > 0 && r.IntN(4) == 0: // a member moves to another node
			i := r.IntN(len(w.members[task]))
			m := *w.members[task][i]
			m.node, m.create = w.nodes[r.IntN(len(w.nodes))], w.next()
			p := m.proc
			w.setCheck(health.CheckState{Node: m.node, CheckID: health.CheckID(p.inst, p.sess, m.task), ServiceID: health.ServiceID(p.inst, m.task),
				Status: health.StatusPassing, Output: "load=0", CreateIndex: m.create, ModifyIndex: m.create})
			w.members[task] = slices.Clone(w.members[task])
			w.members[task][i] = &m
		default:
			w.addMember(task)
		}
		tm := w.read(task, r.IntN(5) == 0)
		if len(tm.Members) == 0 {
			tm.Gone = true
			w.gone[task] = true
		}
		o.Members = &tm
	case k < 26:
		w.mutate()
		if r.IntN(4) == 0 { // the checks changed, the fast path has not answered yet: a read sees them first
			task := w.tasks[r.IntN(len(w.tasks))]
			if !w.gone[task] && len(w.members[task]) > 0 {
				tm := w.read(task, false)
				return health.Observation{Members: &tm}, true
			}
		}
		np := w.nonPassing()
		o.NonPassing = &np
	case k < 29:
		floor := map[string]uint64{}
		for i := range 10 { // i8, i9: never registered
			if r.IntN(3) == 0 {
				floor[fmt.Sprintf("i%d", i)] = uint64(1 + r.IntN(7))
			}
		}
		o.Generations = &health.Generations{Index: w.next(), Keys: fleettest.Keys(floor)}
	case k < 32:
		raw := map[string][]byte{}
		for c := range 3 {
			if r.IntN(2) != 0 {
				continue
			}
			var sel string
			switch r.IntN(3) {
			case 0:
				sel = fmt.Sprintf(`"instance_id":"i%d"`, r.IntN(8))
			case 1:
				sel = fmt.Sprintf(`"task":%q`, w.tasks[r.IntN(len(w.tasks))])
			default:
				sel = `"version_constraint":"<2.0.0"`
			}
			raw[fmt.Sprintf("c%d", c)] = fmt.Appendf(nil, `{"id":"c%d",%s,"reason":"test","by":"op","at":"2026-12-01T00:00:0%dZ"}`, c, sel, r.IntN(3))
		}
		o.Cordons = &health.CordonSet{Index: w.next(), Raw: raw}
	case k < 35:
		rule := []string{"version", "labels", "capacity", "draining", "unhealthy", "cordon"}[r.IntN(6)]
		raw := fmt.Appendf(nil, `{"modes":[{"rule":%q,"mode":"observe"}],"safety_limit":%v}`, rule, []float64{0.25, 0.5, 1}[r.IntN(3)])
		switch r.IntN(4) {
		case 0:
			raw = nil
		case 1:
			raw = []byte(`{"modes":[{"rule":"lease","mode":"observe"}]}`) // refused
		}
		src := "consul-kv:leasehold/control/rules"
		if r.IntN(2) == 0 {
			src = "file:/rules.json"
		}
		o.Rules = &health.RulesSource{Source: src, Raw: raw}
	case k < 36:
		o.Contact = &health.Contact{OK: true, IndexWentBack: true}
	case k < 37:
		o.Contact = &health.Contact{OK: r.IntN(2) == 0}
	case k < 38:
		return health.Observation{Progress: &health.Progress{NonPassing: w.index}}, true
	default:
		if w.safety {
			clock.Advance(time.Duration(r.IntN(30)) * time.Minute)
		} else {
			clock.Advance(time.Duration(r.IntN(30)) * time.Hour)
		}
		np := w.nonPassing()
		o.NonPassing = &np
	}
	return o, true
}

func a3Worlds(seed uint64, safety bool) *a3World {
	w := &a3World{r: rand.New(rand.NewPCG(seed, 3)), tasks: []string{"alpha", "beta", "gamma", "delta"}, nodes: []string{"n1", "n2", "n3", "n4", "n5"},
		members: map[string][]*a3Member{}, gone: map[string]bool{}, truth: map[[2]string]health.CheckState{}, safety: safety}
	for _, n := range w.nodes {
		w.setCheck(health.CheckState{Node: n, CheckID: health.SerfHealthCheckID, Status: health.StatusPassing, CreateIndex: 1, ModifyIndex: 1})
	}
	return w
}

func a3Groups(t *testing.T) []health.Dispatcher {
	var groups []health.Dispatcher
	for _, c := range []struct {
		vc     string
		labels map[string]string
	}{{"", nil}, {">=1.1.0", nil}, {"<2.0.0", map[string]string{"zone": "a"}}} {
		d, err := health.NewDispatcher(c.vc, c.labels)
		if err != nil {
			t.Fatal(err)
		}
		groups = append(groups, d)
	}
	return groups
}

// a3Sessions is every session id the generator can produce, and some more.
func a3Sessions() [][2]string {
	var out [][2]string
	for i := range 10 {
		for g := range 8 {
			for v := range 3 {
				out = append(out, [2]string{fmt.Sprintf("i%d", i), fmt.Sprintf("s%d", g+10*v)})
			}
		}
	}
	return out
}

func a3Compare(inc, full *a3Syncer, groups []health.Dispatcher) error {
	va, vb := inc.s.View(), full.s.View()
	ea, eb := va.Executors(), vb.Executors()
	if len(ea) != len(eb) {
		return fmt.Errorf("%d executors, the full batch %d", len(ea), len(eb))
	}
	for i := range ea {
		x, y := ea[i], eb[i]
		if fmt.Sprint(x.Err) != fmt.Sprint(y.Err) {
			return fmt.Errorf("executor %d: error %v, the full batch %v", i, x.Err, y.Err)
		}
		x.Err, y.Err = nil, nil
		if !reflect.DeepEqual(x, y) {
			return fmt.Errorf("executor %d:\n%+v\nthe full batch:\n%+v", i, x, y)
		}
	}
	var past []health.PastSession
	for _, ps := range inc.s.history.m {
		past = append(past, ps...)
	}
	whole := health.IndexSessions(ea, past)
	for _, k := range a3Sessions() {
		x, y := va.Sessions().Check(k[0], k[1]), vb.Sessions().Check(k[0], k[1])
		if !reflect.DeepEqual(x, y) {
			return fmt.Errorf("session %s/%s: %+v, the full batch %+v", k[0], k[1], x, y)
		}
		if w := whole.Check(k[0], k[1]); !reflect.DeepEqual(x, w) {
			return fmt.Errorf("session %s/%s: %+v, indexed whole %+v", k[0], k[1], x, w)
		}
	}
	for _, d := range groups {
		sa, okA := inc.s.Snapshot(d.Key())
		sb, okB := full.s.Snapshot(d.Key())
		if okA != okB {
			return fmt.Errorf("group %s: snapshot %v, the full batch %v", d.Key(), okA, okB)
		}
		if !okA {
			continue
		}
		for _, typ := range []types.ResponseType{types.Endpoint, types.Cluster, types.Listener, types.Route} {
			if x, y := sa.Resources[typ].Version, sb.Resources[typ].Version; x != y {
				return fmt.Errorf("group %s type %d: version %s, the full batch %s", d.Key(), typ, x, y)
			}
		}
	}
	// Internal state: equal, whatever was touched.
	for name, pair := range map[string][2]any{
		"lapsed":    {inc.s.lapsed, full.s.lapsed},
		"sessions":  {inc.s.sessions, full.s.sessions},
		"instances": {inc.s.instances, full.s.instances},
		"history":   {inc.s.history.m, full.s.history.m},
		"lastSeen":  {inc.s.lastSeen, full.s.lastSeen},
	} {
		if !reflect.DeepEqual(pair[0], pair[1]) && !(reflect.ValueOf(pair[0]).Len() == 0 && reflect.ValueOf(pair[1]).Len() == 0) {
			return fmt.Errorf("%s: %v, the full batch %v", name, pair[0], pair[1])
		}
	}
	return nil
}

// a3Frozen is a deep copy of what a View showed, to check it never changes.
type a3Frozen struct {
	v        *View
	execs    []health.Executor
	sessions map[[2]string]health.SessionStatus
}

func a3Freeze(v *View) a3Frozen {
	f := a3Frozen{v: v, execs: slices.Clone(v.Executors()), sessions: map[[2]string]health.SessionStatus{}}
	for _, k := range a3Sessions() {
		f.sessions[k] = v.Sessions().Check(k[0], k[1])
	}
	return f
}

func (f a3Frozen) changed() error {
	now := f.v.Executors()
	if len(now) != len(f.execs) {
		return fmt.Errorf("view changed: %d executors, was %d", len(now), len(f.execs))
	}
	for i := range now {
		if !reflect.DeepEqual(now[i], f.execs[i]) {
			return fmt.Errorf("view changed: executor %d\n%+v\nwas\n%+v", i, now[i], f.execs[i])
		}
	}
	for k, st := range f.sessions {
		if got := f.v.Sessions().Check(k[0], k[1]); !reflect.DeepEqual(got, st) {
			return fmt.Errorf("view changed: session %v %+v, was %+v", k, got, st)
		}
	}
	return nil
}

func a3Run(t *testing.T, seed uint64, steps int, safety bool) {
	groups := a3Groups(t)
	clock := clockwork.NewFakeClock()
	inc, full := a3New(t, clock, false, groups), a3New(t, clock, true, groups)
	w := a3Worlds(seed, safety)
	w.t = t
	// Start: tasks, generations, non-passing, every task's read.
	start := []health.Observation{
		{Tasks: &health.TaskList{Index: w.next(), Tasks: w.tasks}},
		{Generations: &health.Generations{Index: w.next()}},
	}
	np := w.nonPassing()
	start = append(start, health.Observation{NonPassing: &np})
	for _, task := range w.tasks {
		for range 4 {
			w.addMember(task)
		}
		tm := w.read(task, false)
		start = append(start, health.Observation{Members: &tm})
	}
	inc.batch(start...)
	full.batch(start...)
	if err := a3Compare(inc, full, groups); err != nil {
		t.Fatalf("start: %v", err)
	}
	lapsed := map[[2]string]int{} // sessions answered LAPSED, at which step
	var frozen []a3Frozen
	for step := range steps {
		n := 1
		if w.r.IntN(3) == 0 {
			n = 2 + w.r.IntN(4)
		}
		var obs []health.Observation
		for range n {
			o, _ := w.observation(clock)
			obs = append(obs, o)
		}
		inc.batch(obs...)
		full.batch(obs...)
		if err := a3Compare(inc, full, groups); err != nil {
			t.Fatalf("seed %d step %d: %v\nbatch: %s", seed, step, err, a3Describe(obs))
		}
		for _, f := range frozen {
			if err := f.changed(); err != nil {
				t.Fatalf("seed %d step %d: %v", seed, step, err)
			}
		}
		frozen = append(frozen, a3Freeze(inc.s.View()))
		if len(frozen) > 6 {
			frozen = frozen[1:]
		}
		if !safety {
			continue
		}
		// A session once answered LAPSED is never CURRENT, DRAINING or routed again.
		for _, a := range []*a3Syncer{inc, full} {
			v := a.s.View()
			for _, k := range a3Sessions() {
				st := v.Sessions().Check(k[0], k[1])
				if st.State == health.SessionLapsed {
					if _, ok := lapsed[k]; !ok {
						lapsed[k] = step
					}
				} else if at, ok := lapsed[k]; ok && (st.State == health.SessionCurrent || st.State == health.SessionDraining) {
					t.Fatalf("seed %d step %d: session %v answered LAPSED at step %d, now %s (%s)\nbatch: %s", seed, step, k, at, st.State, st.Detail, a3Describe(obs))
				}
			}
			vs := v.DecideAll(health.Dispatcher{})
			for i, e := range v.Executors() {
				if at, ok := lapsed[[2]string{e.InstanceID, e.SessionID}]; ok && vs[i].Route != health.RouteNone {
					t.Fatalf("seed %d step %d: session %s/%s answered LAPSED at step %d is routed %s (%s)", seed, step, e.InstanceID, e.SessionID, at, vs[i].Route, vs[i].Detail)
				}
			}
		}
	}
}

func a3Describe(obs []health.Observation) string {
	s := ""
	for _, o := range obs {
		switch {
		case o.Members != nil:
			s += fmt.Sprintf("\n  members %s@%d gone=%v:", o.Members.Task, o.Members.Index, o.Members.Gone)
			for _, m := range o.Members.Members {
				s += fmt.Sprintf("\n    %s/%s gen %d node %s create %d err=%v checks=%v", m.InstanceID, m.SessionID, m.Generation, m.Node, m.CreateIndex, m.Err, m.Checks)
			}
		case o.NonPassing != nil:
			s += fmt.Sprintf("\n  non-passing@%d %v", o.NonPassing.Index, o.NonPassing.Checks)
		case o.Generations != nil:
			s += fmt.Sprintf("\n  generations@%d %v", o.Generations.Index, o.Generations.Keys)
		case o.Cordons != nil:
			s += fmt.Sprintf("\n  cordons %d", len(o.Cordons.Raw))
		case o.Rules != nil:
			s += fmt.Sprintf("\n  rules %s %s", o.Rules.Source, o.Rules.Raw)
		case o.Contact != nil:
			s += fmt.Sprintf("\n  contact %+v", *o.Contact)
		case o.Progress != nil:
			s += "\n  progress"
		}
	}
	return s
}

func a3Steps() int {
	if n, err := strconv.Atoi(os.Getenv("A3_STEPS")); err == nil {
		return n
	}
	return 700
}

// a3Seeds: A3_SEEDS=n runs seeds 0..n-1 (A3_STEPS steps each; 40 seeds of
// 3,000 steps held); by default the given ones, to keep the race-detector
// run of the package short.
func a3Seeds(defaults ...uint64) []uint64 {
	if n, err := strconv.Atoi(os.Getenv("A3_SEEDS")); err == nil {
		var seeds []uint64
		for i := range n {
			seeds = append(seeds, uint64(i))
		}
		return seeds
	}
	return defaults
}

// TestAttack3IncrementalEqualsFullWide: the wide generator, long histories
// (clock advances of hours: history pruned) and coalesced batches. Before
// 5394387 (the history forgot sessions still registered) seed 24 failed at
// step 585 (i3/s3 answered STALE incrementally, UNKNOWN — never seen — by
// the full syncer) and seed 26 at step 671 (i2/s6 LAPSED incrementally,
// UNKNOWN by the full syncer, which had rotated its lapse out of the
// history).
func TestAttack3IncrementalEqualsFullWide(t *testing.T) {
	for _, seed := range a3Seeds(24, 26) {
		t.Run(fmt.Sprint("seed=", seed), func(t *testing.T) { a3Run(t, seed, a3Steps(), false) })
	}
}

// TestAttack3LapseIsFinal: the same with clock advances far below the
// history retention: a session once answered LAPSED never comes back.
func TestAttack3LapseIsFinal(t *testing.T) {
	for _, seed := range a3Seeds(0) {
		t.Run(fmt.Sprint("seed=", seed), func(t *testing.T) { a3Run(t, 1000+seed, a3Steps(), true) })
	}
}

// a3Drain: every task type goes and the history retention passes: every
// per-session, per-instance and per-task map is empty again.
func a3Drain(t *testing.T, clock *clockwork.FakeClock, w *a3World, as ...*a3Syncer) {
	t.Helper()
	var obs []health.Observation
	for _, task := range w.tasks {
		obs = append(obs, health.Observation{Members: &health.TaskMembers{Task: task, Index: w.next(), Gone: true}})
	}
	obs = append(obs, health.Observation{Generations: &health.Generations{Index: w.next()}})
	for _, a := range as {
		a.batch(obs...)
	}
	clock.Advance(DefaultHistoryRetention + time.Hour)
	for _, a := range as {
		a.batch(health.Observation{NonPassing: &health.NonPassing{Index: w.next()}})
		s := a.s
		shards := 0
		for _, m := range s.sessionIx.shards {
			shards += len(m)
		}
		sizes := map[string]int{"lapsed": len(s.lapsed), "sessions": len(s.sessions), "instances": len(s.instances), "history": s.history.len(),
			"history.touched": len(s.history.touched), "lastSeen": len(s.lastSeen), "session index": shards, "fleet": len(s.fleet), "printOf": len(s.printOf)}
		for name, n := range sizes {
			if n != 0 {
				t.Errorf("full=%v: %s holds %d entries after everything went", s.fullBatches, name, n)
			}
		}
	}
}

// TestAttack3StateDrains: after a wide random run, nothing is left once
// the fleet is gone for longer than the retention.
func TestAttack3StateDrains(t *testing.T) {
	for seed := range uint64(4) {
		groups := a3Groups(t)
		clock := clockwork.NewFakeClock()
		inc, full := a3New(t, clock, false, groups), a3New(t, clock, true, groups)
		w := a3Worlds(2000+seed, true)
		for range 400 {
			o, _ := w.observation(clock)
			inc.batch(o)
			full.batch(o)
		}
		a3Drain(t, clock, w, inc, full)
	}
}

// TestAttack3ViewsReadWhileRunMutates: Views are read by other goroutines
// (the fencing API, explain, metrics) while Run decides the next batches;
// run with -race. Each reader also checks that a View it holds never
// changes.
func TestAttack3ViewsReadWhileRunMutates(t *testing.T) {
	groups := a3Groups(t)
	clock := clockwork.NewFakeClock()
	s := NewSyncer(SyncConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Clock: clock})
	obs := make(chan health.Observation, 8)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx, obs); close(done) }()
	defer func() { cancel(); <-done }()
	for _, d := range groups {
		s.Subscribe(d)
	}
	stop := make(chan struct{})
	errs := make(chan error, 4)
	readers := make(chan struct{}, 4)
	for range 4 {
		go func() {
			defer func() { readers <- struct{}{} }()
			for {
				select {
				case <-stop:
					return
				default:
				}
				v := s.View()
				f := a3Freeze(v)
				for _, d := range v.Groups {
					v.DecideAll(d)
				}
				for _, g := range groups {
					s.Snapshot(g.Key())
				}
				<-time.After(time.Millisecond)
				if err := f.changed(); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	w := a3Worlds(77, false)
	for _, o := range []health.Observation{{Tasks: &health.TaskList{Index: w.next(), Tasks: w.tasks}}, {Generations: &health.Generations{Index: w.next()}}} {
		obs <- o
	}
	for range 3000 {
		o, _ := w.observation(clock)
		obs <- o
		if w.r.IntN(50) == 0 { // a dispatcher with a new constraint set comes and goes between batches
			d, _ := health.NewDispatcher(fmt.Sprintf(">=1.%d.0", w.r.IntN(3)), nil)
			s.Subscribe(d)
			s.Unsubscribe(d)
		}
	}
	s.Subscribe(groups[0]) // a round trip: everything sent is applied
	close(stop)
	for range 4 {
		<-readers
	}
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
}

// TestAttack3FirstNonPassingSetAtIndexZero: the first non-passing set moves
// no index when it is at 0 (EachChange compared its index with a nil set's
// 0), yet a set at 0 says every check it lacks was passing at 0, where no
// set at all says nothing: a member read before it, with a non-passing check
// modified at 0, was not joined again and kept its read status, where a full
// batch made it passing. Consul's indexes start at 1, so this is odd input
// only; the first set now always counts as a moved index.
func TestAttack3FirstNonPassingSetAtIndexZero(t *testing.T) {
	groups := []health.Dispatcher{{}}
	clock := clockwork.NewFakeClock()
	inc, full := a3New(t, clock, false, groups), a3New(t, clock, true, groups)
	m := fleettest.Member("a", "x", "s1", 1, 9001, "1.0.0", health.StatusWarning, 0)
	m.Checks[1].ModifyIndex = 0
	for _, o := range []health.Observation{{Tasks: &health.TaskList{Index: 1, Tasks: []string{"a"}}}, {Generations: &health.Generations{Index: 1}},
		{Members: &health.TaskMembers{Task: "a", Index: 1, Members: []health.Member{m}}}, {NonPassing: &health.NonPassing{Index: 0}}} {
		inc.batch(o)
		full.batch(o)
	}
	if err := a3Compare(inc, full, groups); err != nil {
		t.Fatal(err)
	}
}
