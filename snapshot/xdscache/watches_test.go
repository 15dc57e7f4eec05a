package xdscache

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/stream/v3"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// watchWorld publishes random snapshots of a few load assignments and
// clusters into one group and opens random watches on it.
type watchWorld struct {
	t     *testing.T
	rng   *rand.Rand
	c     *Cache
	node  *corev3.Node
	group string
	// forms, when set, are nodes of the same constraint set asking for
	// compact endpoint metadata: a watch is opened by one of node and forms.
	forms []*corev3.Node
	// cancels are the open watches' cancels, as the server holds them.
	cancels []func()
}

var worldNames = []string{"a", "b", "c", "d", "e"}

// versions is a random publication: each name present or not, at one of
// three versions; the cluster type now and then not served at all.
func (w *watchWorld) versions() map[string]map[string]string {
	out := map[string]map[string]string{}
	for _, typeURL := range []string{resource.EndpointType, resource.ClusterType} {
		if typeURL == resource.ClusterType && w.rng.IntN(4) == 0 {
			continue
		}
		vs := map[string]string{}
		for _, n := range worldNames {
			if w.rng.IntN(3) > 0 {
				vs[n] = strconv.Itoa(w.rng.IntN(3))
			}
		}
		out[typeURL] = vs
	}
	return out
}

func (w *watchWorld) publish(versions map[string]map[string]string) {
	w.t.Helper()
	res := map[resource.Type][]types.Resource{}
	for n := range versions[resource.EndpointType] {
		res[resource.EndpointType] = append(res[resource.EndpointType],
			translator.Endpoints(n, nil, health.Dispatcher{}))
	}
	for n := range versions[resource.ClusterType] {
		res[resource.ClusterType] = append(res[resource.ClusterType], &clusterv3.Cluster{Name: n})
	}
	snap, err := cache.NewSnapshot("v", res)
	if err != nil {
		w.t.Fatal(err)
	}
	if err := w.c.Set(context.Background(), w.group, snap, versions); err != nil {
		w.t.Fatal(err)
	}
}

// publishRandom publishes random versions, or now and then the group's
// current ones again (an unchanged republication).
func (w *watchWorld) publishRandom() {
	w.t.Helper()
	v := w.versions()
	if w.rng.IntN(4) == 0 {
		w.c.watches.mu.Lock()
		if st := w.c.watches.snaps[w.group]; st != nil {
			v = st.versions
		}
		w.c.watches.mu.Unlock()
	}
	w.publish(v)
}

// open starts a random watch: state of the world or delta, wildcard or
// named, initial or not, knowing a random part of the resources at random
// versions. Its answers are dropped: only which watches stay open matters.
func (w *watchWorld) open() {
	w.t.Helper()
	typeURL := resource.EndpointType
	if w.rng.IntN(2) == 0 {
		typeURL = resource.ClusterType
	}
	var named []string
	for _, n := range worldNames {
		if w.rng.IntN(3) == 0 {
			named = append(named, n)
		}
	}
	wildcard := w.rng.IntN(4) == 0
	if wildcard {
		named = nil
	}
	known := map[string]string{}
	for _, n := range worldNames {
		if w.rng.IntN(3) == 0 {
			known[n] = strconv.Itoa(w.rng.IntN(3))
		}
	}
	version, nonce := "", ""
	if w.rng.IntN(3) > 0 {
		version, nonce = "v", "1"
	}
	node := w.node
	if n := w.rng.IntN(len(w.forms) + 1); n > 0 {
		node = w.forms[n-1]
	}
	var err error
	var cancel func()
	if w.rng.IntN(2) == 0 {
		sub := stream.NewSotwSubscription(named, wildcard)
		sub.SetReturnedResources(known)
		cancel, err = w.c.CreateWatch(&cache.Request{Node: node, TypeUrl: typeURL,
			ResourceNames: named, VersionInfo: version, ResponseNonce: nonce},
			&sub, make(chan cache.Response, 1))
	} else {
		sub := stream.NewDeltaSubscription(named, nil, nil, wildcard)
		sub.SetReturnedResources(known)
		cancel, err = w.c.CreateDeltaWatch(&cache.DeltaRequest{Node: node, TypeUrl: typeURL,
			ResponseNonce: nonce}, &sub, make(chan cache.DeltaResponse, 1))
	}
	if err != nil {
		w.t.Fatal(err)
	}
	w.cancels = append(w.cancels, cancel)
}

// cancel cancels a random watch opened (answered or not; a cancel may come
// twice, as when a stream ends after its watch was answered).
func (w *watchWorld) cancel() {
	if len(w.cancels) > 0 {
		w.cancels[w.rng.IntN(len(w.cancels))]()
	}
}

