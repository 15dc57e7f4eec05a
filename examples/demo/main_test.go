package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
)

// The demo is the README's first command: it must play its whole story on
// real parts (Consul, leasehold serve, executors and a grpc-go dispatcher in
// their own processes), every step checked, and leave nothing running.
func TestDemo(t *testing.T) { playDemo(t, false, "exec-1", "exec-2", "exec-3") }

// make demo DEMO_FLAGS=--datacenters: the two-datacenter story, the same way.
func TestDemoDatacenters(t *testing.T) {
	playDemo(t, true, "dc1-exec-1", "dc1-exec-2", "dc2-exec-1", "dc2-exec-2")
}

func playDemo(t *testing.T, twoDCs bool, executors ...string) {
	consultest.RequireBinary(t)
	if testing.Short() {
		t.Skip("builds three binaries and runs for ~20 s")
	}
	bins := t.TempDir()
	for name, pkg := range map[string]string{"leasehold": "../../cmd/leasehold", "executor": "../executor", "dispatcher": "../dispatcher"} {
		out, err := exec.Command("go", "build", "-o", filepath.Join(bins, name), pkg).CombinedOutput()
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
}
