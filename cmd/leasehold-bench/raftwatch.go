package main

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"
)

// raftWatch follows the Consul server's own timers of writing and committing
// its log while the lapses run, to tell a lapse Consul reported late because
// its server's raft was slow (a lease's critical status is a catalog write,
// committed through raft before any query sees it; on this box raft's log is
// fsynced to a virtual disk) from one late for other reasons. Consul's
// /v1/agent/metrics answers with its last complete 10 s interval only, so
// the watch reads it every few seconds and keeps each interval's maxima.
type raftWatch struct {
	stop  context.CancelFunc
	done  chan struct{}
	since time.Time // the watch's start: intervals that ended before it are not kept
	mu    sync.Mutex
	// newest is the start of the newest interval read.
	newest time.Time
	// intervals by their start: each timer's max and count in it.
	intervals map[time.Time]map[string]timerMax
}

// metricsInterval is how long Consul's metrics intervals are.
const metricsInterval = 10 * time.Second

// followed says which server timers (milliseconds) the watch keeps: raft's
// commit, its leader's write of the log, the log store's write, the state's
// apply, its snapshots and log compaction (a server that took 10,000
// registrations snapshots its state, 16,384 log entries apart by default),
// the state's persisting for a snapshot, and the catalog register RPC a
// check's change arrives by (which waits for the commit). Samples of sizes
// and rates (the log store's batch sizes, its write capacity) and bolt's
// transaction statistics are not timers of one write.
func followed(name string) bool {
	switch name {
	case "consul.raft.commitTime", "consul.raft.leader.dispatchLog",
		"consul.raft.boltdb.storeLogs", "consul.raft.fsm.apply", "consul.raft.compactLogs",
		"consul.fsm.persist", "consul.catalog.register":
		return true
	}
	return strings.HasPrefix(name, "consul.raft.snapshot.")
}

// reported is how many timers end names: those with the worst maxima.
const reported = 4

type timerMax struct {
	Max   float64 // ms
	Count int
}

// agentMetrics is what the watch reads of a /v1/agent/metrics answer.
type agentMetrics struct {
	Timestamp string
	Samples   []struct {
		Name  string
		Count int
		Max   float64
	}
}

