package fleet

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/jonboulle/clockwork"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// Several datacenters (Datacenters ["dc1", "dc2"], dc1 leasehold's own),
// driven through Run with a fake clock: readiness, failover priorities,
// per-datacenter non-passing sets with colliding node names, reach (quiet,
// lost, fail static), contact failures, fencing across datacenters and
// per-datacenter indexes.
//
// The two datacenters' Consul indexes are far apart (dc1 from 100, dc2 from
// 5000), as two Raft logs are: an index of one used in the other's join
// shows up as a node failure (see mdcSerfModify).

const (
	mdcQuiet = 20 * time.Second       // SyncConfig.DatacenterQuiet's default
	mdcLost  = health.DefaultLeaseTTL // SyncConfig.DatacenterLost's default (35 s)
	mdcTick  = 5 * time.Second        // how often an answering datacenter is heard from
	mdcWait  = 5 * time.Second        // real-time deadline of every wait
	mdcTask  = "work"
)

// mdcBase is where each datacenter's Consul index starts.
var mdcBase = map[string]uint64{"dc1": 100, "dc2": 5000}

// mdcSerfModify is the ModifyIndex of every node's (passing) serfHealth in
// a datacenter: before its leases were created (the nodes did not fail
// since), but dc2's is above dc1's leases' CreateIndex, so joining a dc1
// registration with dc2's set would make it NodeFailed.
var mdcSerfModify = map[string]uint64{"dc1": 50, "dc2": 4000}

// mdcExec is one executor registration of task "work".
type mdcExec struct {
	dc, inst, sess string
	gen            uint64
	node           string
}

// The default fleet: two executors per datacenter, on nodes named alike.
var mdcFleet = []mdcExec{
	{"dc1", "a1", "s1", 1, "n1"}, {"dc1", "a2", "s1", 1, "n2"},
	{"dc2", "b1", "s1", 1, "n1"}, {"dc2", "b2", "s1", 1, "n2"},
}

type mdcHarness struct {
	t     *testing.T
	s     *Syncer
	clock *clockwork.FakeClock
	start time.Time
	obs   chan health.Observation // unbuffered: a send returns once Run took it
	pubs  chan string             // groups published
	index map[string]uint64       // per datacenter
	execs []mdcExec
	// barrier is a constraint set never subscribed: unsubscribing it is a
	// no-op that Run takes between batches (settle).
	barrier health.Dispatcher
}

func mdcStart(t *testing.T, execs ...mdcExec) *mdcHarness {
	t.Helper()
	return mdcStartTuned(t, nil, execs...)
}

