package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
)

var datacenters = flag.Bool("datacenters", false,
	"play the two-datacenter story instead: a dispatcher in dc1 fails over to dc2's executors "+
		"when dc1's lapse, comes back, and dc2's partition is reported")

// dcStaleAfter is leasehold's staleness bound in the datacenter story; a
// datacenter silent for longer (while another answers) is not routed.
const dcStaleAfter = 6 * time.Second

// runDatacenters is the two-datacenter story: two Consul dev servers
// federated over WAN, leasehold watching both through dc1's, two executors in
// each, one dispatcher in dc1.
func (d *demo) runDatacenters(ctx context.Context) error {
	if err := d.prepare(); err != nil {
		return err
	}
	execs, dc2, err := d.setUpDatacenters(ctx)
	if err != nil {
		return err
	}
	if err := d.localFirstScene(ctx); err != nil {
		return err
	}
	old, err := d.failoverScene(ctx, execs)
	if err != nil {
		return err
	}
	if err := d.failbackScene(ctx, execs, old); err != nil {
		return err
	}
	if err := d.partitionScene(ctx, dc2); err != nil {
		return err
	}
	d.step("summary")
	d.say("all tasks: %s", d.outcomes.summary(time.Time{}))
	if *keep {
		fmt.Printf("\nstill running (Ctrl-C to stop):\n"+
			"  readiness:    http://%s/readyz\n"+
			"  executors:    http://%s/debug/executors\n"+
			"  Consul UIs:   http://%s/ui  http://%s/ui\n"+
			"  logs:         %s\n",
			d.admin, d.admin, d.agent.HTTPAddr(), dc2.HTTPAddr(), d.logs)
		<-ctx.Done()
	}
	return nil
}

// byDC sums confirmed tasks by datacenter.
func byDC(c map[string]int) (dc1, dc2 int) {
	return c["dc1-exec-1"] + c["dc1-exec-2"], c["dc2-exec-1"] + c["dc2-exec-2"]
}

// setUpDatacenters starts Consul dc1 and dc2 federated, leasehold serve
// watching both, two executors in each and a dispatcher in dc1.
func (d *demo) setUpDatacenters(
	ctx context.Context,
) (execs map[string]*proc, dc2 *consultest.Agent, err error) {
	d.step("setting up: Consul datacenters dc1 and dc2 (federated over WAN), leasehold serve " +
		"--datacenters dc1,dc2, two executors in each, a dispatcher in dc1")
	bin, err := consultest.Binary()
	if err != nil {
		return nil, nil, err
	}
	if d.agent, err = consultest.Launch(bin,
		consultest.Options{NodeName: "demo-dc1", Datacenter: "dc1"}); err != nil {
		return nil, nil, fmt.Errorf("consul dc1: %w", err)
	}
	dc2, err = consultest.Launch(bin,
		consultest.Options{NodeName: "demo-dc2", Datacenter: "dc2", FederateWith: d.agent})
	if err != nil {
		return nil, nil, fmt.Errorf("consul dc2: %w", err)
	}
	d.agents = append(d.agents, dc2)
	if err := d.await(ctx, 30*time.Second,
		"dc2 readable through dc1 (WAN federation)", func() bool {
			_, _, err := d.agent.Client().Catalog().Services(&api.QueryOptions{Datacenter: "dc2"})
			return err == nil
		}); err != nil {
		return nil, nil, err
	}
	d.say("Consul dc1 on %s, dc2 on %s, federated", d.agent.HTTPAddr(), dc2.HTTPAddr())

	d.xdsAddr, d.admin = freeAddr(), freeAddr()
	if _, _, err := d.spawn("leasehold", false, *leaseholdBin, "serve",
		"--consul-addr", d.agent.HTTPAddr(), "--xds-addr", d.xdsAddr, "--admin-addr", d.admin,
		"--datacenters", "dc1,dc2", "--fencing-stale-after", dcStaleAfter.String()); err != nil {
		return nil, nil, err
	}
	execs = map[string]*proc{}
	for _, e := range []struct {
		id    string
		agent *consultest.Agent
	}{{"dc1-exec-1", d.agent}, {"dc1-exec-2", d.agent}, {"dc2-exec-1", dc2}, {"dc2-exec-2", dc2}} {
		p, _, err := d.spawn(e.id, false, *executorBin,
			"--instance", e.id, "--task", task, "--version", "1.4.0",
			"--capacity", "8", "--lease", lease.String(), "--heartbeat", heartbeat.String(),
			"--consul", e.agent.HTTPAddr(), "--drain-timeout", "30s")
		if err != nil {
			return nil, nil, err
		}
		execs[e.id] = p
		d.say("executor %s started, registered with %s's agent", e.id, e.agent.DC)
	}
	if err := d.await(ctx, 30*time.Second, "leasehold serve ready", func() bool {
		return httpOK("http://" + d.admin + "/readyz")
	}); err != nil {
		return nil, nil, err
	}
	d.say("leasehold serve: xDS on %s, admin on http://%s, "+
		"watching dc1 and dc2 through dc1's agent", d.xdsAddr, d.admin)

	boot := filepath.Join(d.logs, "bootstrap.json")
	if out, err := exec.Command(*leaseholdBin, "bootstrap", "--xds-addr", d.xdsAddr,
		"--node-id", dispatcher, "--datacenter", "dc1",
		"--out", boot).CombinedOutput(); err != nil {
		return nil, nil, fmt.Errorf("leasehold bootstrap: %v: %s", err, out)
	}
	_, out, err := d.spawn("dispatcher", true, *dispatcherBin,
		"--bootstrap", boot, "--task", task, "--json",
		"--rate", fmt.Sprint(*rate), "--work", "300ms", "--timeout", "20s")
	if err != nil {
		return nil, nil, err
	}
	go d.outcomes.read(out, d)
	d.say("dispatcher %s started in dc1 (leasehold bootstrap --datacenter dc1)", dispatcher)

	return execs, dc2, nil
}

