package consul

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// gapCatalog is fakeCatalog whose fresh serfHealth listings can be made to fail.
type gapCatalog struct {
	*fakeCatalog
	failListing atomic.Bool
}

func (g *gapCatalog) SerfHealth(ctx context.Context, index uint64, wait time.Duration) (api.HealthChecks, uint64, error) {
	if index == 0 && g.failListing.Load() {
		return nil, 0, errors.New("listing refused")
	}
	return g.fakeCatalog.SerfHealth(ctx, index, wait)
}

// TestFastPathGapStillCarriesLapses: after a failed query of the critical
// checks the set vouches for nothing newer than what it said before, until
// every serfHealth is listed again — but a lapse seen meanwhile goes out at
// once (at the old index); once the listing answers, the index moves on.
func TestFastPathGapStillCarriesLapses(t *testing.T) {
	cat := &gapCatalog{fakeCatalog: newFakeCatalog()}
	h := &watchHarness{t: t, cat: cat.fakeCatalog, out: make(chan health.Observation, 100)}
	w := newWatcher(cat, WatchConfig{MinInterval: time.Millisecond, Out: h.out})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	nonPassing := func(what string) *health.NonPassing {
		t.Helper()
		deadline := time.After(5 * time.Second)
		for {
			select {
			case o := <-h.out:
				if o.NonPassing != nil {
					return o.NonPassing
				}
			case <-deadline:
				t.Fatalf("no set: %s", what)
			}
		}
	}
	cat.push("nonpassing", scripted{index: 10})
	// the first set goes out at 10, or, when the serf listing is taken after
	// it (at 1, then again once the checks passed it), at 0 with progress to
	// 10 after
	for vouched, deadline := uint64(0), time.After(5*time.Second); vouched < 10; {
		select {
		case o := <-h.out:
			switch {
			case o.NonPassing != nil:
				vouched = o.NonPassing.Index
			case o.Progress != nil:
				vouched = max(vouched, o.Progress.NonPassing)
			}
			if vouched > 10 {
				t.Fatalf("the first set vouches for %d, want 10", vouched)
			}
		case <-deadline:
			t.Fatal("the first set never reached 10")
		}
	}
	cat.failListing.Store(true)
	cat.push("nonpassing", scripted{err: errors.New("connection reset")})
	lapse := &api.HealthCheck{Node: "n1", CheckID: health.CheckID("a", "s1", "work"), ServiceID: health.ServiceID("a", "work"), Status: "critical", ModifyIndex: 20}
	cat.push("nonpassing", scripted{index: 20, checks: api.HealthChecks{lapse}})
	np := nonPassing("the lapse during the gap")
	if len(np.Checks) != 1 || np.Checks[0].CheckID != lapse.CheckID {
		t.Fatalf("set during the gap %+v: the lapse did not go out", np.Checks)
	}
	if np.Index != 10 {
		t.Fatalf("set during the gap at %d: it vouches for more than the index before the gap (10)", np.Index)
	}
	// the listing answers again: the next answer moves the index on
	cat.failListing.Store(false)
	cat.push("nonpassing", scripted{index: 21, checks: api.HealthChecks{lapse}})
	deadline := time.After(5 * time.Second)
	for {
		select {
		case o := <-h.out:
			if o.Progress != nil && o.Progress.NonPassing >= 21 || o.NonPassing != nil && o.NonPassing.Index >= 21 {
				return
			}
		case <-deadline:
			t.Fatal("the index never moved on after the listing answered")
		}
	}
}
