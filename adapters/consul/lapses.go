package consul

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jonboulle/clockwork"
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
func (a apiCatalog) LapseMarks(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (api.KVPairs, uint64, error) {
	// The token must write them too: leasehold records the lapses.
	pairs, meta, err := listKV(
		ctx, a.c, a.query(ctx, index, wait), health.LapseMarkPrefix, "write", a.sizes)
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
	probe := &api.KVPair{Key: prefix + lapseWriteProbe, ModifyIndex: math.MaxUint64}
	_, _, err := c.KV().CAS(probe, (&api.WriteOptions{Datacenter: dc}).WithContext(ctx))
	return aclNeeds("kv "+prefix+" (write)", []string{RightKeyPrefix(prefix, "write")}, nil, err)
}

// watchLapses follows the lapse marks (paced like the generation keys, on a
// budget of their own that does not yield to a catalog being written: a
// LAPSED answer waits for its mark to be read back).
func (w *Watcher) watchLapses(ctx context.Context, cat lapseCatalog) {
	var last []health.LapseMark
	bad := map[string]bool{}
	first := true
	handle := func(
		ctx context.Context, pairs api.KVPairs, idx, at uint64, err error,
	) (uint64, error) {
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
			w.sendProgress(ctx, "lapses", at, 0)
			return idx, nil
		}
		first, last = false, marks
		w.send(ctx, health.Observation{Data: &health.LapseMarks{Index: idx, Marks: marks}})
		w.sendProgress(ctx, "lapses", at, idx)
		return idx, nil
	}
	w.blockingLoop(
		ctx,
		watchSpec{
			name:        "lapses",
			minInterval: w.cfg.MinInterval * 4,
			budget:      w.lapseBudget,
			kvListing:   true,
		},
		func(ctx context.Context, index uint64, wait time.Duration) (uint64, handleFunc) {
			pairs, idx, err := cat.LapseMarks(ctx, index, wait)
			at := w.receipt(idx) // the index space of the checks: see refresh.go
			return idx, func() (uint64, error) { return handle(ctx, pairs, idx, at, err) }
		},
	)
}

// LapseRecorder writes lapse marks into Consul KV, in the datacenter of the
// lapsed executor (where its datacenter's replicas read them), and removes
// those whose sessions have had no registration in the catalog for the
// retention (Prune). Record never blocks the caller (the syncer's
// goroutine): marks queue, and are written with retries until they are, or
// until Run ends.
type LapseRecorder struct {
	kv          *api.Client
	log         *slog.Logger
	clock       clockwork.Clock
	retention   time.Duration
	every       time.Duration // between prunes
	gather      time.Duration // how long a mark waits for others (0: not at all)
	datacenters []string      // pruned ([""]: the agent's own)
	failed      metric.Int64Counter

	mu      sync.Mutex
	queue   []health.LapseMark
	dcOf    map[[2]string]string // mark → datacenter ("" the agent's own)
	pending chan struct{}

	pruneMu sync.Mutex
	seen    map[[2]string]markSeen // datacenter, key → what the last prune saw of the mark
}

// markSeen is what one prune saw of a mark.
type markSeen struct {
	index  uint64    // the mark's ModifyIndex
	at     time.Time // when the catalog was read (r.clock: a monotonic reading with the real clock)
	absent bool      // its session had no registration in the catalog then
}

// DefaultMarkGather is how long a lapse's mark waits for others by default.
// Written at once, the mark's write and the marks' reads it woke ran beside
// the lapse's pushes on every measured lapse: at 1,000 streams on 2 cores,
// the median lapse reached its task type's last stream ~2 ms later
// (BENCHMARKS.md, "Lapse marks after the pushes, and fewer allocations per
// lapse"). A LAPSED answer waits for its mark (at most 2 s) that much
// longer.
const DefaultMarkGather = 50 * time.Millisecond

// markTxnOps is how many marks one transaction writes at most: Consul's
// limit of operations in one transaction.
const markTxnOps = 64