// mdcStartTuned is mdcStart with the syncer's configuration tuned.
func mdcStartTuned(t *testing.T, tune func(*SyncConfig), execs ...mdcExec) *mdcHarness {
	t.Helper()
	if len(execs) == 0 {
		execs = mdcFleet
	}
	clock := clockwork.NewFakeClock()
	h := &mdcHarness{t: t, clock: clock, start: clock.Now(), obs: make(chan health.Observation),
		pubs: make(chan string, 1024), index: map[string]uint64{}, execs: execs}
	for dc, b := range mdcBase {
		h.index[dc] = b + 100 // above the registrations' CreateIndex
	}
	var err error
	if h.barrier, err = health.NewDispatcher("",
		map[string]string{"barrier": "never-subscribed"}); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(testLog{t}, &slog.HandlerOptions{Level: slog.LevelInfo}))
	cfg := SyncConfig{Datacenters: []string{"dc1", "dc2"}, Clock: clock, Logger: log,
		OnPublish: func(g string, _ *cache.Snapshot) {
			select {
			case h.pubs <- g:
			default: // waits look at the cache; this only wakes them
			}
		}}
	if tune != nil {
		tune(&cfg)
	}
	h.s = NewSyncer(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { h.s.Run(ctx, h.obs); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return h
}

// within runs f in a goroutine and fails the test if it takes longer than
// mdcWait (a send or a Subscribe that Run never takes).
func (h *mdcHarness) within(what string, f func()) {
	h.t.Helper()
	done := make(chan struct{})
	go func() { f(); close(done) }()
	select {
	case <-done:
	case <-time.After(mdcWait):
		h.t.Fatalf("%s: Run did not take it within %s", what, mdcWait)
	}
}

// settle returns once Run has decided everything sent before: Run takes a
// subscription request only between batches, and the observation channel
// is unbuffered. (The dispatcher is never subscribed: a no-op.)
func (h *mdcHarness) settle() {
	h.t.Helper()
	h.within("barrier", func() { h.s.Unsubscribe(h.barrier) })
}

// send hands observations of datacenter dc to Run and waits until decided.
func (h *mdcHarness) send(dc string, obs ...health.Observation) {
	h.t.Helper()
	for _, o := range obs {
		o.Datacenter = dc
		h.within("observation", func() { h.obs <- o })
	}
	h.settle()
}

// nudge makes Run look at the clock without an answer from any datacenter
// (an unchanged, empty cordon set: leasehold's own configuration).
func (h *mdcHarness) nudge() {
	h.t.Helper()
	h.send("", health.Observation{Data: &health.CordonSet{}})
}

func (h *mdcHarness) next(dc string) uint64 { h.index[dc]++; return h.index[dc] }

func (h *mdcHarness) at() time.Duration { return h.clock.Since(h.start) }

func (h *mdcHarness) member(x mdcExec) health.Member {
	n := slices.Index(h.execs, x)
	create := mdcBase[x.dc] + 10 + uint64(n)
	reg := health.Registration{InstanceID: x.inst, SessionID: x.sess, Generation: x.gen,
		Task:    mdcTask,
		Address: fmt.Sprintf("10.%s.0.%d", strings.TrimPrefix(x.dc, "dc"), 1+n), Port: 9000,
		Version: "1.0.0", Capacity: 4, State: health.StateActive}
	return health.Member{
		Observed: health.Observed{Registration: reg, ServiceID: health.ServiceID(x.inst, mdcTask),
			Node: x.node, CreateIndex: create},
		Checks: []health.CheckState{
			{Node: x.node, CheckID: health.SerfHealthCheckID, Status: health.StatusPassing,
				CreateIndex: 1, ModifyIndex: mdcSerfModify[x.dc]},
			{Node: x.node, CheckID: mdcLeaseOf(x), ServiceID: health.ServiceID(x.inst, mdcTask),
				Status: health.StatusPassing,
				Output: "load=1", CreateIndex: create, ModifyIndex: create},
		},
	}
}

func mdcLeaseOf(x mdcExec) string { return health.CheckID(x.inst, x.sess, mdcTask) }

// Observations of one datacenter.

func (h *mdcHarness) tasks(dc string) health.Observation {
	return health.Observation{Data: &health.TaskList{Index: h.next(dc), Tasks: []string{mdcTask}}}
}

func (h *mdcHarness) members(dc string) health.Observation {
	var ms []health.Member
	for _, x := range h.execs {
		if x.dc == dc {
			ms = append(ms, h.member(x))
		}
	}
	return health.Observation{Data: &health.TaskMembers{Task: mdcTask, Index: h.next(dc),
		Members: ms}}
}

// nonPassing is dc's set: every node's serfHealth (passing, as the watch
// reports them) and the checks given (at the set's index), which replace a
// serfHealth of the same node.
func (h *mdcHarness) nonPassing(dc string, checks ...health.CheckState) health.Observation {
	index := h.next(dc)
	for i := range checks {
		checks[i].ModifyIndex, checks[i].CreateIndex = index, max(checks[i].CreateIndex, 1)
	}
	var set []health.CheckState
	for _, x := range h.execs {
		has := func(c health.CheckState) bool {
			return c.Node == x.node && c.CheckID == health.SerfHealthCheckID
		}
		if x.dc != dc || slices.ContainsFunc(set, has) || slices.ContainsFunc(checks, has) {
			continue
		}
		set = append(set,
			health.CheckState{Node: x.node, CheckID: health.SerfHealthCheckID,
				Status: health.StatusPassing, CreateIndex: 1, ModifyIndex: mdcSerfModify[dc]})
	}
	return health.Observation{Data: &health.NonPassing{Index: index,
		Checks: append(set, checks...)}}
}

func (h *mdcHarness) generations(dc string, floor map[string]uint64) health.Observation {
	return health.Observation{Data: &health.Generations{Index: h.next(dc),
		Keys: fleettest.Keys(floor)}}
}

// heartbeat is one answer of each of dc's watches that answer at least
// every FastWait, with nothing changed: the non-passing checks and the
// generation keys (progress), the task list. (A datacenter is heard from
// only as much as the least recent of them.)
func (h *mdcHarness) heartbeat(dc string) []health.Observation {
	return []health.Observation{
		{Data: &health.Progress{NonPassing: h.next(dc)}},
		{Data: &health.Progress{Generations: h.next(dc)}},
		h.tasks(dc),
	}
}

func mdcContact(ok bool) health.Observation {
	o := health.Observation{Data: &health.Contact{OK: ok}}
	if !ok {
		o.Contact().Err = fmt.Errorf("no answer")
	}
	return o
}

// readAll sends datacenter dc's whole fleet: task list, non-passing
// checks, generation keys (none) and members.
func (h *mdcHarness) readAll(dc string) {
	h.t.Helper()
	h.send(dc, h.tasks(dc), h.nonPassing(dc), h.generations(dc, nil), h.members(dc))
}

// tickUntil advances the fake clock to elapsed in mdcTick steps, each
// datacenter in dcs answering after every step; check (if any) runs after
// each step's answers.
func (h *mdcHarness) tickUntil(elapsed time.Duration, dcs []string, check func()) {
	h.t.Helper()
	for h.at() < elapsed {
		h.clock.Advance(min(mdcTick, elapsed-h.at()))
		for _, dc := range dcs {
			h.send(dc, h.heartbeat(dc)...)
		}
		if len(dcs) == 0 {
			h.nudge()
		}
		if check != nil {
			check()
		}
	}
}

func mdcDispatcher(t *testing.T, dc string) health.Dispatcher {
	t.Helper()
	d, err := health.NewDispatcher("", nil)
	if err != nil {
		t.Fatal(err)
	}
	if dc != "" {
		d = d.InDatacenter(dc)
	}
	return d
}

func (h *mdcHarness) subscribe(ds ...health.Dispatcher) {
	h.t.Helper()
	for _, d := range ds {
		h.within("subscribe", func() { h.s.Subscribe(d) })
	}
}

// waitView returns the first view (the current one or a later) for which
// ok holds; it fails the test after mdcWait.
func (h *mdcHarness) waitView(what string, ok func(v *View) bool) *View {
	h.t.Helper()
	deadline := time.After(mdcWait)
	for {
		v := h.s.View()
		if ok(v) {
			return v
		}
		select {
		case <-v.Changed():
		case <-deadline:
			h.t.Fatalf("at %s: no view with %s", h.at(), what)
		}
	}
}

func (h *mdcHarness) reach(dc string) health.Reach {
	i, ok := h.s.View().Datacenter(dc)
	if !ok {
		h.t.Fatalf("datacenter %s not in the view", dc)
	}
	return i.Reach
}

func (h *mdcHarness) waitReach(dc string, want health.Reach) {
	h.t.Helper()
	h.waitView(fmt.Sprintf("%s %s", dc, want),
		func(v *View) bool { i, _ := v.Datacenter(dc); return i.Reach == want })
}

// load renders the load assignment of task "work" in d's group as
// "priority:region[hosts]" per locality, e.g. "0:dc1[a1 a2] 1:dc2[b1 b2]"
// (a host not HEALTHY carries its status); "(none)" without a snapshot.
func (h *mdcHarness) load(d health.Dispatcher) string {
	snap, ok := h.s.Snapshot(d.Key())
	if !ok {
		return "(none)"
	}
	r, ok := snap.GetResources(resource.EndpointType)[mdcTask]
	if !ok {
		return "(no load assignment)"
	}
	var locs []string
	for _, l := range translator.Expand(r.(*endpointv3.ClusterLoadAssignment)).GetEndpoints() {
		var hosts []string
		for _, lb := range l.GetLbEndpoints() {
			host := lb.GetEndpoint().GetHostname()
			if st := lb.GetHealthStatus(); st != corev3.HealthStatus_HEALTHY {
				host += ":" + st.String()
			}
			hosts = append(hosts, host)
		}
		locs = append(locs,
			fmt.Sprintf("%d:%s[%s]", l.GetPriority(), l.GetLocality().GetRegion(),
				strings.Join(hosts, " ")))
	}
	return strings.Join(locs, " ")
}

// waitLoad waits until d's group is served want (an addition is published
// after the coalescing window: the fake clock is moved past it once).
func (h *mdcHarness) waitLoad(d health.Dispatcher, want string) {
	h.t.Helper()
	deadline := time.After(mdcWait)
	flushed := false
	for {
		if h.load(d) == want {
			return
		}
		if !flushed {
			h.clock.Advance(50 * time.Millisecond) // SyncConfig.AddDelay's default
			flushed = true
			continue
		}
		select {
		case <-h.pubs:
		case <-deadline:
			h.t.Fatalf("at %s: group %q is served %q, want %q", h.at(), d.Key(), h.load(d), want)
		}
	}
}

// expectLoad checks what d's group is served now (after settle: removals
// are in the cache before the view that implies them).
func (h *mdcHarness) expectLoad(d health.Dispatcher, want string) {
	h.t.Helper()
	if got := h.load(d); got != want {
		h.t.Fatalf("at %s: group %q is served %q, want %q", h.at(), d.Key(), got, want)
	}
}

func (h *mdcHarness) session(inst, sess string) health.SessionStatus {
	return h.s.View().Sessions().Check(inst, sess)
}

func (h *mdcHarness) expectSession(inst, sess string,
	want health.SessionState) health.SessionStatus {
	h.t.Helper()
	st := h.session(inst, sess)
	if st.State != want {
		h.t.Fatalf("at %s: session %s/%s is %s (%s), want %s", h.at(), inst, sess, st.State,
			st.Detail, want)
	}
	return st
}

// verdict is the current view's verdict on registration inst/sess for d.
func (h *mdcHarness) verdict(d health.Dispatcher, inst, sess string) health.Verdict {
	h.t.Helper()
	v := h.s.View()
	vs := v.DecideAll(d)
	for i, e := range v.Executors() {
		if e.InstanceID == inst && e.SessionID == sess {
			return vs[i]
		}
	}
	h.t.Fatalf("no registration %s/%s in the view", inst, sess)
	return health.Verdict{}
}

func (h *mdcHarness) expectVerdict(d health.Dispatcher, inst, sess string, route health.Route,
	reason health.Reason) {
	h.t.Helper()
	if v := h.verdict(d, inst, sess); v.Route != route || v.Reason != reason {
		h.t.Fatalf("at %s: %s/%s: %s %q (%s), want %s %q", h.at(), inst, sess, v.Route, v.Reason,
			v.Detail, route, reason)
	}
}

// ofDC are the executors of the fleet in datacenter dc.
func (h *mdcHarness) ofDC(dc string) []mdcExec {
	var out []mdcExec
	for _, x := range h.execs {
		if x.dc == dc {
			out = append(out, x)
		}
	}
	return out
}

const (
	mdcBothFromDC1 = "0:dc1[a1 a2] 1:dc2[b1 b2]"
	mdcBothFromDC2 = "0:dc2[b1 b2] 1:dc1[a1 a2]"
	mdcOnlyDC1     = "0:dc1[a1 a2]"
)

// 1. Not synced (no snapshot, not ready) until every piece of both
// datacenters has been read.
func TestDCsSyncWaitsForEveryDatacenterRead(t *testing.T) {
	pieces := []string{"tasks", "non-passing", "generations", "members"}
	for _, missingDC := range []string{"dc1", "dc2"} {
		for _, missing := range pieces {
			t.Run(missingDC+" without "+missing, func(t *testing.T) {
				h := mdcStart(t)
				d := mdcDispatcher(t, "")
				h.subscribe(d) // before the fleet is read: waits
				piece := func(dc, p string) health.Observation {
					switch p {
					case "tasks":
						return h.tasks(dc)
					case "non-passing":
						return h.nonPassing(dc)
					case "generations":
						return h.generations(dc, nil)
					default:
						return h.members(dc)
					}
				}
				for _, dc := range []string{"dc1", "dc2"} {
					for _, p := range pieces {
						if dc != missingDC || p != missing {
							h.send(dc, piece(dc, p))
						}
					}
				}
				if v := h.s.View(); v.Synced || h.s.Ready() {
					t.Fatalf("synced %v, ready %v with %s's %s unread", v.Synced, h.s.Ready(),
						missingDC, missing)
				}
				h.expectLoad(d, "(none)")
				select {
				case g := <-h.pubs:
					t.Fatalf("published %q before the fleet was read", g)
				default:
				}
				h.send(missingDC, piece(missingDC, missing))
				if v := h.s.View(); !v.Synced || !h.s.Ready() {
					t.Fatalf("synced %v, ready %v once everything was read", v.Synced, h.s.Ready())
				}
				h.expectLoad(d, mdcBothFromDC1)
			})
		}
	}
}

// 1. A datacenter that never answers holds serving back only until it is
// lost: silent longer than DatacenterLost while the other answers.
func TestDCsSyncWithoutALostDatacenter(t *testing.T) {
	for _, tc := range []struct {
		name     string
		dc2Reads []string // what dc2 answered at the start before falling silent
	}{
		{"dc2 never answers", nil},
		{"dc2 answers part then falls silent", []string{"tasks", "non-passing"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := mdcStart(t)
			d1, d2 := mdcDispatcher(t, "dc1"), mdcDispatcher(t, "dc2")
			h.subscribe(d1, d2)
			for _, p := range tc.dc2Reads {
				if p == "tasks" {
					h.send("dc2", h.tasks("dc2"))
				} else {
					h.send("dc2", h.nonPassing("dc2"))
				}
			}
			h.readAll("dc1")
			// Up to DatacenterLost (included) dc2 is only unanswered: not synced.
			h.tickUntil(mdcLost, []string{"dc1"}, func() {
				if v := h.s.View(); v.Synced || h.s.Ready() {
					t.Fatalf("at %s: synced %v, ready %v while dc2 is not lost", h.at(), v.Synced,
						h.s.Ready())
				}
				if r := h.reach("dc2"); h.at() > mdcQuiet && r != health.Unanswered {
					t.Fatalf("at %s: dc2 %s, want unanswered", h.at(), r)
				}
				h.expectLoad(d1, "(none)")
			})
			h.tickUntil(mdcLost+mdcTick, []string{"dc1"}, nil)
			if r := h.reach("dc2"); r != health.Lost {
				t.Fatalf("dc2 %s, want lost", r)
			}
			if v := h.s.View(); !v.Synced || !h.s.Ready() {
				t.Fatalf("synced %v, ready %v with dc1 read and dc2 lost", v.Synced, h.s.Ready())
			}
			h.expectLoad(d1, mdcOnlyDC1)
			h.expectLoad(d2, mdcOnlyDC1) // no gap: dc1's at priority 0
		})
	}
	t.Run("no datacenter answers", func(t *testing.T) {
		h := mdcStart(t)
		h.readAll("dc1")
		h.tickUntil(2*mdcLost+mdcTick, nil, nil)
		if r := h.reach("dc2"); r != health.Unanswered {
			t.Fatalf("dc2 %s with dc1 silent too, want unanswered", r)
		}
		if v := h.s.View(); v.Synced {
			t.Fatal("synced without dc2's fleet while no datacenter answers")
		}
	})
}

// 2. Each dispatcher's datacenter at priority 0, the other at 1; the
// datacenter is part of the group.
func TestDCsFailoverPriorities(t *testing.T) {
	h := mdcStart(t)
	h.readAll("dc1")
	h.readAll("dc2")
	local, d1, d2 := mdcDispatcher(t, ""), mdcDispatcher(t, "dc1"), mdcDispatcher(t, "dc2")
	h.subscribe(local, d1, d2)
	if keys := []string{local.Key(), d1.Key(), d2.Key()}; keys[0] == keys[1] ||
		keys[1] == keys[2] || keys[0] == keys[2] {
		t.Fatalf("group keys not distinct: %q", keys)
	}
	for _, tc := range []struct {
		d    health.Dispatcher
		want string
	}{
		{local, mdcBothFromDC1}, // no datacenter: leasehold's own
		{d1, mdcBothFromDC1},
		{d2, mdcBothFromDC2},
	} {
		h.expectLoad(tc.d, tc.want)
	}
	var groups []string
	for _, g := range h.s.View().Groups {
		groups = append(groups, g.Key())
	}
	for _, d := range []health.Dispatcher{d1, d2} {
		if !slices.Contains(groups, d.Key()) {
			t.Fatalf("view groups %q lack %q", groups, d.Key())
		}
	}
}

// 3. Node n1 exists in both datacenters: a check in one datacenter's
// non-passing set concerns that datacenter's n1 only.
func TestDCsNodeNamesCollide(t *testing.T) {
	serf := func(node string) health.CheckState {
		return health.CheckState{Node: node, CheckID: health.SerfHealthCheckID,
			Status: health.StatusCritical}
	}
	lease := func(x mdcExec) health.CheckState {
		return health.CheckState{Node: x.node, CheckID: mdcLeaseOf(x),
			ServiceID: health.ServiceID(x.inst, mdcTask), Status: health.StatusCritical,
			CreateIndex: 1}
	}
	maint := func(node string) health.CheckState {
		return health.CheckState{Node: node, CheckID: "_node_maintenance",
			Status: health.StatusCritical}
	}
	a1, b1 := mdcFleet[0], mdcFleet[2]
	for _, tc := range []struct {
		name          string
		dc            string
		check         health.CheckState
		hit, spared   mdcExec
		state         health.SessionState
		reason        health.Reason
		load, load2   string // then served to a dispatcher in dc1, in dc2
		finalAfterAll bool   // the session stays out once its checks pass again
	}{
		{"lease critical in dc1", "dc1", lease(a1), a1, b1, health.SessionLapsed,
			health.ReasonLapsed, "0:dc1[a2] 1:dc2[b1 b2]", "0:dc2[b1 b2] 1:dc1[a2]", true},
		{"lease critical in dc2", "dc2", lease(b1), b1, a1, health.SessionLapsed,
			health.ReasonLapsed, "0:dc1[a1 a2] 1:dc2[b2]", "0:dc2[b2] 1:dc1[a1 a2]", true},
		{"serfHealth critical in dc2", "dc2", serf("n1"), b1, a1, health.SessionLapsed,
			health.ReasonLapsed, "0:dc1[a1 a2] 1:dc2[b2]", "0:dc2[b2] 1:dc1[a1 a2]", true},
		{"serfHealth critical in dc1", "dc1", serf("n1"), a1, b1, health.SessionLapsed,
			health.ReasonLapsed, "0:dc1[a2] 1:dc2[b1 b2]", "0:dc2[b1 b2] 1:dc1[a2]", true},
		{"maintenance on n1 in dc2", "dc2", maint("n1"), b1, a1, health.SessionCurrent,
			health.ReasonUnhealthy, "0:dc1[a1 a2] 1:dc2[b2]", "0:dc2[b2] 1:dc1[a1 a2]", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := mdcStart(t)
			h.readAll("dc1")
			h.readAll("dc2")
			d1, d2 := mdcDispatcher(t, "dc1"), mdcDispatcher(t, "dc2")
			h.subscribe(d1, d2)
			for _, x := range h.execs { // every n1 and n2 routed, whatever the other's indexes
				h.expectSession(x.inst, x.sess, health.SessionCurrent)
			}
			h.expectLoad(d1, mdcBothFromDC1)
			h.expectLoad(d2, mdcBothFromDC2)

			h.send(tc.dc, h.nonPassing(tc.dc, tc.check))
			h.expectSession(tc.hit.inst, tc.hit.sess, tc.state)
			h.expectVerdict(d1, tc.hit.inst, tc.hit.sess, health.RouteNone, tc.reason)
			h.expectSession(tc.spared.inst, tc.spared.sess, health.SessionCurrent)
			h.expectVerdict(d1, tc.spared.inst, tc.spared.sess, health.RouteHealthy,
				health.ReasonNone)
			h.expectLoad(d1, tc.load)
			h.expectLoad(d2, tc.load2)

			// The checks pass again and the members are read again in both
			// datacenters: a lapse stays final; the other n1 was never touched.
			h.send(tc.dc, h.nonPassing(tc.dc))
			h.send("dc1", h.members("dc1"))
			h.send("dc2", h.members("dc2"))
			if tc.finalAfterAll {
				h.expectSession(tc.hit.inst, tc.hit.sess, health.SessionLapsed)
				h.expectLoad(d1, tc.load)
			} else {
				h.expectSession(tc.hit.inst, tc.hit.sess, health.SessionCurrent)
				h.waitLoad(d1, mdcBothFromDC1)
			}
			h.expectSession(tc.spared.inst, tc.spared.sess, health.SessionCurrent)
		})
	}
}

