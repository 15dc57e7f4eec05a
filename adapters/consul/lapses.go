package consul

import (
	"context"
	"log/slog"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/consul/api"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"

	"github.com/leasehold/leasehold/health"
)

// Lapse marks (health.LapseMarkPrefix): a lapse is final, and Consul keeps
// no history of a check, so the lapses leasehold sees are recorded in KV (by
// the LapseRecorder) and read back by every replica (the "lapses" watch).

// lapseCatalog is a catalog that can list the lapse marks; the watch runs
// only on one that can (test fakes need not).
type lapseCatalog interface {
	LapseMarks(ctx context.Context, index uint64, wait time.Duration) (api.KVPairs, uint64, error)
}

// LapseMarks lists the lapse marks. A fresh read (index 0: the first, or
// after an error) also asks whether the token may write them, as the
// LapseRecorder must: read alone would leave leasehold ready while every
// lapse it records is refused, and a lapsed session routed again after a
// restart.
func (a apiCatalog) LapseMarks(ctx context.Context, index uint64, wait time.Duration) (api.KVPairs, uint64, error) {
	pairs, meta, err := listKV(ctx, a.c, a.query(ctx, index, wait), health.LapseMarkPrefix, "write") // leasehold writes them too
	if err != nil {
		return nil, 0, err
	}
	if index == 0 && !isRefreshRead(ctx) { // a refresh's read is no first read: asked already
		if err := canWriteKV(ctx, a.c, a.dc, health.LapseMarkPrefix); err != nil {
			return nil, 0, err
		}
	}
	return pairs, meta.LastIndex, nil
}

// lapseWriteProbe is the key under a prefix that canWriteKV's check-and-set
// names; it is never written.
const lapseWriteProbe = ".write-probe"

// canWriteKV asks Consul whether the token may write under prefix, without
// writing: a check-and-set at an index no key can have (a key that does not
// exist is only created at index 0). Consul checks the right first (403),
// then fails the check-and-set.
func canWriteKV(ctx context.Context, c *api.Client, dc, prefix string) error {
	_, _, err := c.KV().CAS(&api.KVPair{Key: prefix + lapseWriteProbe, ModifyIndex: math.MaxUint64}, (&api.WriteOptions{Datacenter: dc}).WithContext(ctx))
	return aclNeeds("kv "+prefix+" (write)", []string{RightKeyPrefix(prefix, "write")}, nil, err)
}

// watchLapses follows the lapse marks (paced like the generation keys, and
// charged to their budget: both grow with the fleet's history).
func (w *Watcher) watchLapses(ctx context.Context, out chan<- health.Observation, cat lapseCatalog) {
	var last []health.LapseMark
	bad := map[string]bool{}
	first := true
	handle := func(ctx context.Context, pairs api.KVPairs, idx, at uint64, err error) (uint64, error) {
		if err != nil {
			first = true
			return 0, err
		}
		marks := make([]health.LapseMark, 0, len(pairs))
		for _, p := range pairs {
			m, err := health.ParseLapseMark(p.Key, p.Value)
			if err != nil {
				if !bad[p.Key] {
					bad[p.Key] = true
					w.log.Warn("lapse mark ignored", "err", err)
				}
				continue
			}
			marks = append(marks, m)
		}
		if !first && slices.EqualFunc(marks, last, func(a, b health.LapseMark) bool {
			return a.InstanceID == b.InstanceID && a.SessionID == b.SessionID
		}) {
			w.sendProgress(ctx, out, "lapses", at, 0)
			return idx, nil
		}
		first, last = false, marks
		w.send(ctx, out, health.Observation{Lapses: &health.LapseMarks{Index: idx, Marks: marks}})
		w.sendProgress(ctx, out, "lapses", at, idx)
		return idx, nil
	}
	w.blockingLoop(ctx, out, watchSpec{name: "lapses", minInterval: w.cfg.MinInterval * 4, budget: w.genBudget, kvListing: true}, func(ctx context.Context, index uint64, wait time.Duration) (uint64, func() (uint64, error)) {
		pairs, idx, err := cat.LapseMarks(ctx, index, wait)
		at := w.receipt(idx) // the index space of the checks: see refresh.go
		return idx, func() (uint64, error) { return handle(ctx, pairs, idx, at, err) }
	})
}

// LapseRecorder writes lapse marks into Consul KV, in the datacenter of the
// lapsed executor (where its datacenter's replicas read them), and removes
// marks older than the retention. Record never blocks the caller (the
// syncer's goroutine): marks queue, and are written with retries until they
// are, or until Run ends.
type LapseRecorder struct {
	kv          *api.Client
	log         *slog.Logger
	retention   time.Duration
	datacenters []string // pruned ([""]: the agent's own)
	failed      metric.Int64Counter

	mu      sync.Mutex
	queue   []health.LapseMark
	dcOf    map[[2]string]string // mark → datacenter ("" the agent's own)
	pending chan struct{}
}

