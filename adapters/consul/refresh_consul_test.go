package consul

import (
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/server"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// meteredConsul is a reverse proxy in front of a Consul agent that counts
// the answers leasehold reads: requests, bytes on the wire (gzip, as the
// client asks) and bytes of JSON, by kind of read, fresh (no index: a
// refresh, or a watch's first read) or blocking.
type meteredConsul struct {
	srv *httptest.Server
	mu  sync.Mutex
	n   map[string]*readCount
}

type readCount struct{ reqs, wire, json int64 }

func meterConsul(tb testing.TB, a *consultest.Agent) *meteredConsul {
	tb.Helper()
	u, _ := url.Parse("http://" + a.HTTPAddr())
	rp := httputil.NewSingleHostReverseProxy(u)
	// A blocking query its client ended (a refresh's, a shutdown's).
	rp.ErrorLog = log.New(io.Discard, "", 0)
	m := &meteredConsul{n: map[string]*readCount{}}
	rp.ModifyResponse = func(resp *http.Response) error {
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return err
		}
		resp.Body = io.NopCloser(bytes.NewReader(body))
		decoded := int64(len(body))
		if strings.EqualFold(resp.Header.Get("Content-Encoding"), "gzip") {
			if zr, err := gzip.NewReader(bytes.NewReader(body)); err == nil {
				n, _ := io.Copy(io.Discard, zr)
				decoded = n
			}
		}
		m.add(resp.Request, int64(len(body)), decoded)
		return nil
	}
	m.srv = httptest.NewServer(rp)
	tb.Cleanup(m.srv.Close)
	return m
}

// readKind names a read by what it lists.
func readKind(r *http.Request) string {
	p := r.URL.Path
	switch {
	case p == "/v1/health/state/critical":
		return "critical"
	case p == "/v1/health/state/warning":
		return "warning"
	case p == "/v1/health/state/any":
		return "serf"
	case p == "/v1/kv/"+health.GenerationKeyPrefix+".kv-index":
		return "kvindex" // the index of the latest KV write (refresh.go)
	case strings.HasPrefix(p, "/v1/kv/"+health.GenerationKeyPrefix):
		return "generations"
	case strings.HasPrefix(p, "/v1/kv/"+health.LapseMarkPrefix):
		return "lapses"
	default:
		return "other"
	}
}