// 4. Reach: dc2 falls silent while dc1 answers every mdcTick. After
// DatacenterQuiet its sessions are UNKNOWN (still routed); after
// DatacenterLost its executors are routed nowhere; once it answers, they are
// routed again. Transitions come from the reach timer: each step's reach is
// awaited before dc1's answer of that step.
func TestDCsReachQuietThenLost(t *testing.T) {
	h := mdcStart(t)
	h.readAll("dc1")
	h.readAll("dc2")
	local, d2 := mdcDispatcher(t, ""), mdcDispatcher(t, "dc2")
	h.subscribe(local, d2)
	h.expectLoad(local, mdcBothFromDC1)

	expectDC1 := func() {
		t.Helper()
		for _, x := range h.ofDC("dc1") {
			h.expectSession(x.inst, x.sess, health.SessionCurrent)
			h.expectVerdict(local, x.inst, x.sess, health.RouteHealthy, health.ReasonNone)
		}
		if r := h.reach("dc1"); r != health.Reached {
			t.Fatalf("at %s: dc1 %s", h.at(), r)
		}
	}
	for h.at() < mdcLost+2*mdcTick {
		h.clock.Advance(mdcTick)
		var want health.Reach
		switch at := h.at(); {
		case at <= mdcQuiet:
			want = health.Reached
		case at <= mdcLost:
			want = health.Unanswered
		default:
			want = health.Lost
		}
		h.waitReach("dc2", want) // the timer's work: dc1 last answered a step ago
		h.nudge()
		if r := h.reach("dc2"); r != want {
			t.Fatalf("at %s: dc2 %s, want %s", h.at(), r, want)
		}
		for _, x := range h.ofDC("dc2") {
			switch want {
			case health.Reached:
				h.expectSession(x.inst, x.sess, health.SessionCurrent)
				h.expectVerdict(local, x.inst, x.sess, health.RouteHealthy, health.ReasonNone)
			case health.Unanswered:
				if st := h.expectSession(x.inst, x.sess,
					health.SessionUnknown); !strings.Contains(st.Detail, "dc2") {
					t.Fatalf("detail %q does not name dc2", st.Detail)
				}
				h.expectVerdict(local, x.inst, x.sess, health.RouteHealthy, health.ReasonNone)
			case health.Lost:
				h.expectSession(x.inst, x.sess, health.SessionUnknown)
				h.expectVerdict(local, x.inst, x.sess, health.RouteNone, health.ReasonUnreachable)
				h.expectVerdict(d2, x.inst, x.sess, health.RouteNone, health.ReasonUnreachable)
			}
		}
		if want == health.Lost {
			h.expectLoad(local, mdcOnlyDC1)
			h.expectLoad(d2, mdcOnlyDC1)
		} else {
			h.expectLoad(local, mdcBothFromDC1)
			h.expectLoad(d2, mdcBothFromDC2)
		}
		expectDC1()
		h.send("dc1", h.heartbeat("dc1")...)
	}

	// dc2 answers again: routed again, no lapse recorded.
	h.send("dc2", h.heartbeat("dc2")...)
	if r := h.reach("dc2"); r != health.Reached {
		t.Fatalf("dc2 %s after answering", r)
	}
	for _, x := range h.ofDC("dc2") {
		h.expectSession(x.inst, x.sess, health.SessionCurrent)
		h.expectVerdict(local, x.inst, x.sess, health.RouteHealthy, health.ReasonNone)
	}
	h.waitLoad(local, mdcBothFromDC1)
	h.waitLoad(d2, mdcBothFromDC2)
	expectDC1()
}

