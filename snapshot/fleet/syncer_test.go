package fleet

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/jonboulle/clockwork"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	"github.com/leasehold/leasehold/snapshot/translator"
)

type published struct {
	group string
	snap  *cache.Snapshot
}

type syncHarness struct {
	t     *testing.T
	s     *Syncer
	clock *clockwork.FakeClock
	obs   chan health.Observation
	pubs  chan published
	index uint64
}

func startSyncer(t *testing.T, logger ...*slog.Logger) *syncHarness {
	h := &syncHarness{t: t, clock: clockwork.NewFakeClock(), obs: make(chan health.Observation, 16),
		pubs: make(chan published, 64)}
	log := slog.New(slog.NewTextHandler(testLog{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	if len(logger) > 0 {
		log = logger[0]
	}
	h.s = NewSyncer(SyncConfig{Logger: log, Clock: h.clock,
		OnPublish: func(g string, snap *cache.Snapshot) { h.pubs <- published{g, snap} }})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { h.s.Run(ctx, h.obs); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	h.obs <- health.Observation{Data: &health.Generations{}} // no generation keys
	return h
}

func (h *syncHarness) generations(floor map[string]uint64) {
	h.index++
	h.obs <- health.Observation{Data: &health.Generations{Index: h.index,
		Keys: fleettest.Keys(floor)}}
}

func (h *syncHarness) publish() published {
	h.t.Helper()
	select {
	case p := <-h.pubs:
		return p
	case <-time.After(5 * time.Second):
		h.t.Fatal("nothing published")
		return published{}
	}
}

// advanceWindow lets a coalesced (addition-only) change be published.
func (h *syncHarness) advanceWindow() {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := h.clock.BlockUntilContext(ctx, 1); err != nil {
		h.t.Fatal("no coalescing timer")
	}
	h.clock.Advance(50 * time.Millisecond)
}

func (h *syncHarness) quiet() {
	h.t.Helper()
	select {
	case p := <-h.pubs:
		h.t.Fatalf("unexpected publish of %s", p.group)
	default:
	}
}

func (h *syncHarness) tasks(tasks ...string) {
	h.index++
	h.obs <- health.Observation{Data: &health.TaskList{Index: h.index, Tasks: tasks}}
}

func (h *syncHarness) members(task string, ms ...health.Member) {
	h.index++
	h.obs <- health.Observation{Data: &health.TaskMembers{Task: task, Index: h.index,
		Members: ms}}
}

func (h *syncHarness) nonPassing(checks ...health.CheckState) {
	h.index++
	for i := range checks {
		checks[i].ModifyIndex = h.index
	}
	h.obs <- health.Observation{Data: &health.NonPassing{Index: h.index, Checks: checks}}
}

// onNodeWithSerf is m registered on node (its checks too), its serfHealth
// check with the given status and ModifyIndex.
func onNodeWithSerf(m health.Member, node string, serf health.CheckStatus,
	serfIdx uint64) health.Member {
	m.Node = node
	checks := make([]health.CheckState, len(m.Checks))
	copy(checks, m.Checks)
	for i := range checks {
		checks[i].Node = node
		if checks[i].CheckID == health.SerfHealthCheckID {
			checks[i].Status, checks[i].ModifyIndex = serf, serfIdx
		}
	}
	m.Checks = checks
	return m
}

// settle waits until Run has applied every observation sent so far, and is
// the view it published.
func (h *syncHarness) settle() *View {
	h.t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		v := h.s.View()
		if v.ConsulIndex >= h.index {
			return v
		}
		select {
		case <-v.Changed():
		case <-h.pubs:
		case <-deadline:
			h.t.Fatalf("the view never reached index %d", h.index)
		}
	}
}

// routesHealthy reports whether the settled view routes inst/sess as
// healthy to an unconstrained dispatcher.
func (h *syncHarness) routesHealthy(inst, sess string) bool {
	h.t.Helper()
	v := h.settle()
	d := dispatcher(h.t, "")
	for i, vd := range v.DecideAll(d) {
		if e := v.Executors()[i]; e.InstanceID == inst && e.SessionID == sess &&
			vd.Route == health.RouteHealthy {
			return true
		}
	}
	return false
}

func endpointsOf(t *testing.T, snap *cache.Snapshot, task string) []string {
	t.Helper()
	r, ok := snap.GetResources(resource.EndpointType)[task]
	if !ok {
		return nil
	}
	var out []string
	for _, loc := range translator.Expand(r.(*endpointv3.ClusterLoadAssignment)).GetEndpoints() {
		for _, lb := range loc.GetLbEndpoints() {
			out = append(out, lb.GetEndpoint().GetHostname()+":"+lb.GetHealthStatus().String())
		}
	}
	return out
}

func dispatcher(t *testing.T, vc string) health.Dispatcher {
	d, err := health.NewDispatcher(vc, nil)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestSyncerRemovalsAreImmediateAdditionsCoalesced(t *testing.T) {
	h := startSyncer(t)
	h.s.Subscribe(dispatcher(t, "")) // before the fleet is read: waits
	h.tasks("work")
	h.nonPassing()
	h.quiet()
	h.members("work",
		fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 5))
	p := h.publish()
	if got := endpointsOf(t, p.snap, "work"); len(got) != 1 || got[0] != "a:HEALTHY" {
		t.Fatalf("endpoints %v", got)
	}
	// an addition waits for the coalescing window
	h.members("work",
		fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 5),
		fleettest.Member("work", "b", "s1", 1, 9002, "1.0.0", health.StatusPassing, 6))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := h.clock.BlockUntilContext(ctx, 1); err != nil {
		t.Fatal("no coalescing timer")
	}
	h.quiet()
	h.clock.Advance(50 * time.Millisecond)
	if got := endpointsOf(t, h.publish().snap, "work"); len(got) != 2 {
		t.Fatalf("after the window: %v", got)
	}
	// a lapse is published at once, without the clock moving
	h.nonPassing(health.CheckState{Node: "n1", CheckID: health.CheckID("a", "s1", "work"),
		ServiceID: "work:a", Status: health.StatusCritical})
	if got := endpointsOf(t, h.publish().snap, "work"); len(got) != 1 || got[0] != "b:HEALTHY" {
		t.Fatalf("after the lapse: %v", got)
	}
	// passing again: the lapsed session stays out
	h.nonPassing()
	h.members("work",
		fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 50),
		fleettest.Member("work", "b", "s1", 1, 9002, "1.0.0", health.StatusPassing, 6))
	h.clock.Advance(time.Second)
	select {
	case p := <-h.pubs:
		if got := endpointsOf(t, p.snap, "work"); len(got) != 1 {
			t.Fatalf("lapsed session routed again: %v", got)
		}
	default:
	}
	if !h.s.Ready() {
		t.Fatal("not ready")
	}
}

func TestSyncerGroupsByConstraintSetAndIsolatesTasks(t *testing.T) {
	h := startSyncer(t)
	h.tasks("work", "other")
	h.nonPassing()
	h.members("work",
		fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 5),
		fleettest.Member("work", "v2", "s1", 1, 9002, "2.0.0", health.StatusPassing, 6))
	h.members("other",
		fleettest.Member("other", "o", "s1", 1, 9100, "1.0.0", health.StatusPassing, 7))
	any, v1 := dispatcher(t, ""), dispatcher(t, "<2.0.0")
	h.s.Subscribe(any)
	h.s.Subscribe(any) // a second stream of the same set shares the group
	h.s.Subscribe(v1)
	snaps := map[string]*cache.Snapshot{}
	for len(snaps) < 2 {
		p := h.publish()
		snaps[p.group] = p.snap
	}
	if got := endpointsOf(t, snaps[any.Key()], "work"); len(got) != 2 {
		t.Fatalf("unconstrained: %v", got)
	}
	if got := endpointsOf(t, snaps[v1.Key()], "work"); len(got) != 1 || got[0] != "a:HEALTHY" {
		t.Fatalf("<2.0.0: %v", got)
	}
	otherOf := func(snap *cache.Snapshot) string {
		return translator.Version(snap.GetResources(resource.EndpointType)["other"])
	}
	otherVersion := otherOf(snaps[any.Key()])
	// draining "a" of task work: urgent for both groups; task other untouched
	drained := fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 8)
	drained.State = health.StateDraining
	h.members("work", drained,
		fleettest.Member("work", "v2", "s1", 1, 9002, "2.0.0", health.StatusPassing, 6))
	for range 2 {
		p := h.publish()
		if got := endpointsOf(t, p.snap, "work"); got[0] != "a:DRAINING" {
			t.Fatalf("%s: %v", p.group, got)
		}
		if p.group == any.Key() && otherOf(p.snap) != otherVersion {
			t.Fatal("task other changed")
		}
	}
	// releasing one of the two streams keeps the group; the second drops it
	h.s.Unsubscribe(any)
	h.s.Unsubscribe(any)
	h.s.Subscribe(v1) // processed after the unsubscribes
	h.members("work",
		fleettest.Member("work", "v2", "s1", 1, 9002, "2.0.0", health.StatusPassing, 6))
	p := h.publish()
	if p.group != v1.Key() {
		t.Fatalf("published dropped group %q", p.group)
	}
	if _, ok := h.s.Snapshot(any.Key()); ok {
		t.Fatal("dropped group still has a snapshot")
	}
}

