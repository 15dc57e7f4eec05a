// Command demo plays leasehold's story on real parts: a Consul dev agent on
// free loopback ports, `leasehold serve`, three example gRPC executors (two
// of version 1.x, one 2.x) and the example dispatcher constrained to 1.x,
// which dials xds:///work through leasehold and confirms each result through
// the Fencing API. It then makes an executor refuse every task (the
// dispatch policy leasehold sends retries each refusal on the other; the
// refused attempts show as the task's failure rate in explain, reported over
// LRS, refuse.go), makes one busy with other work (its load reports lower
// its share of new tasks), freezes one past its lease
// (SIGSTOP, as a long GC pause would), resumes it, and drains another,
// printing a timeline and `leasehold explain` at each step. With
// --datacenters it plays the two-datacenter story instead (datacenters.go):
// failover to another datacenter, failback, and a partition reported. It
// exits non-zero if any step does not turn out as designed; every process it
// started is stopped on exit or Ctrl-C.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
)

var (
	leaseholdBin  = flag.String("leasehold", "bin/leasehold", "leasehold binary")
	executorBin   = flag.String("executor", "bin/executor", "example executor binary")
	dispatcherBin = flag.String("dispatcher", "bin/dispatcher", "example dispatcher binary")
	lease         = flag.Duration("lease", 3*time.Second, "executor lease (production default 35s)")
	heartbeat     = flag.Duration("heartbeat", time.Second,
		"executor heartbeat (production default 10s)")
	rate = flag.Float64("rate", 6, "tasks per second the dispatcher starts")
	keep = flag.Bool("keep", false,
		"after the story, keep everything running until Ctrl-C (prints the URLs to look at)")
	logDir = flag.String("logs", "",
		"folder for the processes' logs (default: a new temporary folder)")
)

const (
	task       = "work"
	dispatcher = "demo-dispatcher"
)

func main() {
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	d := &demo{start: time.Now()}
	err := d.run(ctx)
	d.cleanup()
	if err != nil {
		if ctx.Err() != nil {
			err = errors.New("interrupted")
		}
		fmt.Fprintf(os.Stderr, "\ndemo FAILED: %v\nlogs: %s\n", err, d.logs)
		os.Exit(1)
	}
	fmt.Printf("\ndemo finished: every step behaved as designed (logs: %s)\n", d.logs)
}

type demo struct {
	start    time.Time
	logs     string
	agent    *consultest.Agent
	agents   []*consultest.Agent // more agents (the datacenter story's dc2)
	procs    []*proc
	xdsAddr  string
	admin    string
	outcomes outcomes
	scenes   struct{ refused refused } // what scenes saw, for TestDemo
}

// proc is a child process in its own process group.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

func (p *proc) signal(sig syscall.Signal) { syscall.Kill(-p.cmd.Process.Pid, sig) }

func (d *demo) cleanup() {
	for i := len(d.procs) - 1; i >= 0; i-- {
		p := d.procs[i]
		select {
		case <-p.done:
			continue
		default:
		}
		p.signal(syscall.SIGCONT) // a frozen process cannot die of SIGTERM
		p.signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(3 * time.Second):
			p.signal(syscall.SIGKILL)
			<-p.done
		}
	}
	for _, a := range d.agents {
		a.Close()
	}
	if d.agent != nil {
		d.agent.Close()
	}
}

// say prints a timeline line, stamped with the seconds since the demo
// started.
func (d *demo) say(format string, args ...any) {
	fmt.Printf("%7.1fs  %s\n", time.Since(d.start).Seconds(), fmt.Sprintf(format, args...))
}

func (d *demo) step(format string, args ...any) {
	fmt.Printf("\n== "+format+"\n", args...)
}

