package main

import (
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// What the parts of a run use over a stretch of it: CPU of the Consul agents
// and of `leasehold serve`, and leasehold's Consul queries by watch.

// procCPU is process pid's user+system CPU time so far (0 if it is gone).
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	d, _ := statCPU(string(b))
	return d
}

// statCPU parses utime and stime out of a /proc/<pid>/stat line.
func statCPU(stat string) (time.Duration, error) {
	i := strings.LastIndexByte(stat, ')')
	if i < 0 || i+2 > len(stat) {
		return 0, fmt.Errorf("stat %q: no command name", stat)
	}
	f := strings.Fields(stat[i+2:])
	if len(f) < 13 {
		return 0, fmt.Errorf("stat %q: too few fields", stat)
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64) // fields 14 and 15 of stat, after pid and comm
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("stat %q: bad utime or stime", stat)
	}
	return time.Duration(utime+stime) * time.Second / 100, nil // USER_HZ
}

// statParent is the parent pid and command name of a /proc/<pid>/stat line.
func statParent(stat string) (ppid int, comm string) {
	i, j := strings.IndexByte(stat, '('), strings.LastIndexByte(stat, ')')
	if i < 0 || j < i || j+2 > len(stat) {
		return 0, ""
	}
	f := strings.Fields(stat[j+2:])
	if len(f) < 2 {
		return 0, ""
	}
	ppid, _ = strconv.Atoi(f[1])
	return ppid, stat[i+1 : j]
}

// consulPIDs are the Consul agent processes this harness started: the
// server and the client agents.
type consulPIDs struct {
	server  int
	clients []int
}

// findConsulPIDs finds them among this process's children (consultest
// starts each agent as a direct child); server is the server's pid.
func findConsulPIDs(server int) consulPIDs {
	var p consulPIDs
	self := os.Getpid()
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, path := range stats {
		b, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		ppid, comm := statParent(string(b))
		if ppid != self || comm != "consul" {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(path)))
		if pid == server {
			p.server = pid
		} else {
			p.clients = append(p.clients, pid)
		}
	}
	slices.Sort(p.clients)
	return p
}

// metricBy reads a counter family from leasehold's /metrics, summed by the
// value of one label (e.g. leasehold_consul_wakeups_total by watch).
func (s *served) metricBy(name, label string) (map[string]float64, error) {
	resp, err := http.Get("http://" + s.admin + "/metrics")
	if err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	return samplesBy(string(b), name, label), nil
}

// samplesBy sums the samples of metric name in Prometheus text by the value
// of label ("" for samples without it). name may hold one label matcher,
// name{label="value"}, to sum only the samples that have it.
func samplesBy(text, name, label string) map[string]float64 {
	out := map[string]float64{}
	name, matcher, filtered := strings.Cut(name, "{")
	for _, line := range strings.Split(text, "\n") {
		rest, ok := strings.CutPrefix(line, name)
		if !ok || rest == "" || (rest[0] != '{' && rest[0] != ' ') {
			continue
		}
		if filtered && (rest[0] != '{' || !hasLabel(rest, matcher)) {
			continue
		}
		f := strings.Fields(rest)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			continue
		}
		key := ""
		if _, after, found := strings.Cut(rest, label+`="`); found && rest[0] == '{' {
			key, _, _ = strings.Cut(after, `"`)
		}
		out[key] += v
	}
	return out
}

// hasLabel reports whether the label set that opens rest ({a="x",b="y"} …)
// holds matcher (b="y").
func hasLabel(rest, matcher string) bool {
	set, _, _ := strings.Cut(rest[1:], "}")
	return strings.HasPrefix(set, matcher) && (len(set) == len(matcher) || set[len(matcher)] == ',') ||
		strings.Contains(set, ","+matcher+",") || strings.HasSuffix(set, ","+matcher)
}

// usage is a reading of the counters a window compares.
type usage struct {
	at                         time.Time
	server, clients, leasehold time.Duration // CPU so far
	harness                    time.Duration // this process's (its light streams, probe, executors)
	wakeups, requests          map[string]float64
	readJSON                   map[string]float64 // bytes of JSON read, by watch
	probeWakes, probeBytes     int64
	probeAnswers               int64
}