func (m *meteredConsul) add(r *http.Request, wire, decoded int64) {
	k := readKind(r)
	if idx := r.URL.Query().Get("index"); idx == "" || idx == "0" {
		k += " fresh"
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	c := m.n[k]
	if c == nil {
		c = &readCount{}
		m.n[k] = c
	}
	c.reqs++
	c.wire += wire
	c.json += decoded
}

func (m *meteredConsul) snapshot() map[string]readCount {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[string]readCount{}
	for k, c := range m.n {
		out[k] = *c
	}
	return out
}

// busyFleet is one replica (Watcher, Syncer, Fencing wired as serve wires
// them) over a real agent through meteredConsul, watching a fleet of
// executors whose one lease check flips between passing and warning (full,
// free again) every 50 ms.
type busyFleet struct {
	metered   *meteredConsul
	fencing   *server.Fencing
	asked     atomic.Int64 // Refresh calls the fencing API made
	refreshes atomic.Int64 // Refreshed markers the watcher sent: one per round
}

const (
	busyExecutors = 200
	busyNodes     = 20
	busyMarks     = 100 // lapse marks of sessions gone before
	busyFlip      = 50 * time.Millisecond
	busyCallEvery = 2500 * time.Microsecond // 400 calls/s in all: 20 per flip
)

func startBusyFleet(b *testing.B) *busyFleet {
	b.Helper()
	a := consultest.Start(b)
	c := a.Client()
	register := func(i int, status string) error {
		inst := fmt.Sprintf("e%d", i)
		node := fmt.Sprintf("node-%02d", i%busyNodes)
		reg := health.Registration{InstanceID: inst, SessionID: "s1", Generation: 1, Task: "work",
			Address: "127.0.0.1", Port: 9000 + i, Version: "1.0.0", Capacity: 4,
			State: health.StateActive}
		_, err := c.Catalog().
			Register(&api.CatalogRegistration{Node: node, Address: "127.0.0.1",
				SkipNodeUpdate: true,
				Service: &api.AgentService{
					ID:      health.ServiceID(inst, "work"),
					Service: "work",
					Tags:    []string{"leasehold"},
					Address: "127.0.0.1",
					Port:    9000 + i,
					Meta:    reg.Meta(),
				},
				Check: &api.AgentCheck{
					Node:      node,
					CheckID:   health.CheckID(inst, "s1", "work"),
					Name:      "lease",
					ServiceID: health.ServiceID(inst, "work"),
					Status:    status,
					Output:    "load=1",
				},
			}, nil)
		return err
	}
	for i := range busyExecutors {
		if err := register(i, api.HealthPassing); err != nil {
			b.Fatal(err)
		}
		_, err := c.KV().Put(&api.KVPair{Key: health.GenerationKey(fmt.Sprintf("e%d", i)),
			Value: []byte("1")}, nil)
		if err != nil {
			b.Fatal(err)
		}
	}
	for i := range busyMarks {
		m := health.LapseMark{
			InstanceID: fmt.Sprintf("e%d", i),
			SessionID:  "s0",
			Generation: 1,
			At:         time.Now().UTC().Truncate(time.Second),
			Tasks:      []string{"work"},
		}
		_, err := c.KV().Put(&api.KVPair{Key: health.LapseMarkKey(m.InstanceID, m.SessionID),
			Value: m.Value()}, nil)
		if err != nil {
			b.Fatal(err)
		}
	}

	f := &busyFleet{metered: meterConsul(b, a)}
	client, err := NewClient(f.metered.srv.URL, Connections(32, 1))
	if err != nil {
		b.Fatal(err)
	}
	discard := slog.New(slog.NewTextHandler(io.Discard, nil))
	obs, tee := make(chan health.Observation, 64), make(chan health.Observation, 64)
	w := NewWatcher(client, WatchConfig{Logger: discard, Out: obs})
	syncer := fleet.NewSyncer(fleet.SyncConfig{Logger: discard, AwaitLapses: true})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(4)
	go func() { defer wg.Done(); w.Run(ctx) }()
	go func() {
		defer wg.Done()
		for {
			select {
			case o := <-obs:
				if o.Refreshed() != nil {
					f.refreshes.Add(1)
				}
				select {
				case tee <- o:
				case <-ctx.Done():
					return
				}
			case <-ctx.Done():
				return
			}
		}
	}()
	go func() { defer wg.Done(); syncer.Run(ctx, tee) }()
	go func() { // the busy part: e1 full, free again, every 50 ms
		defer wg.Done()
		t := time.NewTicker(busyFlip)
		defer t.Stop()
		for i := 0; ; i++ {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				// A failure: one flip fewer.
				register(1, []string{api.HealthWarning, api.HealthPassing}[i%2])
			}
		}
	}()
	b.Cleanup(func() { cancel(); wg.Wait() })
	f.fencing = server.NewFencing(
		syncer,
		func(string) time.Time { return w.FreshAsOf() },
		server.FencingOptions{
			Refresh: func(ctx context.Context, _ string, least uint64) (uint64, error) {
				f.asked.Add(1)
				return w.Refresh(ctx, least)
			},
		},
	)
	deadline := time.Now().Add(30 * time.Second)
	for v := syncer.View(); !v.Synced || v.Sessions().Check("e0",
		"s1").State != health.SessionCurrent; v = syncer.View() {
		if time.Now().After(deadline) {
			b.Fatal("the fleet was never read")
		}
		select {
		case <-v.Changed():
		case <-time.After(time.Until(deadline)):
		}
	}
	// Every watch settles in its blocking query (a benchmark, not a test: nothing to wait on).
	time.Sleep(time.Second)
	return f
}

