package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/hashicorp/consul/api"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/testproc"
	"github.com/leasehold/leasehold/server"
)

// A real grpc-go xds:/// dispatcher ACKs routes and clusters carrying a full
// dispatch policy set live through the rules in Consul KV (retries with
// backoff, a deadline, max_requests, outlier ejection, lrs_server self), and
// its calls keep reaching both executors: a NACK would leave it on the
// previous versions, a route it could not apply with no route at all.
func TestFullDispatchPolicyAckedByGRPCLive(t *testing.T) {
	a := consultest.Start(t)
	a.SettleSync()
	startExecutor(t, a, "e1", "1.0.0")
	startExecutor(t, a, "e2", "1.0.0")
	var log syncBuffer
	addrs := startServeTo(t, a, &log)
	start := time.Now()
	d := startDispatcher(t, addrs.xds, "dispatcher-policy", map[string]any{})
	bothServe := func(cs []callResult) bool {
		m := servedBy(cs)
		return m["e1"] > 0 && m["e2"] > 0
	}
	d.await(t, start, 20*time.Second, "calls to both executors (default policy)", bothServe)

	state := func(typeURL string) *server.TypeInfo {
		var ds struct {
			Dispatchers []server.StreamInfo `json:"dispatchers"`
		}
		getBody(t, "http://"+addrs.admin+"/debug/dispatchers", &ds)
		for _, s := range ds.Dispatchers {
			if s.NodeID == "dispatcher-policy" {
				return s.Types[typeURL]
			}
		}
		return nil
	}
	types := []string{resource.RouteType, resource.ClusterType}
	acked := func() map[string]string {
		t.Helper()
		out := map[string]string{}
		for _, typ := range types {
			ti := state(typ)
			if ti != nil && ti.LastNack != nil {
				t.Fatalf("grpc-go NACKed %s: %+v\nserve log:\n%s", typ, ti.LastNack, log.String())
			}
			if ti != nil && ti.LastSent != "" && ti.LastAcked == ti.LastSent {
				out[typ] = ti.LastAcked
			}
		}
		return out
	}
	var before map[string]string
	for deadline := time.Now().Add(15 * time.Second); len(before) < len(types); before = acked() {
		if time.Now().After(deadline) {
			t.Fatalf("the default policy's route and cluster were never ACKed: %v", before)
		}
		time.Sleep(50 * time.Millisecond)
	}

	const rules = `{"dispatch":{"default":{
		"retry":{"on":["UNAVAILABLE","RESOURCE_EXHAUSTED"],"num_retries":4,
			"backoff":{"base":"10ms","max":"100ms"}},
		"max_requests":64,"deadline":"20s",
		"outlier":{"failure_percentage":{"threshold":50,"minimum_hosts":2,"request_volume":10},
			"consecutive_failures":5,"interval":"1s","base_ejection_time":"5s",
			"max_ejection_percent":50}}}}`
	if _, err := a.Client().KV().Put(&api.KVPair{Key: consul.RulesKey, Value: []byte(rules)},
		nil); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(15 * time.Second); ; {
		now := acked()
		if now[resource.RouteType] != "" && now[resource.RouteType] != before[resource.RouteType] &&
			now[resource.ClusterType] != "" &&
			now[resource.ClusterType] != before[resource.ClusterType] {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the policy's route and cluster were not both ACKed within 15 s: %v "+
				"(before %v)\nserve log:\n%s", now, before, log.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	from := time.Now()
	d.await(t, from, 15*time.Second, "calls to both executors under the full policy", bothServe)
	for _, c := range d.since(from) {
		if c.Err != "" {
			t.Fatalf("a call failed under the full policy: %s", c.Err)
		}
	}
}

// The dispatch policy kept by real clients: one Consul agent, one
// `leasehold serve` following a rules file with a policy per task type, and
// one grpc-go xds:/// dispatcher child making the calls the subtests ask for.
// The executors are test gRPC servers registered through the Registrar (the
// registration contract), one fleet per task type so that each subtest has
// its own policy, cluster and counts; each executor records every attempt it
// receives under the call's id (carried in the request), so a call's
// attempts are counted where they land.

// The policies under test, per task type (retries elsewhere off or the
// default, so that a count of attempts is a count of calls).
const (
	policyRetries      = 3 // not the default 2: the route's value is what counts
	policyMaxRequests  = 2
	policyDeadline     = 400 * time.Millisecond
	policyEjectionTime = 2 * time.Second
)

var policyRules = fmt.Sprintf(`{"dispatch":{"tasks":{
	"retry":{"retry":{"num_retries":%d,"backoff":{"base":"5ms","max":"20ms"}}},
	"limit":{"max_requests":%d},
	"deadline":{"deadline":%q},
	"eject":{"retry":{"num_retries":0},
		"outlier":{"failure_percentage":{"threshold":50,"minimum_hosts":3,"request_volume":5},
			"interval":"250ms","base_ejection_time":%q,"max_ejection_percent":50}},
	"lrs":{"retry":{"num_retries":0}}}}}`,
	policyRetries, policyMaxRequests, policyDeadline, policyEjectionTime)

func TestDispatchPolicyKeptByRealGRPCClients(t *testing.T) {
	a := consultest.Start(t)
	a.SettleSync()
	f := newPolicyFleet()
	fleets := []struct {
		task string
		n    int
	}{{"retry", 3}, {"limit", 2}, {"deadline", 1}, {"eject", 3}, {"lrs", 2}}
	for _, fl := range fleets {
		for i := 1; i <= fl.n; i++ {
			f.start(t, a, fl.task, fmt.Sprintf("%s-%d", fl.task, i))
		}
	}
	rulesPath := filepath.Join(t.TempDir(), "rules.json")
	if err := os.WriteFile(rulesPath, []byte(policyRules), 0o600); err != nil {
		t.Fatal(err)
	}
	var log syncBuffer
	addrs := startServeTo(t, a, &log, func(c *serveConfig) { c.rulesFile = rulesPath })
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("serve log:\n%s", log.String())
		}
	})
	c := startCaller(t, addrs.xds, "dispatcher-rules")

	// Every executor has answered a call of its task: the dispatcher has
	// every route and cluster and a connection to every executor.
	start := time.Now()
	deadline := start.Add(30 * time.Second)
	for _, fl := range fleets {
		for !f.allServed(fl.task) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not every executor answered a call within 30 s", fl.task)
			}
			c.call(t, callCmd{Target: "xds:///" + fl.task, N: 10, Gap: 5 * time.Millisecond,
				Timeout: 2 * time.Second})
		}
	}
	t.Logf("every executor answered a call %s after serve started", time.Since(start))

	t.Run("RefusalsAreRetriedOnAnotherExecutorAtMostNumRetriesTimes", func(t *testing.T) {
		ex := f.byTask["retry"]
		defer f.setAll("retry", nil)
		ex[0].set(refuse(codes.Unavailable))
		hit := 0
		for _, r := range c.call(t, callCmd{Target: "xds:///retry", N: 12, Timeout: 5 * time.Second}) {
			at := f.attemptsOf(r.Call)
			if r.Code != codes.OK {
				t.Errorf("call %s: %v %q after attempts %v: want it retried on another executor",
					r.Call, r.Code, r.Msg, at)
				continue
			}
			switch {
			case len(at) == 0:
				t.Errorf("call %s: no executor saw it", r.Call)
			case at[0].instance != ex[0].instance:
				if len(at) != 1 {
					t.Errorf("call %s: attempts %v: want one (the first executor served it)",
						r.Call, at)
				}
			default:
				hit++
				if len(at) != 2 || at[1].instance == ex[0].instance {
					t.Errorf("call %s: attempts %v: want the refusal retried once, on another "+
						"executor", r.Call, at)
				} else {
					t.Logf("call %s: refused by %s, retried on %s %s later (took %s)", r.Call,
						at[0].instance, at[1].instance, at[1].at.Sub(at[0].at), r.Took)
				}
			}
		}
		if hit == 0 {
			t.Fatalf("no call's first attempt reached the refusing executor %s", ex[0].instance)
		}

		// Every executor refusing: each call makes num_retries+1 attempts and
		// fails with the refusal.
		for _, code := range []codes.Code{codes.Unavailable, codes.ResourceExhausted} {
			f.setAll("retry", refuse(code))
			for _, r := range c.call(t, callCmd{Target: "xds:///retry", N: 3,
				Timeout: 5 * time.Second}) {
				at := f.attemptsOf(r.Call)
				if r.Code != code || len(at) != policyRetries+1 {
					t.Errorf("every executor refusing %v: call %s ended %v %q after %d attempts "+
						"%v: want %v after %d", code, r.Call, r.Code, r.Msg, len(at), at, code,
						policyRetries+1)
					continue
				}
				t.Logf("every executor refusing %v: call %s failed after %d attempts in %s "+
					"(per executor %v)", code, r.Call, len(at), r.Took, perInstance(at))
			}
		}
	})

	t.Run("CallsThatMayHaveRunAreNeverRetried", func(t *testing.T) {
		defer f.setAll("retry", nil)
		for _, code := range []codes.Code{codes.DeadlineExceeded, codes.Aborted, codes.Unknown,
			codes.Internal} {
			f.setAll("retry", refuse(code))
			for _, r := range c.call(t, callCmd{Target: "xds:///retry", N: 3,
				Timeout: 5 * time.Second}) {
				if at := f.attemptsOf(r.Call); r.Code != code || len(at) != 1 {
					t.Errorf("every executor failing %v: call %s ended %v %q after attempts %v: "+
						"want %v after exactly one", code, r.Call, r.Code, r.Msg, at, code)
				}
			}
		}
		// An executor that has sent its response headers has started the task
		// (the executor contract): even a code that is retried is then final.
		f.setAll("retry", refuseAfterHeaders(codes.Unavailable))
		for _, r := range c.call(t, callCmd{Target: "xds:///retry", N: 3,
			Timeout: 5 * time.Second}) {
			if at := f.attemptsOf(r.Call); r.Code != codes.Unavailable || len(at) != 1 {
				t.Errorf("every executor failing UNAVAILABLE after its headers: call %s ended "+
					"%v %q after attempts %v: want UNAVAILABLE after exactly one", r.Call,
					r.Code, r.Msg, at)
			}
		}
	})

	t.Run("MaxRequestsCapsCallsInFlight", func(t *testing.T) {
		release := make(chan struct{})
		released := sync.OnceFunc(func() { close(release) })
		defer func() { released(); f.setAll("limit", nil) }()
		f.setAll("limit", block(release))
		held := c.start(t, callCmd{Target: "xds:///limit", N: 1, Parallel: policyMaxRequests,
			Timeout: 10 * time.Second})
		f.await(t, 10*time.Second, fmt.Sprintf("%d calls in flight", policyMaxRequests),
			func() bool { return f.inFlight("limit") == policyMaxRequests })
		over := c.call(t, callCmd{Target: "xds:///limit", N: 1, Timeout: 3 * time.Second})[0]
		want := fmt.Sprintf("max requests %d exceeded", policyMaxRequests)
		if over.Code != codes.Unavailable || !strings.Contains(over.Msg, want) ||
			over.Took > time.Second {
			t.Errorf("call %d with %d in flight ended %v %q after %s: want UNAVAILABLE %q at once",
				policyMaxRequests+1, policyMaxRequests, over.Code, over.Msg, over.Took, want)
		} else {
			t.Logf("call %d with %d in flight failed in %s: %v %q", policyMaxRequests+1,
				policyMaxRequests, over.Took, over.Code, over.Msg)
		}
		if at := f.attemptsOf(over.Call); len(at) != 0 {
			t.Errorf("the call over the limit reached executors: %v", at)
		}
		released()
		for _, r := range c.wait(t, held) {
			if r.Code != codes.OK {
				t.Errorf("held call %s: %v %q", r.Call, r.Code, r.Msg)
			}
		}
		// The limit counts calls in flight, not calls made.
		for _, r := range c.call(t, callCmd{Target: "xds:///limit", N: policyMaxRequests + 1,
			Timeout: 5 * time.Second}) {
			if r.Code != codes.OK {
				t.Errorf("call %s after the held ones ended: %v %q", r.Call, r.Code, r.Msg)
			}
		}
	})

	t.Run("DeadlineEndsACallThatRunsTooLong", func(t *testing.T) {
		release := make(chan struct{})
		defer func() { close(release); f.setAll("deadline", nil) }()
		f.setAll("deadline", block(release))
		r := c.call(t, callCmd{Target: "xds:///deadline", N: 1, Timeout: 10 * time.Second})[0]
		at := f.attemptsOf(r.Call)
		if r.Code != codes.DeadlineExceeded || r.Took < policyDeadline ||
			r.Took > policyDeadline+time.Second {
			t.Fatalf("a call blocked at its executor under a %s deadline (the caller's own: 10 s) "+
				"ended %v %q after %s: want DEADLINE_EXCEEDED after about %s", policyDeadline,
				r.Code, r.Msg, r.Took, policyDeadline)
		}
		if len(at) != 1 || at[0].deadline <= 0 || at[0].deadline > policyDeadline {
			t.Fatalf("attempts %v: want one, whose deadline at the executor is at most %s",
				at, policyDeadline)
		}
		t.Logf("the call ended %v after %s; the executor saw %s left", r.Code, r.Took,
			at[0].deadline)
	})

	t.Run("FailingExecutorIsEjectedAndComesBack", func(t *testing.T) {
		bad := f.byTask["eject"][0]
		defer f.setAll("eject", nil)
		bad.set(refuse(codes.Internal))
		batch := func() []callDone {
			return c.call(t, callCmd{Target: "xds:///eject", For: 400 * time.Millisecond,
				Gap: time.Millisecond, Timeout: 2 * time.Second})
		}
		failedAt := time.Now()
		failures := 0
		deadline := time.Now().Add(15 * time.Second)
		for {
			if time.Now().After(deadline) {
				t.Fatalf("%s, failing every call, was never ejected within 15 s", bad.instance)
			}
			rs := batch()
			n := 0
			for _, r := range rs {
				if r.Code != codes.OK {
					failures++
				}
				for _, a := range f.attemptsOf(r.Call) {
					if a.instance == bad.instance {
						n++
					}
				}
			}
			if n == 0 && len(rs) >= 20 && failures > 0 {
				break // a batch of calls none of which reached it
			}
		}
		last := bad.lastAttempt()
		t.Logf("%s ejected %s after it began failing (%d calls failed)", bad.instance,
			last.Sub(failedAt), failures)
		bad.set(nil)
		var back time.Time
		for back.IsZero() {
			if time.Now().After(last.Add(policyEjectionTime + 5*time.Second)) {
				t.Fatalf("%s ejected at %s never came back", bad.instance, last)
			}
			for _, r := range batch() {
				if r.Code != codes.OK {
					t.Errorf("call %s while %s was ejected: %v %q", r.Call, bad.instance, r.Code,
						r.Msg)
				}
			}
			if a := bad.lastAttempt(); a.After(last) {
				back = bad.firstAttemptAfter(last)
			}
		}
		gap := back.Sub(last)
		if gap < policyEjectionTime-50*time.Millisecond || gap > policyEjectionTime+2*time.Second {
			t.Fatalf("%s had no calls for %s: want the ejection time, %s", bad.instance, gap,
				policyEjectionTime)
		}
		t.Logf("%s had no calls for %s (base_ejection_time %s), then came back", bad.instance,
			gap, policyEjectionTime)
	})

	t.Run("LoadReportsCountTheCallsMade", func(t *testing.T) {
		ex := f.byTask["lrs"]
		defer f.setAll("lrs", nil)
		ex[1].set(refuse(codes.Internal))
		c.call(t, callCmd{Target: "xds:///lrs", N: 20, Timeout: 5 * time.Second})
		ended := time.Now()
		want := map[string]map[string]float64{"lrs": c.outcomes("xds:///lrs")}
		if want["lrs"][server.OutcomeFailed] == 0 || want["lrs"][server.OutcomeSucceeded] == 0 {
			t.Fatalf("calls to lrs %v: want some to fail and some to succeed", want["lrs"])
		}
		// The limit's calls too: a call over max_requests is reported dropped.
		if lim := c.outcomes("xds:///limit"); lim[server.OutcomeDropped] > 0 {
			want["limit"] = lim
		}
		interval := server.DefaultLoadReportInterval
		tick := time.NewTicker(50 * time.Millisecond) // /metrics has no watch API
		defer tick.Stop()
		for {
			got := dispatchCounts(scrape(t, addrs.admin))
			same := true
			for task, w := range want {
				for _, o := range []string{server.OutcomeSucceeded, server.OutcomeFailed,
					server.OutcomeDropped} {
					if got[task][o] > w[o] {
						t.Fatalf("%s: /metrics counts %v calls %s, more than the %v made (%v)",
							task, got[task][o], o, w[o], got)
					}
					same = same && got[task][o] == w[o]
				}
			}
			if same {
				t.Logf("/metrics counts the calls made (%v) %s after the last ended "+
					"(report interval %s)", want, time.Since(ended), interval)
				return
			}
			if time.Since(ended) > interval+time.Second {
				t.Fatalf("/metrics leasehold_dispatch_requests_total %v %s after the last call: "+
					"want %v within the report interval (%s)", got, time.Since(ended), want,
					interval)
			}
			<-tick.C
		}
	})
}