// window is what was used between two readings.
type window struct {
	d                          time.Duration
	server, clients, leasehold time.Duration // CPU
	harness                    time.Duration
	wakeups, requests          map[string]float64
	readJSON                   map[string]float64
	probeWakes, probeBytes     int64
	probeAnswers               int64
	fastPathBytes              int           // one fast-path answer at the window's end
	fastPathTime               time.Duration // median time of a fast-path read at the window's end
}

// String says what leasehold asked of Consul over the window, by watch, and
// the CPU each side spent: what was going on while a phase ran.
func (w window) String() string {
	watches := slices.Sorted(maps.Keys(w.requests))
	var b strings.Builder
	fmt.Fprintf(&b, "over %s leasehold made", r(w.d))
	for _, k := range watches {
		if n := w.requests[k]; n > 0 {
			fmt.Fprintf(&b, " %s %.0f,", k, n)
		}
	}
	fmt.Fprintf(&b, " requests (JSON read:")
	for _, k := range slices.Sorted(maps.Keys(w.readJSON)) {
		if n := w.readJSON[k]; n > 0 {
			fmt.Fprintf(&b, " %s %.1f KB,", k, n/1e3)
		}
	}
	fmt.Fprintf(&b, "); CPU: leasehold %.0f%%, Consul's server %.0f%%, its clients %.0f%% "+
		"of a core, the harness %.0f%%", w.share(w.leasehold), w.share(w.server), w.share(w.clients),
		w.share(w.harness))
	return b.String()
}

// usage reads every counter now.
func (b *bench) usage() usage {
	u := b.consulCPU()
	u.leasehold = b.srv.cpu()
	u.harness = procCPU(os.Getpid())
	u.wakeups, _ = b.srv.metricBy("leasehold_consul_wakeups_total", "watch")
	u.requests, _ = b.srv.metricBy("leasehold_consul_requests_total", "watch")
	u.readJSON, _ = b.srv.metricBy(`leasehold_consul_read_bytes_total{encoding="json"`, "watch")
	if b.probe != nil {
		u.probeWakes, u.probeBytes, u.probeAnswers = b.probe.wakes.Load(),
			b.probe.bytes.Load(), b.probe.answers.Load()
	}
	return u
}

// closeWindow is the window from before until now; with --flapping it also
// times reads of the fast-path query at its end.
func (b *bench) closeWindow(before usage) window {
	w := b.usage().since(before)
	if *flapping > 0 {
		w.fastPathBytes, w.fastPathTime = b.fastPathRead()
	}
	return w
}

// since is the window from an earlier reading to this one.
func (u usage) since(prev usage) window {
	w := window{d: u.at.Sub(prev.at), server: u.server - prev.server,
		clients: u.clients - prev.clients, leasehold: u.leasehold - prev.leasehold,
		harness: u.harness - prev.harness,
		wakeups: map[string]float64{}, requests: map[string]float64{}, readJSON: map[string]float64{},
		probeWakes: u.probeWakes - prev.probeWakes, probeBytes: u.probeBytes - prev.probeBytes,
		probeAnswers: u.probeAnswers - prev.probeAnswers}
	for k, v := range u.wakeups {
		w.wakeups[k] = v - prev.wakeups[k]
	}
	for k, v := range u.requests {
		w.requests[k] = v - prev.requests[k]
	}
	for k, v := range u.readJSON {
		w.readJSON[k] = v - prev.readJSON[k]
	}
	return w
}

// share is cpu as a percentage of one core over the window.
func (w window) share(cpu time.Duration) float64 {
	return 100 * float64(cpu) / float64(max(w.d, 1))
}

// perSecond is n over the window.
func (w window) perSecond(n float64) float64 { return n / max(w.d.Seconds(), 1e-9) }

// loadAverage is the machine's 1-minute load average ("?" if unknown): the
// box is shared, and other work changes every figure.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return "?"
	}
	return f[0]
}