// spawn starts a process whose output goes to logs/<name>.log (stdout to
// the returned reader instead when pipe is set).
func (d *demo) spawn(name string, pipe bool, bin string, args ...string) (*proc, io.Reader, error) {
	f, err := os.Create(filepath.Join(d.logs, name+".log"))
	if err != nil {
		return nil, nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stderr = f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	var out io.Reader
	if pipe {
		if out, err = cmd.StdoutPipe(); err != nil {
			return nil, nil, err
		}
	} else {
		cmd.Stdout = f
	}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	d.procs = append(d.procs, p)
	go func() {
		p.err = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	return p, out, nil
}

func (d *demo) run(ctx context.Context) error {
	if *datacenters {
		return d.runDatacenters(ctx)
	}
	if err := d.prepare(); err != nil {
		return err
	}
	execs, constraint, err := d.setUp(ctx)
	if err != nil {
		return err
	}
	if err := d.spreadScene(ctx, constraint); err != nil {
		return err
	}
	// A refusal (nothing started) is retried elsewhere by the dispatch
	// policy the dispatcher's own client keeps. It comes while the two
	// executors weigh the same: gRPC's retries do not avoid the executor
	// that refused, the balancer picks again, so an executor weighing more
	// (exec-2, after exec-1's busy scene) would draw the retries too.
	if err := d.refuseScene(ctx, execs["exec-2"]); err != nil {
		return err
	}
	// Load reported over ORCA weighs new work: a busier executor gets
	// less, without anything passing through Consul.
	if err := d.busyScene(ctx, execs["exec-1"]); err != nil {
		return err
	}
	fz, err := d.freezeScene(ctx, execs["exec-2"])
	if err != nil {
		return err
	}
	if err := d.resumeScene(ctx, execs["exec-2"], fz); err != nil {
		return err
	}
	if err := d.drainScene(ctx, execs["exec-1"]); err != nil {
		return err
	}
	return d.summary(ctx)
}

// setUp starts a Consul dev agent, leasehold serve, three executors and the
// dispatcher (constrained to constraint).
func (d *demo) setUp(ctx context.Context) (execs map[string]*proc, constraint string, err error) {
	d.step("setting up: a Consul dev agent, leasehold serve, three executors, one dispatcher")
	bin, err := consultest.Binary()
	if err != nil {
		return nil, "", err
	}
	d.agent, err = consultest.Launch(bin, consultest.Options{NodeName: "demo"})
	if err != nil {
		return nil, "", fmt.Errorf("consul agent: %w", err)
	}
	d.agent.SettleSync()
	d.say("Consul 1.13.9 dev agent on %s", d.agent.HTTPAddr())

	d.xdsAddr, d.admin = freeAddr(), freeAddr()
	if _, _, err := d.spawn("leasehold", false, *leaseholdBin, "serve",
		"--consul-addr", d.agent.HTTPAddr(), "--xds-addr", d.xdsAddr,
		"--admin-addr", d.admin); err != nil {
		return nil, "", err
	}
	if err := d.await(ctx, 20*time.Second, "leasehold serve ready", func() bool {
		return httpOK("http://" + d.admin + "/readyz")
	}); err != nil {
		return nil, "", err
	}
	d.say("leasehold serve: xDS on %s, admin on http://%s", d.xdsAddr, d.admin)

	execs = map[string]*proc{}
	for _, e := range []struct{ id, version string }{{"exec-1", "1.4.0"},
		{"exec-2", "1.5.0"}, {"exec-3", "2.0.0"}} {
		p, _, err := d.spawn(e.id, false, *executorBin,
			"--instance", e.id, "--task", task, "--version", e.version,
			"--capacity", "8", "--lease", lease.String(), "--heartbeat", heartbeat.String(),
			"--consul", d.agent.HTTPAddr(), "--drain-timeout", "30s")
		if err != nil {
			return nil, "", err
		}
		execs[e.id] = p
		d.say("executor %s (version %s) started", e.id, e.version)
	}

	boot := filepath.Join(d.logs, "bootstrap.json")
	constraint = ">=1.0.0, <2.0.0"
	if out, err := exec.Command(*leaseholdBin, "bootstrap", "--xds-addr", d.xdsAddr,
		"--node-id", dispatcher, "--version-constraint", constraint,
		"--out", boot).CombinedOutput(); err != nil {
		return nil, "", fmt.Errorf("leasehold bootstrap: %v: %s", err, out)
	}
	_, out, err := d.spawn("dispatcher", true, *dispatcherBin,
		"--bootstrap", boot, "--task", task, "--json",
		"--rate", fmt.Sprint(*rate), "--work", "800ms", "--timeout", "20s")
	if err != nil {
		return nil, "", err
	}
	go d.outcomes.read(out, d)
	d.say("dispatcher %s started: xds:///%s, version constraint %q (bootstrap: %s)",
		dispatcher, task, constraint, boot)

	return execs, constraint, nil
}

// spreadScene shows traffic spreading over the two 1.x executors while 2.x
// never gets any.
func (d *demo) spreadScene(ctx context.Context, constraint string) error {
	d.step("1. traffic spreads over the two 1.x executors; exec-3 (2.0.0) gets none")
	if err := d.await(ctx, 30*time.Second, "confirmed results from exec-1 and exec-2", func() bool {
		c := d.outcomes.confirmedBy(time.Time{})
		return c["exec-1"] >= 5 && c["exec-2"] >= 5
	}); err != nil {
		return err
	}
	if c := d.outcomes.confirmedBy(time.Time{}); c["exec-3"] > 0 {
		return fmt.Errorf("exec-3 (2.0.0) served %d tasks of a dispatcher constrained to %q",
			c["exec-3"], constraint)
	}
	d.say("confirmed so far: %s", d.outcomes.summary(time.Time{}))
	d.explain("--dispatcher", dispatcher)

	return nil
}

// frozen is what the freeze scene leaves for the next: the frozen
// executor's old session, when it froze, and when its lapse reached the
// dispatcher.
type frozen struct {
	session     string
	at, settled time.Time
}

// freezeScene freezes an executor: its lease lapses, routing to it stops
// within the lease, and the dispatcher goes on with the other one.
func (d *demo) freezeScene(ctx context.Context, p *proc) (frozen, error) {
	d.step("2. exec-2 is frozen (SIGSTOP, like a long GC pause) for two leases")
	old2 := d.outcomes.lastSession("exec-2")
	frozenAt := time.Now()
	p.signal(syscall.SIGSTOP)
	d.say("exec-2 frozen (session %s); its lease lapses at most %s after its last heartbeat",
		short(old2), *lease)
	if err := d.await(ctx, *lease+5*time.Second,
		"leasehold reporting exec-2's session LAPSED", func() bool {
			return d.sessionState("exec-2", old2) == "LAPSED"
		}); err != nil {
		return frozen{}, err
	}
	d.say("leasehold: session %s of exec-2 is LAPSED (%.1fs after the freeze); its "+
		"endpoint is gone from every snapshot", short(old2), time.Since(frozenAt).Seconds())
	settled := time.Now().Add(500 * time.Millisecond) // time for the dispatchers to ACK the push
	if err := d.await(ctx, 10*time.Second,
		"tasks started after the lapse confirmed on exec-1", func() bool {
			return d.outcomes.confirmedBy(settled)["exec-1"] >= 5
		}); err != nil {
		return frozen{}, err
	}
	d.say("the dispatcher keeps working: %s since the lapse", d.outcomes.summary(settled))
	d.explain("--instance", "exec-2")
	if wait := 2**lease - time.Since(frozenAt); wait > 0 {
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return frozen{}, ctx.Err()
		}
	}
	return frozen{session: old2, at: frozenAt, settled: settled}, nil
}

// resumeScene resumes the frozen executor: its old session is refused, and
// it returns under a new one.
func (d *demo) resumeScene(ctx context.Context, p *proc, fz frozen) error {
	old2, frozenAt, settled := fz.session, fz.at, fz.settled
	d.step("3. exec-2 resumes (SIGCONT): its old session is refused, it comes back under a new one")
	resumed := time.Now()
	p.signal(syscall.SIGCONT)
	var new2 string
	if err := d.await(ctx, 20*time.Second, "exec-2 serving again under a new session", func() bool {
		new2 = d.outcomes.lastSessionSince("exec-2", resumed)
		return new2 != "" && new2 != old2 && d.outcomes.confirmedBy(resumed)["exec-2"] >= 3
	}); err != nil {
		return err
	}
	d.say("exec-2 confirmed again under session %s (old session %s: %s)",
		short(new2), short(old2), d.sessionState("exec-2", old2))
	byResult := map[string]int{}
	for _, o := range d.outcomes.ofSession(old2, frozenAt) {
		byResult[o.Result]++
	}
	d.say("tasks the frozen process had accepted: %d refused by the fencing check, %d aborted by "+
		"the executor itself (its lease was lost), %d confirmed",
		byResult["refused"], byResult["failed"], byResult["confirmed"])
	if n := d.outcomes.confirmedOfSessionAfter(old2, frozenAt.Add(*lease)); n > 0 {
		return fmt.Errorf("%d results of exec-2's lapsed session were confirmed", n)
	}
	if late := d.outcomes.startedOnAfter("exec-2", old2, settled); late > 0 {
		return fmt.Errorf("%d tasks were sent to exec-2's lapsed session after the "+
			"lapse reached the dispatcher", late)
	}
	d.explain("--instance", "exec-2")

	return nil
}

// drainScene drains an executor, which takes no new tasks, finishes those in
// flight, then leaves.
func (d *demo) drainScene(ctx context.Context, p *proc) error {
	d.step("4. exec-1 drains (SIGTERM): no new tasks, in-flight tasks finish, then it deregisters")
	drain := time.Now()
	session1 := d.outcomes.lastSession("exec-1")
	p.signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(40 * time.Second):
		return errors.New("exec-1 did not finish draining within 40s")
	case <-ctx.Done():
		return ctx.Err()
	}
	if err := p.err; err != nil {
		return fmt.Errorf("exec-1 drain: %v (see %s)", err, filepath.Join(d.logs, "exec-1.log"))
	}
	d.say("exec-1 deregistered and exited %.1fs after SIGTERM", time.Since(drain).Seconds())
	n, err := inFlightAtDrain(filepath.Join(d.logs, "exec-1.log"))
	if err != nil {
		return err
	}
	var fin map[string]int
	if err := d.await(ctx, 5*time.Second,
		fmt.Sprintf("the dispatcher's results of the %d tasks in flight on exec-1", n),
		func() bool {
			fin = d.outcomes.finishedAfter(session1, drain)
			return fin["confirmed"]+fin["refused"]+fin["failed"] >= n
		}); err != nil {
		return err
	}
	d.say("%d tasks were in flight on exec-1 at SIGTERM: %d finished and "+
		"were confirmed, %d otherwise", n, fin["confirmed"], n-fin["confirmed"])
	if fin["confirmed"] != n {
		return fmt.Errorf("a draining executor must finish what it accepted: %v", fin)
	}
	after := time.Now().Add(time.Second)
	if err := d.await(ctx, 15*time.Second,
		"tasks confirmed on exec-2 after the drain", func() bool {
			return d.outcomes.confirmedBy(after)["exec-2"] >= 5
		}); err != nil {
		return err
	}
	if late := d.outcomes.startedOnAfter("exec-1", "", drain.Add(time.Second)); late > 0 {
		return fmt.Errorf("%d tasks were sent to exec-1 more than 1s after it started draining",
			late)
	}
	d.say("after the drain: %s", d.outcomes.summary(after))
	d.explain()

	return nil
}

