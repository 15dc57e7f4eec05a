package main

import (
	"errors"
	"flag"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/http/pprof"
	"runtime"
	"strings"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"

	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// The wire scan must agree with a full unmarshal.
func TestHealthyHosts(t *testing.T) {
	var es []health.Executor
	for i, state := range []health.State{health.StateActive, health.StateDraining, health.StateActive} {
		es = append(es, health.Executor{
			Registration: health.Registration{InstanceID: []string{"a", "b", "c"}[i], SessionID: "s", Generation: 1, Task: "work", Address: "127.0.0.1", Port: 9000 + i, Version: "1.0.0", Capacity: 2, State: state},
			LeaseStatus:  health.StatusPassing, LeaseFound: true, NodeChecks: health.StatusPassing,
		})
	}
	cla := translator.Endpoints("work", es, health.Dispatcher{})
	b, err := proto.Marshal(cla)
	if err != nil {
		t.Fatal(err)
	}
	set := map[string]bool{}
	healthyHosts(b, set)
	if len(set) != 2 || !set["a"] || !set["c"] || set["b"] {
		t.Fatalf("scan = %v, want a and c (b is draining)", set)
	}
}

// A stream's endpoint set follows each response by the resources it
// carries: always the union of every resource's endpoints, and an endpoint
// is stamped gone when the last resource holding it drops it, and the set is
// stamped moved when, and only when, it changed apart from the endpoints
// whose moves are ignored (what converge reports).
func TestStreamSetIsTheUnionOfItsResources(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	ds := newDispatcherSet(1, []string{"work"})
	ds.ignoreMoves([]string{"h7"}) // a canary's: its coming and going is no move
	names := []string{"s0", "s1", "s2"}
	stamped := map[string]bool{} // a departure is stamped the first time only
	for step := range 500 {
		at := time.Unix(int64(step), 0)
		updates := map[string]map[string]bool{}
		var removed []string
		for _, n := range names {
			switch r.IntN(4) {
			case 0:
				hosts := map[string]bool{}
				for range r.IntN(5) {
					hosts[fmt.Sprint("h", r.IntN(8))] = true // hosts may sit in two resources
				}
				updates[n] = hosts
			case 1:
				if r.IntN(3) == 0 {
					removed = append(removed, n)
				}
			}
		}
		before, movedBefore := maps.Clone(ds.sets[0]), ds.moved[0]
		ds.apply(0, at, updates, removed, &discovery.DiscoveryResponse{})
		union := map[string]bool{}
		for _, hosts := range ds.byRes[0] {
			maps.Copy(union, hosts)
		}
		if !maps.Equal(ds.sets[0], union) {
			t.Fatalf("step %d: set %v, the union of the resources %v", step, ds.sets[0], union)
		}
		still := equalApart(before, union, ds.ignore)
		if want := map[bool]time.Time{true: movedBefore, false: at}[still]; ds.moved[0] != want || ds.lastMoved() != want {
			t.Fatalf("step %d: set %v → %v stamped moved at %v, want %v", step, before, union,
				ds.moved[0], want)
		}
		for h := range before {
			if !union[h] && !stamped[h] {
				if ds.gone[0][h] != at {
					t.Fatalf("step %d: %s left at %v, stamped %v", step, h, at, ds.gone[0][h])
				}
				stamped[h] = true
			}
		}
	}
}

// A bench's cleanups run newest first, once: an interrupt closing every
// running bench while the bench closes itself stops nothing twice, and a
// closed bench is no longer among those an interrupt closes.
func TestABenchClosesOnceNewestFirst(t *testing.T) {
	b := &bench{}
	var order []int
	for i := range 3 {
		b.onClose(func() { order = append(order, i) })
	}
	cleanupMu.Lock()
	_, listed := running[b]
	cleanupMu.Unlock()
	if !listed {
		t.Fatal("a bench with cleanups is not among those an interrupt closes")
	}
	b.close()
	b.close()
	if len(order) != 3 || order[0] != 2 || order[2] != 0 {
		t.Fatalf("cleanups ran %v, want [2 1 0] once", order)
	}
	cleanupMu.Lock()
	_, listed = running[b]
	cleanupMu.Unlock()
	if listed {
		t.Fatal("a closed bench is still among those an interrupt closes")
	}
}

// A close racing one in progress (the run failing while an interrupt stops
// its agents) returns only once everything is stopped: the harness then
// exits with nothing left running.
func TestASecondCloseWaitsForTheFirst(t *testing.T) {
	b := &bench{}
	stopping, release := make(chan struct{}), make(chan struct{})
	stopped := false
	b.onClose(func() { stopped = true })
	b.onClose(func() { close(stopping); <-release }) // newest: runs first
	go b.close()
	<-stopping
	second := make(chan struct{})
	go func() { b.close(); close(second) }()
	select {
	case <-second:
		t.Fatal("a second close returned while the first was still stopping")
	case <-time.After(50 * time.Millisecond): // absence check only
	}
	close(release)
	select {
	case <-second:
	case <-time.After(5 * time.Second):
		t.Fatal("the second close never returned")
	}
	if !stopped {
		t.Fatal("the second close returned before every cleanup ran")
	}
}

// What serve allocated is read from a real heap profile's statistics, the
// form net/http/pprof writes; a failed read says so instead of counting 0.
func TestAllocationsAreReadFromTheHeapProfile(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(pprof.Index))
	defer srv.Close()
	s := &served{admin: strings.TrimPrefix(srv.URL, "http://")}
	runtime.GC()
	total, gcs, err := s.allocs()
	if err != nil {
		t.Fatal(err)
	}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	if total <= 0 || uint64(total) > ms.TotalAlloc || gcs < 1 || uint32(gcs) > ms.NumGC {
		t.Fatalf("TotalAlloc %d, NumGC %d: want > 0 and at most the runtime's %d, %d since",
			total, gcs, ms.TotalAlloc, ms.NumGC)
	}
	parseAllocs := func(text string) (int64, int64, error) {
		stats, err := parseHeapStats(strings.NewReader(text))
		if err != nil {
			return 0, 0, err
		}
		return allocsOf(stats)
	}
	if _, _, err := parseAllocs("heap profile: 0: 0 [0: 0] @ heap/1\n"); err == nil {
		t.Fatal("a profile without its statistics: want an error")
	}
	if _, _, err := parseAllocs("# TotalAlloc = x\n# NumGC = 1\n"); err == nil ||
		!strings.Contains(err.Error(), "TotalAlloc") {
		t.Fatalf("a bad TotalAlloc: %v, want an error naming it", err)
	}
	if total, gcs, err := parseAllocs("# TotalAlloc = 7\n# Sys = 3 / 4\n# NumGC = 2\n"); err != nil ||
		total != 7 || gcs != 2 {
		t.Fatalf("TotalAlloc 7, NumGC 2 read as %d, %d, %v", total, gcs, err)
	}
	gone := &served{admin: s.admin}
	srv.Close()
	if _, _, err := gone.allocs(); err == nil {
		t.Fatal("serve gone: want an error")
	}
	res := results{allocErr: errors.New("refused")}
	if got := res.lapseAllocs(); !strings.Contains(got, "unknown") {
		t.Fatalf("lapseAllocs with an error = %q, want unknown", got)
	}
}

