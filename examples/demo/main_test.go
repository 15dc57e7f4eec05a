package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

// The demo is the README's first command: it must play its whole story on
// real parts (Consul, leasehold serve, executors and a grpc-go dispatcher in
// their own processes), every step checked, and leave nothing running.
// Its refusal scene shows the dispatch policy at work: tasks exec-2 refused
// (its log says so) confirmed on exec-1 after the dispatcher's own client
// retried them, within the policy's attempts, and explain's failure rate of
// the task counting the refused attempts the dispatcher reported over LRS.
func TestDemo(t *testing.T) {
	d := playDemo(t, false, "exec-1", "exec-2", "exec-3")
	r := d.scenes.refused
	if len(r.retried) == 0 {
		t.Fatal("the refusal scene saw no task retried elsewhere")
	}
	limit := 1 + health.DefaultDispatch().NumRetries
	for _, o := range r.retried {
		if o.Instance != "exec-1" || o.Attempts < 2 || o.Attempts > limit ||
			len(o.Retried) != o.Attempts-1 {
			t.Errorf("task %s: confirmed on %s after %d attempts (%d retried), want exec-1 "+
				"after 2..%d", o.TaskID, o.Instance, o.Attempts, len(o.Retried), limit)
		}
		if l := logLine(filepath.Join(*logDir, "exec-2.log"), "task_id="+o.TaskID+" "); !strings.Contains(l, "refused a task, not started") ||
			!strings.Contains(l, "code=Unavailable") {
			t.Errorf("task %s: exec-2's log line %q, want its refusal", o.TaskID, l)
		}
	}
	m := rateLine.FindStringSubmatch(r.rateLine)
	if m == nil || m[2] == "0" {
		t.Errorf("explain's failure rate line %q, want failed calls of %s", r.rateLine, task)
	}
}

// make demo DEMO_FLAGS=--datacenters: the two-datacenter story, the same way.
func TestDemoDatacenters(t *testing.T) {
	playDemo(t, true, "dc1-exec-1", "dc1-exec-2", "dc2-exec-1", "dc2-exec-2")
}

func playDemo(t *testing.T, twoDCs bool, executors ...string) *demo {
	consultest.RequireBinary(t)
	if testing.Short() {
		t.Skip("builds three binaries and runs for ~20 s")
	}
	bins := t.TempDir()
	// Built as make demo builds them: -tags grpcnotrace, the Makefile's TAGS.
	for name, pkg := range map[string]string{"leasehold": "../../cmd/leasehold", "executor": "../executor", "dispatcher": "../dispatcher"} {
		out, err := exec.Command("go", "build", "-tags", "grpcnotrace", "-o", filepath.Join(bins, name), pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go build %s: %v\n%s", pkg, err, out)
		}
	}
	*leaseholdBin = filepath.Join(bins, "leasehold")
	*executorBin = filepath.Join(bins, "executor")
	*dispatcherBin = filepath.Join(bins, "dispatcher")
	*logDir = t.TempDir()
	*datacenters = twoDCs
	defer func() { *datacenters = false }()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	d := &demo{start: time.Now()}
	err := d.run(ctx)
	d.cleanup()
	if err != nil {
		for _, name := range append([]string{"leasehold", "dispatcher"}, executors...) {
			if b, rerr := os.ReadFile(filepath.Join(*logDir, name+".log")); rerr == nil {
				t.Logf("--- %s.log\n%s", name, b)
			}
		}
		t.Fatalf("demo: %v", err)
	}
	for _, p := range d.procs {
		select {
		case <-p.done:
		default:
			t.Errorf("%s still running after cleanup", p.name)
		}
	}
	return d
}
