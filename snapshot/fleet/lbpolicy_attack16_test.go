package fleet

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/jonboulle/clockwork"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// attack16Syncer is startSyncer with a server default policy (--lb-policy).
func attack16Syncer(t *testing.T, lb health.LBPolicy) *syncHarness {
	h := &syncHarness{t: t, clock: clockwork.NewFakeClock(), obs: make(chan health.Observation, 16), pubs: make(chan published, 64)}
	h.s = NewSyncer(SyncConfig{Clock: h.clock, LBPolicy: lb, OnPublish: func(g string, snap *cache.Snapshot) { h.pubs <- published{g, snap} }})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { h.s.Run(ctx, h.obs); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	h.obs <- health.Observation{Generations: &health.Generations{}}
	return h
}

func attack16Fleet(h *syncHarness, t *testing.T) published {
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work", "batch")
	h.members("work", fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 3))
	h.members("batch", fleettest.Member("batch", "b", "s1", 1, 9002, "1.0.0", health.StatusPassing, 4))
	h.nonPassing()
	return h.publish()
}

func attack16Clusters(t *testing.T, snap *cache.Snapshot) map[string][]byte {
	t.Helper()
	out := map[string][]byte{}
	for name, r := range snap.GetResources(resource.ClusterType) {
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		out[name] = b
	}
	return out
}

// Two replicas whose effective policies agree — one by --lb-policy, the
// other by the rules' default, a third by per-task choices — serve the same
// cluster bytes and versions: a client failing over is answered with what it
// has.
func TestAttack16ReplicasAgreeOnClusters(t *testing.T) {
	byFlag := attack16Syncer(t, health.LBRoundRobin)
	p1 := attack16Fleet(byFlag, t)

	byRules := attack16Syncer(t, "")
	byRules.obs <- health.Observation{Rules: &health.RulesSource{Source: "file:r", Raw: []byte(`{"load_balancing":{"default":"round_robin"}}`)}}
	p2 := attack16Fleet(byRules, t)

	byTask := attack16Syncer(t, health.LBLeastRequest)
	byTask.obs <- health.Observation{Rules: &health.RulesSource{Source: "file:r", Raw: []byte(`{"load_balancing":{"tasks":{"work":"round_robin","batch":"round_robin"}}}`)}}
	p3 := attack16Fleet(byTask, t)

	c1, c2, c3 := attack16Clusters(t, p1.snap), attack16Clusters(t, p2.snap), attack16Clusters(t, p3.snap)
	for _, task := range []string{"work", "batch"} {
		if !bytes.Equal(c1[task], c2[task]) || !bytes.Equal(c1[task], c3[task]) {
			t.Errorf("%s: cluster bytes differ between replicas with the same policy", task)
		}
		for _, p := range []published{p2, p3} {
			if a, b := p1.snap.VersionMap[resource.ClusterType][task], p.snap.VersionMap[resource.ClusterType][task]; a != b {
				t.Errorf("%s: cluster version %s vs %s", task, a, b)
			}
		}
	}
	for _, p := range []published{p2, p3} {
		if a, b := p1.snap.Resources[types.Cluster].Version, p.snap.Resources[types.Cluster].Version; a != b {
			t.Errorf("cluster type version %s vs %s", a, b)
		}
	}
}

// A rules change of one task's policy changes that task's cluster version
// only; an unrelated rules change none; going back restores the first
// versions exactly (the memo is keyed by policy).
func TestAttack16PolicyChangeVersions(t *testing.T) {
	h := attack16Syncer(t, "")
	first := attack16Fleet(h, t).snap
	vm0 := first.VersionMap[resource.ClusterType]

	rules := func(raw string) {
		h.obs <- health.Observation{Rules: &health.RulesSource{Source: "consul-kv:x", Raw: []byte(raw)}}
	}
	rules(`{"load_balancing":{"tasks":{"batch":"least_request"}}}`)
	h.advanceWindow()
	vm1 := h.publish().snap.VersionMap[resource.ClusterType]
	if vm1["batch"] == vm0["batch"] {
		t.Fatal("batch's policy changed but its cluster kept its version")
	}
	if vm1["work"] != vm0["work"] {
		t.Fatal("work's policy did not change but its cluster got a new version")
	}

	rules(`{"load_balancing":{"tasks":{"batch":"least_request"}},"safety_limit":0.9}`)
	h.advanceWindow()
	vm2 := h.publish().snap.VersionMap[resource.ClusterType]
	if vm2["batch"] != vm1["batch"] || vm2["work"] != vm1["work"] {
		t.Fatalf("an unrelated rules change changed cluster versions: %v → %v", vm1, vm2)
	}

	rules(`{}`)
	h.advanceWindow()
	vm3 := h.publish().snap.VersionMap[resource.ClusterType]
	if vm3["batch"] != vm0["batch"] || vm3["work"] != vm0["work"] {
		t.Fatalf("back to the default: versions %v, want the first %v", vm3, vm0)
	}

	// An invalid document changes nothing, the previous stays.
	prevErr := ""
	for _, tt := range []struct{ doc, field string }{
		{`{"load_balancing":{"tasks":{"batch":null}}}`, `load_balancing.tasks["batch"]`},
		{`{"load_balancing":{"tasks":{"batch":"Round_Robin"}}}`, `load_balancing.tasks["batch"]`},
		{`{"load_balancing":{"tasks":{"":"round_robin"}}}`, `load_balancing.tasks[""]`},
		{`{"load_balancing":{"tasks":{"batch":["round_robin"]}}}`, "load_balancing.tasks"},
		{`{"load_balancing":{"default":"round_robin","default_policy":"x"}}`, "default_policy"},
		{`{"load_balancing":"round_robin"}`, "load_balancing"},
		{`{"load_balancing":{"default":7}}`, "load_balancing.default"},
	} {
		rules(tt.doc)
		// The view shows the refusal once Run has taken the document (each
		// document's error differs from the one before).
		var got string
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			if got = h.s.View().Control.RolloutError; got != prevErr {
				break
			}
		}
		if got == prevErr {
			t.Errorf("%s: accepted (error still %q)", tt.doc, got)
		} else if !strings.Contains(got, tt.field) {
			t.Errorf("%s: error %q does not name %s", tt.doc, got, tt.field)
		}
		prevErr = got
	}
	h.quiet()
}

// Every policy gives a distinct cluster version, and the same policy the
// same version however often it is asked for.
func TestAttack16StaticVersionPerPolicy(t *testing.T) {
	seen := map[string]health.LBPolicy{}
	s := NewSyncer(SyncConfig{})
	for range 2 {
		for _, p := range health.LBPolicies {
			v := s.staticVersion(resource.ClusterType, "work\x00"+string(p), translator.Cluster("work", p))
			if q, ok := seen[v]; ok && q != p {
				t.Fatalf("%s and %s share cluster version %s", p, q, v)
			}
			seen[v] = p
			if want := translator.Version(translator.Cluster("work", p)); v != want {
				t.Fatalf("%s: memoised version %s, content version %s", p, v, want)
			}
		}
	}
}