// LapseRecorderConfig tunes a LapseRecorder; the zero value is serve's.
type LapseRecorderConfig struct {
	// Retention is how long a mark is kept once its session has no
	// registration left in the catalog of any of the datacenters (default:
	// 73 h, as the syncer's history: longer than Consul's reconnect
	// timeout, so a node that comes back brings no lapsed session back).
	Retention time.Duration
	// Datacenters are the datacenters whose marks are pruned and whose
	// catalogs are searched for the marks' sessions (nil: the agent's own).
	Datacenters []string
	// PruneEvery is the time between prunes (default: an hour).
	PruneEvery time.Duration
	// Gather is how long a lapse's mark waits for the marks of the lapses
	// seen after it, to be written with them in one transaction (default
	// DefaultMarkGather; negative: written at once, one transaction for what
	// is queued). It keeps the mark's raft write, and the reads of the marks
	// it wakes in every replica, out of the moments when the lapse's pushes
	// go out, and makes a node's lapsing executors one write rather than
	// one each.
	Gather time.Duration

	Clock  clockwork.Clock      // default: the real clock (monotonic readings)
	Logger *slog.Logger         // default: slog.Default()
	Meter  metric.MeterProvider // default: no metrics
}

// NewLapseRecorder writes and prunes lapse marks through client.
func NewLapseRecorder(client *api.Client, cfg LapseRecorderConfig) *LapseRecorder {
	if len(cfg.Datacenters) == 0 {
		cfg.Datacenters = []string{""}
	}
	if cfg.Retention <= 0 {
		cfg.Retention = 73 * time.Hour
	}
	if cfg.PruneEvery <= 0 {
		cfg.PruneEvery = time.Hour
	}
	if cfg.Gather == 0 {
		cfg.Gather = DefaultMarkGather
	}
	if cfg.Clock == nil {
		cfg.Clock = clockwork.NewRealClock()
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Meter == nil {
		cfg.Meter = metricnoop.NewMeterProvider()
	}
	r := &LapseRecorder{
		kv:          client,
		log:         cfg.Logger.With("component", "lapse-recorder"),
		clock:       cfg.Clock,
		retention:   cfg.Retention,
		every:       cfg.PruneEvery,
		gather:      max(cfg.Gather, 0),
		datacenters: cfg.Datacenters,
		dcOf:        map[[2]string]string{},
		pending:     make(chan struct{}, 1),
		seen:        map[[2]string]markSeen{},
	}
	r.failed, _ = cfg.Meter.Meter("github.com/leasehold/leasehold/adapters/consul").
		Int64Counter("leasehold.lapse_marks.failed",
			metric.WithDescription("lapse marks whose write to Consul KV failed (retried; a "+
				"failed transaction counts every mark it carried); a lapse not recorded is "+
				"final only in this replica's memory until it is"),
		)
	r.failed.Add(context.Background(), 0) // exported before the first failure
	return r
}

// Record queues a lapse mark for e's session; Run writes it after the
// gather, with the others queued meanwhile.
func (r *LapseRecorder) Record(e health.Executor) {
	m := health.LapseMark{
		InstanceID: e.InstanceID,
		SessionID:  e.SessionID,
		Generation: e.Generation,
		At:         r.clock.Now().UTC().Truncate(time.Second),
		Tasks:      []string{e.Task},
	}
	r.mu.Lock()
	r.queue = append(r.queue, m)
	r.dcOf[[2]string{e.InstanceID, e.SessionID}] = e.Datacenter
	r.mu.Unlock()
	select {
	case r.pending <- struct{}{}:
	default:
	}
}

// shutdownFlush bounds how long Run goes on writing queued marks once its
// context ended. It is wall time on purpose, whatever the recorder's clock:
// it bounds how long the process takes to stop.
const shutdownFlush = 3 * time.Second

// Run writes queued marks, each the gather after the first of them was
// queued, and prunes until ctx ends; then it writes what is still queued
// for shutdownFlush more (a lapse seen just before a shutdown is recorded
// too, if Consul answers) and returns ctx's error.
func (r *LapseRecorder) Run(ctx context.Context) error {
	prune := r.clock.NewTicker(r.every)
	defer prune.Stop()
	defer func() {
		fctx, cancel := context.WithTimeout(context.Background(), shutdownFlush)
		defer cancel()
		r.flush(fctx)
	}()
	r.prune(ctx)
	bo := newBackoff(100*time.Millisecond, 10*time.Second)
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-prune.Chan():
			r.prune(ctx)
			continue
		case <-r.pending:
		}
		if r.gather > 0 {
			select {
			case <-ctx.Done():
				return ctx.Err() // what is queued is written by the deferred flush
			case <-r.clock.After(r.gather):
			}
		}
		for !r.flush(ctx) {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-r.clock.After(bo.next()):
			}
		}
		bo.reset()
	}
}