// localFirstScene shows the dispatcher's own datacenter served first.
func (d *demo) localFirstScene(ctx context.Context) error {
	d.step("1. the dispatcher's own datacenter first: dc1's executors get every task, dc2's none")
	if err := d.await(ctx, 30*time.Second, "tasks confirmed on both dc1 executors", func() bool {
		c := d.outcomes.confirmedBy(time.Time{})
		return c["dc1-exec-1"] >= 3 && c["dc1-exec-2"] >= 3
	}); err != nil {
		return err
	}
	if _, in2 := byDC(d.outcomes.confirmedBy(time.Time{})); in2 > 0 {
		return fmt.Errorf("dc2's executors served %d tasks while dc1's were eligible", in2)
	}
	d.say("confirmed so far: %s", d.outcomes.summary(time.Time{}))

	return nil
}

// failoverScene freezes both dc1 executors: their leases lapse and the
// dispatcher fails over to dc2. old is dc1-exec-1's frozen session.
func (d *demo) failoverScene(ctx context.Context, execs map[string]*proc) (old string, err error) {
	d.step("2. both dc1 executors frozen (SIGSTOP): their leases lapse and the " +
		"dispatcher fails over to dc2")
	old = d.outcomes.lastSession("dc1-exec-1")
	frozen := time.Now()
	execs["dc1-exec-1"].signal(syscall.SIGSTOP)
	execs["dc1-exec-2"].signal(syscall.SIGSTOP)
	if err := d.await(ctx, *lease+5*time.Second,
		"leasehold reporting dc1-exec-1's session LAPSED", func() bool {
			return d.sessionState("dc1-exec-1", old) == "LAPSED"
		}); err != nil {
		return "", err
	}
	lapsed := time.Now()
	d.say("dc1's sessions LAPSED %.1fs after the freeze: dc1 has no routed executor, so dc2's "+
		"are at priority 0 in the same push", lapsed.Sub(frozen).Seconds())
	if err := d.await(ctx, 10*time.Second, "tasks confirmed on dc2", func() bool {
		_, in2 := byDC(d.outcomes.confirmedBy(lapsed))
		return in2 >= 5
	}); err != nil {
		return "", err
	}
	d.say("after the failover: %s", d.outcomes.summary(lapsed))

	return old, nil
}