// summary sums up; with --keep it leaves everything running until ctx ends.
func (d *demo) summary(ctx context.Context) error {
	d.step("summary")
	d.say("all tasks: %s", d.outcomes.summary(time.Time{}))
	d.say("exec-3 (2.0.0) served %d tasks: the dispatcher's version "+
		"constraint excluded it throughout", d.outcomes.confirmedBy(time.Time{})["exec-3"])
	if *keep {
		fmt.Printf("\nstill running (Ctrl-C to stop):\n"+
			"  explain:      %s explain --admin-addr %s\n"+
			"  executors:    http://%s/debug/executors\n"+
			"  dispatchers:  http://%s/debug/dispatchers\n"+
			"  metrics:      http://%s/metrics\n"+
			"  Consul UI:    http://%s/ui\n"+
			"  logs:         %s\n",
			*leaseholdBin, d.admin, d.admin, d.admin, d.admin, d.agent.HTTPAddr(), d.logs)
		<-ctx.Done()
	}
	return nil
}

// busyScene makes exec-1 report half its capacity busy with other work
// (SIGUSR1) and waits for its share of new tasks to drop under weighted
// round robin, then frees it again.
func (d *demo) busyScene(ctx context.Context, p *proc) error {
	d.step("1c. exec-1 gets busy with other work: its load reports (ORCA, in every result) show " +
		"it, and its share of new tasks drops")
	share := func(since time.Time) (float64, int) {
		c := d.outcomes.confirmedBy(since)
		n := c["exec-1"] + c["exec-2"]
		if n == 0 {
			return 0, 0
		}
		return float64(c["exec-1"]) / float64(n), n
	}
	before, _ := share(time.Time{})
	p.signal(syscall.SIGUSR1)
	busy := time.Now()
	window := busy.Add(2 * time.Second) // weights are recomputed every second
	var got float64
	if err := d.await(ctx, 20*time.Second, "exec-1's share of new tasks below 35%", func() bool {
		sh, n := share(window)
		if n < 15 {
			return false
		}
		if got = sh; sh < 0.35 {
			return true
		}
		window = time.Now() // not yet, so a fresh window starts
		return false
	}); err != nil {
		return err
	}
	d.say("exec-1's share of new tasks: %.0f%% before, %.0f%% while busy (%.1fs after it got "+
		"busy); nothing went through Consul", 100*before, 100*got, time.Since(busy).Seconds())
	p.signal(syscall.SIGUSR1)
	d.say("exec-1 is free again")
	return nil
}

