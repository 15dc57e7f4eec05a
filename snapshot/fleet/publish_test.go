package fleet

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/stream/v3"
	"github.com/jonboulle/clockwork"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	"github.com/leasehold/leasehold/snapshot/translator"
	"github.com/leasehold/leasehold/snapshot/xdscache"
)

// Dispatchers of one constraint set in three forms: each gets its form's
// bytes (a deterministic marshal of the derived message) with its own
// versions, change after change; a second replica sends the same bytes
// and versions (that only what changed is derived again is
// xdscache's TestADerivationKeepsWhatDidNotChange).
func TestFormsThroughTheCache(t *testing.T) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	replicas := []*syncHarness{startSyncer(t, quiet), startSyncer(t, quiet)}
	d := dispatcher(t, "")
	var members []health.Member
	for i := range 30 {
		members = append(members,
			fleettest.Member("work", fmt.Sprintf("e%02d", i), fmt.Sprintf("sess-%02d", i), 1,
				9000+i, "1.0.0", health.StatusPassing, uint64(5+i)))
	}
	for _, h := range replicas {
		h.s.Subscribe(d)
		h.tasks("work")
		h.members("work", members...)
		h.nonPassing()
	}
	forms := []xdscache.EndpointMetadata{xdscache.MetadataFull, xdscache.MetadataSession,
		xdscache.MetadataNone}
	for round := range 4 {
		type answer struct {
			version string
			bytes   []byte
		}
		got := make([]map[xdscache.EndpointMetadata]answer, len(replicas))
		for r, h := range replicas {
			h.publish()
			got[r] = map[xdscache.EndpointMetadata]answer{}
			for _, f := range forms {
				node := fleettest.Node(t, map[string]any{"endpoint_metadata": string(f)})
				out := make(chan cache.Response, 1)
				req := &cache.Request{TypeUrl: resource.EndpointType,
					ResourceNames: []string{"work"}, Node: node}
				cancel, err := h.s.Cache().CreateWatch(req,
					stream.NewSotwSubscription(req.ResourceNames, true), out)
				if err != nil {
					t.Fatal(err)
				}
				resp, err := (<-out).GetDiscoveryResponse()
				cancel()
				if err != nil || len(resp.Resources) != 1 {
					t.Fatalf("round %d, %s: %v, %d resources", round, f, err,
						len(resp.GetResources()))
				}
				cla := &endpointv3.ClusterLoadAssignment{}
				if err := resp.Resources[0].UnmarshalTo(cla); err != nil {
					t.Fatal(err)
				}
				if n := len(cla.Endpoints[0].LbEndpoints); n != len(members) {
					t.Fatalf("round %d, %s: %d endpoints, want %d", round, f, n, len(members))
				}
				for _, lb := range cla.Endpoints[0].LbEndpoints {
					md := lb.GetMetadata().GetFilterMetadata()
					fields := md[translator.MetadataNamespace].GetFields()
					wantFields := map[xdscache.EndpointMetadata]int{xdscache.MetadataFull: 3,
						xdscache.MetadataSession: 1, xdscache.MetadataNone: 0}[f]
					if len(fields) != wantFields ||
						(f == xdscache.MetadataSession &&
							fields["session_id"].GetStringValue() != "sess-"+
								lb.GetEndpoint().GetHostname()[1:]) {
						t.Fatalf("round %d, %s: endpoint metadata %v", round, f, lb.GetMetadata())
					}
				}
				group := xdscache.GroupOf(node) // the form's group
				snap, _ := h.s.Snapshot(group)
				derived := snap.GetResources(resource.EndpointType)["work"]
				want, _ := proto.MarshalOptions{Deterministic: true}.Marshal(derived)
				if !bytes.Equal(resp.Resources[0].Value, want) {
					t.Fatalf("round %d, %s: bytes differ from a marshal of the derived message",
						round, f)
				}
				got[r][f] = answer{resp.VersionInfo, resp.Resources[0].Value}
			}
		}
		for _, f := range forms {
			a, b := got[0][f], got[1][f]
			if a.version != b.version || !bytes.Equal(a.bytes, b.bytes) {
				t.Fatalf("round %d, %s: replicas differ", round, f)
			}
		}
		if got[0][xdscache.MetadataFull].version == got[0][xdscache.MetadataNone].version ||
			got[0][xdscache.MetadataSession].version == got[0][xdscache.MetadataNone].version {
			t.Fatalf("round %d: two forms share a version", round)
		}
		members = members[:len(members)-1] // a removal, published at once
		for _, h := range replicas {
			h.members("work", members...)
		}
	}
}

