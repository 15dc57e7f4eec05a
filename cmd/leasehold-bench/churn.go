package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// Fleet churn: the whole fleet registers, restarts under new
// sessions and deregisters, once without leasehold and once with it watching
// (same agents, same sizes), while canaries — short leases heartbeated every
// --heartbeat — keep running: a canary that lapses without being stopped is a
// false lapse. In the steps with leasehold, canaries stop one by one (lapse →
// stop through light ADS streams, one per task type), and after each step the
// streams' endpoints are compared with a direct Consul read.

var (
	churnMode = flag.Bool("churn", false,
		"measure fleet churn instead of the lapse phases: --executors register over "+
			"--agents agents, restart under new sessions and deregister, without "+
			"leasehold and then with it watching")
	churnCanaries = flag.Int("churn-canaries", 40,
		"with --churn: executors on the short --lease heartbeated every --heartbeat throughout; "+
			"a third of them stop during the steps with leasehold (lapse → stop)")
	consulProfile = flag.String("consul-profile", "",
		"with --churn: write a 10 s CPU profile of the Consul server taken during the "+
			"--consul-profile-step with leasehold to this file (and without it to FILE.without)")
	consulProfileStep = flag.String("consul-profile-step", "restart",
		"with --consul-profile: the step profiled (register, restart or deregister)")
	churnFirst = flag.String("churn-first", "without",
		"with --churn and one run: which pass runs first, without or with (leasehold)")
	churnRuns = flag.Int("churn-runs", 3,
		"with --churn: runs, each on fresh agents, alternating which pass goes first")
)

const churnVictimEvery = 2 * time.Second

// churnStep is one measured step of a pass. lapses are, for the canaries
// stopped during the step, lease expiry → last stream without it; consulParts
// are Consul's part of them, lease expiry → the harness's own blocking query
// sees the check critical.
type churnStep struct {
	pass, step    string // pass is without or with; step is register, restart or deregister
	d             time.Duration
	changes       int
	consulCPU     time.Duration // server + clients
	leaseholdCPU  time.Duration
	requests      map[string]float64 // leasehold's Consul requests by watch kind
	wire, json    map[string]float64 // leasehold's read bytes by watch kind
	budgetWait    map[string]float64 // seconds waited for the read budget, by watch kind
	lapses        []time.Duration
	consulParts   []time.Duration
	falseLapses   int64
	viewConverged time.Duration // step end → all streams equal a direct Consul read; -1 if never
}

type churner struct {
	b        *bench
	f        *fleet
	canaries []int
	bulk     []int
	victims  []int // canaries that stop, in order
	nextVic  int
	false_   atomic.Int64
	critMu   sync.Mutex
	critSeen map[int]time.Time // stopped canaries: when the harness first saw their check critical
	steps    []churnStep
	first    string // the pass that ran first
}

const churnStart, churnEnd = "<!-- churn:start -->", "<!-- churn:end -->"

// runChurn runs --churn-runs churn runs, alternating which pass goes first,
// and writes their tables and a summary into --write.
// unshardedChurn serves the churn unsharded unless --shard-size was given:
// a task type grows from nothing past the shard size and back within a
// pass, so the shards leasehold serves change while a light stream
// subscribes to one set of names once. At 10,000 executors over 10 task
// types (1,004 registrations each with the canaries) the streams asked for
// two shards while the canaries alone were served as one cluster, and never
// held them.
func unshardedChurn() {
	given := false
	flag.Visit(func(f *flag.Flag) { given = given || f.Name == "shard-size" })
	if !given {
		*shardSize = 0
	}
}

