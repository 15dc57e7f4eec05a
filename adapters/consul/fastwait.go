package consul

import (
	"context"
	"maps"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/health"
)

// minFastWait bounds how short a lease makes the fast queries' wait. Any
// token that may register the task type may declare any lease; one of 1 ms
// must not have every fast watch query Consul ten times a second. The
// watches paced by SlowInterval (1 s) answer every pace + wait at worst, so
// a 2 s lease still sees a view younger than itself; a session on a lease
// under about 1.5 s reads UNKNOWN between answers (its bound is its lease).
const minFastWait = 500 * time.Millisecond

// fastWait is how long the watches that always answer wait: FastWait, or a
// third of the shortest lease declared when that is shorter — and at most a
// second while some task type's membership has not been read (its leases
// are not known yet).
func (w *Watcher) fastWait() time.Duration {
	w.leaseMu.Lock()
	defer w.leaseMu.Unlock()
	return w.fastWaitLocked()
}

// holdShort is how long a shortened fast wait stays short after the lease
// that shortened it is gone: a shortening ends the fast queries in flight
// (cutShort), and Consul holds an ended blocking query's connection until
// its wait is over, so registering and deregistering a short lease must not
// make leasehold end queries again and again (Consul answers 429 past 200
// connections per address).
const holdShort = 10 * time.Minute

func (w *Watcher) fastWaitLocked() time.Duration {
	wait := w.leaseWaitLocked()
	if w.heldWait > 0 && w.cfg.Clock.Now().Before(w.heldUntil) {
		wait = min(wait, w.heldWait)
	}
	return wait
}

// leaseWaitLocked is the fast wait the leases read now call for.
func (w *Watcher) leaseWaitLocked() time.Duration {
	wait := w.cfg.FastWait
	if w.listedTasks == nil {
		return min(wait, time.Second)
	}
	for task := range w.listedTasks {
		l, read := w.taskLeases[task]
		if !read {
			return min(wait, time.Second)
		}
		if l > 0 && l/3 < wait {
			wait = max(l/3, minFastWait)
		}
	}
	return wait
}

// shortenedLocked ends the fast queries in flight if the fast wait is now
// shorter than was: they were asked with the longer wait, and on a quiet
// Consul would answer only after it — past a lease just declared (the
// session's fencing bound, its datacenter's readiness bound).
func (w *Watcher) shortenedLocked(was time.Duration) {
	now := w.fastWaitLocked()
	if now >= was {
		return
	}
	w.heldWait, w.heldUntil = now, w.cfg.Clock.Now().Add(holdShort)
	if w.shorter != nil {
		close(w.shorter)
	}
	w.shorter = make(chan struct{})
}

// shorterC is closed when the fast wait shortens.
func (w *Watcher) shorterC() <-chan struct{} {
	w.leaseMu.Lock()
	defer w.leaseMu.Unlock()
	if w.shorter == nil {
		w.shorter = make(chan struct{})
	}
	return w.shorter
}

// cutShort makes one blocking call of a watch that always answers (wait
// being its fast wait) and, when the fast wait shortens while it is in
// flight, makes it again at once with the shorter wait (that is no
// failure). Only the call is cut short, never what the watch does with its
// answer.
func cutShort[T any](
	w *Watcher,
	ctx context.Context,
	wait time.Duration,
	call func(ctx context.Context, wait time.Duration) (T, uint64, error),
) (T, uint64, error) {
	for {
		shorter := w.shorterC() // before the wait is read: a shortening after it closes this one
		if wait <= 0 {
			return call(ctx, wait) // an immediate read
		}
		wait = min(wait, w.fastWait())
		cctx, cancel := context.WithCancel(ctx)
		var cut atomic.Bool
		done := make(chan struct{})
		go func() {
			select {
			case <-shorter:
				cut.Store(true)
				cancel()
			case <-done:
			}
		}()
		v, idx, err := call(cctx, wait)
		close(done)
		cancel()
		if err == nil || !cut.Load() || ctx.Err() != nil {
			return v, idx, err
		}
	}
}

// listTasks notes the task types of the latest task list.
func (w *Watcher) listTasks(want map[string]bool) {
	w.leaseMu.Lock()
	defer w.leaseMu.Unlock()
	defer w.shortenedLocked(w.fastWaitLocked())
	w.listedTasks = maps.Clone(want)
	for task := range w.taskLeases {
		if !want[task] {
			delete(w.taskLeases, task)
		}
	}
}

// readLeases notes the shortest lease_ttl of a task type's members (0: none
// declares one).
func (w *Watcher) readLeases(task string, members []health.Member) {
	var shortest time.Duration
	for i := range members {
		if l := members[i].LeaseTTL; l > 0 && members[i].Err == nil &&
			(shortest == 0 || l < shortest) {
			shortest = l
		}
	}
	w.leaseMu.Lock()
	defer w.leaseMu.Unlock()
	defer w.shortenedLocked(w.fastWaitLocked())
	if w.taskLeases == nil {
		w.taskLeases = map[string]time.Duration{}
	}
	w.taskLeases[task] = shortest
}