// unanswered fails when a watch left open would have been answered by its
// group's current snapshot (the constraint set's or a form's): what asking
// every watch at each publication would have done.
func (w *watchWorld) unanswered(step string) {
	w.t.Helper()
	wc := w.c.watches
	wc.mu.Lock()
	defer wc.mu.Unlock()
	if err := indexed(&wc.watches); err != nil {
		w.t.Fatalf("%s: state-of-the-world watches: %v", step, err)
	}
	if err := indexed(&wc.deltas); err != nil {
		w.t.Fatalf("%s: delta watches: %v", step, err)
	}
	for group, st := range wc.snaps {
		wc.watches.each(group, func(_ int64, x sotwWatch) {
			if st.respond(x.req, x.sub) != nil {
				w.t.Fatalf("%s: a state-of-the-world watch of %s in %s (wildcard %v, names %v, "+
					"known %v) was left open though the snapshot answers it", step,
					x.req.GetTypeUrl(), group, x.sub.IsWildcard(), x.sub.SubscribedResources(),
					x.sub.ReturnedResources())
			}
		})
		wc.deltas.each(group, func(_ int64, x deltaWatch) {
			if st.respondDelta(x.req, x.sub) != nil {
				w.t.Fatalf("%s: a delta watch of %s in %s (wildcard %v, names %v, known %v) was "+
					"left open though the snapshot answers it", step, x.req.GetTypeUrl(), group,
					x.sub.IsWildcard(), x.sub.SubscribedResources(), x.sub.ReturnedResources())
			}
		})
	}
}

// A publication asks again only the watches that follow a resource that
// changed, and that misses none: after every publication of a random world
// no watch left open is one the new snapshot answers.
func TestAPublicationLeavesOpenOnlyWatchesItDoesNotAnswer(t *testing.T) {
	for run := range 300 {
		node := &corev3.Node{Id: "n"}
		w := &watchWorld{t: t, rng: rand.New(rand.NewPCG(uint64(run), 30)), c: New(),
			node: node, group: GroupOf(node)}
		for step := range 40 {
			switch r := w.rng.IntN(8); {
			case r < 4:
				w.open()
				continue
			case r == 4:
				w.cancel()
			default:
				w.publishRandom()
			}
			w.unanswered(fmt.Sprintf("run %d, step %d", run, step))
		}
	}
}

// The same holds for the groups of compact endpoint metadata derived from a
// constraint set (a form first asked for before or after the set's first
// publication, its load assignments versioned apart from the set's) and
// across a Clear: the first publication after one asks every watch again,
// even those opened while the group had no snapshot.
func TestFormsAndClearsLeaveOpenOnlyWatchesTheirSnapshotDoesNotAnswer(t *testing.T) {
	for run := range 300 {
		node := fleettest.Node(t, map[string]any{})
		w := &watchWorld{t: t, rng: rand.New(rand.NewPCG(uint64(run), 31)), c: New(),
			node: node, group: GroupOf(node), forms: []*corev3.Node{
				fleettest.Node(t, map[string]any{NodeMetaEndpointMetadata: string(MetadataSession)}),
				fleettest.Node(t, map[string]any{NodeMetaEndpointMetadata: string(MetadataNone)}),
			}}
		for step := range 60 {
			// A form's first watch derives it (useForm): every step is checked.
			switch r := w.rng.IntN(11); {
			case r < 5:
				w.open()
			case r == 5:
				w.c.Clear(w.group)
			case r == 6:
				w.cancel()
			default:
				w.publishRandom()
			}
			w.unanswered(fmt.Sprintf("run %d, step %d", run, step))
		}
	}
}

// Only what differs is a change: versions moved, names added and removed,
// and a type served in only one of the two publications changes whole.
func TestChangedNames(t *testing.T) {
	prev := map[string]map[string]string{
		resource.EndpointType: {"a": "1", "b": "1", "gone": "1"},
		resource.ClusterType:  {"a": "1"},
	}
	cur := map[string]map[string]string{
		resource.EndpointType: {"a": "1", "b": "2", "new": "1"},
		resource.ListenerType: {"l": "1"},
	}
	got := changedNames(prev, cur)
	eds := got[resource.EndpointType]
	if eds.all || len(eds.names) != 3 {
		t.Fatalf("endpoints changed %+v, want b, gone and new", eds)
	}
	for _, n := range []string{"b", "gone", "new"} {
		if _, ok := eds.names[n]; !ok {
			t.Errorf("%s missing from the endpoints' change", n)
		}
	}
	if !got[resource.ClusterType].all || !got[resource.ListenerType].all {
		t.Errorf("a type served in one publication only must change whole: %+v", got)
	}
	if _, ok := got[resource.RouteType]; ok {
		t.Errorf("a type served in neither changed: %+v", got)
	}
	same := changedNames(cur, cur)
	if len(same) != 0 {
		t.Errorf("a republication changed %+v", same)
	}
	named := stream.NewSotwSubscription([]string{"a", "x"}, false)
	wild := stream.NewSotwSubscription(nil, true)
	if eds.touches(&named) {
		t.Error("a watch of a and x was touched by b, gone and new")
	}
	if !(typeChange{names: map[string]struct{}{"x": {}}}).touches(&named) {
		t.Error("a watch of x was not touched by x")
	}
	if !eds.touches(&wild) || (typeChange{}).touches(&wild) {
		t.Error("a wildcard watch is touched by any change of its type, and only then")
	}
}