// dispatchCounts is leasehold_dispatch_requests_total by task and outcome.
func dispatchCounts(families map[string]*dto.MetricFamily) map[string]map[string]float64 {
	out := map[string]map[string]float64{}
	for _, m := range families["leasehold_dispatch_requests_total"].GetMetric() {
		var task, outcome string
		for _, l := range m.GetLabel() {
			switch l.GetName() {
			case "task":
				task = l.GetValue()
			case "outcome":
				outcome = l.GetValue()
			}
		}
		if out[task] == nil {
			out[task] = map[string]float64{}
		}
		out[task][outcome] += m.GetCounter().GetValue()
	}
	return out
}

const callerEnv = "LEASEHOLD_TEST_CALLER" // child mode: make the calls asked on stdin

// callCmd asks the caller child for calls to Target: N calls (or as many
// as fit in For) one after the other in each of Parallel workers, each
// with its own Timeout. Each call's request carries its id (the health
// check's service name), which the executors record.
type callCmd struct {
	ID       int           `json:"id"`
	Target   string        `json:"target"`
	N        int           `json:"n,omitempty"`
	For      time.Duration `json:"for,omitempty"`
	Parallel int           `json:"parallel,omitempty"`
	Gap      time.Duration `json:"gap,omitempty"`
	Timeout  time.Duration `json:"timeout"`
}

