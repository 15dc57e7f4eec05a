package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/leasehold/leasehold/health"
)

// refused is what the refuse scene saw, for TestDemo: tasks the refusing
// executor turned away that the dispatcher's own client retried and had
// confirmed elsewhere, and explain's line with the task's failure rate.
type refused struct {
	retried  []outcome
	rateLine string
}

// rateLine is explain's failure rate of the demo's task, as dispatchers
// reported their calls over LRS.
var rateLine = regexp.MustCompile(`(?m)^\s*` + task +
	`: failure rate ([0-9.]+)% \(([0-9]+) failed, ([0-9]+) succeeded\).*$`)

// refuseScene makes exec-2 refuse every task (SIGUSR2: UNAVAILABLE, nothing
// started) while it keeps its lease and stays routed. Nothing in the
// dispatcher retries: the dispatch policy leasehold sends its xDS client
// (by default UNAVAILABLE and RESOURCE_EXHAUSTED, twice) does, onto exec-1.
// The refused attempts count as failed calls in what the dispatcher
// reports over LRS, and explain shows the task's failure rate.
func (d *demo) refuseScene(ctx context.Context, p *proc) error {
	d.step("1b. exec-2 refuses every task (SIGUSR2: UNAVAILABLE, not started) and stays " +
		"routed: the dispatch policy leasehold sent retries each refusal on exec-1, and the " +
		"dispatcher's load reports (LRS) show the failure rate")
	addr2, err := d.executorAddr("exec-2")
	if err != nil {
		return err
	}
	log2 := filepath.Join(d.logs, "exec-2.log")
	failedBefore, err := d.dispatchFailed()
	if err != nil {
		return err
	}
	p.signal(syscall.SIGUSR2)
	if err := d.await(ctx, 5*time.Second, "exec-2 refusing", func() bool {
		return logHas(log2, "refusing=true")
	}); err != nil {
		return err
	}
	from := time.Now()
	d.say("exec-2 (%s) refuses every task; leasehold still routes to it (its lease is "+
		"current)", addr2)
	retriedTo := func() []outcome { return d.outcomes.retriedFrom(addr2, from) }
	if err := d.await(ctx, 15*time.Second,
		"tasks refused by exec-2 retried and confirmed on exec-1", func() bool {
			return len(retriedTo()) >= 3
		}); err != nil {
		return err
	}
	retried := retriedTo()
	for _, o := range retried {
		if o.Instance != "exec-1" {
			return fmt.Errorf("task %s, refused by exec-2, was confirmed on %s", o.TaskID, o.Instance)
		}
		if l := logLine(log2, "task_id="+o.TaskID+" "); !strings.Contains(l, "refused") {
			return fmt.Errorf("task %s was retried from exec-2, whose log has no refusal of "+
				"it", o.TaskID)
		}
	}
	o := retried[0]
	d.say("dispatcher: task %s confirmed on %s after %d attempts; the first went to %s: %s (%s)",
		o.TaskID, o.Instance, o.Attempts, o.Retried[0].Executor, o.Retried[0].Code,
		o.Retried[0].Message)
	d.say("exec-2's log: %s", strings.TrimSpace(logLine(log2, "task_id="+o.TaskID+" ")))
	// Bounded: never more attempts than the policy's, and nothing confirmed
	// on exec-2 while it refused.
	limit := 1 + health.DefaultDispatch().NumRetries
	if n := d.outcomes.mostAttemptsSince(from); n > limit {
		return fmt.Errorf("a task took %d attempts: the dispatch policy allows %d", n, limit)
	}
	if c := d.outcomes.confirmedBy(from); c["exec-2"] > 0 {
		return fmt.Errorf("%d tasks confirmed on exec-2 while it refused every task", c["exec-2"])
	}
	failed := d.outcomes.failedSince(from)
	for _, o := range failed {
		if o.Attempts != limit {
			return fmt.Errorf("task %s failed after %d attempts, not the policy's %d: %s",
				o.TaskID, o.Attempts, limit, o.Error)
		}
	}
	d.say("%d tasks exec-2 refused were retried by the dispatcher's own client and confirmed on "+
		"exec-1; none took more than the policy's %d attempts", len(retried), limit)
	if len(failed) > 0 {
		// The balancer, not the retry, picks each attempt's executor.
		d.say("%d tasks failed after all %d attempts: the balancer picked exec-2 for each",
			len(failed), limit)
	}

	if err := d.await(ctx, 10*time.Second,
		"the refused attempts in the dispatcher's load reports (LRS)", func() bool {
			n, err := d.dispatchFailed()
			return err == nil && n > failedBefore
		}); err != nil {
		return err
	}
	out := d.explain()
	line := rateLine.FindString(out)
	if m := rateLine.FindStringSubmatch(out); m == nil || m[2] == "0" {
		return fmt.Errorf("explain shows no failed calls for %s:\n%s", task, out)
	}
	d.scenes.refused = refused{retried: retried, rateLine: strings.TrimSpace(line)}
	d.say("explain: %s — the refused attempts, reported by the dispatcher over LRS",
		strings.TrimSpace(line))

	p.signal(syscall.SIGUSR2)
	if err := d.await(ctx, 5*time.Second, "exec-2 taking tasks again", func() bool {
		return logHas(log2, "refusing=false")
	}); err != nil {
		return err
	}
	d.say("exec-2 takes tasks again (SIGUSR2)")
	return nil
}

