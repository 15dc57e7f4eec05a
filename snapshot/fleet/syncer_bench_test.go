package fleet

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"testing"
	"time"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// benchSyncFleet is n executors spread over tasks task types and nodes
// nodes, every lease passing.
func benchSyncFleet(n, tasks, nodes int) map[string][]health.Member {
	out := map[string][]health.Member{}
	for i := range n {
		task, node := fmt.Sprintf("task-%d", i%tasks), fmt.Sprintf("node-%d", i%nodes)
		inst, sess := fmt.Sprintf("w-%05d", i), fmt.Sprintf("s-%05d", i)
		m := fleettest.Member(task, inst, sess, 1, 10000+i, "1.0.0", health.StatusPassing,
			uint64(i+10))
		m.Node, m.Checks[0].Node, m.Checks[1].Node = node, node, node
		m.Address = fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255)
		out[task] = append(out[task], m)
	}
	return out
}

// benchSyncer is a running Syncer holding the fleet, with the unconstrained
// constraint set and one version constraint subscribed.
func benchSyncer(b *testing.B,
	fleet map[string][]health.Member) (*Syncer, chan health.Observation) {
	s := NewSyncer(SyncConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	obs := make(chan health.Observation)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx, obs); close(done) }()
	b.Cleanup(func() { cancel(); <-done })
	var tasks []string
	for t := range fleet {
		tasks = append(tasks, t)
	}
	obs <- health.Observation{Data: &health.TaskList{Index: 1, Tasks: tasks}}
	obs <- health.Observation{Data: &health.NonPassing{Index: 1}}
	obs <- health.Observation{Data: &health.Generations{Index: 1}}
	for _, t := range tasks {
		obs <- health.Observation{Data: &health.TaskMembers{Task: t, Index: 2,
			Members: fleet[t]}}
	}
	s.Subscribe(health.Dispatcher{})
	d, err := health.NewDispatcher(">=1.0.0", nil)
	if err != nil {
		b.Fatal(err)
	}
	s.Subscribe(d)
	return s, obs
}

// BenchmarkSyncerChange is leasehold's own work for one change of one
// executor (eligibility, build, cache update, view) with n executors over 10
// task types (or one) and 10 nodes, two constraint sets: "full" turns one executor
// full and free again (warning ↔ passing), "lapse" lapses a different
// executor every time (their critical checks stay in the non-passing set;
// once every executor of its task type lapsed, a fresh fleet is set up).
func BenchmarkSyncerChange(b *testing.B) {
	for _, size := range []struct{ n, tasks int }{{1000, 10}, {10000, 10}, {10000, 1}} {
		n := size.n
		fleet := benchSyncFleet(n, size.tasks, 10)
		victims := fleet[fmt.Sprintf("task-%d", size.tasks/2)]
		b.Run(fmt.Sprintf("full/executors=%d/tasks=%d", n, size.tasks), func(b *testing.B) {
			s, obs := benchSyncer(b, fleet)
			victim := victims[len(victims)/2].Checks[1]
			b.ResetTimer()
			for i := range b.N {
				np := health.NonPassing{Index: uint64(10 + i)}
				if i%2 == 0 {
					c := victim
					c.Status, c.ModifyIndex = health.StatusWarning, np.Index
					np.Checks = []health.CheckState{c}
				}
				v := s.View()
				obs <- health.Observation{Data: &np}
				<-v.Changed()
			}
		})
		b.Run(fmt.Sprintf("lapse/executors=%d/tasks=%d", n, size.tasks), func(b *testing.B) {
			s, obs := benchSyncer(b, fleet)
			var lapsed []health.CheckState
			b.ResetTimer()
			for i := range b.N {
				// Every victim lapsed: start again with a fresh fleet.
				if i > 0 && i%len(victims) == 0 {
					b.StopTimer()
					s, obs = benchSyncer(b, fleet)
					lapsed = nil
					b.StartTimer()
				}
				np := health.NonPassing{Index: uint64(10 + i)}
				c := victims[i%len(victims)].Checks[1]
				c.Status, c.ModifyIndex = health.StatusCritical, np.Index
				lapsed = append(lapsed, c)
				np.Checks = lapsed
				v := s.View()
				obs <- health.Observation{Data: &np}
				<-v.Changed()
			}
		})
	}
}

// BenchmarkSyncerMemory reports the Go heap a Syncer holds per executor
// once it has read a fleet of n over 10 task types (or one) and published
// two constraint sets: what grows with the fleet, streams aside (after a
// forced GC, measured against the heap before the Syncer started); and,
// apart (member-B/executor), the members it was handed as a watch holds them.
func BenchmarkSyncerMemory(b *testing.B) {
	for _, size := range []struct{ n, tasks int }{{10000, 10}, {10000, 1}} {
		// The members as a watch holds them (and hands the syncer), apart
		// from the syncer's own state.
		base := fleettest.HeapAfterGC()
		fleet := benchSyncFleet(size.n, size.tasks, 10)
		perMember := float64(fleettest.HeapAfterGC()-base) / float64(size.n)
		b.Run(fmt.Sprintf("executors=%d/tasks=%d", size.n, size.tasks), func(b *testing.B) {
			b.ReportMetric(perMember, "member-B/executor")
			var perExecutor float64
			for range b.N {
				before := fleettest.HeapAfterGC()
				s, _ := benchSyncer(b, fleet)
				waitSynced(b, s)
				perExecutor = float64(fleettest.HeapAfterGC()-before) / float64(size.n)
				runtime.KeepAlive(s)
			}
			b.ReportMetric(perExecutor, "B/executor")
		})
	}
}

// waitSynced waits until s has published the whole fleet.
func waitSynced(b *testing.B, s *Syncer) {
	deadline := time.After(30 * time.Second)
	for v := s.View(); !v.Synced; v = s.View() {
		select {
		case <-v.Changed():
		case <-deadline:
			b.Fatal("the fleet was never read")
		}
	}
}