func TestSyncerReplicasAgreeOnVersions(t *testing.T) {
	feed := func(h *syncHarness) *cache.Snapshot {
		h.tasks("work")
		h.nonPassing(health.CheckState{Node: "n1", CheckID: health.CheckID("b", "s1", "work"),
			ServiceID: "work:b", Status: health.StatusWarning, Output: "load=4"})
		h.members("work",
			fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 5),
			fleettest.Member("work", "b", "s1", 1, 9002, "1.0.0", health.StatusPassing, 6))
		h.s.Subscribe(dispatcher(t, ">=1.0.0"))
		return h.publish().snap
	}
	s1, s2 := feed(startSyncer(t)), feed(startSyncer(t))
	for _, typ := range []string{resource.ClusterType, resource.EndpointType, resource.ListenerType,
		resource.RouteType} {
		if s1.GetVersion(typ) != s2.GetVersion(typ) || s1.GetVersion(typ) == "" {
			t.Fatalf("%s versions %q and %q", typ, s1.GetVersion(typ), s2.GetVersion(typ))
		}
	}
	_ = types.Endpoint
}

func TestSyncerBadMetadataExcludesOnlyThatRegistration(t *testing.T) {
	h := startSyncer(t)
	h.tasks("work")
	h.nonPassing()
	bad := fleettest.Member("work", "x", "s1", 1, 9009, "1.0.0", health.StatusPassing, 9)
	bad.Err = &health.FieldError{Field: "capacity", Value: "abc", Reason: "not an integer"}
	h.members("work",
		fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 5), bad)
	h.s.Subscribe(dispatcher(t, ""))
	if got := endpointsOf(t, h.publish().snap, "work"); len(got) != 1 || got[0] != "a:HEALTHY" {
		t.Fatalf("endpoints %v", got)
	}
}

