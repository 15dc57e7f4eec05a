package translator

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// BenchmarkEndpoints: a full build of one task's load assignment (decide
// every executor, build, sort) and its content version, per fleet size.
func BenchmarkEndpoints(b *testing.B) {
	for _, n := range []int{1_000, 10_000, 100_000} {
		es := fleettest.Executors(n)
		d, _ := health.NewDispatcher(">=1.0.0", map[string]string{"zone": "eu-1"})
		b.Run(fmt.Sprintf("full-%d", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_, _ = endpointsVersioned("work", es, d)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n),
				"ns/endpoint")
		})
	}
}

// BenchmarkSingleChange: one executor of 10,000 changes; the task's load
// assignment is rebuilt and versioned (what a lapse costs per constraint
// set). The syncer fingerprints every executor once per change for all sets
// (BenchmarkFingerprints); here the changed one is re-fingerprinted.
func BenchmarkSingleChange(b *testing.B) {
	es := fleettest.Executors(10_000)
	prints := make([]uint64, len(es))
	for i := range es {
		prints[i] = ExecutorPrint(&es[i])
	}
	d, _ := health.NewDispatcher("", nil)
	bl := &Builder{}
	bl.BuildPrinted("work", es, prints, d)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		k := i % len(es)
		es[k].Load = (es[k].Load + 1) % 8
		prints[k] = ExecutorPrint(&es[k])
		i++
		_ = bl.BuildPrinted("work", es, prints, d)
	}
}

// BenchmarkFingerprints: the syncer's per-change pass over the fleet that
// tells the builders which executors changed (once per change, shared by
// every constraint set).
func BenchmarkFingerprints(b *testing.B) {
	es := fleettest.Executors(10_000)
	b.ReportAllocs()
	for b.Loop() {
		for i := range es {
			_ = ExecutorPrint(&es[i])
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(es)), "ns/executor")
}

// BenchmarkConstraintSets: the cost of one change at 10,000 executors with 1
// vs 100 distinct constraint sets — linear in sets (each set has its own
// load assignment), independent of how many dispatchers share a set; the
// fingerprint pass is done once per change, as in the syncer.
func BenchmarkConstraintSets(b *testing.B) {
	for _, sets := range []int{1, 100} {
		b.Run(fmt.Sprintf("sets-%d", sets), func(b *testing.B) {
			es := fleettest.Executors(10_000)
			prints := func() []uint64 {
				p := make([]uint64, len(es))
				for i := range es {
					p[i] = ExecutorPrint(&es[i])
				}
				return p
			}
			builders := make([]*Builder, sets)
			ds := make([]health.Dispatcher, sets)
			ps := prints()
			for i := range sets {
				ds[i], _ = health.NewDispatcher(fmt.Sprintf(">=1.%d.0", i%5), nil)
				builders[i] = &Builder{}
				builders[i].BuildPrinted("work", es, ps, ds[i])
			}
			i := 0
			for b.Loop() {
				es[i%len(es)].Load = (es[i%len(es)].Load + 1) % 8
				i++
				ps := prints()
				for k := range sets {
					builders[k].BuildPrinted("work", es, ps, ds[k])
				}
			}
		})
	}
}

// BenchmarkBuilderRetained reports the heap a Builder and its load
// assignment keep per endpoint after a build of 10,000 executors (one
// constraint set of a task type that size: what the server holds for it
// between changes), unsharded and in 10 shards.
func BenchmarkBuilderRetained(b *testing.B) {
	const n = 10_000
	es := fleettest.Executors(n)
	d, _ := health.NewDispatcher("", nil)
	for _, shards := range []int{1, 10} {
		b.Run(fmt.Sprintf("shards-%d", shards), func(b *testing.B) {
			var per float64
			for range b.N {
				before := fleettest.HeapAfterGC()
				bl := &Builder{Shards: shards}
				r := bl.BuildPrinted("work", es, nil, d)
				per = float64(fleettest.HeapAfterGC()-before) / n
				runtime.KeepAlive(bl)
				runtime.KeepAlive(r)
			}
			b.ReportMetric(per, "B/endpoint")
		})
	}
}