// 4. Fail static: when neither datacenter answers, nothing is lost, however
// long the silence.
func TestDCsReachFailStatic(t *testing.T) {
	for _, tc := range []struct {
		name     string
		dc1Later time.Duration // dc1's last answer after dc2's (within a watch's FastWait)
		jump     bool          // one clock move over the whole silence instead of steps
	}{
		{"together, in steps", 0, false},
		{"together, one jump", 0, true},
		{"dc1 10s later, in steps", 10 * time.Second, false},
		{"dc1 10s later, one jump", 10 * time.Second, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := mdcStart(t)
			h.readAll("dc1")
			h.readAll("dc2")
			local, d2 := mdcDispatcher(t, ""), mdcDispatcher(t, "dc2")
			h.subscribe(local, d2)
			h.tickUntil(tc.dc1Later, []string{"dc1"}, nil)
			routed := func() {
				t.Helper()
				for _, dc := range []string{"dc1", "dc2"} {
					if r := h.reach(dc); r == health.Lost {
						t.Fatalf("at %s: %s lost while no datacenter answers", h.at(), dc)
					}
				}
				for _, x := range h.execs {
					h.expectVerdict(local, x.inst, x.sess, health.RouteHealthy, health.ReasonNone)
				}
				h.expectLoad(local, mdcBothFromDC1)
				h.expectLoad(d2, mdcBothFromDC2)
			}
			end := 2*mdcLost + mdcTick
			if tc.jump {
				h.clock.Advance(end - h.at())
			} else {
				h.tickUntil(end, nil, routed) // the syncer looks at the clock on every step
			}
			h.waitReach("dc1", health.Unanswered)
			h.waitReach("dc2", health.Unanswered)
			h.nudge()
			routed()
			for _, x := range h.execs {
				h.expectSession(x.inst, x.sess, health.SessionUnknown)
			}
		})
	}
}

// 5. A failed contact makes the datacenter's sessions UNKNOWN at once (no
// clock move), the other's stay CURRENT; it is lost a lease after its last
// answer while the other answers.
func TestDCsContactFailure(t *testing.T) {
	h := mdcStart(t)
	h.readAll("dc1")
	h.readAll("dc2")
	local := mdcDispatcher(t, "")
	h.subscribe(local)

	h.send("dc2", mdcContact(false))
	if r := h.reach("dc2"); r != health.Unanswered {
		t.Fatalf("dc2 %s after a failed contact", r)
	}
	for _, x := range h.ofDC("dc2") {
		h.expectSession(x.inst, x.sess, health.SessionUnknown)
		h.expectVerdict(local, x.inst, x.sess, health.RouteHealthy, health.ReasonNone)
	}
	for _, x := range h.ofDC("dc1") {
		h.expectSession(x.inst, x.sess, health.SessionCurrent)
	}
	h.expectLoad(local, mdcBothFromDC1)
	if !h.s.Ready() {
		t.Fatal("not ready while dc1 answers")
	}

	h.send("dc2", mdcContact(true))
	h.send("dc2", h.heartbeat("dc2")...) // its last answer
	for _, x := range h.ofDC("dc2") {
		h.expectSession(x.inst, x.sess, health.SessionCurrent)
	}

	// Failing again later (a failure is no answer); dc1 answers: lost once
	// dc2's last answer is a lease old.
	h.tickUntil(2*mdcTick, []string{"dc1"}, nil)
	h.send("dc2", mdcContact(false))
	h.tickUntil(mdcLost, []string{"dc1"}, func() {
		if r := h.reach("dc2"); r != health.Unanswered {
			t.Fatalf("at %s: dc2 %s, want unanswered", h.at(), r)
		}
	})
	h.tickUntil(mdcLost+mdcTick, []string{"dc1"}, nil)
	if r := h.reach("dc2"); r != health.Lost {
		t.Fatalf("dc2 %s a lease after its last answer", r)
	}
	h.expectLoad(local, mdcOnlyDC1)

	h.send("dc1", mdcContact(false))
	if h.s.Ready() {
		t.Fatal("ready while no datacenter answers")
	}
}