func TestSyncerTaskGoneRemovesItsResources(t *testing.T) {
	h := startSyncer(t)
	h.tasks("work")
	h.nonPassing()
	h.members("work",
		fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 5))
	h.s.Subscribe(dispatcher(t, ""))
	h.publish()
	h.tasks()
	h.obs <- health.Observation{Data: &health.TaskMembers{Task: "work", Gone: true}}
	p := h.publish()
	if len(p.snap.GetResources(resource.ListenerType)) != 0 ||
		len(p.snap.GetResources(resource.EndpointType)) != 0 {
		t.Fatal("gone task still served")
	}
}

type testLog struct{ t *testing.T }

func (l testLog) Write(p []byte) (int, error) { l.t.Log(string(p)); return len(p), nil }

func TestSyncerForgetsGenerationsWhenConsulLosesItsState(t *testing.T) {
	h := startSyncer(t)
	h.tasks("work")
	h.nonPassing()
	h.members("work",
		fleettest.Member("work", "a", "old", 3, 9001, "1.0.0", health.StatusPassing, 5))
	h.s.Subscribe(dispatcher(t, ""))
	h.publish()
	// Consul restarts empty: the executor re-registers, its KV generation starts over
	h.obs <- health.Observation{Data: &health.Contact{OK: true, IndexWentBack: true}}
	h.members("work",
		fleettest.Member("work", "a", "new", 1, 9001, "1.0.0", health.StatusPassing, 2))
	p := h.publish() // a new session at the same address is pushed at once: no coalescing window
	if got := endpointsOf(t, p.snap, "work"); len(got) != 1 {
		t.Fatalf("new session fenced by a generation from before the state loss: %v", got)
	}
	// OnPublish runs before the view is published: wait for the view.
	if st := h.settle().Sessions().Check("a", "new"); st.State != health.SessionCurrent {
		t.Fatalf("new session %s", st.State)
	}
}

