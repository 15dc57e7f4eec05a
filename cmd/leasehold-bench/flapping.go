package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// A busy datacenter: --flapping other services, not
// leasehold's (their own name, no leasehold tag, no meta), registered on the
// executors' agents with TTL checks the harness flips between passing and
// warning or critical at --flap-rate changes a second. leasehold's fast path
// (/v1/health/state/any with a filter) wakes on every check change in the
// datacenter, and the Consul server filters the whole checks table for each
// answer; the busy phase measures lapse → stop while they flap against
// leasehold's own lapse phase (the same registrations, nothing flapping),
// and over both windows the agents' and leasehold's CPU, leasehold's Consul
// queries by watch, the fast path's answer, and how often a per-task query
// (the alternative design) would wake.

// bystanderService is the flapping services' name.
const bystanderService = "bystander"

// bystanderTTL outlasts any run, so that only the flaps change the checks.
const bystanderTTL = time.Hour

// flapWarmup lets the flapping reach its rate before the window opens.
const flapWarmup = 3 * time.Second

const (
	flapTick    = 10 * time.Millisecond
	flapWorkers = 8
)

func bystanderID(k int) string    { return fmt.Sprintf("%s-%05d", bystanderService, k) }
func bystanderCheck(k int) string { return "flap:" + bystanderID(k) }

// flapStatus is every flapping check's status in round r — warning,
// passing, critical, passing, … — so each update is a change (registered
// passing, round 0 is warning).
func flapStatus(round int) string { return [...]string{"warn", "pass", "fail", "pass"}[round%4] }

// flapper registers and flaps the other services' checks.
type flapper struct {
	agents  []*api.Client // service k is on agents[agentOf(k, len)]
	n       int
	rate    float64
	next    int          // sequence number of the next change: service next % n, round next / n
	ok      atomic.Int64 // changes the agents accepted
	failed  atomic.Int64
	skipped atomic.Int64 // changes given up because the workers were behind
}

func newFlapper(agents []*api.Client, n int, rate float64) *flapper {
	return &flapper{agents: agents, n: n, rate: rate}
}

func (f *flapper) agent(k int) *api.Agent { return f.agents[agentOf(k, len(f.agents))].Agent() }

func (f *flapper) registerAll() error {
	return parallel(f.n, registerWorkers(len(f.agents)), func(k int) error {
		err := f.agent(k).ServiceRegister(&api.AgentServiceRegistration{
			ID: bystanderID(k), Name: bystanderService, Address: "127.0.0.1", Port: 8080,
			Check: &api.AgentServiceCheck{CheckID: bystanderCheck(k),
				Name: "flapping", TTL: bystanderTTL.String(), Status: "passing"},
		})
		if err != nil {
			return fmt.Errorf("register %s: %w", bystanderID(k), err)
		}
		return nil
	})
}

// run flaps the checks at the rate until ctx ends: one change after
// another, round robin over the services, handed every flapTick to a few
// workers (one service's changes always to the same worker, so they reach
// its agent in order) so that one slow answer does not lower the rate.
// Changes the workers cannot take in time are given up (counted), not
// queued: a backlog would turn into bursts.
func (f *flapper) run(ctx context.Context) {
	var wg sync.WaitGroup
	work := make([]chan int, flapWorkers)
	for w := range work {
		work[w] = make(chan int, 4)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for q := range work[w] {
				k := q % f.n
				if err := f.agent(k).UpdateTTL(bystanderCheck(k),
					"flap", flapStatus(q/f.n)); err != nil {
					f.failed.Add(1)
				} else {
					f.ok.Add(1)
				}
			}
		}()
	}
	defer wg.Wait()
	defer func() {
		for _, c := range work {
			close(c)
		}
	}()
	t := time.NewTicker(flapTick)
	defer t.Stop()
	start, issued := time.Now(), 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for due := int(f.rate * time.Since(start).Seconds()); issued < due; issued++ {
			select {
			case work[(f.next%f.n)%flapWorkers] <- f.next:
				f.next++ // the sequence stays unbroken: every change flips a status
			default:
				f.skipped.Add(int64(due - issued))
				issued = due - 1
			}
		}
	}
}

// fastPathFilter is leasehold's fast-path filter (adapters/consul,
// apiCatalog.NonPassing), for the harness's own reads of the same query.
var fastPathFilter = `(Status != "passing" and (ServiceTags contains ` +
	strconv.Quote(health.DefaultTag) + ` or ServiceID == "")) or CheckID == "serfHealth"`

// fastPathRead reads the fast path's query a few times as leasehold does
// (not blocking) and returns the answer's size and the median time, which is
// mostly the server filtering the whole checks table.
func (b *bench) fastPathRead() (bytes int, took time.Duration) {
	u := "http://" + b.agent.HTTPAddr() +
		"/v1/health/state/any?filter=" + url.QueryEscape(fastPathFilter)
	var times []time.Duration
	for range 5 {
		start := time.Now()
		body, _, err := get(b.ctx, u)
		if err != nil {
			logf("fast-path read: %v", err)
			return 0, 0
		}
		times = append(times, time.Since(start))
		bytes = len(body)
	}
	return bytes, quantile(times, 0.5)
}