// A delta client asking for a form gets that form.
func TestFormsForDeltaClients(t *testing.T) {
	h := startSyncer(t, slog.New(slog.NewTextHandler(io.Discard, nil)))
	d := dispatcher(t, "")
	h.s.Subscribe(d)
	h.tasks("work")
	h.members("work",
		fleettest.Member("work", "e1", "s1", 1, 9001, "1.0.0", health.StatusPassing, 5))
	h.nonPassing()
	h.publish()
	node := fleettest.Node(t, map[string]any{"endpoint_metadata": "none"})
	out := make(chan cache.DeltaResponse, 1)
	req := &cache.DeltaRequest{TypeUrl: resource.EndpointType,
		ResourceNamesSubscribe: []string{"work"}, Node: node}
	cancel, err := h.s.Cache().CreateDeltaWatch(req,
		stream.NewDeltaSubscription(req.ResourceNamesSubscribe, nil, nil, false), out)
	if err != nil {
		t.Fatal(err)
	}
	if cancel != nil { // nil when answered at once
		defer cancel()
	}
	resp, err := (<-out).GetDeltaDiscoveryResponse()
	if err != nil || len(resp.Resources) != 1 {
		t.Fatalf("%v, %d resources", err, len(resp.GetResources()))
	}
	cla := &endpointv3.ClusterLoadAssignment{}
	if err := resp.Resources[0].Resource.UnmarshalTo(cla); err != nil {
		t.Fatal(err)
	}
	if lb := cla.Endpoints[0].LbEndpoints[0]; lb.Metadata != nil ||
		lb.GetEndpoint().GetHostname() != "e1" {
		t.Fatalf("delta client got %v", lb)
	}
}

// Through the cache: every state-of-the-world response carries, for each
// load assignment, exactly a deterministic proto.Marshal of the snapshot's
// message, change after change, for two constraint sets at once (their
// Builders hold their endpoints' encodings apart).
func TestSotwResponsesAreProtoMarshalBytes(t *testing.T) {
	h := startSyncer(t, slog.New(slog.NewTextHandler(io.Discard, nil)))
	sets := []health.Dispatcher{dispatcher(t, ""), dispatcher(t, ">=1.5.0")}
	for _, d := range sets {
		h.s.Subscribe(d)
	}
	h.tasks("work")
	var members []health.Member
	for i := range 40 {
		members = append(members,
			fleettest.Member("work", fmt.Sprintf("e%02d", i), "s1", 1, 9000+i,
				fmt.Sprintf("1.%d.0", i%10), health.StatusPassing, uint64(5+i)))
	}
	h.members("work", members...)
	h.nonPassing()
	for round := range 6 {
		for range sets {
			h.publish()
		}
		for _, d := range sets {
			snap, ok := h.s.Snapshot(d.Key())
			if !ok {
				t.Fatalf("round %d: no snapshot for %s", round, d.Key())
			}
			out := make(chan cache.Response, 1)
			req := &cache.Request{TypeUrl: resource.EndpointType, ResourceNames: []string{"work"},
				Node: &corev3.Node{Id: "d", Metadata: nodeMeta(t, d)}}
			cancel, err := h.s.Cache().CreateWatch(req,
				stream.NewSotwSubscription(req.ResourceNames, true), out)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := (<-out).GetDiscoveryResponse()
			cancel()
			if err != nil || len(resp.Resources) != 1 {
				t.Fatalf("round %d: %v, %d resources", round, err, len(resp.GetResources()))
			}
			cla := snap.GetResources(resource.EndpointType)["work"]
			want, _ := proto.MarshalOptions{Deterministic: true}.Marshal(cla)
			if !bytes.Equal(resp.Resources[0].Value, want) {
				t.Fatalf("round %d, set %s: response bytes differ from proto.Marshal", round,
					d.Key())
			}
		}
		members = members[:len(members)-1] // 1.9.0, 1.8.0, …: removed from both sets at once
		h.members("work", members...)
	}
}

