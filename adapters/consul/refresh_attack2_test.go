package consul

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/server"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// instantCatalog is an idle Consul: a query at index 0 is answered at once,
// a blocking query (index > 0) waits out its wait time (or its context), as
// Consul does when nothing changes. It counts the fresh (index-0) reads of
// the non-passing checks and the generation keys.
type instantCatalog struct {
	freshNP, freshGen atomic.Int64
}

func (c *instantCatalog) block(ctx context.Context, index uint64, wait time.Duration) error {
	if index == 0 {
		return nil
	}
	if wait <= 0 {
		wait = time.Minute
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func (c *instantCatalog) Services(ctx context.Context, index uint64, wait time.Duration) (map[string][]string, uint64, error) {
	if err := c.block(ctx, index, wait); err != nil {
		return nil, 0, err
	}
	return map[string][]string{"consul": nil, "work": {"leasehold"}}, 10, nil
}

func (c *instantCatalog) ServiceNodes(ctx context.Context, task, tag string, index uint64, wait time.Duration) ([]*api.CatalogService, uint64, error) {
	if err := c.block(ctx, index, wait); err != nil {
		return nil, 0, err
	}
	return []*api.CatalogService{{Node: "n1", ServiceID: health.ServiceID("x", "work"), CreateIndex: 30, ModifyIndex: 30,
		ServiceMeta: map[string]string{health.MetaSessionID: "s1"}}}, 30, nil
}

func (c *instantCatalog) HealthService(ctx context.Context, task, tag string, _ []string) ([]*api.ServiceEntry, uint64, error) {
	reg := health.Registration{InstanceID: "x", SessionID: "s1", Generation: 1, Task: "work", Address: "127.0.0.1", Port: 9001,
		Version: "1.0.0", Capacity: 4, State: health.StateActive}
	return []*api.ServiceEntry{{
		Node:    &api.Node{Node: "n1", Address: "127.0.0.1"},
		Service: &api.AgentService{ID: health.ServiceID("x", "work"), Service: "work", Tags: []string{"leasehold"}, Address: "127.0.0.1", Port: 9001, Meta: reg.Meta(), CreateIndex: 30, ModifyIndex: 30},
		Checks: api.HealthChecks{
			{Node: "n1", CheckID: health.SerfHealthCheckID, Status: api.HealthPassing, CreateIndex: 5, ModifyIndex: 5},
			{Node: "n1", CheckID: health.CheckID("x", "s1", "work"), ServiceID: health.ServiceID("x", "work"), Status: api.HealthPassing, Output: "load=0", CreateIndex: 30, ModifyIndex: 30},
		},
	}}, 30, nil
}

func (c *instantCatalog) ChecksInState(ctx context.Context, tag, state string, index uint64, wait time.Duration) (api.HealthChecks, uint64, error) {
	if index == 0 && state == api.HealthCritical {
		c.freshNP.Add(1)
	}
	if err := c.block(ctx, index, wait); err != nil {
		return nil, 0, err
	}
	return nil, 31, nil
}

func (c *instantCatalog) SerfHealth(ctx context.Context, index uint64, wait time.Duration) (api.HealthChecks, uint64, error) {
	if err := c.block(ctx, index, wait); err != nil {
		return nil, 0, err
	}
	return api.HealthChecks{{Node: "n1", CheckID: health.SerfHealthCheckID, Status: api.HealthPassing, CreateIndex: 5, ModifyIndex: 5}}, 31, nil
}

func (c *instantCatalog) NodeSerf(ctx context.Context, node string) (*api.HealthCheck, error) {
	return &api.HealthCheck{Node: node, CheckID: health.SerfHealthCheckID, Status: api.HealthPassing, CreateIndex: 5, ModifyIndex: 5}, nil
}

func (c *instantCatalog) Generations(ctx context.Context, index uint64, wait time.Duration) (api.KVPairs, uint64, error) {
	if index == 0 {
		c.freshGen.Add(1)
	}
	if err := c.block(ctx, index, wait); err != nil {
		return nil, 0, err
	}
	return api.KVPairs{{Key: health.GenerationKey("x"), Value: []byte("1"), ModifyIndex: 29}}, 29, nil
}

// TestAttack2ConcurrentRefreshLosesItsMarker: Refresh takes its sequence
// number first and then writes it into each watch's one-slot kick channel,
// replacing whatever is pending there, in map order (random per call). Two
// concurrent calls — fencing requests arriving together, every one of them
// carrying a min_consul_index as examples/dispatcher does — interleave:
// R1 takes seq 6, R2 takes seq 7; R2 writes 7 to the generations channel,
// R1 replaces it with 6 there, and the generations watch answers 6 only.
// Refreshed ≥ 7 is never sent, and R2's caller (catchUp) waits its whole
// budget (the request's deadline, up to the staleness bound) and answers
// UNKNOWN — although both watches did read Consul afresh after R2 began.
func TestAttack2ConcurrentRefreshLosesItsMarker(t *testing.T) {
	cat := &instantCatalog{}
	out := make(chan health.Observation, 64)
	w := newWatcher(cat, WatchConfig{MinInterval: time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Out: out})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)
	var mu sync.Mutex
	var marker uint64
	markerChanged := make(chan struct{}, 1)
	go func() {
		for o := range out {
			if o.Refreshed != nil {
				mu.Lock()
				marker = max(marker, *o.Refreshed)
				mu.Unlock()
				select {
				case markerChanged <- struct{}{}:
				default:
				}
			}
		}
	}()
	waitMarker := func(want uint64, d time.Duration) bool {
		deadline := time.After(d)
		for {
			mu.Lock()
			got := marker
			mu.Unlock()
			if got >= want {
				return true
			}
			select {
			case <-markerChanged:
			case <-deadline:
				return false
			}
		}
	}
	for burst := 0; burst < 3000; burst++ {
		var wg sync.WaitGroup
		var highest atomic.Uint64
		for range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				seq, _ := w.Refresh(ctx, everything)
				for h := highest.Load(); seq > h && !highest.CompareAndSwap(h, seq); h = highest.Load() {
				}
			}()
		}
		wg.Wait()
		if !waitMarker(highest.Load(), 2*time.Second) {
			mu.Lock()
			got := marker
			mu.Unlock()
			t.Fatalf("burst %d: Refresh returned seq %d, but after 2 s (no further Refresh) the highest Refreshed marker is %d: "+
				"the caller of %d waits out its deadline and answers UNKNOWN (%d fresh non-passing reads, %d fresh generation reads so far)",
				burst, highest.Load(), got, highest.Load(), cat.freshNP.Load(), cat.freshGen.Load())
		}
	}
}

