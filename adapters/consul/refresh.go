package consul

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/leasehold/leasehold/health"
)

// Refreshes: the fencing API asks a Watcher to read Consul afresh when its
// view has not reached a request's min_consul_index. What a refresh costs
// is what is behind, never a full re-read:
//
//   - each refreshable watch knows the index its view is current at (at):
//     its answer's own index, or higher — an answer received after another
//     answer at index I was made by Consul at I or later (one agent, one
//     leader, one raft index), so it is current there too. This gives the
//     generation keys and the lapse marks, whose KV listings keep the
//     index of their last write, a place in the checks' index space;
//   - a refresh reads afresh only the watches whose at is below the index
//     asked for: the generation keys alone when only they are behind, the
//     critical checks (with the warning ones and every node's serfHealth
//     when those are behind too) when the non-passing set is;
//   - the KV listings behind (the generation keys, the lapse marks) are
//     first asked about with one small read: the index of the datacenter's
//     latest KV write. When no write came after a listing's answer, that
//     answer is still current, and nothing more is read;
//   - a fresh read is made beside the watch's blocking query, never by
//     cancelling it (runQuery);
//   - one round is in flight per datacenter (a Watcher): requests arriving
//     meanwhile share the next round, whatever their number;
//   - rounds have their own share of the read budget (a quarter of
//     ReadRate, like the generation keys): a round waits while that share
//     is in debt and is charged with what it read, so min_consul_index costs
//     Consul at most that rate however many calls pass it, and never delays
//     the watches' own reads (a STALE, a deregistration).

// refresher holds the rounds (Watcher.refresh).
type refresher struct {
	mu     sync.Mutex
	seq    uint64            // the last round numbered
	next   *refreshRound     // the round requests join now (nil: none asked for)
	flight *refreshRound     // the round whose fresh reads are awaited (nil: none)
	done   map[string]uint64 // per watch: the latest round it answered afresh
	signal chan struct{}     // a round is waiting (capacity 1)

	// at is, per refreshable watch, the index its view is known current at
	// (updated after what makes it so went out); "np" is the non-passing
	// set as published.
	at map[string]*atomic.Uint64
}

// refreshRound is one refresh: every request it answers, and the watches
// it asked to read afresh.
type refreshRound struct {
	seq   uint64
	least uint64 // the highest index its requests asked for
	reads []string
	done  chan struct{} // closed once each of reads answered afresh
}

// npProgress names the published non-passing set in refresher.at.
const npProgress = "np"

func (r *refresher) init(names []string) {
	r.done, r.signal, r.at = map[string]uint64{}, make(
		chan struct{},
		1,
	), map[string]*atomic.Uint64{}
	for _, n := range append([]string{npProgress}, names...) {
		r.at[n] = new(atomic.Uint64)
	}
}

// atOf is the index watch name's view is known current at.
func (r *refresher) atOf(name string) uint64 {
	if a := r.at[name]; a != nil {
		return a.Load()
	}
	return 0
}

// raise records that watch name's view is current at index at (never
// lowering it).
func (r *refresher) raise(name string, at uint64) {
	a := r.at[name]
	if a == nil {
		return
	}
	for old := a.Load(); at > old && !a.CompareAndSwap(old, at); old = a.Load() {
	}
}

// Refresh asks the watches whose view has not reached index least (a
// fencing request's min_consul_index) to read Consul afresh now, without
// waiting for their blocking queries. It returns the round's sequence
// number: an Observation with Refreshed ≥ it follows once every watch it
// concerns either answered a read made after this call, or was current at
// least already. Requests made while a round is in flight share the next.
func (w *Watcher) Refresh(_ context.Context, least uint64) (uint64, error) {
	r := &w.refresh
	r.mu.Lock()
	if r.next == nil {
		r.seq++
		r.next = &refreshRound{seq: r.seq}
	}
	r.next.least = max(r.next.least, least)
	seq := r.next.seq
	r.mu.Unlock()
	select {
	case r.signal <- struct{}{}:
	default:
	}
	return seq, nil
}

// behind are the refreshable watches whose view is below least: the
// critical checks when the published non-passing set is (with the warning
// checks and the serfHealth listing when those are behind too: a check
// that moved between states, a node that failed and came back), and the
// generation keys and lapse marks on their own.
func (w *Watcher) behind(least uint64) []string {
	r := &w.refresh
	npBehind := r.atOf(npProgress) < least
	var out []string
	for _, name := range w.refreshable {
		switch name {
		case "non-passing":
			if npBehind {
				out = append(out, name)
			}
		case "warning", "serf":
			if npBehind && r.atOf(name) < least {
				out = append(out, name)
			}
		default:
			if r.atOf(name) < least {
				out = append(out, name)
			}
		}
	}
	return out
}

// runRefreshes runs the rounds, one at a time, until ctx ends.
func (w *Watcher) runRefreshes(ctx context.Context) {
	r := &w.refresh
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.signal:
		}
		for {
			r.mu.Lock()
			round := r.next
			r.next = nil
			r.mu.Unlock()
			if round == nil {
				break
			}
			if !w.runRound(ctx, round) {
				return
			}
		}
	}
}