// callDone is how one call ended, seen by the dispatcher.
type callDone struct {
	Call string        `json:"call"`
	Code codes.Code    `json:"code"`
	Msg  string        `json:"msg,omitempty"`
	Took time.Duration `json:"took"`
}

// callBatch answers a callCmd.
type callBatch struct {
	ID    int        `json:"id"`
	Calls []callDone `json:"calls"`
}

// runCallerChild runs the commands read from stdin, each as it comes,
// until stdin closes, printing each one's calls when they have all ended.
func runCallerChild() int {
	var mu sync.Mutex
	clients := map[string]healthpb.HealthClient{}
	client := func(target string) (healthpb.HealthClient, error) {
		mu.Lock()
		defer mu.Unlock()
		if c, ok := clients[target]; ok {
			return c, nil
		}
		conn, err := grpc.NewClient(target,
			grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, err
		}
		clients[target] = healthpb.NewHealthClient(conn)
		return clients[target], nil
	}
	var outMu sync.Mutex
	enc := json.NewEncoder(os.Stdout)
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		var cmd callCmd
		if err := json.Unmarshal(sc.Bytes(), &cmd); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		hc, err := client(cmd.Target)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		go func() {
			b := callBatch{ID: cmd.ID, Calls: cmd.run(hc)}
			outMu.Lock()
			defer outMu.Unlock()
			enc.Encode(b)
		}()
	}
	return 0
}