// countChecks reads every check in the datacenter once: how many the fast
// path's filter walks for each answer, and their size as JSON.
func (b *bench) countChecks() (n, size int, err error) {
	body, _, err := get(b.ctx, "http://"+b.agent.HTTPAddr()+"/v1/health/state/any")
	if err != nil {
		return 0, 0, err
	}
	var all []json.RawMessage
	if err := json.Unmarshal(body, &all); err != nil {
		return 0, 0, fmt.Errorf("checks: %w", err)
	}
	return len(all), len(body), nil
}

// get reads u and returns its body and X-Consul-Index.
func get(ctx context.Context, u string) ([]byte, uint64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, 0, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, 0, fmt.Errorf("GET %s: %s: %s", u, resp.Status, body)
	}
	index, _ := strconv.ParseUint(resp.Header.Get("X-Consul-Index"), 10, 64)
	return body, index, nil
}

// busyResults is the busy phase's part of the table.
type busyResults struct {
	services      int
	rate          float64
	achieved      float64 // changes per second the agents accepted in the window
	failed        int64
	skipped       int64
	checks, bytes int // checks in the datacenter, and their size as JSON
	lapse         []time.Duration
	consulPart    []time.Duration // of which lease expiry → the per-task probe saw it critical
	lastBeat      []time.Duration // the victims' last heartbeat round trips
	err           error           // lapses that never reached every stream
	quiet, busy   window
	alone         window // flapping again with leasehold stopped: Consul's CPU only
}

// busyLapses lets executors [2n, 3n) lapse while the other services flap.
func (b *bench) busyLapses() error {
	if b.flap == nil || b.n == 0 || b.quiet == nil {
		return nil
	}
	res := &busyResults{services: b.flap.n, rate: b.flap.rate, quiet: *b.quiet}
	var err error
	if res.checks, res.bytes, err = b.countChecks(); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(b.ctx)
	flapped := make(chan struct{})
	go func() { defer close(flapped); b.flap.run(ctx) }()
	logf("%d services flapping at %g changes/s; %d checks in the datacenter",
		res.services, res.rate, res.checks)
	time.Sleep(flapWarmup) // the window opens at the steady rate
	before, ok, failed, skipped := b.usage(), b.flap.ok.Load(),
		b.flap.failed.Load(), b.flap.skipped.Load()
	victims := span(2*b.n, 3*b.n)
	expiries := b.fleet.lapseAll(victims)
	res.lapse, res.err = b.fleet.lapseLatencies(b.ds, victims, expiries)
	res.consulPart = b.probe.consulPart(b.fleet, victims, expiries)
	res.lastBeat = b.fleet.heartbeatRTTs(victims)
	res.achieved = float64(b.flap.ok.Load()-ok) / time.Since(before.at).Seconds()
	res.failed, res.skipped = b.flap.failed.Load()-failed, b.flap.skipped.Load()-skipped
	res.busy = b.closeWindow(before)
	cancel()
	<-flapped
	b.res.busy = res
	if res.err != nil {
		logf("lapses while flapping did not all reach the streams: %v", res.err)
	}
	logf("lapse → stop while %d services flap (%.0f changes/s done): %s (quiet: %s)",
		res.services, res.achieved, dist(res.lapse), dist(b.res.lapse))
	logf("Consul server CPU %.0f%% → %.0f%% of a core; leasehold wakeups/s %s",
		res.quiet.share(res.quiet.server), res.busy.share(res.busy.server),
		rates(res.quiet, res.busy, res.quiet.wakeups, res.busy.wakeups))
	return nil
}

// rates is "kind quiet → busy/s" for every watch kind either window saw.
func rates(quiet, busy window, q, f map[string]float64) string {
	var kinds []string
	for k := range q {
		kinds = append(kinds, k)
	}
	for k := range f {
		if !slices.Contains(kinds, k) {
			kinds = append(kinds, k)
		}
	}
	slices.Sort(kinds)
	var parts []string
	for _, k := range kinds {
		parts = append(parts, fmt.Sprintf("%s %.2f → %.2f",
			k, quiet.perSecond(q[k]), busy.perSecond(f[k])))
	}
	return strings.Join(parts, ", ")
}