// runRound asks the watches behind to read afresh (once the refreshes'
// share of the read budget allows), waits for their answers and sends the
// round's Refreshed marker; false when ctx ended.
func (w *Watcher) runRound(ctx context.Context, round *refreshRound) bool {
	reads := w.behind(round.least)
	if len(reads) > 0 && w.refreshBudget != nil {
		waited, ok := w.refreshBudget.wait(ctx, nil)
		if waited > 0 {
			w.budgetWait.Add(
				ctx,
				waited.Seconds(),
				metric.WithAttributes(w.attrs(attribute.String("watch", "refresh"))...),
			)
		}
		if !ok {
			return false
		}
		reads = w.behind(round.least) // answers that came during the wait count
	}
	reads = w.unwrittenKV(ctx, reads)
	if len(reads) > 0 {
		round.reads, round.done = reads, make(chan struct{})
		r := &w.refresh
		r.mu.Lock()
		r.flight = round
		r.mu.Unlock()
		w.rounds.Add(ctx, 1, w.dcAttrs())
		for _, name := range reads {
			kick := w.refreshC[name]
			for sent := false; !sent; {
				select {
				case kick <- round.seq:
					sent = true
				default: // a read that failed left its request queued: this one replaces it
					select {
					case <-kick:
					default:
					}
				}
			}
		}
		w.wakeMu.Lock() // after the requests are queued: a pause that missed them ends now
		close(w.refreshWake)
		w.refreshWake = make(chan struct{})
		w.wakeMu.Unlock()
		select {
		case <-round.done:
		case <-ctx.Done():
			return false
		}
	}
	return w.send(ctx, health.Observation{Data: &health.Refreshed{Seq: round.seq}})
}

// kvIndexCatalog can read the index of the datacenter's latest KV write
// (apiCatalog.KVIndex); ok false: it cannot tell now.
type kvIndexCatalog interface {
	KVIndex(ctx context.Context) (idx uint64, ok bool, err error)
}

// isKVListing reports whether watch name lists a KV prefix.
func isKVListing(name string) bool { return name == "generations" || name == "lapses" }

// unwrittenKV drops from reads the KV listings that no KV write followed,
// and says they are current now: the datacenter's latest KV write (one
// small read) is not above the index a listing's answer is current at,
// and any write after that answer would be (Consul made it later). It
// returns reads as they are when the catalog cannot tell.
func (w *Watcher) unwrittenKV(ctx context.Context, reads []string) []string {
	kc, ok := w.cat.(kvIndexCatalog)
	if !ok || !slices.ContainsFunc(reads, isKVListing) {
		return reads
	}
	pctx, sizes := withReadSizes(ctx)
	idx, ok, err := kc.KVIndex(pctx)
	w.countRead(ctx, watchSpec{name: "refresh"}, sizes, w.refreshBudget)
	w.requests.Add(ctx, 1, metric.WithAttributes(w.attrs(attribute.String("watch", "refresh"))...))
	if err != nil || !ok {
		if err != nil && ctx.Err() == nil {
			w.log.Debug("the index of the latest KV write not read; the listings are read instead",
				"err", err)
		}
		return reads
	}
	at := w.receipt(idx)
	return slices.DeleteFunc(reads, func(name string) bool {
		if !isKVListing(name) || idx > w.refresh.atOf(name) {
			return false
		}
		w.sendProgress(ctx, name, at, 0)
		return true
	})
}

// refreshed records that watch name answered round seq afresh (what it read
// went out before), ending the round once every watch it asked has.
func (w *Watcher) refreshed(name string, seq uint64) {
	r := &w.refresh
	r.mu.Lock()
	defer r.mu.Unlock()
	r.done[name] = max(r.done[name], seq)
	f := r.flight
	if f == nil {
		return
	}
	for _, n := range f.reads {
		if r.done[n] < f.seq {
			return
		}
	}
	r.flight = nil
	close(f.done)
}

// readFunc reads one answer of a watch — the Consul call, made in any
// goroutine — and returns its index (0: the read failed) and what handles
// the answer, called in the watch's goroutine.
type readFunc func(ctx context.Context, index uint64, wait time.Duration) (uint64, handleFunc)

// handleFunc handles one answer of a watch and returns the index the watch
// goes on from (0 with an error: the read or the answer failed).
type handleFunc func() (uint64, error)

// queryRead is the read of a watch no refresh reads afresh: query reads and
// handles its answer at once, in the watch's goroutine.
func queryRead(
	query func(ctx context.Context, index uint64, wait time.Duration) (uint64, error),
) readFunc {
	return func(ctx context.Context, index uint64, wait time.Duration) (uint64, handleFunc) {
		next, err := query(ctx, index, wait)
		return next, func() (uint64, error) { return next, err }
	}
}