// 6. An instance's sessions are fenced across datacenters, by the newest
// registered session and by the generation floors of every datacenter
// merged by max.
func TestDCsFencingAcrossDatacenters(t *testing.T) {
	type dcKey struct {
		dc    string
		floor uint64 // the generation key of instance x in dc's KV
	}
	type want struct {
		s1, s2       health.SessionState
		newer        string // the newer session the stale ones name
		newerGen     uint64
		load1, load2 string // served to dispatchers in dc1, dc2
	}
	for _, tc := range []struct {
		name           string
		gen1, gen2     uint64  // x/s1's in dc1, x/s2's in dc2
		registered     want    // no generation keys
		floors         []dcKey // then each in turn; floor 0: no key for x
		afterEachFloor []want
	}{
		{
			name: "newer in dc2", gen1: 3, gen2: 4,
			registered: want{health.SessionStale, health.SessionCurrent, "s2", 4, "0:dc2[x]",
				"0:dc2[x]"},
			floors: []dcKey{
				{"dc2", 5}, // a key only in dc2's KV fences both
				{"dc1", 2}, // a lower key read later does not lower the floor
				{"dc2", 0}, // dc2's key gone: dc1's 2 confirms neither (both above it)
				{"dc1", 7}, // a key only in dc1's KV fences dc2's session too
			},
			afterEachFloor: []want{
				{health.SessionStale, health.SessionStale, health.GoneSession, 5, "", ""},
				{health.SessionStale, health.SessionStale, health.GoneSession, 5, "", ""},
				{health.SessionUnknown, health.SessionUnknown, "", 0, "", ""},
				{health.SessionStale, health.SessionStale, health.GoneSession, 7, "", ""},
			},
		},
		{
			name: "newer in dc1", gen1: 4, gen2: 3,
			registered: want{health.SessionCurrent, health.SessionStale, "s1", 4, "0:dc1[x]",
				"0:dc1[x]"},
			floors: []dcKey{{"dc2", 4}, {"dc1", 3}},
			afterEachFloor: []want{
				// Equal to s1's: s1 stays newest.
				{health.SessionCurrent, health.SessionStale, "s1", 4, "0:dc1[x]", "0:dc1[x]"},
				{health.SessionCurrent, health.SessionStale, "s1", 4, "0:dc1[x]", "0:dc1[x]"},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s1 := mdcExec{"dc1", "x", "s1", tc.gen1, "n1"}
			s2 := mdcExec{"dc2", "x", "s2", tc.gen2, "n1"}
			h := mdcStart(t, s1, s2)
			h.readAll("dc1")
			h.readAll("dc2")
			d1, d2 := mdcDispatcher(t, "dc1"), mdcDispatcher(t, "dc2")
			h.subscribe(d1, d2)
			check := func(step string, w want) {
				t.Helper()
				for _, c := range []struct {
					x     mdcExec
					state health.SessionState
				}{{s1, w.s1}, {s2, w.s2}} {
					st := h.session(c.x.inst, c.x.sess)
					if st.State != c.state {
						t.Fatalf("%s: %s/%s is %s (%s), want %s", step, c.x.inst, c.x.sess,
							st.State, st.Detail, c.state)
					}
					if st.Datacenter != c.x.dc {
						t.Fatalf("%s: %s/%s answered in datacenter %q", step, c.x.inst, c.x.sess,
							st.Datacenter)
					}
					if c.state == health.SessionStale {
						if st.NewerSessionID != w.newer || st.NewerGeneration != w.newerGen {
							t.Fatalf("%s: %s/%s newer %s/%d, want %s/%d", step, c.x.inst, c.x.sess,
								st.NewerSessionID, st.NewerGeneration, w.newer, w.newerGen)
						}
						h.expectVerdict(d1, c.x.inst, c.x.sess, health.RouteNone,
							health.ReasonFenced)
					}
				}
				h.waitLoad(d1, w.load1)
				h.waitLoad(d2, w.load2)
			}
			check("registered", tc.registered)
			keys := map[string]map[string]uint64{}
			for i, f := range tc.floors {
				keys[f.dc] = map[string]uint64{}
				if f.floor > 0 {
					keys[f.dc]["x"] = f.floor
				}
				h.send(f.dc, h.generations(f.dc, keys[f.dc]))
				check(fmt.Sprintf("after %s's key %d", f.dc, f.floor), tc.afterEachFloor[i])
			}
		})
	}
}

// 7. Each datacenter's indexes, refreshes and progress are its own; the
// view's top-level indexes are leasehold's own datacenter's.
func TestDCsIndexesPerDatacenter(t *testing.T) {
	h := mdcStart(t)
	read := map[string]DCIndexes{}
	for _, dc := range []string{"dc1", "dc2"} {
		np, gen := h.nonPassing(dc), h.generations(dc, nil)
		h.send(dc, h.tasks(dc), np, gen, h.members(dc))
		read[dc] = DCIndexes{ConsulIndex: h.index[dc], NonPassingIndex: np.NonPassing().Index,
			GenerationsIndex: gen.Generations().Index}
	}
	expect := func(step string) {
		t.Helper()
		v := h.s.View()
		for _, dc := range []string{"dc1", "dc2"} {
			got, ok := v.Datacenter(dc)
			if !ok {
				t.Fatalf("%s: %s not in the view", step, dc)
			}
			w := read[dc]
			if got.ConsulIndex != w.ConsulIndex || got.NonPassingIndex != w.NonPassingIndex ||
				got.GenerationsIndex != w.GenerationsIndex || got.Refreshed != w.Refreshed {
				t.Fatalf("%s: %s has %+v, want %+v", step, dc, got, w)
			}
		}
		l := read["dc1"]
		if v.Local != "dc1" || v.ConsulIndex != l.ConsulIndex ||
			v.NonPassingIndex != l.NonPassingIndex || v.GenerationsIndex != l.GenerationsIndex ||
			v.Refreshed != l.Refreshed {
			t.Fatalf("%s: the view's own indexes (local %q: consul %d, non-passing %d, "+
				"generations %d, refreshed %d) are not dc1's %+v",
				step, v.Local, v.ConsulIndex, v.NonPassingIndex, v.GenerationsIndex, v.Refreshed, l)
		}
		if _, ok := v.Datacenter("dc3"); ok {
			t.Fatalf("%s: dc3 is not watched", step)
		}
		if got := v.Datacenters(); !slices.Equal(got, []string{"dc1", "dc2"}) {
			t.Fatalf("%s: datacenters %q", step, got)
		}
	}
	progress := map[string][2]uint64{}
	for dc, r := range read {
		progress[dc] = [2]uint64{r.NonPassingIndex, r.GenerationsIndex}
	}
	expectProgress := func(step string) {
		t.Helper()
		for _, dc := range []string{"dc1", "dc2"} {
			p := h.s.Progress(dc)
			np, gen := p.NonPassing, p.Generations
			if w := progress[dc]; np != w[0] || gen != w[1] {
				t.Fatalf("%s: Progress(%s) = %d, %d, want %d, %d", step, dc, np, gen, w[0], w[1])
			}
		}
	}
	expect("read")
	expectProgress("read")

	// A refresh answered in dc2 (current at 5300 there) moves dc2 only.
	seq := uint64(7)
	h.send("dc2", health.Observation{Data: &health.Refreshed{Seq: seq, AtLeast: 5300}})
	r := read["dc2"]
	r.Refreshed = 7
	read["dc2"] = r
	progress["dc2"] = [2]uint64{5300, 5300}
	expect("dc2 refreshed")
	expectProgress("dc2 refreshed")

	// One answered in dc1 moves dc1 only, and not below dc2's.
	seq1 := uint64(3)
	h.send("dc1", health.Observation{Data: &health.Refreshed{Seq: seq1, AtLeast: 250}})
	r = read["dc1"]
	r.Refreshed = 3
	read["dc1"] = r
	progress["dc1"] = [2]uint64{250, 250}
	expect("dc1 refreshed")
	expectProgress("dc1 refreshed")

	// Progress of one watch of one datacenter.
	h.send("dc1", health.Observation{Data: &health.Progress{NonPassing: 260}})
	progress["dc1"] = [2]uint64{260, 250}
	expectProgress("dc1 non-passing progress")
	h.send("dc2", health.Observation{Data: &health.Progress{Generations: 5400}})
	progress["dc2"] = [2]uint64{5300, 5400}
	expectProgress("dc2 generations progress")

	// A new non-passing set in dc2 moves dc2's indexes only.
	np := h.nonPassing("dc2")
	h.send("dc2", np)
	r = read["dc2"]
	r.NonPassingIndex, r.ConsulIndex = np.NonPassing().Index, max(r.ConsulIndex, np.NonPassing().Index)
	read["dc2"] = r
	expect("dc2 non-passing")
	expectProgress("dc2 non-passing") // 5300 is above the set's index
}