// failbackScene resumes dc1's executors under new sessions, and the
// dispatcher goes back to dc1.
func (d *demo) failbackScene(ctx context.Context, execs map[string]*proc, old string) error {
	d.step("3. dc1's executors resume (SIGCONT): they return under new sessions and " +
		"the dispatcher goes back to dc1")
	resumed := time.Now()
	execs["dc1-exec-1"].signal(syscall.SIGCONT)
	execs["dc1-exec-2"].signal(syscall.SIGCONT)
	if err := d.await(ctx, 20*time.Second,
		"tasks confirmed on dc1 again under new sessions", func() bool {
			s := d.outcomes.lastSessionSince("dc1-exec-1", resumed)
			in1, _ := byDC(d.outcomes.confirmedBy(resumed))
			return s != "" && s != old && in1 >= 5
		}); err != nil {
		return err
	}
	back := time.Now()
	if err := d.await(ctx, 10*time.Second, "more tasks on dc1", func() bool {
		in1, _ := byDC(d.outcomes.confirmedBy(back.Add(time.Second)))
		return in1 >= 5
	}); err != nil {
		return err
	}
	if late := d.outcomes.startedOnAfter("dc2-exec-1", "", back.Add(time.Second)) +
		d.outcomes.startedOnAfter("dc2-exec-2", "", back.Add(time.Second)); late > 0 {
		return fmt.Errorf("%d tasks went to dc2 after dc1's executors were back", late)
	}
	d.say("back on dc1: %s", d.outcomes.summary(back.Add(time.Second)))

	return nil
}

// partitionScene freezes dc2's only Consul server: leasehold reports it lost,
// and dc1's dispatcher is not disturbed.
func (d *demo) partitionScene(ctx context.Context, dc2 *consultest.Agent) error {
	d.step("4. dc2's only Consul server freezes (a partition): leasehold reports it, " +
		"dc1's dispatcher is not disturbed")
	if err := dc2.Freeze(); err != nil {
		return err
	}
	partitioned := time.Now()
	var reach map[string]struct {
		Reach  string `json:"reach"`
		Detail string `json:"detail"`
	}
	if err := d.await(ctx, dcStaleAfter+15*time.Second, "/readyz reporting dc2 lost", func() bool {
		resp, err := http.Get("http://" + d.admin + "/readyz")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var body struct {
			Datacenters map[string]struct {
				Reach  string `json:"reach"`
				Detail string `json:"detail"`
			} `json:"datacenters"`
		}
		json.NewDecoder(resp.Body).Decode(&body)
		reach = body.Datacenters
		return resp.StatusCode == http.StatusOK && reach["dc2"].Reach == "lost"
	}); err != nil {
		return err
	}
	d.say("/readyz (200: dc1 answers): dc1 %s; dc2 %s — %s (%.1fs after the freeze)",
		reach["dc1"].Reach, reach["dc2"].Reach,
		reach["dc2"].Detail, time.Since(partitioned).Seconds())
	d.say("dc2-exec-1's session: %s (its datacenter does not answer)",
		d.sessionState("dc2-exec-1", d.outcomes.lastSession("dc2-exec-1")))
	d.explain("--instance", "dc2-exec-1")
	if in1, _ := byDC(d.outcomes.confirmedBy(partitioned)); in1 < 5 {
		return fmt.Errorf("dc1's dispatcher confirmed only %d tasks on dc1 during dc2's partition",
			in1)
	}
	d.say("meanwhile in dc1: %s", d.outcomes.summary(partitioned))
	if err := dc2.Thaw(); err != nil {
		return err
	}

	return nil
}

// prepare checks the binaries and opens the log folder.
func (d *demo) prepare() error {
	for _, b := range []string{*leaseholdBin, *executorBin, *dispatcherBin} {
		if _, err := os.Stat(b); err != nil {
			return fmt.Errorf("%s missing: run `make demo` (it builds bin/leasehold, "+
				"bin/executor and bin/dispatcher)", b)
		}
	}
	d.logs = *logDir
	if d.logs == "" {
		var err error
		if d.logs, err = os.MkdirTemp("", "leasehold-demo-"); err != nil {
			return err
		}
	} else if err := os.MkdirAll(d.logs, 0o755); err != nil {
		return err
	}
	fmt.Printf("leasehold demo — logs of every process in %s\n", d.logs)
	fmt.Printf("executors hold %s leases with a heartbeat every %s (shortened from 35s/10s so "+
		"the story fits in a minute)\n", *lease, *heartbeat)
	return nil
}
