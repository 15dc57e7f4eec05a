package fleet

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"testing"
	"time"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// TestChurnDoesNotGrowMemory: 20,000 sessions come and go (some lapse, some
// carry bad metadata); once they are gone for longer than the history
// retention, every per-session and per-registration map is back to the size
// of the fleet that is left, and so is the heap.
func TestChurnDoesNotGrowMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("churns 20,000 sessions")
	}
	h := startSyncer(t, slog.New(slog.NewTextHandler(io.Discard, nil))) // 20,000 sessions' logs would dwarf the test
	h.s.Subscribe(dispatcher(t, ""))
	h.tasks("work")
	h.nonPassing()
	steady := fleettest.Member("work", "steady", "s0", 1, 9000, "1.0.0", health.StatusPassing, 1)
	h.members("work", steady)
	h.publish()
	settle := func() { // until Run has applied the last observation (none coalesced away)
		t.Helper()
		deadline := time.After(10 * time.Second)
		for v := h.s.View(); v.ConsulIndex < h.index; v = h.s.View() {
			select {
			case <-v.Changed():
			case <-h.pubs: // OnPublish must never block Run
			case <-deadline:
				t.Fatalf("the view never reached index %d", h.index)
			}
		}
	}
	sizes := func() (history, lastSeen, lapsed, bad, prints int) {
		t.Helper()
		settle()
		h.s.Subscribe(dispatcher(t, ">=9.9.9")) // a round trip through Run: its writes are visible
		h.s.Unsubscribe(dispatcher(t, ">=9.9.9"))
		bad, prints = 0, 0
		for _, ts := range h.s.fleet {
			bad += len(ts.bad)
			prints += len(ts.prints)
		}
		return h.s.history.len(), len(h.s.lastSeen), len(h.s.lapsed), bad, prints
	}
	heap := func() uint64 {
		var m runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	sizes()
	before := heap()

	const batches, perBatch = 200, 100
	for b := range batches {
		ms := []health.Member{steady}
		for i := range perBatch {
			n := b*perBatch + i
			lease := health.StatusPassing
			if n%10 == 0 {
				lease = health.StatusCritical
			}
			m := fleettest.Member("work", fmt.Sprintf("inst-%d", n), fmt.Sprintf("s-%d", n), 1, 10000+i, "1.0.0", lease, h.index+1)
			if n%7 == 0 {
				m.Err = errors.New("capacity: not an integer")
			}
			ms = append(ms, m)
		}
		h.members("work", ms...)
		settle()
		h.clock.Advance(time.Second)
	}
	h.members("work", steady) // every churned session is gone
	history, _, _, _, _ := sizes()
	if want := 1 + historyInstances; history != want { // 17,142 instances went, the 10,000 gone last are kept
		t.Fatalf("history holds %d instances right after the churn, want %d: gone sessions must still be answered for a while", history, want)
	}
	if st := h.s.View().Sessions().Check("inst-19990", "s-19990"); st.State != health.SessionLapsed {
		t.Fatalf("a lapsed session gone a moment ago answers %s, want LAPSED", st.State)
	}
	if history <= 1 {
		t.Fatalf("history holds %d instances right after the churn: gone sessions must still be answered for a while", history)
	}
	h.clock.Advance(h.s.cfg.HistoryRetention + time.Minute)
	h.members("work", steady)
	history, lastSeen, lapsed, bad, prints := sizes()
	if history > 1 || lastSeen > 1 || lapsed > 0 || bad > 0 || prints > 1 {
		t.Fatalf("after the retention: history %d, lastSeen %d, lapsed %d, bad %d, registrations %d; want the one steady executor at most", history, lastSeen, lapsed, bad, prints)
	}
	if after := heap(); after > before+4<<20 {
		t.Fatalf("heap %d KiB after the churn, %d KiB before", after>>10, before>>10)
	}
	if st := h.s.View().Sessions().Check("inst-5", "s-5"); st.State != health.SessionUnknown {
		t.Fatalf("a session gone past the retention answers %s", st.State)
	}
}