// await polls cond until it holds, saying what it waits for when it takes
// more than a second.
func (d *demo) await(
	ctx context.Context, timeout time.Duration, what string, cond func() bool,
) error {
	deadline := time.Now().Add(timeout)
	told := false
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("waited %s for %s", timeout, what)
		}
		if !told && time.Until(deadline) < timeout-time.Second {
			d.say("waiting for %s (up to %s)…", what, timeout)
			told = true
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return nil
}

// explain prints `leasehold explain` as an operator would run it, and
// returns what it printed.
func (d *demo) explain(args ...string) string {
	args = append([]string{"explain", "--admin-addr", d.admin}, args...)
	out, err := exec.Command(*leaseholdBin, args...).CombinedOutput()
	fmt.Printf("\n   $ leasehold %s\n", strings.Join(args, " "))
	for _, l := range strings.Split(strings.TrimRight(string(out), "\n"), "\n") {
		fmt.Println("   " + l)
	}
	if err != nil {
		fmt.Printf("   (explain: %v)\n", err)
	}
	fmt.Println()
	return string(out)
}

// sessionState asks leasehold's fencing API (JSON on the admin port).
func (d *demo) sessionState(instance, session string) string {
	resp, err := http.Get("http://" + d.admin +
		"/v1/session?instance_id=" + instance + "&session_id=" + session)
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	var r struct {
		State string `json:"state"`
	}
	json.NewDecoder(resp.Body).Decode(&r)
	return r.State
}

