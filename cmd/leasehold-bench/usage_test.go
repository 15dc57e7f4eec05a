package main

import (
	"os"
	"reflect"
	"testing"
	"time"
)

func TestStatCPUAndParent(t *testing.T) {
	// A command name with spaces and parentheses, as /proc allows.
	stat := "4242 (consul (x) y) S 17 4242 17 0 -1 4194560 100 0 0 0 250 130 0 0 20 0 12 0 100 0 0"
	d, err := statCPU(stat)
	if err != nil || d != 3800*time.Millisecond {
		t.Fatalf("statCPU = %s, %v; want 3.8s (250+130 ticks)", d, err)
	}
	if ppid, comm := statParent(stat); ppid != 17 || comm != "consul (x) y" {
		t.Fatalf("statParent = %d, %q", ppid, comm)
	}
	if _, err := statCPU("garbage"); err == nil {
		t.Fatal("garbage: want an error")
	}
	if procCPU(os.Getpid()) < 0 {
		t.Fatal("own CPU negative")
	}
}

func TestSamplesBy(t *testing.T) {
	text := `# HELP leasehold_consul_wakeups_total blocking queries that returned a new index
# TYPE leasehold_consul_wakeups_total counter
leasehold_consul_wakeups_total{otel_scope_name="x",watch="non-passing"} 12
leasehold_consul_wakeups_total{otel_scope_name="x",watch="task"} 3
leasehold_consul_wakeups_total{otel_scope_name="y",watch="task"} 2
leasehold_consul_wakeups_totalx{watch="task"} 99
leasehold_consul_requests_total{watch="task"} 7
leasehold_consul_wakeups_total 1
`
	got := samplesBy(text, "leasehold_consul_wakeups_total", "watch")
	want := map[string]float64{"non-passing": 12, "task": 5, "": 1}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("samplesBy = %v, want %v", got, want)
	}
}

func TestSamplesByOneLabelValue(t *testing.T) {
	text := `leasehold_consul_read_bytes_total{encoding="json",otel_scope_name="x",watch="task"} 100
leasehold_consul_read_bytes_total{encoding="wire",otel_scope_name="x",watch="task"} 10
leasehold_consul_read_bytes_total{otel_scope_name="x",encoding="json",watch="generations"} 50
leasehold_consul_read_bytes_total{otel_scope_name="x",watch="quiet",encoding="json"} 7
leasehold_consul_read_bytes_total{encoding="jsonx",watch="task"} 1000
leasehold_consul_read_bytes_total 1
`
	got := samplesBy(text, `leasehold_consul_read_bytes_total{encoding="json"`, "watch")
	want := map[string]float64{"task": 100, "generations": 50, "quiet": 7}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("samplesBy = %v, want %v", got, want)
	}
}

func TestWindow(t *testing.T) {
	at := time.Now()
	before := usage{at: at, server: time.Second, leasehold: 0, wakeups: map[string]float64{"non-passing": 10}}
	after := usage{at: at.Add(10 * time.Second), server: 6 * time.Second, leasehold: time.Second, wakeups: map[string]float64{"non-passing": 510, "task": 2}}
	w := after.since(before)
	if w.share(w.server) != 50 || w.share(w.leasehold) != 10 {
		t.Fatalf("shares %.1f%% %.1f%%, want 50%% 10%%", w.share(w.server), w.share(w.leasehold))
	}
	if w.perSecond(w.wakeups["non-passing"]) != 50 || w.wakeups["task"] != 2 {
		t.Fatalf("wakeups %v", w.wakeups)
	}
	if got := rates(w, w, map[string]float64{"a": 10}, map[string]float64{"b": 20}); got != "a 1.00 → 0.00, b 0.00 → 2.00" {
		t.Fatalf("rates = %q", got)
	}
}

// Every change of a flapping check flips its status, so each is a write to
// the catalog (and a wake of the fast path).
func TestFlapStatusAlwaysChanges(t *testing.T) {
	prev := "pass" // registered passing
	seen := map[string]bool{}
	for round := range 12 {
		s := flapStatus(round)
		if s == prev {
			t.Fatalf("round %d: %s again", round, s)
		}
		seen[s], prev = true, s
	}
	if !seen["warn"] || !seen["fail"] {
		t.Fatalf("statuses %v: want warning and critical both", seen)
	}
}