// TestAttack2ConcurrentFencingRequestsAnswerUnknown is the same through the
// fencing API, wired as `leasehold serve` wires it (Watcher.Refresh): a burst
// of concurrent CheckSession calls for a CURRENT session, each with a
// min_consul_index the view has not reached, on an idle and healthy Consul.
// Every one should be answered CURRENT within a few milliseconds (both
// watches read afresh at once); some wait out their deadline and are
// answered UNKNOWN ("reading Consul afresh did not finish in time").
func TestAttack2ConcurrentFencingRequestsAnswerUnknown(t *testing.T) {
	cat := &instantCatalog{}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	obs := make(chan health.Observation, 64)
	w := newWatcher(cat, WatchConfig{MinInterval: time.Millisecond, Logger: log, Out: obs})
	syncer := fleet.NewSyncer(fleet.SyncConfig{Logger: log})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); w.Run(ctx) }()
	go func() { defer wg.Done(); syncer.Run(ctx, obs) }()
	defer func() { cancel(); wg.Wait() }()
	f := server.NewFencing(syncer, func(string) time.Time { return w.FreshAsOf() },
		server.FencingOptions{Refresh: func(ctx context.Context, _ string, atLeast uint64) (uint64, error) { return w.Refresh(ctx, atLeast) }})

	deadline := time.Now().Add(5 * time.Second)
	for v := syncer.View(); !v.Synced; v = syncer.View() {
		if time.Now().After(deadline) {
			t.Fatal("never synced")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The dispatcher's min index: any index above what the checks and the
	// generation keys last changed at (here: the membership's, 30).
	const minIndex = 30
	const perBurst = 16
	for burst := 0; burst < 3000; burst++ {
		var unknown atomic.Int64
		var slowest atomic.Int64
		var rg sync.WaitGroup
		start := make(chan struct{})
		for range perBurst {
			rg.Add(1)
			go func() {
				defer rg.Done()
				<-start
				rctx, rcancel := context.WithTimeout(context.Background(), time.Second)
				defer rcancel()
				start := time.Now()
				r, err := f.CheckSession(rctx, &leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1", MinConsulIndex: minIndex})
				took := time.Since(start)
				for s := slowest.Load(); int64(took) > s && !slowest.CompareAndSwap(s, int64(took)); s = slowest.Load() {
				}
				if err != nil || r.State != leaseholdv1.SessionState_CURRENT {
					unknown.Add(1)
					t.Logf("burst %d: %v %v after %s", burst, r.GetState(), r.GetDetail(), took.Round(time.Millisecond))
				}
			}()
		}
		close(start)
		rg.Wait()
		if n := unknown.Load(); n > 0 {
			t.Fatalf("burst %d: %d of %d concurrent fencing requests for a CURRENT session on an idle, healthy Consul were not answered CURRENT (slowest %s): a Refresh kick was lost",
				burst, n, perBurst, time.Duration(slowest.Load()).Round(time.Millisecond))
		}
	}
}

func (c *instantCatalog) GenerationKeys(context.Context, []string) (api.KVPairs, error) {
	return nil, nil
}