// outcome is one line of the dispatcher's --json output.
type outcome struct {
	At       time.Time     `json:"at"`
	TaskID   string        `json:"task_id"`
	Instance string        `json:"instance_id"`
	Session  string        `json:"session_id"`
	Version  string        `json:"version"`
	Result   string        `json:"result"`
	State    string        `json:"session_state"`
	Error    string        `json:"error"`
	Latency  time.Duration `json:"latency_ns"`
	Attempts int           `json:"attempts"`
	Retried  []struct {
		Executor string `json:"executor"`
		Code     string `json:"code"`
		Message  string `json:"message"`
	} `json:"retried"`
}

func (o outcome) started() time.Time { return o.At.Add(-o.Latency) }

type outcomes struct {
	mu  sync.Mutex
	all []outcome
}

func (os *outcomes) read(r io.Reader, d *demo) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		var o outcome
		if json.Unmarshal(sc.Bytes(), &o) != nil || o.TaskID == "" {
			continue // the closing summary
		}
		os.mu.Lock()
		os.all = append(os.all, o)
		os.mu.Unlock()
		if o.Result != "confirmed" {
			why := o.State + o.Error
			who := ""
			if o.Instance != "" {
				who = " from " + o.Instance + " session " + short(o.Session)
			}
			if len(why) > 110 {
				why = why[:110] + "…"
			}
			d.say("  dispatcher: task %s %s%s: %s", o.TaskID, o.Result, who, why)
		}
	}
}

