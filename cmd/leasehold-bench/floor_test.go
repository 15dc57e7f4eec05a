package main

import (
	"context"
	"maps"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	protobuf "google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// task is the task type of a one-task-type run.
var task = taskNames(1)[0]

// response is a SotW EDS response listing the given instances.
func response(t *testing.T, version string, ids ...string) *discovery.DiscoveryResponse {
	t.Helper()
	var es []health.Executor
	for i, id := range ids {
		es = append(es, health.Executor{
			Registration: health.Registration{InstanceID: id, SessionID: "s", Generation: 1, Task: task, Address: "127.0.0.1", Port: 9000 + i, Version: "1.0.0", Capacity: 2, State: health.StateActive},
			LeaseStatus:  health.StatusPassing, LeaseFound: true, NodeChecks: health.StatusPassing,
		})
	}
	a, err := anypb.New(translator.Endpoints(task, es, health.Dispatcher{}))
	if err != nil {
		t.Fatal(err)
	}
	return &discovery.DiscoveryResponse{VersionInfo: version, TypeUrl: resource.EndpointType, Nonce: version, Resources: []*anypb.Any{a}}
}

// The plan keeps only removals, in order, naming a removed host for each.
func TestPlanFloor(t *testing.T) {
	base := response(t, "1", "a", "b", "c", "d")
	since := []*discovery.DiscoveryResponse{
		response(t, "2", "a", "b", "c", "d"), // no change: not replayed
		response(t, "3", "b", "c", "d"),
		response(t, "4", "c"),
	}
	plan, err := planFloor(base, since)
	if err != nil {
		t.Fatal(err)
	}
	if plan.base != 4 || len(plan.frames) != 3 || !reflect.DeepEqual(plan.removed, []string{"a", "b"}) {
		t.Fatalf("plan: base %d, %d frames, removed %v; want 4, 3, [a b]", plan.base, len(plan.frames), plan.removed)
	}
	if _, err := planFloor(nil, since); err == nil {
		t.Fatal("no base: want an error")
	}
}

func TestFramesRoundTrip(t *testing.T) {
	frames, others := [][]byte{{1, 2, 3}, make([]byte, 300), {}}, [][]byte{{4}, {5, 6}}
	path, err := writeFrames(frames, others)
	if err != nil {
		t.Fatal(err)
	}
	defer os.Remove(path)
	got, gotOthers, err := readFrames(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || len(got[1]) != 300 || got[0][2] != 3 || len(got[2]) != 0 {
		t.Fatalf("frames = %v", got)
	}
	if !reflect.DeepEqual(gotOthers, others) {
		t.Fatalf("others = %v, want %v", gotOthers, others)
	}
	if _, _, err := readFrames(filepath.Join(t.TempDir(), "none")); err == nil {
		t.Fatal("missing file: want an error")
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	short := filepath.Join(t.TempDir(), "short")
	b[0] = 0 // no frame pushed: not even the starting state
	if err := os.WriteFile(short, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := readFrames(short); err == nil {
		t.Fatal("no pushed frame: want an error")
	}
	b[0] = 9 // more frames pushed than the file holds
	if err := os.WriteFile(short, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := readFrames(short); err == nil {
		t.Fatal("a count past the frames: want an error")
	}
}

// The bare server feeds the light clients of the leasehold measurement:
// they see its starting state, then each push, with a time for each.
func TestFloorServerWithLightClients(t *testing.T) {
	plan, err := planFloor(response(t, "1", "a", "b", "c"), []*discovery.DiscoveryResponse{response(t, "2", "b", "c"), response(t, "3", "c")})
	if err != nil {
		t.Fatal(err)
	}
	fs, err := newFloorServer(plan.frames, nil)
	if err != nil {
		t.Fatal(err)
	}
	addr := serveFloorFor(t, fs)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ds, err := startDispatchers(ctx, addr, 5, []string{task}, nil, 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := ds.awaitAll(func(_ string, set map[string]bool) bool { return len(set) == plan.base }, 10*time.Second); err != nil {
		t.Fatal("starting state:", err)
	}
	for _, host := range plan.removed {
		at := fs.push()
		if err := ds.awaitAll(func(_ string, set map[string]bool) bool { return !set[host] }, 10*time.Second); err != nil {
			t.Fatalf("push removing %s: %v", host, err)
		}
		if d := ds.goneFromAll(host).Sub(at); d < 0 || d > 10*time.Second {
			t.Fatalf("push → last stream = %s", d)
		}
	}
	if !fs.push().IsZero() {
		t.Fatal("a push past the last frame: want the zero time")
	}
}

// named is response with its load assignments renamed name (a shard's) and
// the resources of more added.
func named(t *testing.T, version, name string, ids []string,
	more ...*discovery.DiscoveryResponse) *discovery.DiscoveryResponse {
	t.Helper()
	r := response(t, version, ids...)
	cla := &endpointv3.ClusterLoadAssignment{}
	if err := r.Resources[0].UnmarshalTo(cla); err != nil {
		t.Fatal(err)
	}
	cla.ClusterName = name
	a, err := anypb.New(cla)
	if err != nil {
		t.Fatal(err)
	}
	r.Resources = []*anypb.Any{a}
	for _, m := range more {
		r.Resources = append(r.Resources, m.Resources...)
	}
	return r
}

// A sharded task's lapse resends its shard alone: the plan (and the light
// clients) follow endpoints per load assignment, so a response carrying one
// shard removes what left that shard, not the other shards' endpoints.
func TestPlanFloorFollowsEachShard(t *testing.T) {
	s0, s1 := translator.ShardName(task, 0, 2), translator.ShardName(task, 1, 2)
	base := named(t, "1", s0, []string{"a", "b"}, named(t, "1", s1, []string{"c", "d"}))
	plan, err := planFloor(base, []*discovery.DiscoveryResponse{
		named(t, "2", s1, []string{"c"}), // d lapses: shard 1 alone is resent
		named(t, "3", s0, []string{"a", "b"}),
		named(t, "4", s0, []string{"b"}), // a lapses
	})
	if err != nil {
		t.Fatal(err)
	}
	if plan.base != 4 || !slices.Equal(plan.removed, []string{"d", "a"}) || plan.gone != 2 {
		t.Fatalf("plan: base %d, removed %v (%d): want 4, [d a] (2)", plan.base, plan.removed,
			plan.gone)
	}
	fs, err := newFloorServer(plan.frames, nil)
	if err != nil {
		t.Fatal(err)
	}
	addr := serveFloorFor(t, fs)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ds, err := startDispatchers(ctx, addr, 3, []string{task},
		map[string]int{task: 2}, *streamsPerConn)
	if err != nil {
		t.Fatal(err)
	}
	if err := ds.awaitAll(func(_ string, set map[string]bool) bool { return len(set) == 4 },
		10*time.Second); err != nil {
		t.Fatal("starting state:", err)
	}
	fs.push() // removes d
	if err := ds.awaitAll(func(_ string, set map[string]bool) bool {
		return !set["d"] && set["a"] && set["b"] && set["c"]
	}, 10*time.Second); err != nil {
		t.Fatalf("after shard 1 alone was resent, a client must hold a, b, c: %v", err)
	}
}

// The floor holds as many streams as leasehold did: those of the other task
// types get their task type's state when they open and no push after, and
// each push reaches the pushed task type's streams, in leasehold's layout
// (client i follows tasks[i % len(tasks)], streams of every task type
// sharing a connection).
func TestTheFloorHoldsTheOtherTaskTypesStreams(t *testing.T) {
	tasks := taskNames(3)
	other := func(task, version string, ids ...string) *discovery.DiscoveryResponse {
		return named(t, version, task, ids)
	}
	plan, err := planFloor(named(t, "1", tasks[0], []string{"a", "b", "c"}),
		[]*discovery.DiscoveryResponse{
			named(t, "2", tasks[0], []string{"b", "c"}),
			named(t, "3", tasks[0], []string{"c"}),
		})
	if err != nil {
		t.Fatal(err)
	}
	whole, err := plan.withOthers(tasks, map[string]*discovery.DiscoveryResponse{
		tasks[1]: other(tasks[1], "1", "x", "y"),
		tasks[2]: other(tasks[2], "1", "z"),
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(whole.others) != 2 || !maps.Equal(whole.startOf(tasks[1], tasks[0]), set("x", "y")) ||
		!maps.Equal(whole.startOf(tasks[2], tasks[0]), set("z")) ||
		!maps.Equal(whole.startOf(tasks[0], tasks[0]), set("a", "b", "c")) {
		t.Fatalf("others: %d frames, hosts %v, pushed %v; want 2, {%s:[x y] %s:[z]}, [a b c]",
			len(whole.others), whole.hosts, whole.start, tasks[1], tasks[2])
	}
	if _, err := plan.withOthers(tasks, map[string]*discovery.DiscoveryResponse{
		tasks[1]: other(tasks[1], "1", "x")}); err == nil || !strings.Contains(err.Error(), tasks[2]) {
		t.Fatalf("no state for %s: %v, want an error naming it", tasks[2], err)
	}
	// A task type whose every load assignment went (delta) holds nothing to
	// classify its streams by: refused, naming it.
	if _, err := plan.withOthers(tasks, map[string]*discovery.DiscoveryResponse{
		tasks[1]: other(tasks[1], "1", "x"), tasks[2]: {}}); err == nil ||
		!strings.Contains(err.Error(), tasks[2]) {
		t.Fatalf("empty state for %s: %v, want an error naming it", tasks[2], err)
	}
	path, err := writeFrames(whole.frames, whole.others)
	if err != nil {
		t.Fatal(err)
	}
	defer os.Remove(path)
	frames, others, err := readFrames(path)
	if err != nil {
		t.Fatal(err)
	}
	fs, err := newFloorServer(frames, others)
	if err != nil {
		t.Fatal(err)
	}
	addr := serveFloorFor(t, fs)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ds, err := startDispatchers(ctx, addr, 9, tasks, nil, 4)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{tasks[0]: {"a", "b", "c"}, tasks[1]: {"x", "y"},
		tasks[2]: {"z"}}
	holds := func(set map[string]bool, hosts []string) bool {
		return len(set) == len(hosts) && !slices.ContainsFunc(hosts, func(h string) bool {
			return !set[h]
		})
	}
	if err := ds.awaitAll(func(task string, set map[string]bool) bool {
		return holds(set, want[task])
	}, 10*time.Second); err != nil {
		t.Fatal("starting state:", err)
	}
	for k, host := range whole.removed {
		at := fs.push()
		want[tasks[0]] = want[tasks[0]][1:]
		if err := ds.awaitAll(func(task string, set map[string]bool) bool {
			return holds(set, want[task])
		}, 10*time.Second); err != nil {
			t.Fatalf("push %d removing %s: %v", k, host, err)
		}
		if d := ds.goneFromAll(host).Sub(at); d < 0 || d > 10*time.Second {
			t.Fatalf("push → last stream = %s", d)
		}
	}
	fs.mu.Lock()
	pushed := len(fs.streams)
	fs.mu.Unlock()
	if pushed != 3 {
		t.Fatalf("%d streams took pushes; want the pushed task type's 3", pushed)
	}
}

// set is the set of hosts.
func set(hosts ...string) map[string]bool {
	s := map[string]bool{}
	for _, h := range hosts {
		s[h] = true
	}
	return s
}

// Each task type's first client keeps what it holds for the floor's other
// streams; client 0's responses are the pushed ones.
func TestTheOtherTaskTypesStateIsWhatTheirFirstClientHolds(t *testing.T) {
	tasks := taskNames(2)
	ds := newDispatcherSet(4, tasks)
	r1 := named(t, "1", tasks[1], []string{"x", "y"})
	ds.apply(1, time.Now(), nil, nil, r1)
	ds.apply(3, time.Now(), nil, nil, named(t, "9", tasks[1], []string{"q"})) // not a first client
	ds.apply(0, time.Now(), nil, nil, named(t, "1", tasks[0], []string{"a"}))
	state := ds.otherState()
	if len(state) != 1 || len(state[tasks[1]].GetResources()) != 1 ||
		!protobuf.Equal(state[tasks[1]].Resources[0], r1.Resources[0]) {
		t.Fatalf("other state = %v; want %s's first client's response", state, tasks[1])
	}
	ds.apply(1, time.Now(), nil, []string{tasks[1]}, &discovery.DiscoveryResponse{})
	if n := len(ds.otherState()[tasks[1]].GetResources()); n != 0 {
		t.Fatalf("after its removal %d resources held; want 0", n)
	}
}

// serveFloorFor serves fs on a loopback port until the test ends and
// returns its address.
func serveFloorFor(t *testing.T, fs *floorServer) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(grpc.ForceServerCodecV2(rawCodec{}))
	fs.register(g)
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	return lis.Addr().String()
}
