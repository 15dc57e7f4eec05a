package fleet

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/health"
)

// TestViewsDoNotChangeWhileRunDecides: Views are read by other goroutines (the
// fencing API, explain, metrics) while Run decides the next batches; run with
// -race. Each reader also checks that a View it holds never changes.
func TestViewsDoNotChangeWhileRunDecides(t *testing.T) {
	smallChunks(t) // writes to a chunk a view holds are races too
	groups := worldGroups(t)
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
				f := freezeView(v)
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
	w := newRandomWorld(77, false)
	for _, o := range []health.Observation{{Data: &health.TaskList{Index: w.next(),
		Tasks: w.tasks}}, {Data: &health.Generations{Index: w.next()}}} {
		obs <- o
	}
	for range 3000 {
		o, _ := w.observation(clock)
		obs <- o
		// A dispatcher with a new constraint set comes and goes between batches.
		if w.r.IntN(50) == 0 {
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

// TestAllYieldsExecutorsWithoutTheFlatList: All walks what Executors lists, in
// its order, and builds no flat list (the 4.4 MB at 10,000 executors that a
// view would otherwise hold until it is replaced).
func TestAllYieldsExecutorsWithoutTheFlatList(t *testing.T) {
	v := emptyView()
	exec := func(inst string) health.Executor {
		return health.Executor{Registration: health.Registration{InstanceID: inst}}
	}
	v.byTask = []execList{execListOf([]health.Executor{exec("a"), exec("b")}), {},
		execListOf([]health.Executor{exec("c")})}
	var got []string
	for e := range v.All() {
		got = append(got, e.InstanceID)
	}
	if v.flat != nil {
		t.Fatal("All built the flat list")
	}
	var want []string
	for _, e := range v.Executors() {
		want = append(want, e.InstanceID)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) || len(want) != 3 {
		t.Fatalf("All yielded %v, Executors lists %v", got, want)
	}
	n := 0
	for range v.All() {
		n++
		break
	}
	if n != 1 {
		t.Fatalf("All went on after its consumer stopped: %d", n)
	}
}