// 4b. A lost datacenter stays lost when the others go silent too: no news of
// it came, and the snapshot last served without it stays (fail static keeps
// the last known snapshot, it does not bring back what was taken out).
func TestDCsLostStaysLostWhenTheOthersGoSilent(t *testing.T) {
	h := mdcStart(t)
	h.readAll("dc1")
	h.readAll("dc2")
	local := mdcDispatcher(t, "")
	h.subscribe(local)
	h.tickUntil(mdcLost+2*mdcTick, []string{"dc1"}, nil) // dc2 silent, dc1 answering
	h.waitReach("dc2", health.Lost)
	h.waitLoad(local, mdcOnlyDC1)
	h.clock.Advance(2 * mdcLost) // now dc1 is silent too
	h.waitReach("dc1", health.Unanswered)
	h.nudge()
	if r := h.reach("dc2"); r != health.Lost {
		t.Fatalf("dc2 %s once dc1 went silent too, want lost", r)
	}
	h.expectLoad(local, mdcOnlyDC1)
	for _, x := range h.ofDC("dc2") {
		h.expectVerdict(local, x.inst, x.sess, health.RouteNone, health.ReasonUnreachable)
	}
	// dc2 answers: routed again.
	h.send("dc2", h.heartbeat("dc2")...)
	h.waitReach("dc2", health.Reached)
	for _, x := range h.ofDC("dc2") {
		h.expectVerdict(local, x.inst, x.sess, health.RouteHealthy, health.ReasonNone)
	}
}

// TestDCsShortLeasesMakeASilentDatacenterLostSooner: dc2's executors
// declare a 10 s lease (lease_ttl): once dc2 has been silent for longer than
// that while dc1 answers, a lapse there may have gone unseen, so its
// executors are Lost — not after DatacenterLost's 35 s.
func TestDCsShortLeasesMakeASilentDatacenterLostSooner(t *testing.T) {
	const lease = 10 * time.Second
	h := mdcStart(t)
	h.readAll("dc1")
	h.readAll("dc2")
	m := h.members("dc2")
	for i := range m.Members().Members {
		m.Members().Members[i].LeaseTTL = lease
	}
	h.send("dc2", m)
	local := mdcDispatcher(t, "")
	h.subscribe(local)
	h.expectLoad(local, mdcBothFromDC1)
	start := h.at()
	for h.at()-start < lease+2*mdcTick {
		h.clock.Advance(mdcTick)
		silent := h.at() - start
		want := health.Reached // quiet for at most its lease: answering
		if silent > lease {
			want = health.Lost
		}
		h.waitReach("dc2", want)
		h.send("dc1", h.heartbeat("dc1")...)
		if r := h.reach("dc2"); r != want {
			t.Fatalf("dc2 silent for %s: %s, want %s", silent, r, want)
		}
	}
	h.expectLoad(local, mdcOnlyDC1)
	for _, x := range h.ofDC("dc2") {
		v := h.verdict(local, x.inst, x.sess)
		if v.Reason != health.ReasonUnreachable || !strings.Contains(v.Detail, "lease_ttl") {
			t.Fatalf("%s: %+v, want datacenter-unreachable naming the lease_ttl bound", x.inst, v)
		}
	}
}

// TestDCsACopyOfASessionInAnotherDatacenterIsNotTheSession: x's session
// registered in dc2, whose generation key names it; another instance's
// token registers a copy of it in dc1, whose Raft log is younger (its
// indexes lower than any of dc2's). Indexes of two datacenters do not order
// registrations: the copy is not the session, whatever its CreateIndex —
// the session stays routed and CURRENT in dc2, the copy unconfirmed.
func TestDCsACopyOfASessionInAnotherDatacenterIsNotTheSession(t *testing.T) {
	real := mdcExec{"dc2", "x", "s-real", 5, "n1"}
	copied := mdcExec{"dc1", "x", "s-real", 5, "evil"}
	h := mdcStart(t, real, copied)
	h.readAll("dc1")
	h.readAll("dc2")
	h.send("dc2", health.Observation{Data: &health.Generations{Index: h.next("dc2"),
		Keys: map[string]health.GenerationRecord{"x": {Generation: 5, SessionID: "s-real",
			ModifyIndex: mdcBase["dc2"] + 5}}}})
	if h.member(copied).CreateIndex >= h.member(real).CreateIndex {
		t.Fatal("the copy must have the lower CreateIndex (dc1's indexes are lower)")
	}
	local := mdcDispatcher(t, "")
	h.subscribe(local)
	v := h.s.View()
	for i, vd := range v.DecideAll(local) {
		e := v.Executors()[i]
		want := health.ReasonNone
		if e.Datacenter == copied.dc {
			want = health.ReasonUnconfirmed
		}
		if vd.Reason != want {
			t.Fatalf("x/s-real in %s on %s: %s %q (%s), want %q", e.Datacenter, e.Node, vd.Route,
				vd.Reason, vd.Detail, want)
		}
	}
	st := h.expectSession("x", "s-real", health.SessionCurrent)
	if st.Datacenter != "dc2" {
		t.Fatalf("x/s-real answered in %q, want dc2 (where its key and registration are)",
			st.Datacenter)
	}
	h.waitLoad(local, "0:dc2[x]")
}

// TestDCsATinyLeaseTTLDoesNotMakeAnAnsweringDatacenterLost: one registration
// in dc2 (any token that may register the task type can write one) declares
// a lease_ttl of 1 ms. Its watches cannot answer that often (the fast
// watches wait at least 100 ms, more under load): dc2, answering every
// second, stays Reached — no registration makes a datacenter's bounds
// tighter than leasehold's own floor.
func TestDCsATinyLeaseTTLDoesNotMakeAnAnsweringDatacenterLost(t *testing.T) {
	h := mdcStart(t)
	h.readAll("dc1")
	h.readAll("dc2")
	m := h.members("dc2")
	m.Members().Members[0].LeaseTTL = time.Millisecond
	h.send("dc2", m)
	local := mdcDispatcher(t, "")
	h.subscribe(local)
	h.expectLoad(local, mdcBothFromDC1)
	for start := h.at(); h.at()-start < 10*time.Second; {
		h.clock.Advance(time.Second)
		h.send("dc1", h.heartbeat("dc1")...) // dc2 has been silent for a second
		if r := h.reach("dc2"); r != health.Reached {
			i, _ := h.s.View().Datacenter("dc2")
			t.Fatalf("at %s, dc2 answering every second is %s (%s)", h.at(), r, i.ReachDetail)
		}
		h.send("dc2", h.heartbeat("dc2")...)
	}
	h.expectLoad(local, mdcBothFromDC1)
}