func (cmd callCmd) run(hc healthpb.HealthClient) []callDone {
	var mu sync.Mutex
	var out []callDone
	var wg sync.WaitGroup
	start := time.Now()
	for w := range max(cmd.Parallel, 1) {
		wg.Go(func() {
			for k := 0; cmd.N == 0 && time.Since(start) < cmd.For || k < cmd.N; k++ {
				id := fmt.Sprintf("%d.%d.%d", cmd.ID, w, k)
				ctx, cancel := context.WithTimeout(context.Background(), cmd.Timeout)
				t0 := time.Now()
				_, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: id})
				d := callDone{Call: id, Code: status.Code(err), Took: time.Since(t0)}
				cancel()
				if err != nil {
					d.Msg = status.Convert(err).Message()
				}
				mu.Lock()
				out = append(out, d)
				mu.Unlock()
				if cmd.Gap > 0 {
					time.Sleep(cmd.Gap) // the child's pace between calls, not a wait for an event
				}
			}
		})
	}
	wg.Wait()
	return out
}

// caller is a running caller child.
type caller struct {
	stdin io.Writer
	mu    sync.Mutex
	next  int
	waits map[int]pendingCmd
	made  map[string][]callDone // by target
}

type pendingCmd struct {
	target string
	done   chan []callDone
}