// flush writes every queued mark, a datacenter's in transactions of up to
// markTxnOps; false when one was not written (it stays queued). A mark
// Consul refuses (a rule denying its key, say) is left out of this flush's
// later transactions, so the others are written all the same.
func (r *LapseRecorder) flush(ctx context.Context) bool {
	refused := map[[2]string]bool{}
	for {
		r.mu.Lock()
		dc, batch := r.nextBatch(refused)
		r.mu.Unlock()
		if len(batch) == 0 {
			return len(refused) == 0
		}
		bad, err := r.writeMarks(ctx, dc, batch)
		if err != nil {
			if ctx.Err() == nil {
				r.failed.Add(ctx, int64(len(batch)))
				r.log.Error(
					"lapse marks not written; retrying (until they are, those lapses are final "+
						"in this replica's memory only)",
					"marks", len(batch), "first", health.LapseMarkKey(batch[0].InstanceID,
						batch[0].SessionID), "datacenter", dc, "err", err)
			}
			return false
		}
		for k, why := range bad {
			refused[k] = true
			r.failed.Add(ctx, 1)
			r.log.Error(
				"lapse mark refused; retrying (until it is written, the lapse is final in this "+
					"replica's memory only)",
				"key", health.LapseMarkKey(k[0], k[1]), "datacenter", dc, "err", why)
		}
		done := map[[2]string]bool{} // written, or another replica's
		for _, m := range batch {
			if k := [2]string{m.InstanceID, m.SessionID}; bad[k] == nil {
				done[k] = true
			}
		}
		r.mu.Lock()
		r.queue = slices.DeleteFunc(r.queue, func(m health.LapseMark) bool {
			return done[[2]string{m.InstanceID, m.SessionID}]
		})
		for k := range done {
			delete(r.dcOf, k)
		}
		r.mu.Unlock()
	}
}

// nextBatch is the next transaction's marks (called with r.mu held): those
// of the datacenter of the first queued mark not in skip, in the order they
// were queued, at most markTxnOps, and once each (a session that lapsed in
// two task types is one mark: the first; a transaction creating one key
// twice would fail whole).
func (r *LapseRecorder) nextBatch(skip map[[2]string]bool) (string, []health.LapseMark) {
	var (
		dc    string
		batch []health.LapseMark
		in    = map[[2]string]bool{}
	)
	for _, m := range r.queue {
		k := [2]string{m.InstanceID, m.SessionID}
		if skip[k] || in[k] {
			continue
		}
		if len(batch) == 0 {
			dc = r.dcOf[k]
		} else if r.dcOf[k] != dc {
			continue
		}
		in[k] = true
		batch = append(batch, m)
		if len(batch) == markTxnOps {
			break
		}
	}
	return dc, batch
}

