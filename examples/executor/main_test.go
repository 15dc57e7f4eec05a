package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/examples/workpb"
)

var (
	buildOnce sync.Once
	built     string
	buildErr  error
)

// executorBinary builds the executor once for the package's tests, as make
// builds it (-tags grpcnotrace, the Makefile's TAGS: the build cache is then
// shared with the other tests' builds).
func executorBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "executor-test")
		if err != nil {
			buildErr = err
			return
		}
		built = filepath.Join(dir, "executor")
		if out, err := exec.Command("go", "build", "-tags", "grpcnotrace", "-o", built, ".").CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return built
}

func TestMain(m *testing.M) {
	code := m.Run()
	if built != "" {
		os.RemoveAll(filepath.Dir(built))
	}
	os.Exit(code)
}

// executor is a running example executor and its log.
type executor struct {
	t     *testing.T
	cmd   *exec.Cmd
	lines chan string
	log   strings.Builder
}

// startExecutor runs the executor as instance exec-1 of task work against
// agent a, with more flags.
func startExecutor(t *testing.T, a *consultest.Agent, flags ...string) *executor {
	t.Helper()
	cmd := exec.Command(executorBinary(t), append([]string{"--instance", "exec-1", "--task", "work",
		"--consul", a.HTTPAddr()}, flags...)...)
	cmd.Env = append(os.Environ(), "CONSUL_HTTP_TOKEN=")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	e := &executor{t: t, cmd: cmd, lines: make(chan string, 100)}
	go func() {
		defer close(e.lines)
		for s := bufio.NewScanner(stderr); s.Scan(); {
			e.lines <- s.Text()
		}
	}()
	return e
}

// await reads the log until a line containing every one of what.
func (e *executor) await(what ...string) {
	e.t.Helper()
	deadline := time.After(30 * time.Second)
	for {
		select {
		case l, ok := <-e.lines:
			if !ok {
				e.t.Fatalf("the executor ended before %q:\n%s", what, e.log.String())
			}
			e.log.WriteString(l + "\n")
			all := true
			for _, w := range what {
				all = all && strings.Contains(l, w)
			}
			if all {
				return
			}
		case <-deadline:
			e.t.Fatalf("no %q in the executor's log:\n%s", what, e.log.String())
		}
	}
}