// executorAddr is the address an executor registered for the demo's task.
func (d *demo) executorAddr(instance string) (string, error) {
	services, err := d.agent.Client().Agent().Services()
	if err != nil {
		return "", fmt.Errorf("consul services: %w", err)
	}
	s, ok := services[task+":"+instance]
	if !ok {
		return "", fmt.Errorf("%s is not registered", instance)
	}
	return s.Address + ":" + strconv.Itoa(s.Port), nil
}

// dispatchFailed is the failed calls of the demo's task in the last
// minute, as the dispatchers reported them over LRS.
func (d *demo) dispatchFailed() (int64, error) {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get("http://" + d.admin + "/debug/executors?task=" + task)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var body struct {
		DispatchOutcomes *struct {
			Tasks []struct {
				Task   string `json:"task"`
				Failed int64  `json:"failed"`
			} `json:"tasks"`
		} `json:"dispatch_outcomes"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return 0, fmt.Errorf("/debug/executors: %w", err)
	}
	if body.DispatchOutcomes == nil {
		return 0, fmt.Errorf("/debug/executors: no dispatch_outcomes (no LRS server?)")
	}
	for _, t := range body.DispatchOutcomes.Tasks {
		if t.Task == task {
			return t.Failed, nil
		}
	}
	return 0, nil
}

// retriedFrom lists the confirmed tasks started after t whose earlier
// attempts went to addr.
func (os *outcomes) retriedFrom(addr string, t time.Time) []outcome {
	os.mu.Lock()
	defer os.mu.Unlock()
	var out []outcome
	for _, o := range os.all {
		if o.Result != "confirmed" || !o.started().After(t) || len(o.Retried) == 0 {
			continue
		}
		for _, r := range o.Retried {
			if r.Executor == addr {
				out = append(out, o)
				break
			}
		}
	}
	return out
}

// failedSince lists the failed tasks started after t.
func (os *outcomes) failedSince(t time.Time) []outcome {
	os.mu.Lock()
	defer os.mu.Unlock()
	var out []outcome
	for _, o := range os.all {
		if o.Result == "failed" && o.started().After(t) {
			out = append(out, o)
		}
	}
	return out
}

// mostAttemptsSince is the most attempts any task started after t took.
func (os *outcomes) mostAttemptsSince(t time.Time) int {
	os.mu.Lock()
	defer os.mu.Unlock()
	n := 0
	for _, o := range os.all {
		if o.started().After(t) {
			n = max(n, o.Attempts)
		}
	}
	return n
}

// logHas says whether a log file has a line containing s.
func logHas(path, s string) bool { return logLine(path, s) != "" }

// logLine is the first line of a log file containing s ("" when none).
func logLine(path, s string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, s) {
			return l
		}
	}
	return ""
}