// A rule going from observe to enforce removes what it now excludes, and a
// removal is published at once (no coalescing window), like a lapse. An
// invalid configuration changes nothing.
func TestSyncerRuleModesObserveThenEnforce(t *testing.T) {
	h := startSyncer(t)
	d := dispatcher(t, "<2.0.0")
	h.s.Subscribe(d)
	h.tasks("work")
	h.nonPassing()
	h.members("work",
		fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 5),
		fleettest.Member("work", "b", "s1", 1, 9002, "2.0.0", health.StatusPassing, 6))
	if got := endpointsOf(t, h.publish().snap, "work"); len(got) != 1 {
		t.Fatalf("enforced by default: %v", got)
	}
	rules := func(raw string) {
		h.obs <- health.Observation{Data: &health.RulesSource{Source: "file:test",
			Raw: []byte(raw)}}
	}
	rules(`{"modes":[{"rule":"version","mode":"observe"}]}`)
	h.advanceWindow() // an addition: coalesced
	if got := endpointsOf(t, h.publish().snap, "work"); len(got) != 2 {
		t.Fatalf("version observed: %v", got)
	}
	if v := h.s.View().Decide(h.s.View().Executors()[1], d); v.Route != health.RouteHealthy ||
		len(v.Observed) != 1 {
		t.Fatalf("the view's verdict under observe: %+v", v)
	}
	rules(`{"modes":[{"rule":"lease","mode":"observe"}]}`) // invalid: refused
	rules(`{"modes":[{"rule":"version","mode":"enforce"}]}`)
	// no clock advance: the removal must not wait for the window
	if got := endpointsOf(t, h.publish().snap, "work"); len(got) != 1 || got[0] != "a:HEALTHY" {
		t.Fatalf("version enforced again: %v", got)
	}
	// The snapshot is set (OnPublish) before the view follows it: wait for it.
	deadline := time.After(5 * time.Second)
	for v := h.s.View(); v.Control.RolloutSource != "file:test" ||
		v.Control.Rollout.ModeOf(health.ReasonVersion, "work",
			d) != health.ModeEnforce; v = h.s.View() {
		select {
		case <-v.Changed():
		case <-deadline:
			t.Fatalf("control state: %+v", v.Control)
		}
	}
}

// A rollout that changes a task type's load-balancing policy republishes
// its cluster (nothing else changed); an invalid one changes nothing.
func TestSyncerLoadBalancingPolicyFromRules(t *testing.T) {
	h := startSyncer(t)
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	h.nonPassing()
	h.members("work",
		fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 3))
	policyOf := func(p published) string {
		t.Helper()
		for _, r := range p.snap.Resources[types.Cluster].Items {
			c := r.Resource.(*clusterv3.Cluster)
			first := c.GetLoadBalancingPolicy().GetPolicies()[0].GetTypedExtensionConfig()
			return first.GetTypedConfig().GetTypeUrl() + " " +
				string(mustJSON(t, c.GetLoadBalancingPolicy()))
		}
		t.Fatal("no cluster")
		return ""
	}
	first := policyOf(h.publish())
	if !strings.Contains(first, "ClientSideWeightedRoundRobin") {
		t.Fatalf("default policy: %s", first)
	}
	h.obs <- health.Observation{Data: &health.RulesSource{Source: "consul-kv:x",
		Raw: []byte(`{"load_balancing":{"tasks":{"work":"least_request"}}}`)}}
	h.advanceWindow()
	if got := policyOf(h.publish()); !strings.Contains(got, "LeastRequest") ||
		strings.Contains(got, "ClientSideWeightedRoundRobin") {
		t.Fatalf("after the rules: %s", got)
	}
	h.obs <- health.Observation{Data: &health.RulesSource{Source: "consul-kv:x",
		Raw: []byte(`{"load_balancing":{"tasks":{"work":"fastest"}}}`)}}
	deadline := time.After(5 * time.Second)
	for v := h.s.View(); v.Control.RolloutError == ""; v = h.s.View() { // until Run refused it
		select {
		case <-v.Changed():
		case <-deadline:
			t.Fatal("the invalid rules were never refused")
		}
	}
	h.quiet()
	if st := h.s.View().Control; !strings.Contains(st.RolloutError,
		`load_balancing.tasks["work"]`) {
		t.Fatalf("invalid rules: error %q", st.RolloutError)
	}
}

func mustJSON(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := protojson.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// The rules applied are logged as JSON people read: a scope of <2.0.0 is
// written so, not as \u003c2.0.0 (the audit record carries the same detail).
func TestRulesAppliedAreWrittenReadably(t *testing.T) {
	lines := make(logLines, 64)
	h := startSyncer(t, slog.New(slog.NewTextHandler(lines, nil)))
	h.obs <- health.Observation{Data: &health.RulesSource{Source: "file:test",
		Raw: []byte(`{"modes":[{"rule":"version","mode":"observe",` +
			`"constraint_set":{"version_constraint":"<2.0.0"}}]}`)}}
	deadline := time.After(10 * time.Second)
	for {
		select {
		case l := <-lines:
			if !strings.Contains(l, "rollout configuration applied") {
				continue
			}
			if !strings.Contains(l, `<2.0.0`) || strings.Contains(l, `u003c`) {
				t.Fatalf("escaped for HTML: %s", l)
			}
			return
		case <-deadline:
			t.Fatal("the rules were never applied")
		}
	}
}

// logLines hands each log line written to the test (the syncer logs from
// its own goroutine).
type logLines chan string

func (l logLines) Write(p []byte) (int, error) {
	select {
	case l <- string(p):
	default: // the test reads what it needs; more is not kept
	}
	return len(p), nil
}