// A run is labelled make bench's only when its flags are the ones make bench
// passes (--delta among them); any other size, path or client kind is the
// harness's own run.
func TestARunIsLabelledMakeBenchOnlyWithItsFlags(t *testing.T) {
	res := results{executors: 500, dispatchers: 100, grpcN: 3, tasks: 1,
		lapse: make([]time.Duration, 50), fanout: make([]time.Duration, 10),
		lease: 10 * time.Second, heartbeat: 3 * time.Second}
	set := func(name, v string) (restore func()) {
		was := flag.Lookup(name).Value.String()
		if err := flag.Set(name, v); err != nil {
			t.Fatal(err)
		}
		return func() { flag.Set(name, was) }
	}
	defer set("delta", "true")()
	if got := res.invocation(); !strings.HasPrefix(got, "`make bench` → ") ||
		!strings.HasSuffix(got, " --delta`") {
		t.Fatalf("make bench's flags: %s", got)
	}
	for _, f := range [][2]string{{"executors", "1000"}, {"dispatchers", "1000"},
		{"grpc-clients", "0"}, {"lapses", "20"}, {"lease", "6s"}, {"consul-xds", "false"},
		{"delta", "false"}} {
		restore := set(f[0], f[1])
		if got := res.invocation(); strings.HasPrefix(got, "`make bench`") {
			t.Errorf("--%s %s labelled as make bench's: %s", f[0], f[1], got)
		}
		restore()
	}
}