func (br *busyResults) rows(b *strings.Builder, res results) {
	q, f, a := br.quiet, br.busy, br.alone
	lapses := dist(br.lapse)
	if br.err != nil {
		lapses += fmt.Sprintf(" — not all: %v", br.err)
	}
	fmt.Fprintf(b,
		"| busy datacenter: %d other services (`%s`: no leasehold tag, no meta) on the same "+
			"agents, TTL checks flipping passing → warning → passing → critical; "+
			"changes/s asked → accepted by the agents (failed, given up) | %g → %.1f/s "+
			"(%d, %d); %d checks in the datacenter (%.1f MB as JSON) | |\n",
		br.services, bystanderService, br.rate, br.achieved, br.failed,
		br.skipped, br.checks, float64(br.bytes)/(1<<20))
	fmt.Fprintf(b,
		"| lapse → stop while they flap, %d lapses (quiet: the first row, the same "+
			"registrations with nothing flapping) | %s | as quiet |\n", len(br.lapse), lapses)
	fmt.Fprintf(b,
		"| of which Consul while they flap: lease expiry → the harness's per-task query has "+
			"the lease critical (quiet: in the rows above) | %s | |\n", dist(br.consulPart))
	fmt.Fprintf(b, "| the lapsed executors' last heartbeat round trip while they flap | %s | |\n",
		dist(br.lastBeat))
	fmt.Fprintf(b, "| lapse → stop, flapping ÷ quiet | %s | ≈ 1× |\n",
		ratios(br.lapse, res.lapse))
	fmt.Fprintf(b,
		"| windows: quiet = leasehold's lapse phase, flapping = this phase's lapses, alone = as "+
			"long flapping again after `leasehold serve` stopped | %s, %s, %s | |\n",
		q.d.Round(100*time.Millisecond), f.d.Round(100*time.Millisecond),
		a.d.Round(100*time.Millisecond))
	fmt.Fprintf(b,
		"| Consul server CPU, %% of one core: quiet → flapping → alone (the rest of "+
			"flapping's is serving leasehold's wakes) | %.1f%% → %.1f%% → %.1f%% | |\n",
		q.share(q.server), f.share(f.server), a.share(a.server))
	if *agents > 1 {
		fmt.Fprintf(b,
			"| Consul client agents' CPU (%d agents together), %% of one core: quiet → "+
				"flapping → alone | %.1f%% → %.1f%% → %.1f%% | |\n", *agents-1,
			q.share(q.clients), f.share(f.clients), a.share(a.clients))
	}
	fmt.Fprintf(b,
		"| `leasehold serve` CPU, %% of one core: quiet → flapping | %.1f%% → %.1f%% | |\n",
		q.share(q.leasehold), f.share(f.leasehold))
	fmt.Fprintf(b,
		"| leasehold's blocking queries that woke (`leasehold_consul_wakeups_total`), per second "+
			"by watch: quiet → flapping | %s | |\n", rates(q, f, q.wakeups, f.wakeups))
	fmt.Fprintf(b,
		"| leasehold's Consul requests (`leasehold_consul_requests_total`), per second by watch: "+
			"quiet → flapping | %s | |\n", rates(q, f, q.requests, f.requests))
	fmt.Fprintf(b,
		"| the fast path's answer (`/v1/health/state/any` + filter): size; one read's time (the "+
			"server filtering every check), quiet → flapping | %.1f KB; %s → %s | |\n",
		float64(f.fastPathBytes)/1024, r(q.fastPathTime), r(f.fastPathTime))
	fmt.Fprintf(b,
		"| what the fast path costs while flapping: answers × size | %.0f KB/s, %.0f filter "+
			"passes over %d checks a second | |\n",
		f.perSecond(f.wakeups["non-passing"])*float64(f.fastPathBytes)/1024,
		f.perSecond(f.requests["non-passing"]), br.checks)
	fmt.Fprintf(b,
		"| the alternative, probed by the harness: one `/v1/health/service/<task>?filter=%s` "+
			"blocking query per task type (%d, per-task index): wakes/s, all together, quiet "+
			"→ flapping; bytes per answer while flapping | %.2f → %.2f; %.1f KB | no "+
			"wake from other services |\n",
		probeFilter, res.tasks, q.perSecond(float64(q.probeWakes)),
		f.perSecond(float64(f.probeWakes)),
		float64(f.probeBytes)/float64(max(1, f.probeAnswers))/1024)
}

// flapAlone flaps again, as long as the busy window, with leasehold and its
// streams stopped. That measures what the flapping costs Consul by itself,
// so that the rest of the busy window's Consul CPU is what serving
// leasehold's wakes costs.
func (b *bench) flapAlone() error {
	br := b.res.busy
	if br == nil {
		return nil
	}
	ctx, cancel := context.WithCancel(b.ctx)
	flapped := make(chan struct{})
	go func() { defer close(flapped); b.flap.run(ctx) }()
	time.Sleep(flapWarmup) // the window opens at the steady rate
	before := b.consulCPU()
	time.Sleep(br.busy.d) // the measurement window itself
	after := b.consulCPU()
	cancel()
	<-flapped
	br.alone = window{d: after.at.Sub(before.at),
		server: after.server - before.server, clients: after.clients - before.clients}
	logf("flapping with leasehold stopped: Consul server CPU %.0f%% of a core "+
		"(%.0f%% with leasehold watching)",
		br.alone.share(br.alone.server), br.busy.share(br.busy.server))
	return nil
}

// consulCPU reads the Consul agents' CPU alone.
func (b *bench) consulCPU() usage {
	u := usage{at: time.Now(), server: procCPU(b.pids.server)}
	for _, pid := range b.pids.clients {
		u.clients += procCPU(pid)
	}
	return u
}