// NewLapseRecorder writes through client; marks older than retention (zero:
// 73 h, as the syncer's history) are removed from the datacenters (nil: the
// agent's own).
func NewLapseRecorder(client *api.Client, log *slog.Logger, retention time.Duration, datacenters []string, meter metric.MeterProvider) *LapseRecorder {
	if len(datacenters) == 0 {
		datacenters = []string{""}
	}
	if retention <= 0 {
		retention = 73 * time.Hour
	}
	if log == nil {
		log = slog.Default()
	}
	if meter == nil {
		meter = metricnoop.NewMeterProvider()
	}
	r := &LapseRecorder{kv: client, log: log.With("component", "lapse-recorder"), retention: retention, datacenters: datacenters, dcOf: map[[2]string]string{}, pending: make(chan struct{}, 1)}
	r.failed, _ = meter.Meter("github.com/leasehold/leasehold/adapters/consul").Int64Counter("leasehold.lapse_marks.failed",
		metric.WithDescription("writes of lapse marks to Consul KV that failed (retried); a lapse not recorded is final only in this replica's memory until it is"))
	return r
}

// Record queues a lapse mark for e's session.
func (r *LapseRecorder) Record(e health.Executor) {
	m := health.LapseMark{InstanceID: e.InstanceID, SessionID: e.SessionID, Generation: e.Generation, At: time.Now().UTC().Truncate(time.Second), Tasks: []string{e.Task}}
	r.mu.Lock()
	r.queue = append(r.queue, m)
	r.dcOf[[2]string{e.InstanceID, e.SessionID}] = e.Datacenter
	r.mu.Unlock()
	select {
	case r.pending <- struct{}{}:
	default:
	}
}

// Run writes queued marks and prunes old ones until ctx ends; then it
// writes what is still queued for a few seconds more (a lapse seen just
// before a shutdown is recorded too, if Consul answers).
func (r *LapseRecorder) Run(ctx context.Context) {
	prune := time.NewTicker(time.Hour)
	defer prune.Stop()
	defer func() {
		fctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		r.flush(fctx)
	}()
	r.prune(ctx)
	bo := newBackoff(100*time.Millisecond, 10*time.Second)
	for {
		if r.flush(ctx) {
			bo.reset()
		} else {
			select {
			case <-ctx.Done():
				return
			case <-time.After(bo.next()):
			}
			continue
		}
		select {
		case <-ctx.Done():
			return
		case <-r.pending:
		case <-prune.C:
			r.prune(ctx)
		}
	}
}

// flush writes every queued mark; false when one failed (it stays queued).
func (r *LapseRecorder) flush(ctx context.Context) bool {
	for {
		r.mu.Lock()
		if len(r.queue) == 0 {
			r.mu.Unlock()
			return true
		}
		m := r.queue[0]
		dc := r.dcOf[[2]string{m.InstanceID, m.SessionID}]
		r.mu.Unlock()
		// Create only: a mark another replica wrote first stays as it is.
		key := health.LapseMarkKey(m.InstanceID, m.SessionID)
		_, _, err := r.kv.KV().CAS(&api.KVPair{Key: key, Value: m.Value(), ModifyIndex: 0}, (&api.WriteOptions{Datacenter: dc}).WithContext(ctx))
		if err != nil {
			if ctx.Err() == nil {
				r.failed.Add(ctx, 1)
				r.log.Error("lapse mark not written; retrying (until it is, the lapse is final in this replica's memory only)", "key", key, "datacenter", dc, "err", err)
			}
			return false
		}
		r.mu.Lock()
		r.queue = r.queue[1:]
		delete(r.dcOf, [2]string{m.InstanceID, m.SessionID})
		r.mu.Unlock()
	}
}

// prune removes the marks older than the retention, in every datacenter
// (each replica does; a mark changed meanwhile is kept).
func (r *LapseRecorder) prune(ctx context.Context) {
	cutoff := time.Now().Add(-r.retention)
	for _, dc := range r.datacenters {
		pairs, _, err := r.kv.KV().List(health.LapseMarkPrefix, (&api.QueryOptions{Datacenter: dc}).WithContext(ctx))
		if err != nil {
			continue // next hour
		}
		for _, p := range pairs {
			m, err := health.ParseLapseMark(p.Key, p.Value)
			if err != nil || m.At.IsZero() || !m.At.Before(cutoff) {
				continue
			}
			if _, _, err := r.kv.KV().DeleteCAS(p, (&api.WriteOptions{Datacenter: dc}).WithContext(ctx)); err != nil {
				break
			}
		}
	}
}