func nodeMeta(t *testing.T, d health.Dispatcher) *structpb.Struct {
	m := map[string]any{}
	if d.VersionConstraint != "" {
		m[health.NodeMetaVersionConstraint] = d.VersionConstraint
	}
	st, err := structpb.NewStruct(m)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// The delta cache's per-resource versions are the translator's content
// versions, set with the snapshot: a change alters the version of the
// resources it changed and of no other, and go-control-plane never has to
// marshal and hash the group to find out.
func TestDeltaVersionsAreContentVersions(t *testing.T) {
	h := startSyncer(t)
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("a", "b")
	h.members("a", fleettest.Member("a", "x", "s1", 1, 9001, "1.0.0", health.StatusPassing, 5))
	h.members("b", fleettest.Member("b", "y", "s1", 1, 9002, "1.0.0", health.StatusPassing, 6))
	h.nonPassing() // the fleet is read: one publish with both tasks
	before := h.publish().snap
	vm := before.VersionMap
	for _, typ := range []string{resource.ListenerType, resource.RouteType, resource.ClusterType,
		resource.EndpointType} {
		if len(vm[typ]) != 2 || vm[typ]["a"] == "" || vm[typ]["b"] == "" {
			t.Fatalf("%s versions %v, want one per task", typ, vm[typ])
		}
	}
	if err := before.ConstructVersionMap(); err != nil ||
		fmt.Sprint(before.VersionMap) != fmt.Sprint(vm) {
		t.Fatalf("ConstructVersionMap replaced the content versions: %v", err)
	}
	h.members("a") // x leaves task a: a removal, published at once
	after := h.publish().snap.VersionMap
	if after[resource.EndpointType]["a"] == vm[resource.EndpointType]["a"] {
		t.Fatal("task a's endpoints changed but kept their version")
	}
	if after[resource.EndpointType]["b"] != vm[resource.EndpointType]["b"] ||
		after[resource.ClusterType]["a"] != vm[resource.ClusterType]["a"] {
		t.Fatal("an unchanged resource got a new version: delta clients would be sent it again")
	}
}

// BenchmarkDeltaVersionMap is what a change cost go-control-plane per
// group while a delta client was connected (marshal and hash every
// resource: here one load assignment of 1,000 endpoints), against the
// versions set with the snapshot.
func BenchmarkDeltaVersionMap(b *testing.B) {
	execs := make([]health.Executor, 1000)
	for i := range execs {
		execs[i] = health.Join(fleettest.Member("work", fmt.Sprintf("e%d", i), "s1", 1, 10000+i,
			"1.0.0", health.StatusPassing, 5), nil)
	}
	cla := (&translator.Builder{}).BuildPrinted("work", execs, nil, health.Dispatcher{}).CLA
	for _, bc := range []struct {
		name     string
		versions func() map[string]map[string]string
	}{
		{"hash every resource", func() map[string]map[string]string { return nil }},
		{"content versions set", func() map[string]map[string]string {
			return map[string]map[string]string{resource.EndpointType: {"work": "v1"}}
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for range b.N {
				s := &cache.Snapshot{VersionMap: bc.versions()}
				s.Resources[types.Endpoint] = cache.NewResources("v", []types.Resource{cla})
				if err := s.ConstructVersionMap(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// startSyncerWithPolicy is startSyncer with a server default policy
// (--lb-policy).
func startSyncerWithPolicy(t *testing.T, lb health.LBPolicy) *syncHarness {
	return startSyncerWith(t, SyncConfig{LBPolicy: lb})
}

// startSyncerWith starts a Syncer configured by cfg on the harness's clock.
func startSyncerWith(t *testing.T, cfg SyncConfig) *syncHarness {
	h := &syncHarness{t: t, clock: clockwork.NewFakeClock(), obs: make(chan health.Observation, 16),
		pubs: make(chan published, 64)}
	cfg.Clock = h.clock
	cfg.OnPublish = func(g string, snap *cache.Snapshot) { h.pubs <- published{g, snap} }
	h.s = NewSyncer(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { h.s.Run(ctx, h.obs); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	h.obs <- health.Observation{Data: &health.Generations{}}
	return h
}

// readWorkAndBatch subscribes an unconstrained dispatcher and reads a fleet of
// two task types, work and batch, one executor each; it is the publication
// that follows.
func readWorkAndBatch(h *syncHarness, t *testing.T) published {
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work", "batch")
	h.members("work",
		fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 3))
	h.members("batch",
		fleettest.Member("batch", "b", "s1", 1, 9002, "1.0.0", health.StatusPassing, 4))
	h.nonPassing()
	return h.publish()
}

// clusterBytes are the deterministic bytes of each cluster of snap, by name.
func clusterBytes(t *testing.T, snap *cache.Snapshot) map[string][]byte {
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

// TestReplicasWithTheSamePolicyAgreeOnClusters: replicas whose effective
// policies agree (one by --lb-policy, another by the rules' default, a third
// by per-task choices) serve the same cluster bytes and versions: a client
// failing over is answered with what it has.
func TestReplicasWithTheSamePolicyAgreeOnClusters(t *testing.T) {
	byFlag := startSyncerWithPolicy(t, health.LBRoundRobin)
	p1 := readWorkAndBatch(byFlag, t)

	byRules := startSyncerWithPolicy(t, "")
	byRules.obs <- health.Observation{Data: &health.RulesSource{Source: "file:r",
		Raw: []byte(`{"load_balancing":{"default":"round_robin"}}`)}}
	p2 := readWorkAndBatch(byRules, t)

	byTask := startSyncerWithPolicy(t, health.LBLeastRequest)
	byTask.obs <- health.Observation{Data: &health.RulesSource{Source: "file:r",
		Raw: []byte(`{"load_balancing":{"tasks":{"work":"round_robin","batch":"round_robin"}}}`)}}
	p3 := readWorkAndBatch(byTask, t)

	c1, c2, c3 := clusterBytes(t, p1.snap), clusterBytes(t, p2.snap), clusterBytes(t, p3.snap)
	for _, task := range []string{"work", "batch"} {
		if !bytes.Equal(c1[task], c2[task]) || !bytes.Equal(c1[task], c3[task]) {
			t.Errorf("%s: cluster bytes differ between replicas with the same policy", task)
		}
		for _, p := range []published{p2, p3} {
			a, b := p1.snap.VersionMap[resource.ClusterType][task],
				p.snap.VersionMap[resource.ClusterType][task]
			if a != b {
				t.Errorf("%s: cluster version %s vs %s", task, a, b)
			}
		}
	}
	for _, p := range []published{p2, p3} {
		a, b := p1.snap.Resources[types.Cluster].Version, p.snap.Resources[types.Cluster].Version
		if a != b {
			t.Errorf("cluster type version %s vs %s", a, b)
		}
	}
}

// TestPolicyChangeChangesOnlyItsClusterVersion: a rules change of one task's
// policy changes that task's cluster version only, an unrelated rules change
// none, and going back restores the first versions exactly (the memo is keyed
// by policy). An invalid document changes nothing and is refused naming the
// field.
func TestPolicyChangeChangesOnlyItsClusterVersion(t *testing.T) {
	h := startSyncerWithPolicy(t, "")
	first := readWorkAndBatch(h, t).snap
	vm0 := first.VersionMap[resource.ClusterType]

	rules := func(raw string) {
		h.obs <- health.Observation{Data: &health.RulesSource{Source: "consul-kv:x",
			Raw: []byte(raw)}}
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
		got := awaitRolloutError(h, prevErr)
		if got == prevErr {
			t.Errorf("%s: accepted (error still %q)", tt.doc, got)
		} else if !strings.Contains(got, tt.field) {
			t.Errorf("%s: error %q does not name %s", tt.doc, got, tt.field)
		}
		prevErr = got
	}
	h.quiet()
}

// TestStaticResourceIsPerPolicy: every policy gives a distinct cluster and
// version, and the same policy the same cluster (made once) and version
// however often it is asked for.
func TestStaticResourceIsPerPolicy(t *testing.T) {
	seen := map[string]health.LBPolicy{}
	s := NewSyncer(SyncConfig{})
	made := map[health.LBPolicy]proto.Message{}
	for range 2 {
		for _, p := range health.LBPolicies {
			m, v := s.staticResource(resource.ClusterType, "work\x00"+string(p),
				func() proto.Message { return translator.Cluster("work", p, health.DefaultDispatch()) })
			if q, ok := seen[v]; ok && q != p {
				t.Fatalf("%s and %s share cluster version %s", p, q, v)
			}
			seen[v] = p
			want := translator.Cluster("work", p, health.DefaultDispatch())
			if v != translator.Version(want) || !proto.Equal(m, want) {
				t.Fatalf("%s: memoised version %s of %v, content version %s of %v", p, v, m,
					translator.Version(want), want)
			}
			if prev, ok := made[p]; ok && prev != m {
				t.Fatalf("%s: the cluster was made again", p)
			}
			made[p] = m
		}
	}
}

// awaitRolloutError is the rollout error of the first view whose error is
// not prev, or prev when none comes within 5 seconds.
func awaitRolloutError(h *syncHarness, prev string) string {
	deadline := time.After(5 * time.Second)
	for {
		v := h.s.View()
		if got := v.Control.RolloutError; got != prev {
			return got
		}
		select {
		case <-v.Changed():
		case <-deadline:
			return prev
		}
	}
}

// A task type past ShardSize registrations is published as shards: one
// route weighing them, a cluster and a load assignment per shard, the
// resources consistent and the same on two replicas. Each shard's cluster is
// balanced as the task's one cluster is (the task's policy: weighted round
// robin on ORCA reports by default). A constraint set that routes to part of
// the task has the same shards, each executor in the same one. A lapse is
// published at once and changes its shard's load assignment alone.
// Dispatchers that said weighted_clusters: false get the task as one cluster.
func TestShardedTaskIsPublishedAsShardsAndALapseAsItsShard(t *testing.T) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	replicas := []*syncHarness{startSyncerWith(t, SyncConfig{ShardSize: 10, Logger: quiet}),
		startSyncerWith(t, SyncConfig{ShardSize: 10, Logger: quiet})}
	d, single := dispatcher(t, ""), dispatcher(t, "").InSingleCluster()
	newer := dispatcher(t, ">=1.0.0") // routes to 25 of the 35
	var members []health.Member
	for i := range 35 {
		version := "1.0.0"
		if i%7 < 2 {
			version = "0.9.0"
		}
		members = append(members, fleettest.Member("work", fmt.Sprintf("e%02d", i),
			fmt.Sprintf("s%02d", i), 1, 9000+i, version, health.StatusPassing, uint64(5+i)))
	}
	snaps := make([]map[string]*cache.Snapshot, len(replicas))
	for r, h := range replicas {
		h.s.Subscribe(d)
		h.s.Subscribe(single)
		h.s.Subscribe(newer)
		h.tasks("work")
		h.members("work", members...)
		h.nonPassing()
		snaps[r] = map[string]*cache.Snapshot{}
		for range 3 {
			p := h.publish()
			snaps[r][p.group] = p.snap
		}
	}
	snap := snaps[0][d.Key()]
	if snap == nil || snaps[0][single.Key()] == nil {
		t.Fatalf("published groups %v: want %s and %s", snaps[0], d.Key(), single.Key())
	}
	loads := snap.GetResources(resource.EndpointType)
	clusters := snap.GetResources(resource.ClusterType)
	if len(loads) != 4 || len(clusters) != 4 {
		t.Fatalf("35 registrations in shards of 10: %d load assignments, %d clusters; want 4",
			len(loads), len(clusters))
	}
	route := snap.GetResources(resource.RouteType)["work"].(*routev3.RouteConfiguration)
	names := translator.RouteClusters(route.GetVirtualHosts()[0].GetRoutes()[0])
	total := 0
	for i, n := range names {
		if n != translator.ShardName("work", i, 4) || clusters[n] == nil || loads[n] == nil {
			t.Fatalf("route sends to %v: shard %d is not a published cluster", names, i)
		}
		total += len(endpointsOf(t, snap, n))
	}
	if total != 35 {
		t.Fatalf("%d endpoints across the shards, want 35", total)
	}
	for _, typ := range []string{resource.EndpointType, resource.ClusterType,
		resource.RouteType} {
		for g := range snaps[0] {
			if a, b := snaps[0][g].GetVersion(typ), snaps[1][g].GetVersion(typ); a != b {
				t.Fatalf("%s of %s: version %s on one replica, %s on the other", typ, g, a, b)
			}
		}
	}
	if one := snaps[0][single.Key()].GetResources(resource.EndpointType); len(one) != 1 ||
		len(endpointsOf(t, snaps[0][single.Key()], "work")) != 35 {
		t.Fatalf("weighted_clusters: false got %d load assignments, want work alone", len(one))
	}
	// Nothing configured: every cluster of the task, its one and each shard's,
	// balances by the default policy.
	want := translator.Cluster("work", health.DefaultLBPolicy, health.TaskDispatch{}).
		GetLoadBalancingPolicy()
	clusters["work (one cluster)"] = snaps[0][single.Key()].GetResources(
		resource.ClusterType)["work"]
	for n, c := range clusters {
		if got := c.(*clusterv3.Cluster).GetLoadBalancingPolicy(); got == nil ||
			!proto.Equal(got, want) {
			t.Fatalf("%s is balanced by %v, want the task's %v", n, got, want)
		}
	}
	delete(clusters, "work (one cluster)")
	part := snaps[0][newer.Key()]
	routed := 0
	for i := range 4 {
		n := translator.ShardName("work", i, 4)
		if part.GetResources(resource.ClusterType)[n] == nil {
			t.Fatalf("the constraint set >=1.0.0 has no shard %s", n)
		}
		for _, e := range endpointsOf(t, part, n) {
			inst, _, _ := strings.Cut(e, ":")
			if translator.ShardOf(inst, 4) != i {
				t.Fatalf("the constraint set >=1.0.0 has %s in shard %d, the others in %d", inst,
					i, translator.ShardOf(inst, 4))
			}
			routed++
		}
	}
	if routed != 25 {
		t.Fatalf("the constraint set >=1.0.0 routes to %d, want the 25 of 1.0.0", routed)
	}

	// e07 lapses: published at once, its shard alone changed.
	h := replicas[0]
	h.index = 100 // past the members' own check indexes
	h.nonPassing(health.CheckState{Node: "n1", CheckID: health.CheckID("e07", "s07", "work"),
		ServiceID: "work:e07", Status: health.StatusCritical})
	after := map[string]*cache.Snapshot{}
	for range 2 { // e07 runs 0.9.0: the set >=1.0.0 has nothing new to publish
		p := h.publish()
		after[p.group] = p.snap
	}
	h.quiet()
	lapsed := translator.ShardName("work", translator.ShardOf("e07", 4), 4)
	versions := func(s *cache.Snapshot) map[string]string {
		return s.VersionMap[resource.EndpointType]
	}
	for name, v := range versions(after[d.Key()]) {
		changed := v != versions(snap)[name]
		if changed != (name == lapsed) {
			t.Fatalf("after a lapse in %s, %s changed: %v", lapsed, name, changed)
		}
	}
	for _, e := range endpointsOf(t, after[d.Key()], lapsed) {
		if strings.HasPrefix(e, "e07:") {
			t.Fatalf("lapsed e07 still in %s", lapsed)
		}
	}
	if got := endpointsOf(t, after[single.Key()], "work"); len(got) != 34 {
		t.Fatalf("the single-cluster group after the lapse: %d endpoints, want 34", len(got))
	}
}

// At fleet size a lapse seldom moves its shard's route weight: one executor
// of ~80 is ~1% of the shard's capacity, under a step. It is published at
// once all the same (no coalescing window passes), as its shard's load
// assignment alone, with the route as it was.
func TestALapseThatMovesNoWeightIsPublishedAtOnce(t *testing.T) {
	h := startSyncerWith(t, SyncConfig{ShardSize: 100,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	d := dispatcher(t, "")
	var members []health.Member
	for i := range 250 {
		members = append(members, fleettest.Member("work", fmt.Sprintf("e%03d", i),
			fmt.Sprintf("s%03d", i), 1, 9000+i, "1.0.0", health.StatusPassing, uint64(5+i)))
	}
	h.s.Subscribe(d)
	h.tasks("work")
	h.members("work", members...)
	h.nonPassing()
	before := h.publish().snap
	if n := len(before.GetResources(resource.EndpointType)); n != 3 {
		t.Fatalf("250 registrations in shards of 100: %d load assignments, want 3", n)
	}
	h.index = 1000 // past the members' own check indexes
	h.nonPassing(health.CheckState{Node: "n1", CheckID: health.CheckID("e100", "s100", "work"),
		ServiceID: "work:e100", Status: health.StatusCritical})
	after := h.publish().snap // at once: the fake clock never reached a window's end
	if a, b := before.GetVersion(resource.RouteType), after.GetVersion(resource.RouteType); a != b {
		t.Fatalf("the route changed (%s → %s): this lapse moved a weight, so the test "+
			"drills nothing; lapse another executor", a, b)
	}
	lapsed := translator.ShardName("work", translator.ShardOf("e100", 3), 3)
	for name, v := range after.VersionMap[resource.EndpointType] {
		if changed := v != before.VersionMap[resource.EndpointType][name]; changed != (name == lapsed) {
			t.Fatalf("after a lapse in %s, %s changed: %v", lapsed, name, changed)
		}
	}
	for _, e := range endpointsOf(t, after, lapsed) {
		if strings.HasPrefix(e, "e100:") {
			t.Fatalf("lapsed e100 still in %s", lapsed)
		}
	}
}

// A publication coalesced after the changes it carries (two additions in one
// window) is a trace of its own linked to each change's consul_change span;
// one published at once (a lapse) is the change's child, with no link.
func TestCoalescedPublicationLinksToEveryChangeItCarries(t *testing.T) {
	spans := endedSpans{tracetest.NewSpanRecorder(), make(chan struct{}, 1)}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	h := startSyncerWith(t, SyncConfig{Tracer: tp,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	h.nonPassing()
	a := fleettest.Member("work", "a", "s1", 1, 9001, "1.0.0", health.StatusPassing, 5)
	b := fleettest.Member("work", "b", "s1", 1, 9002, "1.0.0", health.StatusPassing, 6)
	c := fleettest.Member("work", "c", "s1", 1, 9003, "1.0.0", health.StatusPassing, 7)
	h.members("work", a)
	h.publish()
	h.members("work", a, b) // an addition: waits for the window
	h.settle()
	h.members("work", a, b, c) // another, in the same window
	h.settle()
	h.quiet()
	h.advanceWindow()
	if got := endpointsOf(t, h.publish().snap, "work"); len(got) != 3 {
		t.Fatalf("after the window: %v", got)
	}
	ended := spans.Ended()
	var changes []trace.SpanContext
	var update sdktrace.ReadOnlySpan
	for _, s := range ended {
		switch s.Name() {
		case "leasehold.consul_change":
			changes = append(changes, s.SpanContext())
		case "leasehold.cache_update":
			update = s // the last one: the coalesced publication
		}
	}
	if len(changes) < 3 || update == nil {
		t.Fatalf("spans: %d changes, cache update %v", len(changes), update)
	}
	linked := map[trace.SpanID]bool{}
	for _, l := range update.Links() {
		linked[l.SpanContext.SpanID()] = true
	}
	for _, ch := range changes[len(changes)-2:] { // the two additions
		if !linked[ch.SpanID()] {
			t.Errorf("the coalesced cache update does not link to change %s (links %v)",
				ch.SpanID(), update.Links())
		}
	}
	if update.Parent().IsValid() && len(update.Links()) == 0 {
		t.Errorf("coalesced update: parent %v, no links", update.Parent())
	}

	// A lapse is published at once: the cache update is its change's child.
	h.nonPassing(health.CheckState{Node: "n1", CheckID: health.CheckID("a", "s1", "work"),
		ServiceID: "work:a", Status: health.StatusCritical})
	h.publish()
	var last sdktrace.ReadOnlySpan // the lapse's change, ended once its publication is
	for deadline := time.After(5 * time.Second); ; {
		ended = spans.Ended()
		if last = ended[len(ended)-1]; last.Name() == "leasehold.consul_change" {
			break
		}
		select {
		case <-spans.more:
		case <-deadline:
			t.Fatalf("the lapse's change span never ended; last %s", last.Name())
		}
	}
	for _, s := range ended {
		if s.Name() == "leasehold.cache_update" {
			update = s
		}
	}
	if update.Parent().SpanID() != last.SpanContext().SpanID() || len(update.Links()) != 0 {
		t.Errorf("the lapse's cache update: parent %v, links %v; want the change %v, none",
			update.Parent().SpanID(), update.Links(), last.SpanContext().SpanID())
	}
}

// endedSpans records spans and says when one ended.
type endedSpans struct {
	*tracetest.SpanRecorder
	more chan struct{}
}

func (e endedSpans) OnEnd(s sdktrace.ReadOnlySpan) {
	e.SpanRecorder.OnEnd(s)
	select {
	case e.more <- struct{}{}:
	default:
	}
}

// A removal in one shard names that shard alone, so only streams following
// it wait for the push (a stream following other shards is sent nothing and
// must not be counted as a lapse it never got).
func TestChangedLoadsNameOnlyTheShardsThatChanged(t *testing.T) {
	old := []translator.Shard{{Name: "work/shard-0", Version: "a"},
		{Name: "work/shard-1", Version: "b"}}
	next := []translator.Shard{{Name: "work/shard-0", Version: "a"},
		{Name: "work/shard-1", Version: "c"}}
	if got := changedLoads(old, next); len(got) != 1 || got[0] != "work/shard-1" {
		t.Fatalf("changed %v, want [work/shard-1]", got)
	}
	grown := append(next, translator.Shard{Name: "work/shard-2", Version: "d"})
	if got := changedLoads(next, grown); len(got) != 1 || got[0] != "work/shard-2" {
		t.Fatalf("a new shard: changed %v, want [work/shard-2]", got)
	}
	if got := changedLoads(nil, []translator.Shard{{Name: "work", Version: "e"}}); len(got) != 1 {
		t.Fatalf("unsharded: changed %v, want [work]", got)
	}
}

// routeAndClusterVersions are the route and cluster versions of snap, by
// name.
func routeAndClusterVersions(snap *cache.Snapshot) (map[string]string, map[string]string) {
	return snap.VersionMap[resource.RouteType], snap.VersionMap[resource.ClusterType]
}

// TestDispatchPolicyChangeChangesOnlyItsTasksVersions: a rules change of one
// task's dispatch policy changes that task's route and cluster versions
// only, the resources carry the policy, two replicas with the same rules
// agree, going back restores the first versions, and an invalid policy
// changes nothing and is refused naming the field.
func TestDispatchPolicyChangeChangesOnlyItsTasksVersions(t *testing.T) {
	h := startSyncerWithPolicy(t, "")
	first := readWorkAndBatch(h, t).snap
	r0, c0 := routeAndClusterVersions(first)
	rules := func(raw string) {
		h.obs <- health.Observation{Data: &health.RulesSource{Source: "consul-kv:x",
			Raw: []byte(raw)}}
	}
	const doc = `{"dispatch":{"tasks":{"batch":{"max_requests":2,"deadline":"10s",` +
		`"retry":{"on":["UNAVAILABLE"],"num_retries":1}}}}}`
	rules(doc)
	h.advanceWindow()
	p1 := h.publish().snap
	r1, c1 := routeAndClusterVersions(p1)
	if r1["batch"] == r0["batch"] || c1["batch"] == c0["batch"] {
		t.Fatalf("batch's policy changed but its route %s→%s or cluster %s→%s did not",
			r0["batch"], r1["batch"], c0["batch"], c1["batch"])
	}
	if r1["work"] != r0["work"] || c1["work"] != c0["work"] {
		t.Fatal("work's policy did not change but its route or cluster got a new version")
	}
	for _, res := range p1.GetResources(resource.RouteType) {
		r := res.(*routev3.RouteConfiguration)
		a := r.GetVirtualHosts()[0].GetRoutes()[0].GetRoute()
		want := map[string]string{"batch": "unavailable",
			"work": "unavailable,resource-exhausted"}[r.GetName()]
		if got := a.GetRetryPolicy().GetRetryOn(); got != want {
			t.Errorf("%s: retry_on %q, want %q", r.GetName(), got, want)
		}
		if (r.GetName() == "batch") != (a.GetMaxStreamDuration() != nil) {
			t.Errorf("%s: max_stream_duration %v", r.GetName(), a.GetMaxStreamDuration())
		}
	}
	c := p1.GetResources(resource.ClusterType)["batch"].(*clusterv3.Cluster)
	if c.GetCircuitBreakers().GetThresholds()[0].GetMaxRequests().GetValue() != 2 {
		t.Errorf("batch's cluster: circuit breakers %v", c.GetCircuitBreakers())
	}

	// Another replica given the same rules serves the same versions.
	other := startSyncerWithPolicy(t, "")
	other.obs <- health.Observation{Data: &health.RulesSource{Source: "file:r", Raw: []byte(doc)}}
	r2, c2 := routeAndClusterVersions(readWorkAndBatch(other, t).snap)
	for _, task := range []string{"work", "batch"} {
		if r2[task] != r1[task] || c2[task] != c1[task] {
			t.Errorf("%s: replicas with the same rules disagree on versions", task)
		}
	}

	rules(`{}`)
	h.advanceWindow()
	r3, c3 := routeAndClusterVersions(h.publish().snap)
	if r3["batch"] != r0["batch"] || c3["batch"] != c0["batch"] {
		t.Fatal("back to the default: batch's versions are not the first ones")
	}

	prevErr := ""
	for _, tt := range []struct{ doc, field string }{
		{`{"dispatch":{"tasks":{"batch":{"retry":{"on":["ABORTED"]}}}}}`,
			`dispatch.tasks["batch"].retry.on[0]`},
		{`{"dispatch":{"default":{"retry":{"num_retries":9}}}}`, "dispatch.default.retry.num_retries"},
		{`{"dispatch":{"tasks":{"batch":{"max_requests":-1}}}}`, `dispatch.tasks["batch"].max_requests`},
	} {
		rules(tt.doc)
		got := awaitRolloutError(h, prevErr)
		if got == prevErr || !strings.Contains(got, tt.field) {
			t.Errorf("%s: error %q, want one naming %s", tt.doc, got, tt.field)
		}
		prevErr = got
	}
	h.quiet() // nothing published: the previous rules stay in force
}

// workWithAMovedInstance is n passing registrations of task work (e00…,
// sessions s00…) and a new session of e03 starting on another node while
// its old one stays: n+1 registrations of n instances.
func workWithAMovedInstance(n int) (members []health.Member, moved health.Member) {
	for i := range n {
		members = append(members, fleettest.Member("work", fmt.Sprintf("e%02d", i),
			fmt.Sprintf("s%02d", i), 1, 9000+i, "1.0.0", health.StatusPassing, uint64(5+i)))
	}
	moved = onNodeWithSerf(fleettest.Member("work", "e03", "s03-new", 2, 9100, "1.0.0",
		health.StatusPassing, 20), "n2", health.StatusPassing, 1)
	return members, moved
}

// A task's shards follow its instances, not its registrations: an instance
// whose new session starts on another node holds two registrations until
// the old one goes, and a task of exactly ShardSize instances must not be
// re-sharded (every shard resent) at each such step of a rollout. One more
// instance does shard it.
func TestShardsFollowInstancesNotRegistrations(t *testing.T) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	h := startSyncerWith(t, SyncConfig{ShardSize: 10, Logger: quiet})
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	members, moved := workWithAMovedInstance(10)
	h.members("work", append(members, moved)...)
	h.nonPassing()
	snap := h.publish().snap
	if loads := snap.GetResources(resource.EndpointType); len(loads) != 1 || loads["work"] == nil {
		t.Fatalf("10 instances in 11 registrations, shards of 10: load assignments %v, "+
			"want work alone", slices.Sorted(maps.Keys(loads)))
	}
	if c := h.s.View().ClusterOf(moved.Executor(), dispatcher(t, "")); c != "work" {
		t.Fatalf("the view sends e03 in %s, want work", c)
	}

	h.members("work", append(members, moved, fleettest.Member("work", "e10", "s10", 1, 9010,
		"1.0.0", health.StatusPassing, 21))...)
	h.advanceWindow()
	snap = h.publish().snap
	loads := snap.GetResources(resource.EndpointType)
	want := []string{translator.ShardName("work", 0, 2), translator.ShardName("work", 1, 2)}
	if got := slices.Sorted(maps.Keys(loads)); !slices.Equal(got, want) {
		t.Fatalf("11 instances in shards of 10: load assignments %v, want %v", got, want)
	}
}

// A sharded task's route follows its policy too (the weighted route is kept
// while the weights stay, but not across a policy change).
func TestDispatchPolicyChangeRebuildsAShardedRoute(t *testing.T) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	h := startSyncerWith(t, SyncConfig{ShardSize: 2, Logger: quiet})
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	var members []health.Member
	for i := range 5 {
		members = append(members, fleettest.Member("work", fmt.Sprintf("e%d", i),
			fmt.Sprintf("s%d", i), 1, 9000+i, "1.0.0", health.StatusPassing, 4))
	}
	h.members("work", members...)
	h.nonPassing()
	r0, _ := routeAndClusterVersions(h.publish().snap)
	h.obs <- health.Observation{Data: &health.RulesSource{Source: "consul-kv:x",
		Raw: []byte(`{"dispatch":{"default":{"deadline":"3s"}}}`)}}
	h.advanceWindow()
	p := h.publish().snap
	r1, _ := routeAndClusterVersions(p)
	if r1["work"] == r0["work"] {
		t.Fatal("the sharded route kept its version across a policy change")
	}
	r := p.GetResources(resource.RouteType)["work"].(*routev3.RouteConfiguration)
	a := r.GetVirtualHosts()[0].GetRoutes()[0].GetRoute()
	if a.GetWeightedClusters() == nil || a.GetMaxStreamDuration().GetMaxStreamDuration().
		AsDuration() != 3*time.Second {
		t.Fatalf("sharded route action %v", a)
	}
}

// Explain names the shard that serves each executor: for every executor the
// view routes, ClusterOf names a load assignment of the snapshot that holds
// it, whatever the registrations (an instance on two nodes, a bad
// registration naming no instance, one naming an instance that others name
// too), and a set that cannot take weighted clusters is named the task.
func TestClusterOfNamesTheShardThatServesTheExecutor(t *testing.T) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	h := startSyncerWith(t, SyncConfig{ShardSize: 5, Logger: quiet})
	d := dispatcher(t, "")
	h.s.Subscribe(d)
	h.tasks("work")
	members, moved := workWithAMovedInstance(9)
	noID := fleettest.Member("work", "", "s-bad", 1, 9200, "1.0.0", health.StatusPassing, 21)
	noID.Err = errors.New("instance_id: missing")
	badOfE05 := fleettest.Member("work", "e05", "s-bad", 1, 9201, "1.0.0", health.StatusPassing, 22)
	badOfE05.Node, badOfE05.Err = "n3", errors.New("version: not semver")
	h.members("work", append(members, moved, noID, badOfE05)...)
	h.nonPassing()
	snap := h.publish().snap
	v := h.settle()
	loads := snap.GetResources(resource.EndpointType)
	if len(loads) < 2 {
		t.Fatalf("10 instances in shards of 5: load assignments %v", slices.Sorted(maps.Keys(loads)))
	}
	holds := func(name, session string) bool {
		cla, ok := loads[name].(*endpointv3.ClusterLoadAssignment)
		if !ok {
			return false
		}
		for _, l := range translator.Expand(cla).GetEndpoints() {
			for _, lb := range l.GetLbEndpoints() {
				md := lb.GetMetadata().GetFilterMetadata()[translator.MetadataNamespace]
				if md.GetFields()["session_id"].GetStringValue() == session {
					return true
				}
			}
		}
		return false
	}
	verdicts := v.DecideAll(d)
	routed := 0
	for i, e := range v.Executors() {
		if verdicts[i].Route == health.RouteNone {
			continue
		}
		routed++
		if c := v.ClusterOf(e, d); !holds(c, e.SessionID) {
			t.Errorf("explain sends %s/%s in %s, which does not hold it", e.InstanceID,
				e.SessionID, c)
		}
	}
	if routed < 9 {
		t.Fatalf("%d executors routed, want at least 9", routed)
	}
	single := d
	single.SingleCluster = true
	if c := v.ClusterOf(v.Executors()[0], single); c != "work" {
		t.Fatalf("a set without weighted clusters is sent %s, want work", c)
	}
}