func startCaller(t *testing.T, xdsAddr, nodeID string) *caller {
	t.Helper()
	bootstrap, err := newBootstrap(xdsAddr, nodeID, "", map[string]string{}, "", "")
	if err != nil {
		t.Fatal(err)
	}
	child := testproc.Start(t, nodeID, callerEnv+"=1",
		"GRPC_XDS_BOOTSTRAP_CONFIG="+string(bootstrap))
	c := &caller{stdin: child.Stdin, waits: map[int]pendingCmd{}, made: map[string][]callDone{}}
	go func() {
		for line := range child.Lines {
			var b callBatch
			if json.Unmarshal(line, &b) != nil {
				continue
			}
			c.mu.Lock()
			p, ok := c.waits[b.ID]
			delete(c.waits, b.ID)
			if ok {
				c.made[p.target] = append(c.made[p.target], b.Calls...)
			}
			c.mu.Unlock()
			if ok {
				p.done <- b.Calls
			}
		}
	}()
	return c
}

// start sends cmd; the channel gives its calls when they have all ended.
func (c *caller) start(t *testing.T, cmd callCmd) <-chan []callDone {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.next++
	cmd.ID = c.next
	p := pendingCmd{target: cmd.Target, done: make(chan []callDone, 1)}
	c.waits[cmd.ID] = p
	line, err := json.Marshal(cmd)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.stdin.Write(append(line, '\n')); err != nil {
		t.Fatalf("caller child: %v", err)
	}
	return p.done
}