// writeMarks creates marks in datacenter dc in one transaction, each only
// if it is absent: a mark another replica wrote first stays as it is. A
// mark Consul refuses rolls the transaction back; the marks refused are
// read, and left out of the transaction written again: present (another
// replica's, which fails the check-and-set) they are done, absent (or
// unreadable) they are returned, each with why, to stay queued. An error
// is a transaction that failed whole (Consul unreachable, say): nothing was
// written.
func (r *LapseRecorder) writeMarks(
	ctx context.Context, dc string, marks []health.LapseMark,
) (map[[2]string]error, error) {
	ops := make(api.TxnOps, 0, len(marks))
	for _, m := range marks {
		key := health.LapseMarkKey(m.InstanceID, m.SessionID)
		ops = append(ops, &api.TxnOp{KV: &api.KVTxnOp{Verb: api.KVCAS, Key: key, Value: m.Value()}})
	}
	of := marks // the mark of each op (replaced, never written in place)
	bad := map[[2]string]error{}
	for len(ops) > 0 {
		ok, resp, _, err := r.kv.Txn().Txn(ops, (&api.QueryOptions{Datacenter: dc}).WithContext(ctx))
		if err != nil {
			return nil, err
		}
		if ok {
			return bad, nil
		}
		out := map[int]bool{}
		for _, te := range resp.Errors {
			if te.OpIndex < 0 || te.OpIndex >= len(ops) {
				return nil, fmt.Errorf("transaction refused: %s", te.What)
			}
			key, m := ops[te.OpIndex].KV.Key, of[te.OpIndex]
			p, _, err := r.kv.KV().Get(key, (&api.QueryOptions{Datacenter: dc}).WithContext(ctx))
			switch k := [2]string{m.InstanceID, m.SessionID}; {
			case err != nil:
				bad[k] = fmt.Errorf("%s refused (%s), and reading it: %w", key, te.What, err)
			case p == nil:
				bad[k] = fmt.Errorf("%s refused: %s", key, te.What)
			}
			out[te.OpIndex] = true
		}
		if len(out) == 0 {
			return nil, errors.New("transaction refused, naming no operation")
		}
		var keptOps api.TxnOps
		var keptOf []health.LapseMark
		for i := range ops {
			if !out[i] {
				keptOps, keptOf = append(keptOps, ops[i]), append(keptOf, of[i])
			}
		}
		ops, of = keptOps, keptOf
	}
	return bad, nil
}

// prune is Prune from Run: what fails is logged, and tried again at the
// next prune.
func (r *LapseRecorder) prune(ctx context.Context) {
	if err := r.Prune(ctx); err != nil && ctx.Err() == nil {
		r.log.Warn("lapse marks not all pruned (tried again at the next prune)", "err", err)
	}
}

// Prune removes the lapse marks whose sessions have had no registration
// in the catalog for the retention, in every datacenter. A lapse is final
// for as long as its session can be routed again: a registration still in
// the catalog (any task, any node — a failed one's stays until Consul's
// reconnect timeout reaps it —, any datacenter) would be routed by a
// replica started after its mark went, once its check passed again. So
// each prune reads the catalogs (not a replica's memory of them), and
// removes nothing when one cannot be read.
//
// The time a session has had no registration is counted in its mark
// (UnregisteredSeconds), in durations measured between two prunes of one
// replica that both found the session unregistered and the mark unchanged,
// and added with a check-and-set from the index the first one saw: each
// index's lifetime is counted at most once, whichever replicas prune, and
// replicas whose wall clocks disagree count alike. A prune that finds the
// session registered again sets the count back to zero. Time nobody
// counted (no replica running, or a restart's first prune) only keeps the
// mark longer.
func (r *LapseRecorder) Prune(ctx context.Context) error {
	r.pruneMu.Lock()
	defer r.pruneMu.Unlock()
	type listed struct {
		dc    string
		pairs api.KVPairs
	}
	var (
		marks []listed
		errs  []error
		n     int
	)
	for _, dc := range r.datacenters {
		pairs, _, err := r.kv.KV().
			List(health.LapseMarkPrefix, (&api.QueryOptions{Datacenter: dc}).WithContext(ctx))
		if err != nil {
			errs = append(
				errs,
				fmt.Errorf("datacenter %q: list %s: %w", dc, health.LapseMarkPrefix, err),
			)
			continue
		}
		marks = append(marks, listed{dc, pairs})
		n += len(pairs)
	}
	seen := make(map[[2]string]markSeen, n)
	defer func() { r.seen = seen }() // what was not seen now is forgotten: counting starts again
	if n == 0 {
		return errors.Join(errs...)
	}
	registered, err := r.registeredSessions(ctx)
	if err != nil {
		return errors.Join(append(errs, fmt.Errorf("nothing pruned: %w", err))...)
	}
	now := r.clock.Now()
	for _, l := range marks {
		wo := (&api.WriteOptions{Datacenter: l.dc}).WithContext(ctx)
		for _, p := range l.pairs {
			m, err := health.ParseLapseMark(p.Key, p.Value)
			if err != nil || !health.LapseMarkReadable(p.Value) {
				continue // kept: nothing tells how long it has been
			}
			sk := [2]string{l.dc, p.Key}
			if registered[[2]string{m.InstanceID, m.SessionID}] {
				seen[sk] = markSeen{index: p.ModifyIndex, at: now}
				if m.UnregisteredSeconds != 0 { // registered again: the retention starts over
					idx, err := r.setUnregistered(ctx, l.dc, p, 0)
					if err != nil {
						errs = append(errs, err)
					}
					seen[sk] = markSeen{index: idx, at: now}
				}
				continue
			}
			prev, ok := r.seen[sk]
			if !ok || !prev.absent || prev.index != p.ModifyIndex || now.Before(prev.at) {
				// Counting starts now.
				seen[sk] = markSeen{index: p.ModifyIndex, at: now, absent: true}
				continue
			}
			total := m.Unregistered() + now.Sub(prev.at)
			if total < r.retention {
				idx, err := r.setUnregistered(ctx, l.dc, p, total)
				if err != nil {
					errs = append(errs, err)
				}
				seen[sk] = markSeen{index: idx, at: now, absent: true}
				continue
			}
			// Deleted only as it was read: a mark another replica changed
			// meanwhile (counted, or found registered) is looked at again.
			ok, _, err = r.kv.KV().DeleteCAS(p, wo)
			switch {
			case err != nil:
				errs = append(errs, fmt.Errorf("datacenter %q: delete %s: %w", l.dc, p.Key, err))
				seen[sk] = markSeen{index: p.ModifyIndex, at: prev.at, absent: true}
			case ok:
				r.log.Info(
					"lapse mark pruned: its session has had no registration for the retention",
					"key", p.Key, "datacenter", l.dc, "unregistered", total.Truncate(time.Second),
					"lapsed_at", m.At)
			}
		}
	}
	return errors.Join(errs...)
}