// startRaftWatch starts reading the server's metrics at addr every period.
func startRaftWatch(ctx context.Context, addr string, period time.Duration) *raftWatch {
	ctx, cancel := context.WithCancel(ctx)
	w := &raftWatch{stop: cancel, done: make(chan struct{}), since: time.Now(),
		intervals: map[time.Time]map[string]timerMax{}}
	go func() {
		defer close(w.done)
		t := time.NewTicker(period)
		defer t.Stop()
		for {
			if body, _, err := get(ctx, "http://"+addr+"/v1/agent/metrics"); err == nil {
				w.read(body)
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return w
}

// waitFor waits until the interval starting at last has been read, the
// watch's context ends, or a minute passes.
func (w *raftWatch) waitFor(last time.Time) {
	giveUp := time.After(time.Minute)
	for {
		w.mu.Lock()
		read := !w.newest.Before(last)
		w.mu.Unlock()
		if read {
			return
		}
		select {
		case <-w.done:
			return
		case <-giveUp:
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// read keeps an answer's maxima of the timers followed.
func (w *raftWatch) read(body []byte) {
	var m agentMetrics
	if json.Unmarshal(body, &m) != nil || m.Timestamp == "" {
		return
	}
	// Consul writes the interval's start as Go's time.String without the
	// monotonic reading.
	start, err := time.Parse("2006-01-02 15:04:05 -0700 MST", m.Timestamp)
	if err != nil || !start.Add(metricsInterval).After(w.since) {
		return // not an interval of the watch's
	}
	got := map[string]timerMax{}
	for _, s := range m.Samples {
		if followed(s.Name) {
			got[s.Name] = timerMax{Max: s.Max, Count: s.Count}
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.intervals[start] = got
	if start.After(w.newest) {
		w.newest = start
	}
}

// end waits until the watch has read the interval the window ends in
// (Consul answers with its last complete interval, so up to 10 s and a
// period after the end; a minute at most), stops it, and says, for the
// timers with the worst maxima over the intervals read, that max and how
// many of the intervals had one over 100 ms.
func (w *raftWatch) end() string {
	if w == nil {
		return ""
	}
	w.waitFor(time.Now().Truncate(metricsInterval))
	w.stop()
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.intervals) == 0 {
		return "no metrics read"
	}
	type timer struct {
		name       string
		worst      float64
		at         time.Time // the start of the interval of its worst
		slow, seen int
	}
	byName := map[string]*timer{}
	for start, iv := range w.intervals {
		for name, t := range iv {
			tm := byName[name]
			if tm == nil {
				tm = &timer{name: name}
				byName[name] = tm
			}
			tm.seen++
			if t.Max > tm.worst || (t.Max == tm.worst && start.Before(tm.at)) {
				tm.worst, tm.at = t.Max, start
			}
			if t.Max > 100 {
				tm.slow++
			}
		}
	}
	timers := slices.SortedFunc(maps.Values(byName), func(a, b *timer) int {
		if a.worst != b.worst {
			return cmp.Compare(b.worst, a.worst)
		}
		return strings.Compare(a.name, b.name)
	})
	var parts []string
	for _, t := range timers[:min(reported, len(timers))] {
		parts = append(parts, fmt.Sprintf("%s max %.1f ms in %s–%s (over 100 ms in %d of %d intervals)",
			strings.TrimPrefix(t.name, "consul."), t.worst, t.at.Local().Format("15:04:05"),
			t.at.Add(metricsInterval).Local().Format("15:04:05"), t.slow, t.seen))
	}
	if len(parts) == 0 {
		parts = append(parts, "no raft timer")
	}
	return fmt.Sprintf("%d intervals of 10 s; the worst timers: %s", len(w.intervals),
		strings.Join(parts, "; "))
}

// snapshotRaft has the Consul server take a raft snapshot now (a GET of
// /v1/snapshot, whose body is discarded), with --consul-snapshot, before a
// phase's lapses. Registering the fleet writes a raft log entry per
// registration and check, and Consul snapshots its state once 16,384 entries
// have been written (checked every 30 to 60 s): at 10,000 executors that
// snapshot came due right after the registering, took ~400 ms of the box
// (raft.snapshot.takeSnapshot, fsm.persist) and, when it fell among the
// lapses, held two or three of them 300–500 ms (BENCHMARKS.md, "The
// instrument's own load"). Taken here, the next one is 16,384 writes away:
// the lapses meet the server as it runs, not its digestion of the fleet's
// registering. Without the flag Consul's own timing stands.
func (b *bench) snapshotRaft() error {
	if !*consulSnapshot {
		return nil
	}
	took, size, err := takeSnapshot(b.ctx, b.agent.HTTPAddr())
	if err != nil {
		return fmt.Errorf("--consul-snapshot: %w", err)
	}
	logf("Consul's server took a raft snapshot before the lapses (%s, %d KB)", r(took), size/1024)
	// The raft watch keeps every metrics interval its window overlaps: the
	// lapses start in a later interval than the snapshot's, whatever
	// --settle, so the snapshot is not reported as among them.
	time.Sleep(time.Until(time.Now().Truncate(metricsInterval).Add(metricsInterval)))
	return nil
}

// takeSnapshot has the Consul server at addr take a snapshot, and says how
// long that took and how large it was.
func takeSnapshot(ctx context.Context, addr string) (time.Duration, int, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	body, _, err := get(ctx, "http://"+addr+"/v1/snapshot")
	if err != nil {
		return 0, 0, err
	}
	return time.Since(start), len(body), nil
}
