package otel

import (
	"context"
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

func series(t *testing.T, tel *Telemetry) int {
	t.Helper()
	rec := httptest.NewRecorder()
	tel.MetricsHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(rec.Body)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, f := range fams {
		n += len(f.GetMetric())
	}
	return n
}

func fleetOf(gen, n int, lapsed bool) []health.Member {
	var ms []health.Member
	for i := range n {
		inst, sess := fmt.Sprintf("w%d-%d", gen, i), fmt.Sprintf("s%d", gen)
		status := health.StatusPassing
		if lapsed && i%10 == 0 {
			status = health.StatusCritical
		}
		reg := health.Registration{InstanceID: inst, SessionID: sess, Generation: 1, Task: "work", Address: "127.0.0.1", Port: 10000 + i, Version: "1.0.0", Capacity: 4, State: health.StateActive}
		ms = append(ms, health.Member{
			Observed: health.Observed{Registration: reg, ServiceID: health.ServiceID(inst, "work"), Node: "n1", CreateIndex: uint64(i + 1)},
			Checks: []health.CheckState{
				{Node: "n1", CheckID: "serfHealth", Status: health.StatusPassing, ModifyIndex: 1},
				{Node: "n1", CheckID: health.CheckID(inst, sess, "work"), ServiceID: health.ServiceID(inst, "work"), Status: status, ModifyIndex: uint64(gen*10000 + i + 1)},
			},
		})
	}
	return ms
}

// TestMetricSeriesStayBounded: 1,000 executors come, lapse and go, three
// times over; the number of series does not grow with them.
func TestMetricSeriesStayBounded(t *testing.T) {
	tel, err := Setup(context.Background(), Config{})
	if err != nil {
		t.Fatal(err)
	}
	s := fleet.NewSyncer(fleet.SyncConfig{Meter: tel.Meter, Tracer: tel.Tracer})
	obs := make(chan health.Observation, 4)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.Run(ctx, obs)
	obs <- health.Observation{Data: &health.TaskList{Tasks: []string{"work"}}}
	obs <- health.Observation{Data: &health.NonPassing{Index: 1}}
	obs <- health.Observation{Data: &health.Generations{Index: 1}}
	s.Subscribe(health.Dispatcher{})
	wait := func(n int, index uint64) {
		deadline := time.After(10 * time.Second)
		for v := s.View(); len(v.Executors()) != n || v.ConsulIndex != index; v = s.View() {
			select {
			case <-v.Changed():
			case <-deadline:
				t.Fatalf("view never held %d executors", n)
			}
		}
	}
	var counts []int
	for gen := 1; gen <= 3; gen++ {
		obs <- health.Observation{Data: &health.TaskMembers{Task: "work", Index: uint64(gen * 100000), Members: fleetOf(gen, 1000, gen > 1)}}
		wait(1000, uint64(gen*100000))
		counts = append(counts, series(t, tel))
	}
	obs <- health.Observation{Data: &health.TaskMembers{Task: "work", Index: 999999, Members: nil}}
	wait(0, 999999)
	counts = append(counts, series(t, tel))
	t.Logf("series after each wave of 1,000 executors: %v", counts)
	for _, c := range counts {
		if c > 60 {
			t.Fatalf("series grew with the fleet: %v", counts)
		}
	}
	if counts[2] != counts[1] {
		t.Fatalf("a second wave of new executors added series: %v", counts)
	}
}