// TestDCsCommonSilenceIsNoPartition: every datacenter is watched through
// leasehold's one local agent. When that agent is away for longer than a
// lease (restarted, upgraded, its host overloaded), no datacenter answers:
// fail static, as documented. When it is back, whichever datacenter's watches
// answer first (the local one: no WAN round trip; its back-offs ran out
// first) must not make the others Lost at once because their silence, which
// began with its own, already exceeds the lease: nothing shows a partition.
// Otherwise every dc2 executor would leave every assignment until dc2 answers
// again (for a failed watch: once every one of its per-task watches has
// answered, after its back-off), and dispatchers in dc2 would be failed over
// to dc1 across the WAN meanwhile. A datacenter is Lost only after being
// silent for the bound while another answers.
func TestDCsCommonSilenceIsNoPartition(t *testing.T) {
	h := mdcStart(t)
	h.readAll("dc1")
	h.readAll("dc2")
	local, inDC2 := mdcDispatcher(t, ""), mdcDispatcher(t, "dc2")
	h.subscribe(local, inDC2)
	h.tickUntil(2*mdcTick, []string{"dc1", "dc2"}, nil)
	h.waitLoad(local, mdcBothFromDC1)
	h.waitLoad(inDC2, mdcBothFromDC2)

	// The local agent is away: nobody answers for longer than a lease.
	h.clock.Advance(mdcLost + 2*mdcTick)
	h.nudge()
	h.waitReach("dc1", health.Unanswered)
	h.waitReach("dc2", health.Unanswered)
	h.expectLoad(local, mdcBothFromDC1) // fail static
	h.expectLoad(inDC2, mdcBothFromDC2)

	// The agent is back; dc1's watches answer first.
	h.send("dc1", h.heartbeat("dc1")...)
	h.waitReach("dc1", health.Reached)
	if r := h.reach("dc2"); r == health.Lost {
		t.Errorf("dc2 is %s the moment dc1 answered after a silence both shared (it was never "+
			"silent while another answered)", r)
	}
	if got := h.load(inDC2); got != mdcBothFromDC2 {
		t.Errorf("the dispatcher in dc2 is served %q (its own datacenter's executors gone) after "+
			"a common silence, want %q", got, mdcBothFromDC2)
	}
}

// TestDCsSessionInTwoDatacentersIsAnsweredFromTheWorst: a session registered
// in two datacenters (one executor process registered with two agents, or two
// task types through two agents) is answered from the worst of its
// registrations: dc2 unanswered → UNKNOWN; a lapse seen in dc2 → LAPSED, and
// its dc1 registration leaves the assignments too.
func TestDCsSessionInTwoDatacentersIsAnsweredFromTheWorst(t *testing.T) {
	x1 := mdcExec{"dc1", "x", "s1", 1, "n1"}
	x2 := mdcExec{"dc2", "x", "s1", 1, "n1"}
	h := mdcStart(t, x1, x2)
	h.readAll("dc1")
	h.readAll("dc2")
	local := mdcDispatcher(t, "")
	h.subscribe(local)
	h.tickUntil(mdcTick, []string{"dc1", "dc2"}, nil)
	h.expectSession("x", "s1", health.SessionCurrent)

	// dc2 goes quiet: the session is not vouched for.
	h.tickUntil(mdcTick+mdcQuiet+mdcTick, []string{"dc1"}, nil)
	h.waitReach("dc2", health.Unanswered)
	h.expectSession("x", "s1", health.SessionUnknown)

	// dc2 answers with the lease critical: LAPSED, both registrations out.
	lease := health.CheckState{Node: "n1", CheckID: mdcLeaseOf(x2),
		ServiceID: health.ServiceID("x", mdcTask), Status: health.StatusCritical, CreateIndex: 1}
	h.send("dc2", h.nonPassing("dc2", lease),
		health.Observation{Data: &health.Progress{Generations: h.next("dc2")}}, h.tasks("dc2"))
	h.waitReach("dc2", health.Reached)
	h.expectSession("x", "s1", health.SessionLapsed)
	h.expectVerdict(local, "x", "s1", health.RouteNone, health.ReasonLapsed)
	for _, e := range h.s.View().Executors() {
		if v := h.s.View().Decide(e, local); v.Route != health.RouteNone {
			t.Fatalf("%s/%s in %s routed (%s) after its session lapsed in dc2", e.InstanceID,
				e.SessionID, e.Datacenter, v.Route)
		}
	}
}

// TestDCsMovedInstanceStaysFencedThroughReach: an instance that moved from
// dc1 to dc2 (docs/failure-semantics.md: it keeps counting its generation) keeps its old session
// in dc1 STALE and unrouted however dc2's reach goes (quiet, lost, back), as
// long as its new registration or its generation key in dc2 was read.
func TestDCsMovedInstanceStaysFencedThroughReach(t *testing.T) {
	old := mdcExec{"dc1", "x", "s1", 3, "n1"}
	moved := mdcExec{"dc2", "x", "s2", 4, "n1"}
	h := mdcStart(t, old, moved)
	h.send("dc1", h.tasks("dc1"), h.nonPassing("dc1"),
		h.generations("dc1", map[string]uint64{"x": 3}), h.members("dc1"))
	h.send("dc2", h.tasks("dc2"), h.nonPassing("dc2"),
		h.generations("dc2", map[string]uint64{"x": 4}), h.members("dc2"))
	local := mdcDispatcher(t, "")
	h.subscribe(local)
	check := func(step string) {
		t.Helper()
		if st := h.session("x", "s1"); st.State != health.SessionStale {
			t.Fatalf("%s: x/s1 %s (%s), want STALE", step, st.State, st.Detail)
		}
		h.expectVerdict(local, "x", "s1", health.RouteNone, health.ReasonFenced)
	}
	check("read")
	h.tickUntil(mdcQuiet+mdcTick, []string{"dc1"}, func() { check("dc2 quiet") })
	h.waitReach("dc2", health.Unanswered)
	h.tickUntil(mdcLost+2*mdcTick, []string{"dc1"}, func() { check("dc2 going") })
	h.waitReach("dc2", health.Lost)
	check("dc2 lost")
	if st := h.session("x", "s2"); st.State == health.SessionCurrent {
		t.Fatalf("x/s2 in a lost datacenter answered CURRENT")
	}
	h.send("dc2", h.heartbeat("dc2")...)
	h.waitReach("dc2", health.Reached)
	check("dc2 back")
	h.expectSession("x", "s2", health.SessionCurrent)
}

// The digests of singleDCDigest as the build before several datacenters
// (336dbe1) computed them with this same function: a fleet of one unnamed
// datacenter must be served exactly what it was served then. Re-pinned once,
// when routes gained the default dispatch policy's retry_policy and clusters
// lrs_server (issue 31): the load assignments and listeners were checked to
// digest as before (ba7c5091…/fa06b0fb… with routes and clusters; e574a523…/
// 2481b986… without them, before and after). Since endpoints are held
// encoded (translator/encoded.go), a locality's wire lists its endpoints
// after its weight and priority: load assignments are digested as the
// canonical encoding of the message they parse to (translator.Expand),
// which the pin, unchanged, shows to be what was served before.
const (
	singleDCBytes    = "9001c0a079baf89005ac3089450785b3a54b9a75cc5ded3bb15b189db1046007"
	singleDCVersions = "9461fbcb6b88674df6729e18e96fb416f398a2c826e0949813eae2eabeec8d0d"
)

// TestDCsOneUnnamedDatacenterIsServedTheSameBytes: a fleet of one unnamed
// datacenter without zone labels is served the same bytes as before several
// datacenters existed: every load assignment (three constraint sets,
// incremental builds) and every resource of a syncer's snapshot, before and
// after a lapse.
func TestDCsOneUnnamedDatacenterIsServedTheSameBytes(t *testing.T) {
	if got, _ := singleDCDigest(t); got != singleDCBytes {
		t.Fatalf("bytes digest %s, want %s", got, singleDCBytes)
	}
}

// TestDCsOneUnnamedDatacenterKeepsItsVersions: the same fleet's load
// assignments keep their content versions too (locality.go: "layout stays 0
// for one locality without names: the content alone versions it"), so an
// endpoint's digest must not hash a locality that has neither datacenter nor
// zone. Otherwise every EDS version
// of every single-datacenter deployment would change on upgrade, and during a
// rolling upgrade replicas would disagree on the version of identical content
// (one needless push of every assignment to every client that moves between
// them).
func TestDCsOneUnnamedDatacenterKeepsItsVersions(t *testing.T) {
	if _, got := singleDCDigest(t); got != singleDCVersions {
		t.Fatalf("versions digest %s, want %s (the bytes are the same)", got, singleDCVersions)
	}
}

