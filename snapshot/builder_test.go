package snapshot

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/health"
)

// A Builder that reuses across hundreds of random changes (loads, lapses,
// drains, new sessions, versions, labels, joins and leaves, reordering) must
// give exactly what a fresh build gives: the same message and version, and
// the same removal verdict as comparing the two load assignments.
func TestBuilderIncrementalEqualsFresh(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 11))
	for _, dc := range []struct {
		version string
		labels  map[string]string
	}{
		{"", nil}, {">=1.2.0", nil}, {"", map[string]string{"zone": "a"}},
	} {
		d, err := health.NewDispatcher(dc.version, dc.labels)
		if err != nil {
			t.Fatal(err)
		}
		es := benchFleet(200)
		bl := &Builder{}
		prev := bl.BuildPrinted("work", es, nil, d)
		for step := range 400 {
			for range 1 + r.IntN(4) {
				mutate(r, &es)
			}
			if r.IntN(5) == 0 {
				r.Shuffle(len(es), func(i, j int) { es[i], es[j] = es[j], es[i] })
			}
			got := bl.BuildPrinted("work", es, nil, d)
			want := (&Builder{}).BuildPrinted("work", es, nil, d)
			if !proto.Equal(got.CLA, want.CLA) {
				t.Fatalf("%s step %d: incremental load assignment differs from a fresh build", d.Key(), step)
			}
			if got.Version != want.Version {
				t.Fatalf("%s step %d: version %s, fresh %s", d.Key(), step, got.Version, want.Version)
			}
			if ref := removesOrDrains(prev.CLA, got.CLA); got.RemovesOrDrains != ref {
				t.Fatalf("%s step %d: RemovesOrDrains %v, comparing the assignments says %v", d.Key(), step, got.RemovesOrDrains, ref)
			}
			if got.Decided > 8*4 {
				t.Fatalf("step %d: decided %d executors afresh for at most 4 changes", step, got.Decided)
			}
			prev = got
		}
	}
}

func mutate(r *rand.Rand, es *[]health.Executor) {
	fleet := *es
	if len(fleet) == 0 {
		*es = benchFleet(1)
		return
	}
	i := r.IntN(len(fleet))
	e := &fleet[i]
	switch r.IntN(10) {
	case 0:
		e.Load = r.IntN(10)
	case 1:
		e.Lease = []health.CheckStatus{health.StatusPassing, health.StatusCritical, health.StatusWarning}[r.IntN(3)]
	case 2:
		e.State = []health.State{health.StateActive, health.StateDraining}[r.IntN(2)]
	case 3:
		e.SessionID = fmt.Sprintf("s%d", r.IntN(1000))
		e.Generation++
	case 4:
		e.Version = []string{"1.0.0", "1.4.2", "2.0.0"}[r.IntN(3)]
	case 5:
		e.Labels = map[string]string{"zone": []string{"a", "b"}[r.IntN(2)]}
	case 6: // leaves
		*es = append(fleet[:i], fleet[i+1:]...)
	case 7: // joins
		n := benchFleet(1)[0]
		n.InstanceID = fmt.Sprintf("new-%d", r.IntN(1e6))
		n.ServiceID = "work:" + n.InstanceID
		n.Port = r.IntN(3) + 10000
		*es = append(fleet, n)
	case 8:
		e.Port = 10000 + r.IntN(3) // collide with others' addresses
	case 9:
		e.Capacity = r.IntN(200)
	}
}
