package main

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// ms is n milliseconds each.
func ms(n ...int) []time.Duration {
	out := make([]time.Duration, len(n))
	for i, v := range n {
		out[i] = time.Duration(v) * time.Millisecond
	}
	return out
}

// A run's samples are written as they were measured and read back whole;
// pooled, each series is one distribution over every run's samples, and
// leasehold's part ÷ its floor is read among them all, beside each run's
// own ratio.
func TestPooledRunsAreReadAmongAllTheirSamples(t *testing.T) {
	dir := t.TempDir()
	res := results{executors: 1000, dispatchers: 1000, tasks: 10, lease: 10 * time.Second,
		heartbeat: 3 * time.Second, lapse: ms(10, 20), afterConsul: ms(5, 40),
		consulPart: ms(5, 3), floor: ms(4, 4, 20), floorTask: ms(3), fanout: ms(9)}
	a, b := filepath.Join(dir, "a.json"), filepath.Join(dir, "b.json")
	if err := writeSamples(a, res); err != nil {
		t.Fatal(err)
	}
	res.lapse, res.afterConsul, res.floor = ms(11, 12), ms(6, 7), ms(5, 30, 6)
	if err := writeSamples(b, res); err != nil {
		t.Fatal(err)
	}
	runs, err := readSamples([]string{a, b})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(runs[1], samplesOf(res)) {
		t.Fatalf("read back %+v, want %+v", runs[1], samplesOf(res))
	}
	out := pooled(runs)
	for _, want := range []string{
		"2 runs of ",
		"| of which leasehold on the harness's clock (probe → last stream) | 4 | min 5ms, p50 7ms, " +
			"p99 40ms, max 40ms |",
		"| floor: push → last stream, leasehold's layout | 6 | min 4ms, p50 6ms, p99 30ms, max 30ms |",
		"leasehold's part ÷ floor, pooled: p50 1.2×, p99 1.3×",
		"each run's own: run 1: p50 10.0×, p99 2.0×; run 2: p50 1.2×, p99 0.2×",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("the pooled report lacks %q:\n%s", want, out)
		}
	}
}

// Files that cannot be pooled are refused, naming the file: none named, one
// missing, one not JSON, one without the harness's probe (no part on its
// clock), and runs of two invocations.
func TestSamplesThatCannotBePooledAreRefused(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, res results) string {
		p := filepath.Join(dir, name)
		if err := writeSamples(p, res); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := results{executors: 1000, dispatchers: 100, afterConsul: ms(5), floor: ms(4),
		lapse: ms(9)}
	a := write("a.json", good)
	noProbe := good
	noProbe.afterConsul = nil
	other := good
	other.executors = 500
	notJSON := filepath.Join(dir, "x.json")
	if err := os.WriteFile(notJSON, []byte("{"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		paths []string
		want  string
	}{
		{nil, "name the samples files"},
		{[]string{a, filepath.Join(dir, "missing.json")}, "missing.json"},
		{[]string{a, notJSON}, "x.json"},
		{[]string{a, write("np.json", noProbe)}, "np.json: no lapses measured"},
		{[]string{a, write("o.json", other)}, "o.json is a run of"},
	} {
		if _, err := readSamples(c.paths); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want an error naming %q", c.paths, err, c.want)
		}
	}
}