func runChurn() error {
	if *churnFirst != "without" && *churnFirst != "with" {
		return fmt.Errorf("--churn-first %q: want without or with", *churnFirst)
	}
	if *churnRuns < 1 {
		return fmt.Errorf("--churn-runs %d: want at least 1", *churnRuns)
	}
	if s := *consulProfileStep; s != "register" && s != "restart" && s != "deregister" {
		return fmt.Errorf("--consul-profile-step %q: want register, restart or deregister", s)
	}
	if *bulkLease == 0 {
		*bulkLease = 10 * time.Minute
	}
	unshardedChurn()
	var runs []*churner
	for k := range *churnRuns {
		first := *churnFirst
		if *churnRuns > 1 {
			first = []string{"without", "with"}[k%2]
		}
		c, err := churnOnce(first)
		if err != nil {
			return fmt.Errorf("churn run %d: %w", k+1, err)
		}
		runs = append(runs, c)
		fmt.Print(c.markdown())
	}
	out := churnSummary(runs)
	for _, c := range runs {
		out += c.markdown()
	}
	fmt.Print(out)
	if *write == "" {
		return nil
	}
	return writeSection(*write, churnStart, churnEnd,
		"## Fleet churn (leasehold-bench --churn)", out)
}

// churnSummary is, per step, each run's ratio with/without and their median.
func churnSummary(runs []*churner) string {
	var b strings.Builder
	fmt.Fprintf(&b,
		"%d runs of `leasehold-bench --churn --executors %d --tasks %d --agents %d "+
			"--churn-canaries %d --lease %s --heartbeat %s%s`, %s, %d cores; passes "+
			"alternate which goes first.\n\n",
		len(runs), *executors, max(1, *tasks), *agents, *churnCanaries, *lease,
		*heartbeat, setupFlags(), time.Now().UTC().Format("2006-01-02"), runtime.NumCPU())
	b.WriteString("| step | time with ÷ without, each run | median | leasehold's reads per " +
		"change (wire / JSON), median | false lapses (all runs) | lapse → stop (all " +
		"runs) | of which Consul: expiry → its catalog shows it critical " +
		"|\n|---|---|---|---|---|---|---|\n")
	for _, step := range []string{"register", "restart", "deregister"} {
		var ratios, wire, json []float64
		var falses int64
		var lapses, consul []time.Duration
		for _, c := range runs {
			wo, wi := c.step("without", step), c.step("with", step)
			ratios = append(ratios, float64(wi.d)/float64(max(wo.d, 1)))
			wire = append(wire, sum(wi.wire)/float64(max(wi.changes, 1))/1000)
			json = append(json, sum(wi.json)/float64(max(wi.changes, 1))/1000)
			falses += wo.falseLapses + wi.falseLapses
			lapses = append(lapses, wi.lapses...)
			consul = append(consul, wi.consulParts...)
		}
		var each []string
		for _, r := range ratios {
			each = append(each, fmt.Sprintf("%.2f×", r))
		}
		fmt.Fprintf(&b, "| %s %d | %s | %.2f× | %.1f KB / %.1f KB | %d | %s | %s |\n",
			step, *executors, strings.Join(each, ", "), median(ratios), median(wire),
			median(json), falses, dist(lapses), dist(consul))
	}
	b.WriteString("\n")
	return b.String()
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// step is the measured step of a pass ("without" or "with").
func (c *churner) step(pass, step string) churnStep {
	for _, s := range c.steps {
		if s.pass == pass && s.step == step {
			return s
		}
	}
	return churnStep{}
}

// churnOnce is one churn run on fresh agents.
func churnOnce(first string) (*churner, error) {
	ctx, cancel := context.WithCancel(context.Background())
	b := &bench{ctx: ctx}
	defer b.close()
	defer cancel()
	if err := b.startConsul(); err != nil {
		return nil, err
	}
	n := *churnCanaries
	c := &churner{b: b, critSeen: map[int]time.Time{}}
	c.f = newFleet(b.clients, n+*executors, taskNames(*tasks), *bulkLease, func(i int) bool {
		return i < n
	})
	c.canaries, c.bulk = span(0, n), span(n, n+*executors)
	for k, i := range c.canaries {
		if k%3 == 0 {
			c.victims = append(c.victims, i)
		}
	}
	logf("churn: %d executors over %d task types and %d agents; %d canaries on lease %s "+
		"(heartbeat %s); the rest on lease %s",
		*executors, len(c.f.tasks), len(b.clients), n, *lease, *heartbeat, *bulkLease)
	if err := c.f.registerEach(c.canaries, 1); err != nil {
		return nil, err
	}
	go c.f.heartbeatAll(ctx)
	go c.watchFalseLapses(ctx)
	c.first = first
	passes := []string{"without", "with"}
	if first == "with" {
		passes = []string{"with", "without"}
	}
	for _, pass := range passes {
		if err := c.pass(pass == "with"); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// pass registers the bulk, restarts it under new sessions and deregisters it.
func (c *churner) pass(with bool) error {
	b := c.b
	name := "without"
	var ds *dispatcherSet
	if with {
		name = "with"
		srv, err := startServe(b.agent.HTTPAddr())
		if err != nil {
			return err
		}
		b.srv = srv
		defer func() { srv.stop(); b.srv = nil }()
		dctx, stop := context.WithCancel(b.ctx)
		defer stop()
		if ds, err = startDispatchers(dctx, srv.xds, len(c.f.tasks), c.f.tasks,
			c.f.shards(), *streamsPerConn); err != nil {
			return err
		}
		if d := c.converge(ds, 60*time.Second); d < 0 {
			return fmt.Errorf("the streams never held the canaries")
		}
		// The victims stop during the steps and lapse up to a lease after a
		// step's end; their lapse → stop is measured on its own, and the
		// view's catch-up is with the rest of the fleet.
		var victims []string
		for _, i := range c.victims {
			victims = append(victims, c.f.ids[i])
		}
		ds.ignoreMoves(victims)
	}
	gen := c.f.gens[c.bulk[0]].Load()
	for _, step := range []struct {
		name string
		do   func() error
	}{
		{"register", func() error { return c.f.registerEach(c.bulk, gen+1) }},
		{"restart", func() error { return c.f.registerEach(c.bulk, gen+2) }},
		{"deregister", func() error { return c.f.deregisterEach(c.bulk) }},
	} {
		s := churnStep{pass: name, step: step.name, changes: len(c.bulk)}
		before := c.reading()
		falseBefore := c.false_.Load()
		start := time.Now()
		var lapses sync.WaitGroup
		var mu sync.Mutex
		done := make(chan struct{})
		if with && step.name != "deregister" {
			go c.stopVictims(done, ds, &lapses, &mu, &s.lapses, &s.consulParts)
		}
		go c.f.progress(done, 15*time.Second)
		if step.name == *consulProfileStep && *consulProfile != "" {
			path := *consulProfile
			if !with {
				path += ".without"
			}
			go c.profileConsul(path)
		}
		if with && step.name == "restart" {
			b.profile(10 * time.Second) // leasehold serve's profile, with --profile
		}
		err := step.do()
		s.d = time.Since(start)
		close(done)
		if err != nil {
			return fmt.Errorf("%s %s: %w", name, step.name, err)
		}
		if with {
			s.viewConverged = c.converge(ds, 60*time.Second)
		}
		lapses.Wait()
		after := c.reading()
		s.falseLapses = c.false_.Load() - falseBefore
		s.consulCPU = after.consul - before.consul
		s.leaseholdCPU = after.leasehold - before.leasehold
		s.requests, s.wire, s.json, s.budgetWait = diffMap(after.requests, before.requests),
			diffMap(after.wire, before.wire), diffMap(after.json, before.json),
			diffMap(after.wait, before.wait)
		c.steps = append(c.steps, s)
		logf("churn %s leasehold: %s of %d in %s (false lapses %d, view converged after %s, "+
			"lapse → stop %s; of which Consul %s)", name, step.name, s.changes, r(s.d),
			s.falseLapses, r(s.viewConverged), dist(s.lapses), dist(s.consulParts))
	}
	return nil
}

// stopVictims stops the next canary every churnVictimEvery until done and
// measures each one's lapse → stop.
func (c *churner) stopVictims(
	done <-chan struct{}, ds *dispatcherSet, wg *sync.WaitGroup,
	mu *sync.Mutex, out, consul *[]time.Duration,
) {
	t := time.NewTicker(churnVictimEvery)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
		}
		mu.Lock()
		if c.nextVic >= len(c.victims) {
			mu.Unlock()
			return
		}
		i := c.victims[c.nextVic]
		c.nextVic++
		mu.Unlock()
		expiry := c.f.stop(i)
		wg.Add(1)
		go func() {
			defer wg.Done()
			lat, err := c.f.lapseLatencies(ds, []int{i}, []time.Time{expiry})
			if err != nil {
				logf("churn: %v", err)
			}
			c.critMu.Lock()
			seen, ok := c.critSeen[i]
			c.critMu.Unlock()
			mu.Lock()
			*out = append(*out, lat...)
			if ok && len(lat) > 0 {
				*consul = append(*consul, seen.Sub(expiry))
			}
			mu.Unlock()
		}()
	}
}

// converge waits until every stream holds exactly the executors a direct
// Consul read shows passing for its task type (apart from the endpoints
// whose moves ds ignores), confirmed by a second read,
// and returns how long after start the streams came to hold it: the time of
// the last change of any stream's set, 0 if none changed since start, -1 if
// not within timeout. The time is the streams' own, not that of this check:
// one read of the truth (every task type's health, with checks) takes this
// harness about a second at 10,000 executors, and a check that counted its
// own reads could not report less than two of them.
func (c *churner) converge(ds *dispatcherSet, timeout time.Duration) time.Duration {
	start := time.Now()
	for time.Since(start) < timeout {
		truth, err := c.passing()
		if err == nil {
			if ds.awaitAll(func(task string, set map[string]bool) bool {
				return equalApart(set, truth[task], ds.ignore)
			}, 2*time.Second) == nil {
				// The truth may have moved while the streams caught up, so it is
				// read again; so may the streams while it was.
				held := ds.lastMoved()
				if again, err := c.passing(); err == nil && equalTruth(again, truth) &&
					ds.lastMoved().Equal(held) {
					return max(held.Sub(start), 0)
				}
			}
		}
	}
	return -1
}

// passing is, per task type, the instances Consul shows with every check
// passing, read from the server.
func (c *churner) passing() (map[string]map[string]bool, error) {
	out := map[string]map[string]bool{}
	for _, task := range c.f.tasks {
		entries, _, err := c.b.clients[0].Health().Service(task, health.DefaultTag, true, nil)
		if err != nil {
			return nil, err
		}
		set := map[string]bool{}
		for _, e := range entries {
			set[e.Service.Meta[health.MetaInstanceID]] = true
		}
		out[task] = set
	}
	return out, nil
}

func equalSets(a, b map[string]bool) bool {
	if len(a) != len(b) {
		return false
	}
	for k := range a {
		if !b[k] {
			return false
		}
	}
	return true
}

// equalApart is equalSets apart from the keys in ignore.
func equalApart(a, b, ignore map[string]bool) bool {
	n := 0
	for k := range a {
		if ignore[k] {
			continue
		}
		if !b[k] {
			return false
		}
		n++
	}
	for k := range b {
		if !ignore[k] {
			n--
		}
	}
	return n == 0
}

func equalTruth(a, b map[string]map[string]bool) bool {
	if len(a) != len(b) {
		return false
	}
	for k := range a {
		if !equalSets(a[k], b[k]) {
			return false
		}
	}
	return true
}

// watchFalseLapses follows Consul's critical checks: one of a running,
// never-stopped executor's current session is a false lapse.
func (c *churner) watchFalseLapses(ctx context.Context) {
	byID := map[string]int{}
	for i, id := range c.f.ids {
		byID[id] = i
	}
	seen := map[string]uint64{}
	var index uint64
	for ctx.Err() == nil {
		checks, meta, err := c.b.clients[0].Health().State(api.HealthCritical,
			(&api.QueryOptions{WaitIndex: index, WaitTime: 10 * time.Second}).WithContext(ctx))
		if err != nil {
			time.Sleep(time.Second) // back-off of a harness read, not a wait for a result
			index = 0
			continue
		}
		index = meta.LastIndex
		for _, ch := range checks {
			inst, session, _, ok := health.ParseCheckID(ch.CheckID)
			i, known := byID[inst]
			if ok && known && c.f.stopped[i].Load() {
				c.critMu.Lock()
				if _, was := c.critSeen[i]; !was {
					c.critSeen[i] = time.Now()
				}
				c.critMu.Unlock()
			}
			if !ok || !known || c.f.stopped[i].Load() || !c.f.registered[i].Load() ||
				session != c.f.sessionOf(i) || seen[ch.CheckID] == ch.ModifyIndex {
				continue
			}
			seen[ch.CheckID] = ch.ModifyIndex
			c.false_.Add(1)
			logf("churn: FALSE LAPSE of %s (session %s): %q", inst, session, ch.Output)
		}
	}
}

type churnReading struct {
	consul, leasehold          time.Duration
	requests, wire, json, wait map[string]float64
}

func (c *churner) reading() churnReading {
	u := c.b.consulCPU()
	rd := churnReading{consul: u.server + u.clients}
	if s := c.b.srv; s != nil {
		rd.leasehold = s.cpu()
		rd.requests, _ = s.metricBy("leasehold_consul_requests_total", "watch")
		rd.wait, _ = s.metricBy("leasehold_consul_read_budget_wait_seconds_total", "watch")
		if text, err := s.metricsText(); err == nil {
			rd.wire = samplesWhere(text, "leasehold_consul_read_bytes_total",
				"watch", `encoding="wire"`)
			rd.json = samplesWhere(text, "leasehold_consul_read_bytes_total",
				"watch", `encoding="json"`)
		}
	}
	return rd
}

// metricsText is leasehold's /metrics.
func (s *served) metricsText() (string, error) {
	resp, err := http.Get("http://" + s.admin + "/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// samplesWhere is samplesBy over the samples whose labels contain match.
func samplesWhere(text, name, label, match string) map[string]float64 {
	var keep []string
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, name+"{") && strings.Contains(line, match) {
			keep = append(keep, line)
		}
	}
	return samplesBy(strings.Join(keep, "\n"), name, label)
}

func diffMap(after, before map[string]float64) map[string]float64 {
	out := map[string]float64{}
	for k, v := range after {
		out[k] = v - before[k]
	}
	return out
}

// registerEach registers executors ids under generation gen (the session
// s<gen>): the generation key first, as the Registrar does, then the
// service with its TTL check (replacing the previous session's), then one
// heartbeat with the load.
func (f *fleet) registerEach(ids []int, gen uint64) error {
	f.done.Store(0)
	return parallel(len(ids), registerWorkers(len(f.agents)), func(k int) error {
		defer f.done.Add(1)
		i := ids[k]
		task := f.taskOf(i)
		client := f.agents[agentOf(i, len(f.agents))]
		if _, err := client.KV().Put(&api.KVPair{Key: health.GenerationKey(f.ids[i]),
			Value: []byte(strconv.FormatUint(gen, 10))}, nil); err != nil {
			return fmt.Errorf("generation of %s: %w", f.ids[i], err)
		}
		session := fmt.Sprintf("s%d", gen)
		reg := health.Registration{InstanceID: f.ids[i], SessionID: session, Generation: gen,
			Task: task, Address: "127.0.0.1", Port: 20000 + i, Version: "1.0.0", Capacity: 8,
			State: health.StateActive}
		sent := time.Now()
		err := client.Agent().ServiceRegisterOpts(&api.AgentServiceRegistration{
			ID: health.ServiceID(reg.InstanceID, task), Name: task,
			Tags: []string{health.DefaultTag}, Address: reg.Address, Port: reg.Port,
			Meta: reg.Meta(),
			Checks: api.AgentServiceChecks{{CheckID: health.CheckID(reg.InstanceID, session, task),
				TTL: f.leaseOf(i).String(), Status: "passing",
				DeregisterCriticalServiceAfter: "10m"}},
		}, api.ServiceRegisterOpts{ReplaceExistingChecks: true})
		if err != nil {
			return fmt.Errorf("register %s: %w", reg.InstanceID, err)
		}
		f.gens[i].Store(gen)
		f.lastAck[i].Store(sent.UnixNano())
		f.registered[i].Store(true)
		f.beat(i)
		return nil
	})
}

// deregisterEach deregisters executors ids (their generation keys stay, as
// a Registrar leaves them).
func (f *fleet) deregisterEach(ids []int) error {
	f.done.Store(0)
	return parallel(len(ids), registerWorkers(len(f.agents)), func(k int) error {
		defer f.done.Add(1)
		i := ids[k]
		f.registered[i].Store(false)
		if err := f.agent(i).ServiceDeregister(
			health.ServiceID(f.ids[i], f.taskOf(i))); err != nil {
			return fmt.Errorf("deregister %s: %w", f.ids[i], err)
		}
		return nil
	})
}

func (c *churner) markdown() string {
	var b strings.Builder
	fmt.Fprintf(&b,
		"\n`leasehold-bench --churn --executors %d --tasks %d --agents %d --churn-canaries %d "+
			"--lease %s --heartbeat %s --churn-first %s%s` (load average %s at its end)\n\n",
		*executors, len(c.f.tasks), len(c.b.clients), *churnCanaries,
		*lease, *heartbeat, c.first, setupFlags(), loadAverage())
	b.WriteString("| step | without leasehold | with leasehold | ratio | Consul CPU without / " +
		"with | leasehold CPU | leasehold read per change (wire / JSON) | by watch (JSON " +
		"per change) | budget wait | requests | false lapses | lapse → stop | view = " +
		"Consul after |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, step := range []string{"register", "restart", "deregister"} {
		var wo, wi churnStep
		for _, s := range c.steps {
			if s.step == step && s.pass == "without" {
				wo = s
			} else if s.step == step {
				wi = s
			}
		}
		per := func(m map[string]float64) float64 { return sum(m) / float64(max(wi.changes, 1)) }
		var by []string
		for _, k := range slices.Sorted(maps.Keys(wi.json)) {
			by = append(by,
				fmt.Sprintf("%s %.1f KB", k, wi.json[k]/float64(max(wi.changes, 1))/1000))
		}
		var reqs []string
		for _, k := range slices.Sorted(maps.Keys(wi.requests)) {
			reqs = append(reqs, fmt.Sprintf("%s %.0f", k, wi.requests[k]))
		}
		fmt.Fprintf(&b,
			"| %s %d | %s | %s | %.2f× | %s / %s | %s | %.1f KB / %.1f KB | %s | %.1f s "+
				"| %s | %d / %d | %s | %s |\n",
			step, wi.changes, r(wo.d), r(wi.d), float64(wi.d)/float64(max(wo.d, 1)),
			r(wo.consulCPU), r(wi.consulCPU), r(wi.leaseholdCPU),
			per(wi.wire)/1000, per(wi.json)/1000, strings.Join(by, ", "), sum(wi.budgetWait),
			strings.Join(reqs, ", "), wo.falseLapses, wi.falseLapses, dist(wi.lapses),
			r(wi.viewConverged))
	}
	return b.String()
}

func sum(m map[string]float64) float64 {
	var s float64
	for _, v := range m {
		s += v
	}
	return s
}

// profileConsul writes a 10 s CPU profile of the Consul server (enable_debug).
func (c *churner) profileConsul(path string) {
	resp, err := http.Get("http://" + c.b.agent.HTTPAddr() + "/debug/pprof/profile?seconds=10")
	if err != nil {
		logf("consul profile: %v", err)
		return
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil {
		err = os.WriteFile(path, b, 0o644)
	}
	if err != nil {
		logf("consul profile: %v", err)
	}
}
