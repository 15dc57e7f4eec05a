package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
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