// setUnregistered sets mark p's unregistered time to d if p is unchanged,
// and returns the mark's index after (0 when it was changed meanwhile or
// the write failed: counting starts again at the next prune).
func (r *LapseRecorder) setUnregistered(
	ctx context.Context,
	dc string,
	p *api.KVPair,
	d time.Duration,
) (uint64, error) {
	v, err := health.WithUnregistered(p.Value, d)
	if err != nil {
		return 0, err
	}
	// A transaction, because it answers with the index the write gave the
	// mark (a plain check-and-set does not): the next prune counts from it.
	ops := api.TxnOps{
		{KV: &api.KVTxnOp{Verb: api.KVCAS, Key: p.Key, Value: v, Index: p.ModifyIndex}},
	}
	ok, resp, _, err := r.kv.Txn().Txn(ops, (&api.QueryOptions{Datacenter: dc}).WithContext(ctx))
	if err != nil {
		return 0, fmt.Errorf("datacenter %q: update %s: %w", dc, p.Key, err)
	}
	if !ok || len(resp.Results) != 1 || resp.Results[0].KV == nil {
		return 0, nil // changed meanwhile (by another replica's prune)
	}
	return resp.Results[0].KV.ModifyIndex, nil
}

// registeredSessions reads every registration in the catalog of every
// datacenter (any service: a lapsed session stays lapsed in every task) and
// returns the sessions they name. A catalog that cannot be read, or not
// all of it (ACLs filter what the token may not read), is an error.
func (r *LapseRecorder) registeredSessions(ctx context.Context) (map[[2]string]bool, error) {
	registered := map[[2]string]bool{}
	for _, dc := range r.datacenters {
		cat := apiCatalog{c: r.kv, dc: dc}
		names, _, err := cat.Services(ctx, 0, 0)
		if err != nil {
			return nil, fmt.Errorf("datacenter %q: %w", dc, err)
		}
		for name := range names {
			regs, _, err := cat.ServiceNodes(ctx, name, "", 0, 0)
			if err != nil {
				return nil, fmt.Errorf("datacenter %q: %w", dc, err)
			}
			for _, s := range regs {
				inst := s.ServiceMeta[health.MetaInstanceID]
				sess := s.ServiceMeta[health.MetaSessionID]
				if inst != "" && sess != "" {
					registered[[2]string{inst, sess}] = true
				}
			}
		}
	}
	return registered, nil
}
