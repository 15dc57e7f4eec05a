// Command demo runs the executor side of leasehold on real parts: a Consul dev
// agent on free loopback ports and example executor processes, driven through
// the failure drills of the design while a blocking-query watch prints what
// Consul (and so leasehold) sees. It exits non-zero if any step does not turn
// out as the design says.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

var (
	executorBin = flag.String("executor", "bin/executor", "example executor binary")
	lease       = flag.Duration("lease", 2*time.Second, "executor lease")
	heartbeat   = flag.Duration("heartbeat", 500*time.Millisecond, "executor heartbeat")
	verbose     = flag.Bool("v", false, "show executor logs")
)

const task = "work"

func main() {
	flag.Parse()
	if err := demo(); err != nil {
		fmt.Fprintln(os.Stderr, "demo FAILED:", err)
		os.Exit(1)
	}
	fmt.Println("\ndemo finished: every step behaved as designed")
}

func step(format string, args ...any) {
	fmt.Printf("\n== "+format+"\n", args...)
}

func demo() error {
	bin, err := consultest.Binary()
	if err != nil {
		return err
	}
	agent, err := consultest.Launch(bin, consultest.Options{NodeName: "demo"})
	if agent != nil {
		defer agent.Close()
	}
	if err != nil {
		return err
	}
	agent.SettleSync()
	c := agent.Client()
	fmt.Printf("Consul %s dev agent on %s (lease %s, heartbeat %s)\n", "1.13.9", agent.HTTPAddr(), *lease, *heartbeat)

	w := newWatcher(c)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.run(ctx)

	var procs []*executor
	defer func() {
		for _, p := range procs {
			p.kill()
		}
	}()
	start := func(instance, version string) (*executor, error) {
		p, err := startExecutor(agent.HTTPAddr(), instance, version)
		if err == nil {
			procs = append(procs, p)
		}
		return p, err
	}

	step("1. three executors register, each under a fresh session, and heartbeat")
	e1, err := start("exec-1", "1.4.0")
	if err != nil {
		return err
	}
	e2, err := start("exec-2", "1.4.0")
	if err != nil {
		return err
	}
	e3, err := start("exec-3", "1.5.0")
	if err != nil {
		return err
	}
	if err := w.await(10*time.Second, "3 passing", func(v view) bool { return v.count(api.HealthPassing) == 3 }); err != nil {
		return err
	}
	w.print()

	step("2. exec-1 takes two tasks: full, so its lease check turns warning (no new work)")
	e1.url = "http://" + w.snapshot()["exec-1"].addr // where it registered
	results := make(chan string, 4)
	for range 2 {
		go func() { results <- e1.work(4 * *lease) }()
	}
	if err := w.await(5*time.Second, "exec-1 warning", func(v view) bool { return v.status("exec-1") == api.HealthWarning }); err != nil {
		select {
		case r := <-results:
			return fmt.Errorf("%w (a task returned: %s)", err, r)
		default:
			return err
		}
	}
	w.print()

	step("3. exec-2 is frozen (SIGSTOP: a GC pause) for two leases: its lease lapses")
	old2 := w.snapshot().session("exec-2")
	t0 := time.Now()
	e2.signal(syscall.SIGSTOP)
	if err := w.await(*lease+2*time.Second, "exec-2 critical", func(v view) bool { return v.status("exec-2") == api.HealthCritical }); err != nil {
		return err
	}
	fmt.Printf("   critical %s after the freeze (lease %s)\n", time.Since(t0).Round(time.Millisecond), *lease)
	<-time.After(2**lease - time.Since(t0))
	e2.signal(syscall.SIGCONT)
	fmt.Println("   resumed: it notices the lost lease itself and comes back under a NEW session")
	if err := w.await(10*time.Second, "exec-2 new session passing", func(v view) bool {
		return v.session("exec-2") != old2 && v.status("exec-2") == api.HealthPassing
	}); err != nil {
		return err
	}
	w.print()

	step("4. exec-3 is restarted while the old process still runs (same instance id)")
	old3 := w.snapshot().session("exec-3")
	e3b, err := start("exec-3", "1.5.1")
	if err != nil {
		return err
	}
	if err := w.await(10*time.Second, "exec-3 replaced", func(v view) bool {
		return v.session("exec-3") != old3 && v.status("exec-3") == api.HealthPassing
	}); err != nil {
		return err
	}
	if err := e3.waitExit(10 * time.Second); err == nil {
		return errors.New("the superseded exec-3 process exited cleanly; want an error exit")
	}
	fmt.Println("   the old process's heartbeat was refused; it saw a newer session of its instance and exited instead of fighting")
	w.print()

	step("5. SIGTERM to exec-1 with two tasks in flight: draining, then deregistered when they finish")
	e1.signal(syscall.SIGTERM)
	if err := w.await(5*time.Second, "exec-1 draining", func(v view) bool { return v.state("exec-1") == "draining" }); err != nil {
		return err
	}
	w.print()
	for range 2 {
		fmt.Println("   task result:", <-results)
	}
	if err := w.await(15*time.Second, "exec-1 gone", func(v view) bool { return v.session("exec-1") == "" }); err != nil {
		return err
	}
	if err := e1.waitExit(10 * time.Second); err != nil {
		return fmt.Errorf("exec-1 exit: %w", err)
	}
	w.print()

	step("6. shut down the rest")
	for _, p := range []*executor{e2, e3b} {
		p.signal(syscall.SIGTERM)
	}
	for _, p := range []*executor{e2, e3b} {
		if err := p.waitExit(15 * time.Second); err != nil {
			return fmt.Errorf("%s exit: %w", p.instance, err)
		}
	}
	return w.await(5*time.Second, "nothing registered", func(v view) bool { return len(v) == 0 })
}