// confirmedBy counts confirmed results per instance of tasks started after t.
func (os *outcomes) confirmedBy(t time.Time) map[string]int {
	os.mu.Lock()
	defer os.mu.Unlock()
	c := map[string]int{}
	for _, o := range os.all {
		if o.Result == "confirmed" && o.started().After(t) {
			c[o.Instance]++
		}
	}
	return c
}

func (os *outcomes) summary(t time.Time) string {
	os.mu.Lock()
	defer os.mu.Unlock()
	by := map[string]int{}
	for _, o := range os.all {
		if !o.started().After(t) {
			continue
		}
		k := o.Result
		if o.Result == "confirmed" {
			k = "confirmed on " + o.Instance
		}
		by[k]++
	}
	var parts []string
	for k, n := range by {
		parts = append(parts, fmt.Sprintf("%d %s", n, k))
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}

func (os *outcomes) lastSession(instance string) string {
	return os.lastSessionSince(instance, time.Time{})
}

func (os *outcomes) lastSessionSince(instance string, t time.Time) string {
	os.mu.Lock()
	defer os.mu.Unlock()
	for i := len(os.all) - 1; i >= 0; i-- {
		if o := os.all[i]; o.Instance == instance &&
			o.Result == "confirmed" && o.started().After(t) {
			return o.Session
		}
	}
	return ""
}

// ofSession lists the outcomes of tasks a session accepted after t (failed
// tasks name the session in their error).
func (os *outcomes) ofSession(session string, t time.Time) []outcome {
	os.mu.Lock()
	defer os.mu.Unlock()
	var out []outcome
	for _, o := range os.all {
		if (o.Session == session || strings.Contains(o.Error, session)) && o.At.After(t) {
			out = append(out, o)
		}
	}
	return out
}

func (os *outcomes) confirmedOfSessionAfter(session string, t time.Time) int {
	n := 0
	for _, o := range os.ofSession(session, t) {
		if o.Result == "confirmed" {
			n++
		}
	}
	return n
}

// startedOnAfter counts tasks started after t that an instance (and
// session, if given) accepted.
func (os *outcomes) startedOnAfter(instance, session string, t time.Time) int {
	os.mu.Lock()
	defer os.mu.Unlock()
	n := 0
	for _, o := range os.all {
		if o.Instance == instance &&
			(session == "" || o.Session == session) && o.started().After(t) {
			n++
		}
	}
	return n
}

// finishedAfter counts by result the outcomes of a session's tasks that
// started before t and finished after it.
func (os *outcomes) finishedAfter(session string, t time.Time) map[string]int {
	os.mu.Lock()
	defer os.mu.Unlock()
	c := map[string]int{}
	for _, o := range os.all {
		if (o.Session == session || strings.Contains(o.Error, session)) &&
			o.started().Before(t) && o.At.After(t) {
			c[o.Result]++
		}
	}
	return c
}

// inFlightAtDrain reads how many tasks the executor had in flight when it
// started draining, from its log ("SIGTERM: draining ... in_flight=N").
func inFlightAtDrain(log string) (int, error) {
	b, err := os.ReadFile(log)
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if i := strings.Index(l, "in_flight="); i >= 0 && strings.Contains(l, "draining") {
			var n int
			if _, err := fmt.Sscan(l[i+len("in_flight="):], &n); err == nil {
				return n, nil
			}
		}
	}
	return 0, fmt.Errorf("%s: no \"draining ... in_flight=N\" line", log)
}

func freeAddr() string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func httpOK(url string) bool {
	c := http.Client{Timeout: time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

func short(s string) string {
	if len(s) > 8 {
		return s[:8]
	}
	return s
}
