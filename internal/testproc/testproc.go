// Package testproc runs the test binary itself as a child process in a given
// mode (a frozen executor, a grpc-go dispatcher that needs its own
// environment...), reads the lines it prints and always cleans it up.
package testproc

import (
	"bufio"
	"io"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// Proc is a running child.
type Proc struct {
	Cmd   *exec.Cmd
	Lines <-chan []byte // stdout, one line at a time; closed at EOF
	// Stdin is the child's stdin, for a child that takes commands: closing
	// it tells the child to exit (the cleanup closes it).
	Stdin io.Writer
}

// Start re-runs the test binary with env added (running no tests: the
// child's TestMain reads env and takes another path). Its stderr goes to the
// test log under name. When the test ends the child is resumed if stopped,
// its stdin is closed (its signal to exit) and it is killed if it has not
// exited within 10 s.
func Start(t testing.TB, name string, env ...string) *Proc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = logWriter{t, name}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan []byte, 1024)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			lines <- append([]byte(nil), sc.Bytes()...)
		}
	}()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGCONT)
		stdin.Close()
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	return &Proc{Cmd: cmd, Lines: lines, Stdin: stdin}
}

// Signal sends sig to the child.
func (p *Proc) Signal(sig syscall.Signal) error { return p.Cmd.Process.Signal(sig) }

// WaitForExit is how a child's main loop learns to stop: it returns when the
// parent closes stdin.
func WaitForExit() { io.Copy(io.Discard, os.Stdin) }

type logWriter struct {
	t    testing.TB
	name string
}

func (w logWriter) Write(p []byte) (int, error) {
	w.t.Logf("[%s] %s", w.name, p)
	return len(p), nil
}