// singleDCDigest builds load assignments and a syncer's snapshots for a
// fleet of one unnamed datacenter without zone labels, and digests every
// byte and version of them.
func singleDCDigest(t *testing.T) (bytesDigest, versionsDigest string) {
	t.Helper()
	fleet := func() []health.Executor {
		es := make([]health.Executor, 300)
		for i := range es {
			st := health.StateActive
			if i%7 == 0 {
				st = health.StateDraining
			}
			v := "1.4.2"
			if i%5 == 0 {
				v = "2.0.0"
			}
			es[i] = health.Executor{
				Registration: health.Registration{
					InstanceID: fmt.Sprintf("exec-%04d", i), SessionID: "s", Generation: 1,
					Task:    "work",
					Address: fmt.Sprintf("10.0.%d.%d", i/200, (i%200)/1+1-(i%19)/18),
					Port:    9000 + i%3, Version: v, Capacity: 8,
					State: st, Labels: map[string]string{"rack": fmt.Sprintf("r%d", i%3)},
				},
				ServiceID: fmt.Sprintf("work:exec-%04d", i), Node: fmt.Sprintf("n%d", i%50),
				CreateIndex: uint64(100 + i),
				LeaseStatus: health.StatusPassing, LeaseFound: i%17 != 0,
				NodeChecks: health.StatusPassing, Load: i % 8,
			}
			if i%11 == 0 {
				es[i].LeaseStatus = health.StatusCritical
			}
			if i%13 == 0 {
				es[i].Load = 8
			}
		}
		return es
	}
	hb, hv := sha256.New(), sha256.New()
	out := func(parts ...any) { fmt.Fprintln(hb, parts...) }
	ver := func(parts ...any) { fmt.Fprintln(hv, parts...) }
	d0, _ := health.NewDispatcher("", nil)
	d1, _ := health.NewDispatcher(">=1.0.0, <2.0.0", map[string]string{"rack": "r1"})
	d2 := d0.WithTasks([]string{"work"})
	for _, d := range []health.Dispatcher{d0, d1, d2} {
		es := fleet()
		bl := &translator.Builder{}
		for step := range 4 {
			r := bl.BuildPrinted("work", es, nil, d)
			b, err := proto.MarshalOptions{Deterministic: true}.Marshal(translator.Expand(r.CLA))
			if err != nil {
				t.Fatal(err)
			}
			out(d.Key(), step, hex.EncodeToString(b), r.RemovesOrDrains)
			ver(d.Key(), step, r.Version)
			es[step*7+1].Load = (es[step*7+1].Load + 3) % 9
			es[step*11+2].State = health.StateDraining
			es = es[:len(es)-step]
		}
	}

	// The syncer: one unnamed datacenter.
	obs := make(chan health.Observation, 16)
	pubs := make(chan *cache.Snapshot, 64)
	s := NewSyncer(SyncConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Clock:     clockwork.NewFakeClock(),
		OnPublish: func(_ string, snap *cache.Snapshot) { pubs <- snap }})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx, obs); close(done) }()
	defer func() { cancel(); <-done }()
	var members []health.Member
	for i, e := range fleet()[:40] {
		o := health.Observed{Registration: e.Registration, ServiceID: e.ServiceID, Node: e.Node,
			CreateIndex: e.CreateIndex}
		members = append(members, health.Member{Observed: o, Checks: []health.CheckState{
			{Node: e.Node, CheckID: health.SerfHealthCheckID, Status: health.StatusPassing,
				CreateIndex: 1, ModifyIndex: 1},
			{Node: e.Node, CheckID: health.CheckID(e.InstanceID, e.SessionID, "work"),
				ServiceID: e.ServiceID, Status: health.StatusPassing,
				Output: fmt.Sprintf("load=%d", i%8), CreateIndex: e.CreateIndex,
				ModifyIndex: e.CreateIndex},
		}})
	}
	obs <- health.Observation{Data: &health.TaskList{Index: 1, Tasks: []string{"work"}}}
	obs <- health.Observation{Data: &health.NonPassing{Index: 2}}
	obs <- health.Observation{Data: &health.Generations{Index: 3,
		Keys: fleettest.Keys(map[string]uint64{"exec-0003": 2})}}
	obs <- health.Observation{Data: &health.TaskMembers{Task: "work", Index: 500,
		Members: members}}
	for !s.View().Synced {
		<-s.View().Changed()
	}
	s.Subscribe(d1)
	snapOut := func(step string) {
		snap, ok := s.Snapshot(d1.Key())
		if !ok {
			t.Fatalf("%s: no snapshot", step)
		}
		for _, url := range []string{resource.ClusterType, resource.EndpointType,
			resource.ListenerType, resource.RouteType} {
			ver(step, url, snap.GetVersion(url))
			res := snap.GetResources(url)
			names := make([]string, 0, len(res))
			for n := range res {
				names = append(names, n)
			}
			sort.Strings(names)
			for _, n := range names {
				m := res[n]
				if cla, ok := m.(*endpointv3.ClusterLoadAssignment); ok {
					m = translator.Expand(cla)
				}
				b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
				if err != nil {
					t.Fatal(err)
				}
				out(step, n, hex.EncodeToString(b))
			}
		}
	}
	snapOut("subscribed")
	lapse := members[4].Checks[1]
	lapse.Status, lapse.ModifyIndex = health.StatusCritical, 600
	before, _ := s.Snapshot(d1.Key())
	obs <- health.Observation{Data: &health.NonPassing{Index: 600,
		Checks: []health.CheckState{lapse}}}
	for {
		snap, _ := s.Snapshot(d1.Key())
		if snap.GetVersion(resource.EndpointType) != before.GetVersion(resource.EndpointType) {
			break
		}
		select {
		case <-pubs:
		case <-time.After(5 * time.Second):
			t.Fatal("the lapse was not published")
		}
	}
	snapOut("lapsed")
	return hex.EncodeToString(hb.Sum(nil)), hex.EncodeToString(hv.Sum(nil))
}

// Executors kept in chunks of 2 in both datacenters (five each: chunks of
// 2, 2, 1): a build from the two lists' chunks one after another keeps each
// executor with its own print (a lapse in either datacenter removes that
// executor and no other), and no view already published changes when a
// later batch writes a chunk it holds.
func TestDCsChunksOfBothDatacentersStayAlignedAndViewsUnchanged(t *testing.T) {
	smallChunks(t)
	var execs []mdcExec
	for _, dc := range []string{"dc1", "dc2"} {
		for i := range 5 {
			execs = append(execs, mdcExec{dc, fmt.Sprintf("%s-%d", dc, i), "s1", 1,
				fmt.Sprintf("n%d", i)})
		}
	}
	h := mdcStart(t, execs...)
	h.readAll("dc1")
	h.readAll("dc2")
	d := mdcDispatcher(t, "dc1")
	h.subscribe(d)
	hosts := func(dc string, skip ...string) string {
		var out []string
		for _, x := range execs {
			if x.dc == dc && !slices.Contains(skip, x.inst) {
				out = append(out, x.inst)
			}
		}
		return strings.Join(out, " ")
	}
	h.waitLoad(d, "0:dc1["+hosts("dc1")+"] 1:dc2["+hosts("dc2")+"]")
	frozen := []frozenView{freezeView(h.s.View())}
	lease := func(x mdcExec) health.CheckState {
		return health.CheckState{Node: x.node, CheckID: mdcLeaseOf(x),
			ServiceID: health.ServiceID(x.inst, mdcTask), Status: health.StatusCritical,
			CreateIndex: 1}
	}
	unchanged := func(step string) {
		t.Helper()
		for i, f := range frozen {
			if err := f.changed(); err != nil {
				t.Fatalf("%s: view %d: %v", step, i, err)
			}
		}
		frozen = append(frozen, freezeView(h.s.View()))
	}
	h.send("dc2", h.nonPassing("dc2", lease(execs[8]))) // dc2-3, in dc2's second chunk
	h.expectLoad(d, "0:dc1["+hosts("dc1")+"] 1:dc2["+hosts("dc2", "dc2-3")+"]")
	unchanged("dc2-3 lapsed")
	h.send("dc1", h.nonPassing("dc1", lease(execs[4]))) // dc1-4, alone in dc1's last chunk
	h.expectLoad(d, "0:dc1["+hosts("dc1", "dc1-4")+"] 1:dc2["+hosts("dc2", "dc2-3")+"]")
	unchanged("dc1-4 lapsed")
	h.send("dc2", h.nonPassing("dc2", lease(execs[8]), lease(execs[5]))) // dc2-0 too
	h.expectLoad(d, "0:dc1["+hosts("dc1", "dc1-4")+"] 1:dc2["+hosts("dc2", "dc2-3", "dc2-0")+"]")
	unchanged("dc2-0 lapsed")
}
