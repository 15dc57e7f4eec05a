package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// The watch keeps each 10 s interval's maxima of the raft timers (Consul
// answers with its last complete interval only, so intervals are read
// several times and kept once), not an interval that ended before it began,
// and reports the worst, when, and how many intervals went over 100 ms;
// other samples are not its business.
func TestRaftWatchKeepsEachIntervalsWorst(t *testing.T) {
	base := time.Now().UTC().Truncate(10 * time.Second)
	ts := func(k int) string { return base.Add(time.Duration(k) * 10 * time.Second).String() }
	interval := func(ts string, commit, dispatch float64) string {
		return `{"Timestamp":"` + ts + `","Gauges":[],"Samples":[` +
			`{"Name":"consul.raft.commitTime","Count":40,"Max":` + ftoa(commit) + `},` +
			`{"Name":"consul.raft.leader.dispatchLog","Count":40,"Max":` + ftoa(dispatch) + `},` +
			`{"Name":"consul.raft.boltdb.logBatchSize","Count":40,"Max":12450},` +
			`{"Name":"consul.http.GET.v1.agent.metrics","Count":3,"Max":900}]}`
	}
	answers := []string{interval(ts(-2), 900, 900), interval(ts(0), 12.5, 10),
		interval(ts(0), 12.5, 10), interval(ts(1), 480.2, 470.9), interval(ts(2), 30, 25)}
	served := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/agent/metrics" {
			http.NotFound(w, r)
			return
		}
		w.Write([]byte(answers[min(served, len(answers)-1)]))
		served++
	}))
	defer srv.Close()
	w := startRaftWatch(context.Background(), strings.TrimPrefix(srv.URL, "http://"),
		time.Millisecond)
	deadline := time.After(10 * time.Second)
	for {
		w.mu.Lock()
		n := len(w.intervals)
		w.mu.Unlock()
		if n == 3 {
			break
		}
		select {
		case <-deadline:
			t.Fatalf("read %d intervals, want 3", n)
		case <-time.After(time.Millisecond):
		}
	}
	got := w.end()
	at := base.Add(10 * time.Second).Local().Format("15:04:05")
	for _, want := range []string{"3 intervals", "raft.commitTime max 480.2 ms in " + at + "–",
		"(over 100 ms in 1 of 3", "raft.leader.dispatchLog max 470.9 ms"} {
		if !strings.Contains(got, want) {
			t.Errorf("%q lacks %q", got, want)
		}
	}
	if strings.Contains(got, "metrics") || strings.Contains(got, "logBatchSize") {
		t.Errorf("%q reports a timer it does not follow", got)
	}
	var none *raftWatch
	if none.end() != "" {
		t.Error("no watch: want nothing said")
	}
}

func ftoa(f float64) string { return strconv.FormatFloat(f, 'f', -1, 64) }

// A snapshot is asked of the server's /v1/snapshot, and a refusal is an
// error (the phase does not go on as if it had been taken).
func TestTakeSnapshotAsksTheServer(t *testing.T) {
	asked := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/snapshot" || r.Method != http.MethodGet {
			http.Error(w, "no", http.StatusForbidden)
			return
		}
		asked++
		w.Write(make([]byte, 4096))
	}))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	if _, size, err := takeSnapshot(context.Background(), addr); err != nil || size != 4096 || asked != 1 {
		t.Fatalf("snapshot: %d bytes, %v, asked %d times; want 4096, nil, once", size, err, asked)
	}
	srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "Permission denied", http.StatusForbidden)
	})
	if _, _, err := takeSnapshot(context.Background(), addr); err == nil {
		t.Fatal("a refused snapshot was taken as taken")
	}
}

// fakeInmemSink answers /v1/agent/metrics as Consul's armon/go-metrics
// InmemSink does (DisplayMetrics): intervals start at time.Now().Truncate(10 s)
// on the wall clock, and the answer is the last complete one (data[n-2]),
// its Timestamp interval.Round(time.Second).UTC().String().
type fakeInmemSink struct {
	mu        sync.Mutex
	intervals map[time.Time]map[string]float64 // by start: each timer's max
}

func (s *fakeInmemSink) record(name string, ms float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	start := time.Now().Truncate(metricsInterval)
	if s.intervals == nil {
		s.intervals = map[time.Time]map[string]float64{}
	}
	if s.intervals[start] == nil {
		s.intervals[start] = map[string]float64{}
	}
	s.intervals[start][name] = max(s.intervals[start][name], ms)
}

func (s *fakeInmemSink) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/v1/agent/metrics" {
		http.NotFound(w, r)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	last := time.Now().Truncate(metricsInterval).Add(-metricsInterval)
	var samples []string
	for name, ms := range s.intervals[last] {
		samples = append(samples, `{"Name":"`+name+`","Count":1,"Max":`+ftoa(ms)+`}`)
	}
	w.Write([]byte(`{"Timestamp":"` + last.Round(time.Second).UTC().String() +
		`","Gauges":[],"Samples":[` + strings.Join(samples, ",") + `]}`))
}

// The interval a window ends in is answered only once it is complete: the
// watch waits for it rather than report a window whose slow commit fell in
// its last seconds as having none (a review's finding).
func TestRaftWatchReadsTheIntervalItsWindowEndsIn(t *testing.T) {
	if time.Until(time.Now().Truncate(metricsInterval).Add(metricsInterval)) < time.Second {
		time.Sleep(time.Second) // the window below stays inside one interval
	}
	sink := &fakeInmemSink{}
	srv := httptest.NewServer(sink)
	defer srv.Close()
	w := startRaftWatch(context.Background(), strings.TrimPrefix(srv.URL, "http://"),
		50*time.Millisecond)
	time.Sleep(200 * time.Millisecond)           // the watch reads Consul's answers meanwhile
	sink.record("consul.raft.commitTime", 480.2) // a lapse's commit waited for the disk
	time.Sleep(200 * time.Millisecond)
	got := w.end()
	if !strings.Contains(got, "raft.commitTime max 480.2 ms") {
		t.Fatalf("the watch of a window with a 480.2 ms commit says %q", got)
	}
}
