package consul

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

// quietCatalog answers every first read at once and then blocks every
// blocking query until its context ends (a quiet Consul), counting the
// queries in flight.
type quietCatalog struct {
	inFlight, most atomic.Int64
	mu             sync.Mutex
	answered       map[string]bool
}

func (q *quietCatalog) block(ctx context.Context, what string, index uint64) error {
	q.mu.Lock()
	first := !q.answered[what]
	q.answered[what] = true
	q.mu.Unlock()
	if first || index == 0 {
		return nil
	}
	n := q.inFlight.Add(1)
	for m := q.most.Load(); n > m && !q.most.CompareAndSwap(m, n); m = q.most.Load() {
	}
	defer q.inFlight.Add(-1)
	<-ctx.Done()
	return ctx.Err()
}

func (q *quietCatalog) Services(
	ctx context.Context,
	index uint64,
	_ time.Duration,
) (map[string][]string, uint64, error) {
	return map[string][]string{}, 10, q.block(ctx, "services", index)
}

func (q *quietCatalog) ServiceNodes(
	ctx context.Context,
	task, _ string,
	index uint64,
	_ time.Duration,
) ([]*api.CatalogService, uint64, error) {
	return nil, 10, q.block(ctx, "task "+task, index)
}

func (q *quietCatalog) HealthService(
	context.Context,
	string,
	string,
	[]string,
) ([]*api.ServiceEntry, uint64, error) {
	return nil, 10, nil
}

func (q *quietCatalog) ChecksInState(
	ctx context.Context,
	_, state string,
	index uint64,
	_ time.Duration,
) (api.HealthChecks, uint64, error) {
	return nil, 10, q.block(ctx, state, index)
}

func (q *quietCatalog) SerfHealth(
	ctx context.Context,
	index uint64,
	_ time.Duration,
) (api.HealthChecks, uint64, error) {
	return nil, 10, q.block(ctx, "serf", index)
}

func (q *quietCatalog) NodeSerf(
	context.Context,
	string,
) (*api.HealthCheck, error) {
	return nil, nil
}

func (q *quietCatalog) Generations(
	ctx context.Context,
	index uint64,
	_ time.Duration,
) (api.KVPairs, uint64, error) {
	return nil, 10, q.block(ctx, "generations", index)
}

func (q *quietCatalog) LapseMarks(
	ctx context.Context,
	index uint64,
	_ time.Duration,
) (api.KVPairs, uint64, error) {
	return nil, 10, q.block(ctx, "lapses", index)
}

// A Watcher holds exactly openQueries queries open besides its per-task
// slots: the agent's connection pool (Connections) is sized on it, and a
// query waiting for a connection delays whatever it would bring — a lapse
// too. A watch added without counting it fails here.
func TestWatcherHoldsOpenQueriesItCounts(t *testing.T) {
	q := &quietCatalog{answered: map[string]bool{}}
	out := make(chan health.Observation, 1000)
	w := newWatcher(
		q,
		WatchConfig{MinInterval: time.Millisecond, SlowInterval: time.Millisecond, Out: out},
	)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	deadline := time.Now().Add(5 * time.Second)
	for q.inFlight.Load() < openQueries && time.Now().Before(deadline) {
		select {
		case <-out:
		case <-time.After(10 * time.Millisecond):
		}
	}
	settle := time.After(200 * time.Millisecond) // a watch more would be blocking by then too
	for more := true; more; {
		select {
		case <-out:
		case <-settle:
			more = false
		}
	}
	if n, most := q.inFlight.Load(), q.most.Load(); n != openQueries || most != openQueries {
		t.Fatalf(
			"%d queries open with no task type (at most %d), want openQueries = %d (Connections "+
				"sizes the agent's pool on it)",
			n,
			most,
			openQueries,
		)
	}
	if got, want := Connections(8, 2), 2*4+2*(openQueries+1)+2; got != want {
		t.Fatalf("Connections(8, 2) = %d, want %d", got, want)
	}
}

func (q *quietCatalog) GenerationKeys(context.Context, []string) (api.KVPairs, error) {
	return nil, nil
}

// TestWatchersRefuseADatacenterConsulCannotAnswer: a real agent of datacenter
// dc1 answers ?dc=dc1 but refuses ?dc=DC1 (Consul's datacenter names are
// lowercase: "No path to datacenter"), so NewWatchers, and with it serve
// --datacenters, refuses "DC1", whose watches could only ever fail, and
// duplicates that differ only in case ("dc1" and "DC1": one datacenter, or
// none).
func TestWatchersRefuseADatacenterConsulCannotAnswer(t *testing.T) {
	a := consultest.Start(t, consultest.Options{Datacenter: "dc1"})
	c := a.Client()
	if _, _, err := c.Catalog().Services(&api.QueryOptions{Datacenter: "dc1"}); err != nil {
		t.Fatalf("?dc=dc1: %v", err)
	}
	_, _, err := c.Catalog().Services(&api.QueryOptions{Datacenter: "DC1"})
	if err == nil {
		t.Skip("this Consul answers ?dc=DC1: capitals are a datacenter it knows")
	}
	t.Logf("?dc=DC1: %v", err)
	for _, dcs := range [][]string{{"DC1"}, {"dc1", "DC1"}} {
		if _, err := NewWatchers(c, WatchConfig{}, dcs); err == nil {
			t.Errorf("NewWatchers(%q) accepted: Consul refuses ?dc=DC1", dcs)
		}
	}
}