// executor is one example executor process.
type executor struct {
	instance string
	cmd      *exec.Cmd
	addr     chan string
	exited   chan error
	url      string
}

func startExecutor(consulAddr, instance, version string) (*executor, error) {
	cmd := exec.Command(*executorBin, "--consul", consulAddr, "--instance", instance, "--task", task,
		"--version", version, "--capacity", "2", "--lease", lease.String(), "--heartbeat", heartbeat.String(),
		"--label", "zone=eu-1")
	e := &executor{instance: instance, cmd: cmd, exited: make(chan error, 1)}
	out := io.Discard
	if *verbose {
		out = prefixWriter{"   [" + instance + "] "}
	}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s (run `make demo`, which builds it): %w", *executorBin, err)
	}
	go func() { e.exited <- cmd.Wait() }()
	fmt.Printf("   started %s (pid %d, version %s)\n", instance, cmd.Process.Pid, version)
	return e, nil
}

func (e *executor) signal(s syscall.Signal) {
	e.cmd.Process.Signal(s)
	fmt.Printf("   %s <- %s\n", e.instance, s)
}

func (e *executor) kill() {
	e.cmd.Process.Signal(syscall.SIGCONT)
	e.cmd.Process.Kill()
}

func (e *executor) waitExit(timeout time.Duration) error {
	select {
	case err := <-e.exited:
		return err
	case <-time.After(timeout):
		return fmt.Errorf("%s did not exit within %s", e.instance, timeout)
	}
}

// work sends one task to the executor at its registered address.
func (e *executor) work(d time.Duration) string {
	url := e.url
	resp, err := http.Post(url+fmt.Sprintf("/work?ms=%d", d.Milliseconds()), "", nil)
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return strings.TrimSpace(string(b))
}

// view is what Consul reports per instance.
type view map[string]row

type row struct {
	session, status, state, output, addr string
}

func (v view) count(status string) int {
	n := 0
	for _, r := range v {
		if r.status == status {
			n++
		}
	}
	return n
}
func (v view) status(i string) string  { return v[i].status }
func (v view) state(i string) string   { return v[i].state }
func (v view) session(i string) string { return v[i].session }

// watcher follows the task's health with blocking queries.
type watcher struct {
	c       *api.Client
	mu      sync.Mutex
	cur     view
	changed chan struct{}
}

func newWatcher(c *api.Client) *watcher {
	return &watcher{c: c, cur: view{}, changed: make(chan struct{})}
}

func (w *watcher) run(ctx context.Context) {
	var index uint64
	for ctx.Err() == nil {
		es, meta, err := w.c.Health().Service(task, "", false, (&api.QueryOptions{WaitIndex: index, WaitTime: 10 * time.Second}).WithContext(ctx))
		if err != nil {
			select {
			case <-ctx.Done():
			case <-time.After(200 * time.Millisecond):
			}
			continue
		}
		if meta.LastIndex < index {
			index = 0
		} else {
			index = meta.LastIndex
		}
		v := view{}
		for _, e := range es {
			sess := e.Service.Meta[health.MetaSessionID]
			r := row{session: sess, state: e.Service.Meta[health.MetaState], addr: fmt.Sprintf("%s:%d", e.Service.Address, e.Service.Port), status: api.HealthCritical}
			for _, ch := range e.Checks {
				if _, s, _, ok := health.ParseCheckID(ch.CheckID); ok && s == sess {
					r.status, r.output = ch.Status, ch.Output
				}
			}
			v[e.Service.Meta[health.MetaInstanceID]] = r
		}
		w.mu.Lock()
		w.cur = v
		close(w.changed)
		w.changed = make(chan struct{})
		w.mu.Unlock()
	}
}

func (w *watcher) snapshot() view {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.cur
}

func (w *watcher) await(timeout time.Duration, what string, cond func(view) bool) error {
	deadline := time.After(timeout)
	for {
		w.mu.Lock()
		v, ch := w.cur, w.changed
		w.mu.Unlock()
		if cond(v) {
			return nil
		}
		select {
		case <-ch:
		case <-deadline:
			return fmt.Errorf("step %q: not reached within %s", what, timeout)
		}
	}
}

func (w *watcher) print() {
	v := w.snapshot()
	ids := make([]string, 0, len(v))
	for id := range v {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	fmt.Printf("   %-8s %-10s %-9s %-8s %s\n", "instance", "session", "state", "lease", "output")
	for _, id := range ids {
		r := v[id]
		fmt.Printf("   %-8s %-10s %-9s %-8s %s\n", id, short(r.session), r.state, r.status, firstLine(r.output))
	}
}

func short(s string) string {
	if len(s) > 8 {
		return s[:8] + "…"
	}
	return s
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

type prefixWriter struct{ prefix string }

func (p prefixWriter) Write(b []byte) (int, error) {
	for _, line := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		fmt.Println(p.prefix + line)
	}
	return len(b), nil
}