func (c *caller) wait(t *testing.T, done <-chan []callDone) []callDone {
	t.Helper()
	select {
	case cs := <-done:
		return cs
	case <-time.After(60 * time.Second):
		t.Fatalf("caller child: no answer within 60 s")
		return nil
	}
}

func (c *caller) call(t *testing.T, cmd callCmd) []callDone {
	t.Helper()
	return c.wait(t, c.start(t, cmd))
}

// outcomes counts every call made to target as LRS reports them: failed
// calls over max_requests are dropped (they never reached an executor).
func (c *caller) outcomes(target string) map[string]float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string]float64{}
	for _, d := range c.made[target] {
		switch {
		case d.Code == codes.OK:
			out[server.OutcomeSucceeded]++
		case d.Code == codes.Unavailable && strings.HasPrefix(d.Msg, "max requests"):
			out[server.OutcomeDropped]++
		default:
			out[server.OutcomeFailed]++
		}
	}
	return out
}

// policyFleet is the test's executors, by task type.
type policyFleet struct {
	byTask  map[string][]*policyExecutor
	changed chan struct{} // an attempt began or ended somewhere
}

func newPolicyFleet() *policyFleet {
	return &policyFleet{byTask: map[string][]*policyExecutor{}, changed: make(chan struct{}, 1)}
}

// attempt is one attempt of a call an executor received.
type attempt struct {
	call, instance string
	at             time.Time
	deadline       time.Duration // left when it arrived (0: none)
}

func (a attempt) String() string { return a.instance }

// behaviour is how an executor answers (nil: it serves).
type behaviour func(ctx context.Context) error

func refuse(code codes.Code) behaviour {
	return func(context.Context) error {
		return status.Errorf(code, "test executor answers %v", code)
	}
}

// refuseAfterHeaders answers code after sending the response headers, as an
// executor does that started the task and then failed.
func refuseAfterHeaders(code codes.Code) behaviour {
	return func(ctx context.Context) error {
		if err := grpc.SendHeader(ctx, metadata.Pairs("accepted-by", "test")); err != nil {
			return err
		}
		return status.Errorf(code, "test executor answers %v after its headers", code)
	}
}

// block holds each call until release closes (then serves) or its deadline.
func block(release <-chan struct{}) behaviour {
	return func(ctx context.Context) error {
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		}
	}
}

// policyExecutor is a gRPC health server registered for one task type that
// records each attempt and answers as told. It refuses without sending
// headers first: a client retries only a call whose answer had none
// (grpc-go: a trailers-only response).
type policyExecutor struct {
	healthpb.UnimplementedHealthServer
	instance string
	fleet    *policyFleet
	behave   atomic.Pointer[behaviour]
	mu       sync.Mutex
	attempts []attempt
	inFlight int
}