// measure makes b.N CheckSession calls for e0/s1 from callers goroutines,
// 400 a second in all (a dispatcher confirming results), each passing
// minIndex(the highest consul_index any answer carried so far), and reports
// per 1,000 calls what they cost.
func (f *busyFleet) measure(b *testing.B, callers int, minIndex func(seen uint64) uint64) {
	before, asked, refreshes := f.metered.snapshot(), f.asked.Load(), f.refreshes.Load()
	var seen atomic.Uint64
	var unknown atomic.Int64
	var mu sync.Mutex
	var lat []time.Duration
	var next atomic.Int64
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []time.Duration
			pace := time.NewTicker(time.Duration(callers) * busyCallEvery)
			defer pace.Stop()
			for ; next.Add(1) <= int64(b.N); <-pace.C {
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
				t0 := time.Now()
				r, err := f.fencing.CheckSession(
					ctx,
					&leaseholdv1.CheckSessionRequest{
						InstanceId:     "e0",
						SessionId:      "s1",
						MinConsulIndex: minIndex(seen.Load()),
					},
				)
				mine = append(mine, time.Since(t0))
				cancel()
				if err != nil || r.GetState() != leaseholdv1.SessionState_CURRENT {
					unknown.Add(1)
				}
				for s := seen.Load(); r.ConsulIndex > s && !seen.CompareAndSwap(s,
					r.ConsulIndex); s = seen.Load() {
				}
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	took := time.Since(start)
	b.StopTimer()
	after := f.metered.snapshot()
	per := 1000 / float64(b.N)
	var wire, json, fresh int64
	kinds := map[string]int64{}
	for k, c := range after {
		d := readCount{c.reqs - before[k].reqs, c.wire - before[k].wire, c.json - before[k].json}
		wire, json = wire+d.wire, json+d.json
		if name, ok := strings.CutSuffix(k, " fresh"); ok && name != "other" {
			fresh += d.reqs
			kinds[name] += d.reqs
		}
	}
	slices.Sort(lat)
	b.ReportMetric(float64(f.asked.Load()-asked)*per, "asked/1kcalls")
	b.ReportMetric(float64(f.refreshes.Load()-refreshes)*per, "rounds/1kcalls")
	b.ReportMetric(float64(fresh)*per, "freshreads/1kcalls")
	for _, k := range []string{"critical", "warning", "serf", "generations", "lapses", "kvindex"} {
		b.ReportMetric(float64(kinds[k])*per, k+"/1kcalls")
	}
	b.ReportMetric(float64(wire)/1024*per, "wireKB/1kcalls")
	b.ReportMetric(float64(json)/1024*per, "jsonKB/1kcalls")
	b.ReportMetric(float64(unknown.Load())*per, "notcurrent/1kcalls")
	if len(lat) > 0 {
		b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50ms")
		b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99ms")
	}
	b.ReportMetric(float64(took)/float64(busyFlip)*per, "flips/1kcalls")
}

// BenchmarkCheckSessionBusyFleet (make bench; never part of make test):
// what fencing calls passing the last consul_index (as examples/dispatcher
// does) cost Consul on a busy fleet — 200 executors on 20 nodes, their
// generation keys, 100 lapse marks, one lease check flipping between
// passing and warning every 50 ms, 400 calls a second — per 1,000 calls:
// refreshes asked for, refresh rounds (markers), fresh reads by watch (what
// the rounds cost, beside the warning watch's own reads of the critical
// checks, one per flip), bytes read (wire and JSON, all watches together,
// their blocking answers included), latency. Beside it the floor measured
// in the same run: the same calls without min_consul_index (no refresh can
// happen: what the watches read anyway meanwhile); then one caller, and
// eight at once. Run with -benchtime 1000x.
func BenchmarkCheckSessionBusyFleet(b *testing.B) {
	f := startBusyFleet(b)
	for _, p := range []struct {
		name     string
		callers  int
		minIndex func(seen uint64) uint64
	}{
		{"floor=no-min-index", 1, func(uint64) uint64 { return 0 }},
		{"last-consul-index", 1, func(seen uint64) uint64 { return seen }},
		{"last-consul-index/8-callers", 8, func(seen uint64) uint64 { return seen }},
	} {
		b.Run(p.name, func(b *testing.B) { f.measure(b, p.callers, p.minIndex) })
	}
}
