package main

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
)

// The executor names the signal it drains on (SIGINT is not SIGTERM), and
// says "drained and deregistered" once both happened: Consul no longer has
// its registration.
func TestExecutorDrainsOnSIGINTSayingSo(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t)
	bin := filepath.Join(t.TempDir(), "executor")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	cmd := exec.Command(bin, "--instance", "exec-1", "--task", "work",
		"--consul", a.HTTPAddr())
	cmd.Env = append(os.Environ(), "CONSUL_HTTP_TOKEN=")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill() })
	lines := make(chan string, 100)
	go func() {
		defer close(lines)
		for s := bufio.NewScanner(stderr); s.Scan(); {
			lines <- s.Text()
		}
	}()
	var log strings.Builder
	await := func(what string) {
		t.Helper()
		deadline := time.After(30 * time.Second)
		for {
			select {
			case l, ok := <-lines:
				if !ok {
					t.Fatalf("the executor ended before %q:\n%s", what, log.String())
				}
				log.WriteString(l + "\n")
				if strings.Contains(l, what) {
					return
				}
			case <-deadline:
				t.Fatalf("no %q in the executor's log:\n%s", what, log.String())
			}
		}
	}
	await("msg=registered")
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	await("SIGINT: draining")
	await("drained and deregistered")
	for l := range lines {
		log.WriteString(l + "\n")
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("exit: %v\n%s", err, log.String())
	}
	if strings.Contains(log.String(), "SIGTERM") {
		t.Errorf("the log says SIGTERM after a SIGINT:\n%s", log.String())
	}
	services, err := a.Client().Agent().Services()
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := services["work:exec-1"]; ok {
		t.Errorf("still registered after \"drained and deregistered\": %v", services)
	}
}