func (f *policyFleet) start(t *testing.T, a *consultest.Agent, task, instance string) {
	t.Helper()
	e := &policyExecutor{instance: instance, fleet: f}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	healthpb.RegisterHealthServer(g, e)
	go g.Serve(lis)
	reg, err := consul.NewRegistrar(consul.NewAPIAgent(a.Client()), consul.Config{
		InstanceID: instance, Tasks: []string{task},
		Address: "127.0.0.1", Port: lis.Addr().(*net.TCPAddr).Port,
		Version: "1.0.0", Capacity: 4,
		Lease: health.Lease{TTL: 2 * time.Second,
			Heartbeat: 500 * time.Millisecond, DeregisterAfter: time.Minute},
		Load:  func() int { return 0 },
		Probe: func(context.Context) error { return nil },
		Logger: slog.New(slog.NewTextHandler(testWriter{t, instance},
			&slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go reg.Run(ctx)
	t.Cleanup(func() {
		cancel()
		<-reg.Done()
		g.Stop()
	})
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	if _, err := reg.WaitSession(wctx, nil); err != nil {
		t.Fatalf("%s never registered: %v", instance, err)
	}
	f.byTask[task] = append(f.byTask[task], e)
}

func (e *policyExecutor) Check(
	ctx context.Context, req *healthpb.HealthCheckRequest,
) (*healthpb.HealthCheckResponse, error) {
	a := attempt{call: req.GetService(), instance: e.instance, at: time.Now()}
	if dl, ok := ctx.Deadline(); ok {
		a.deadline = time.Until(dl)
	}
	e.mu.Lock()
	e.attempts = append(e.attempts, a)
	e.inFlight++
	e.mu.Unlock()
	e.fleet.notify()
	defer func() {
		e.mu.Lock()
		e.inFlight--
		e.mu.Unlock()
		e.fleet.notify()
	}()
	if b := e.behave.Load(); b != nil && *b != nil {
		if err := (*b)(ctx); err != nil {
			return nil, err
		}
	}
	grpc.SetHeader(ctx, metadata.Pairs("x-instance", e.instance))
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

func (e *policyExecutor) set(b behaviour) { e.behave.Store(&b) }

func (e *policyExecutor) lastAttempt() time.Time {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.attempts) == 0 {
		return time.Time{}
	}
	return e.attempts[len(e.attempts)-1].at
}

func (e *policyExecutor) firstAttemptAfter(t time.Time) time.Time {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, a := range e.attempts {
		if a.at.After(t) {
			return a.at
		}
	}
	return time.Time{}
}

func (f *policyFleet) notify() {
	select {
	case f.changed <- struct{}{}:
	default:
	}
}

func (f *policyFleet) setAll(task string, b behaviour) {
	for _, e := range f.byTask[task] {
		e.set(b)
	}
}

// allServed says whether every executor of task has received a call.
func (f *policyFleet) allServed(task string) bool {
	for _, e := range f.byTask[task] {
		if e.lastAttempt().IsZero() {
			return false
		}
	}
	return true
}

func (f *policyFleet) inFlight(task string) int {
	n := 0
	for _, e := range f.byTask[task] {
		e.mu.Lock()
		n += e.inFlight
		e.mu.Unlock()
	}
	return n
}

// attemptsOf is every attempt of call, in the order they arrived.
func (f *policyFleet) attemptsOf(call string) []attempt {
	var out []attempt
	for _, es := range f.byTask {
		for _, e := range es {
			e.mu.Lock()
			for _, a := range e.attempts {
				if a.call == call {
					out = append(out, a)
				}
			}
			e.mu.Unlock()
		}
	}
	slices.SortFunc(out, func(a, b attempt) int { return a.at.Compare(b.at) })
	return out
}

// await waits until cond holds, looking again whenever an attempt begins
// or ends.
func (f *policyFleet) await(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.After(timeout)
	for !cond() {
		select {
		case <-f.changed:
		case <-deadline:
			t.Fatalf("%s not seen within %s", what, timeout)
		}
	}
}

func perInstance(as []attempt) map[string]int {
	m := map[string]int{}
	for _, a := range as {
		m[a.instance]++
	}
	return m
}