// dial connects to the executor's registered address.
func dial(t *testing.T, a *consultest.Agent) *grpc.ClientConn {
	t.Helper()
	services, err := a.Client().Agent().Services()
	if err != nil {
		t.Fatal(err)
	}
	s, ok := services["work:exec-1"]
	if !ok {
		t.Fatalf("work:exec-1 not registered: %v", services)
	}
	conn, err := grpc.NewClient(fmt.Sprintf("%s:%d", s.Address, s.Port),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// startRun sends one task as a stream, so that its response headers can be
// read before it ends.
func startRun(ctx context.Context, t *testing.T, conn *grpc.ClientConn, id string,
	d time.Duration) grpc.ClientStream {
	t.Helper()
	cs, err := conn.NewStream(ctx, &grpc.StreamDesc{StreamName: "Run"},
		"/"+workpb.Work_ServiceDesc.ServiceName+"/Run")
	if err != nil {
		t.Fatal(err)
	}
	if err := cs.SendMsg(&workpb.RunRequest{TaskId: id,
		DurationMs: uint32(d.Milliseconds())}); err != nil {
		t.Fatal(err)
	}
	if err := cs.CloseSend(); err != nil {
		t.Fatal(err)
	}
	return cs
}

// The executor names the signal it drains on (SIGINT is not SIGTERM), and
// says "drained and deregistered" once both happened: Consul no longer has
// its registration.
func TestExecutorDrainsOnSIGINTSayingSo(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t)
	e := startExecutor(t, a)
	e.await("msg=registered")
	if err := e.cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	e.await("SIGINT: draining")
	e.await("drained and deregistered")
	for l := range e.lines {
		e.log.WriteString(l + "\n")
	}
	if err := e.cmd.Wait(); err != nil {
		t.Fatalf("exit: %v\n%s", err, e.log.String())
	}
	if strings.Contains(e.log.String(), "SIGTERM") {
		t.Errorf("the log says SIGTERM after a SIGINT:\n%s", e.log.String())
	}
	services, err := a.Client().Agent().Services()
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := services["work:exec-1"]; ok {
		t.Errorf("still registered after \"drained and deregistered\": %v", services)
	}
}

// The executor contract: a task the executor started is committed at once
// (its response headers arrive while it runs, so no client retries it
// whatever comes after) and, still running when the executor stops, is
// answered ABORTED, never UNAVAILABLE (a closed connection would be); a task
// sent while it drains is refused UNAVAILABLE without headers (not started,
// retryable).
func TestExecutorNeverAnswersNotStartedForATaskItStarted(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t)
	e := startExecutor(t, a, "--drain-timeout", "1500ms")
	e.await("msg=registered")
	conn := dial(t, a)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	cs := startRun(ctx, t, conn, "t1", 20*time.Second)
	hctx, hcancel := context.WithTimeout(ctx, 5*time.Second)
	defer hcancel()
	header := make(chan metadata.MD, 1)
	go func() {
		md, _ := cs.Header()
		header <- md
	}()
	select {
	case md := <-header:
		if got := md.Get("accepted-by"); len(got) != 1 || !strings.HasPrefix(got[0], "exec-1 ") {
			t.Fatalf("a started task's response headers: %v, want accepted-by exec-1 <session>", md)
		}
	case <-hctx.Done():
		t.Fatal("no response headers 5s into a 20s task: the call is not committed while it runs")
	}

	if err := e.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	e.await("SIGTERM: draining")
	var md metadata.MD
	_, err := workpb.NewWorkClient(conn).Run(ctx, &workpb.RunRequest{TaskId: "t2"},
		grpc.Header(&md))
	if status.Code(err) != codes.Unavailable || len(md.Get("accepted-by")) > 0 {
		t.Errorf("a task sent while draining: %v, headers %v; want UNAVAILABLE without headers",
			err, md)
	}
	e.await("refused a task, not started", "task_id=t2", "code=Unavailable")

	err = cs.RecvMsg(&workpb.RunResult{})
	if status.Code(err) != codes.Aborted {
		t.Errorf("a started task when the executor stopped: %v, want ABORTED", err)
	}
}

// SIGUSR2 makes the executor refuse every task, UNAVAILABLE without
// headers (nothing started), logging which; a second SIGUSR2 ends it.
func TestExecutorRefusesEveryTaskBetweenTwoSIGUSR2(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t)
	e := startExecutor(t, a)
	e.await("msg=registered")
	conn := dial(t, a)
	work := workpb.NewWorkClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	if err := e.cmd.Process.Signal(syscall.SIGUSR2); err != nil {
		t.Fatal(err)
	}
	e.await("SIGUSR2", "refusing=true")
	var md metadata.MD
	_, err := work.Run(ctx, &workpb.RunRequest{TaskId: "t1"}, grpc.Header(&md))
	if status.Code(err) != codes.Unavailable || len(md.Get("accepted-by")) > 0 {
		t.Errorf("refusing: %v, headers %v; want UNAVAILABLE without headers", err, md)
	}
	e.await("refused a task, not started", "task_id=t1", "code=Unavailable")

	if err := e.cmd.Process.Signal(syscall.SIGUSR2); err != nil {
		t.Fatal(err)
	}
	e.await("SIGUSR2", "refusing=false")
	res, err := work.Run(ctx, &workpb.RunRequest{TaskId: "t2"}, grpc.Header(&md))
	if err != nil || res.GetInstanceId() != "exec-1" || len(md.Get("accepted-by")) != 1 {
		t.Errorf("after the second SIGUSR2: %v, %v, headers %v; want the task run", res, err, md)
	}
}
