// Package loadreport lets an executor report its load to dispatchers the way
// gRPC and Envoy carry it (ORCA), with grpc-go's orca package: in every
// call's trailer (what weighted round robin weighs endpoints by) and out of
// band on xds.data.orca.v3.OpenRcaService (for tools and sidecars; grpc-go
// reports there at most every 30 s).
//
// What is reported: application utilization = tasks in flight ÷ capacity
// (an idle executor half a task's worth: 0 would be ignored),
// qps = tasks completed per second (over the last few seconds), and the named
// metrics in_flight and capacity. Consul still carries the full / not full
// gate (the lease check's warning status, seen by leasehold at once); the
// utilization travels straight to each dispatcher, current to the call.
package loadreport

import (
	"context"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/orca"
)

// Named metrics in every report.
const (
	MetricInFlight = "in_flight"
	MetricCapacity = "capacity"
)

// qpsWindow is how far back completed tasks count towards qps.
const qpsWindow = 5 * time.Second

// Reporter records an executor's load for ORCA.
type Reporter struct {
	capacity int
	inFlight func() int
	now      func() time.Time
	rec      orca.ServerMetricsRecorder

	mu   sync.Mutex  // one update at a time; guards done
	done []time.Time // completions within qpsWindow, oldest first
}

// New reports the load of an executor running up to capacity tasks at once,
// inFlight() of them now. Install ServerOption on its gRPC server, Register
// the out-of-band service, call Report in each task handler and Done when a
// task ends. inFlight must not call back into the Reporter (it is called
// under its lock).
func New(capacity int, inFlight func() int) (*Reporter, error) {
	if capacity < 1 {
		return nil, fmt.Errorf("capacity: %d: want at least 1", capacity)
	}
	if inFlight == nil {
		return nil, fmt.Errorf("inFlight: want a function")
	}
	return &Reporter{capacity: capacity, inFlight: inFlight, now: time.Now, rec: orca.NewServerMetricsRecorder()}, nil
}

// ServerOption attaches a load report to the trailer of every call whose
// handler called Report.
func (r *Reporter) ServerOption() grpc.ServerOption { return orca.CallMetricsServerOption(r.rec) }

// Register serves the out-of-band ORCA service on s. Each report is brought
// up to date as it is sent (what `leasehold register` reads at each probe):
// tasks that start call nothing, so without this an executor that filled up
// would report the load of whenever a handler last returned.
func (r *Reporter) Register(s grpc.ServiceRegistrar) error {
	return orca.Register(s, orca.ServiceOptions{ServerMetricsProvider: current{r}})
}

// current is the recorder's metrics, updated as they are read.
type current struct{ r *Reporter }

func (c current) ServerMetrics() *orca.ServerMetrics {
	c.r.update()
	return c.r.rec.ServerMetrics()
}

// Report brings the report up to date and marks the handler's call for a
// per-call report (grpc-go attaches one only to calls that asked for their
// recorder). Call it as the handler returns, so the trailer carries the load
// as the task ends, with the handler's context (or an interceptor's chained
// after ServerOption: the recorder is in the context from there on).
func (r *Reporter) Report(ctx context.Context) {
	r.update()
	orca.CallMetricsRecorderFromContext(ctx) // the server's metrics, merged in by ServerOption
}

// Done counts a task that ended (for qps).
func (r *Reporter) Done() {
	r.mu.Lock()
	now := r.now()
	r.done = append(r.done, now)
	r.prune(now) // also when nothing reports: only the window is kept
	r.mu.Unlock()
}

// prune drops completions older than qpsWindow; r.mu is held.
func (r *Reporter) prune(now time.Time) {
	cut := 0
	for cut < len(r.done) && now.Sub(r.done[cut]) > qpsWindow {
		cut++
	}
	r.done = r.done[cut:]
}

// idleTasks is the tasks in flight an idle executor reports utilization
// for: gRPC's and Envoy's weighted round robin ignore a report of
// utilization 0, so an executor reporting 0 as its task ends would carry no
// weight of its own and be weighed as the mean of those that report — the
// busy ones — and a busy executor among idle peers would get its full share.
const idleTasks = 0.5

// utilization is n tasks in flight of capacity, within [idleTasks/capacity, 1].
func utilization(n, capacity int) float64 {
	return min(max(float64(n), idleTasks)/float64(capacity), 1)
}

// namedMetrics is what grpc-go's recorder offers beyond its interface.
type namedMetrics interface {
	SetNamedMetric(name string, val float64)
}

// update sets utilization and qps from the executor's state now. One update
// at a time: grpc-go's recorder sets each field by copy-and-swap, so fields
// of concurrent updates would interleave (and could be lost), leaving a
// report that mixes two moments.
func (r *Reporter) update() {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := r.inFlight()
	r.rec.SetApplicationUtilization(utilization(n, r.capacity))
	if nm, ok := r.rec.(namedMetrics); ok {
		nm.SetNamedMetric(MetricInFlight, float64(n))
		nm.SetNamedMetric(MetricCapacity, float64(r.capacity))
	}
	r.prune(r.now())
	r.rec.SetQPS(float64(len(r.done)) / qpsWindow.Seconds())
}

// Run keeps the out-of-band report current until ctx ends.
func (r *Reporter) Run(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		r.update()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
