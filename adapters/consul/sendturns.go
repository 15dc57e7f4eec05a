package consul

import "sync"

// sendTurns orders sends that are decided under a lock but made after it is
// released. A turn is taken under the lock, so turns follow the order of the
// decisions; a turn's sends wait until the turn before it has ended. So the
// lock is never held while a send waits for a full channel (which would hold
// every goroutine that needs the lock, and whatever waits on them), and what
// is sent still goes out in the order it was decided.
type sendTurns struct {
	mu   sync.Mutex
	last chan struct{} // closed when the latest turn taken has ended (nil: none taken)
}

// sendTurn is one place in the order of a sendTurns.
type sendTurn struct {
	prev <-chan struct{} // closed when the turn before has ended (nil: there is none)
	done chan struct{}   // closed by end
}

// take takes the next turn. Call it with the deciding lock held; then, with
// the lock released, await the turn, send, and end it.
func (s *sendTurns) take() sendTurn {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := sendTurn{prev: s.last, done: make(chan struct{})}
	s.last = t.done
	return t
}

// await waits until every earlier turn has ended; false when stop closed
// first (nothing is sent any more).
func (t sendTurn) await(stop <-chan struct{}) bool {
	if t.prev == nil {
		return true
	}
	select {
	case <-t.prev:
		return true
	case <-stop:
		return false
	}
}

// end lets the next turn go. Every turn taken must end, sent or not.
func (t sendTurn) end() { close(t.done) }