// runQuery runs one query of watch name. For a refreshable watch, a refresh
// request is answered with a fresh, non-blocking read made beside the
// blocking query in flight, which goes on: cancelling it would leave its
// connection with the agent until its wait ends (Consul holds a blocking
// query its client left), and refreshes would soon use up the connections
// Consul allows one client (429). A blocking answer no newer than a fresh
// one handled meanwhile is dropped. fresh holds the sizes of the fresh reads
// (nil: none), which the refreshes' budget is charged with.
func (w *Watcher) runQuery(
	ctx context.Context,
	name string,
	index uint64,
	wait time.Duration,
	read readFunc,
) (next uint64, fresh *readSizes, err error) {
	kick := w.refreshC[name]
	if kick == nil {
		_, handle := read(ctx, index, wait)
		next, err = handle()
		return next, nil, err
	}
	select {
	case seq := <-kick: // already asked: read afresh without a blocking query first
		if index == 0 {
			// A read at index 0 anyway (the first, or after an error) is
			// the watch's own (with its first read's checks: the lapse
			// marks' write right) and answers the request too.
			_, handle := read(ctx, 0, 0)
			if next, err = handle(); err != nil {
				requeue(kick, seq)
				return 0, nil, err
			}
			w.refreshed(name, seq)
			return next, nil, nil
		}
		return w.freshRead(ctx, name, kick, seq, read, false)
	default:
	}
	if index == 0 {
		// Not a blocking query: Consul answers it at once, and a request
		// coming meanwhile is answered by the read right after (the loop
		// finds it pending), not by a second read beside it.
		_, handle := read(ctx, 0, wait)
		next, err = handle()
		return next, nil, err
	}
	type answer struct {
		idx    uint64
		handle handleFunc
	}
	blocking := make(chan answer, 1)
	go func() {
		idx, handle := read(ctx, index, wait)
		blocking <- answer{idx, handle}
	}()
	var handled uint64 // the index of the newest fresh answer handled meanwhile
	for {
		select {
		case a := <-blocking:
			if a.idx != 0 && a.idx <= handled {
				return handled, fresh, nil // a fresh read brought as much
			}
			next, err = a.handle()
			return next, fresh, err
		case seq := <-kick:
			n, sizes, err := w.freshRead(ctx, name, kick, seq, read, true)
			fresh = fresh.plus(sizes)
			if err != nil {
				return 0, fresh, err // the blocking query ends on its own; its answer is not needed
			}
			handled = max(handled, n)
		}
	}
}

// freshRead answers refresh round seq with a read at index 0 (Consul
// answers at once); beside: a blocking query of the watch is in flight, so
// the read takes the connection kept for one (freshSlot). A read that fails
// puts the request back: the watch's next successful read (after its
// back-off) answers it, so fencing waiting on it hears as soon as Consul
// answers again.
func (w *Watcher) freshRead(
	ctx context.Context,
	name string,
	kick chan uint64,
	seq uint64,
	read readFunc,
	beside bool,
) (uint64, *readSizes, error) {
	if beside {
		select { // one at a time: the connection the agent's pool keeps for it (Connections)
		case w.freshSlot <- struct{}{}:
		case <-ctx.Done():
			return 0, nil, ctx.Err()
		}
		// Held while handling too: what it reads more (the other state's checks).
		defer func() { <-w.freshSlot }()
	}
	fctx, sizes := withReadSizes(context.WithValue(ctx, refreshReadKey{}, true))
	_, handle := read(fctx, 0, 0)
	next, err := handle()
	if err != nil {
		requeue(kick, seq)
		return 0, sizes, err
	}
	w.refreshed(name, seq)
	return next, sizes, nil
}

// requeue puts back a refresh request whose read failed (a newer request
// queued meanwhile answers it too).
func requeue(kick chan uint64, seq uint64) {
	select {
	case kick <- seq:
	default:
	}
}

type refreshReadKey struct{}

// isRefreshRead reports whether ctx is a refresh's fresh read (not a
// watch's first read, nor one after an error).
func isRefreshRead(ctx context.Context) bool {
	ok, _ := ctx.Value(refreshReadKey{}).(bool)
	return ok
}

// receipt notes an answer at index idx as it arrives and returns the index
// the answering watch is current at: idx, or the highest index of any
// answer that arrived before (Consul made this one later).
func (w *Watcher) receipt(idx uint64) uint64 {
	before := w.reached.Load()
	w.noteReached(idx)
	return max(idx, before)
}

// noteReached raises the highest index any answer carried.
func (w *Watcher) noteReached(idx uint64) {
	for old := w.reached.Load(); idx > old; old = w.reached.Load() {
		if w.reached.CompareAndSwap(old, idx) {
			return
		}
	}
}

// forgetIndexes drops every index known: Consul lost or restored its state,
// and indexes of before say nothing of the new one. It returns the fast
// path's next turn (sendTurns), taken with the indexes dropped, for what
// says so: it goes out after every set decided before.
func (w *Watcher) forgetIndexes() sendTurn {
	w.reached.Store(0)
	for _, a := range w.refresh.at {
		a.Store(0)
	}
	f := &w.fast
	f.mu.Lock()
	defer f.mu.Unlock()
	f.critAt, f.warnAt, f.serfAt = 0, 0, 0
	return f.turns.take()
}
