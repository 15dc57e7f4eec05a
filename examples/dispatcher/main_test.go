package main

import (
	"context"
	"flag"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/leasehold/leasehold/examples/workpb"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// refusingWork answers every task UNAVAILABLE (not started), counting calls.
type refusingWork struct{ calls atomic.Int64 }

func (w *refusingWork) Run(context.Context, *workpb.RunRequest,
	...grpc.CallOption) (*workpb.RunResult, error) {
	w.calls.Add(1)
	return nil, status.Error(codes.Unavailable, "draining: no new tasks")
}

// One call per task, whatever the flags: a refusal (UNAVAILABLE, not
// started) is retried by the dispatch policy leasehold sends to the
// dispatcher's xDS client, within its bounds, never again by the dispatcher,
// whose own retries would multiply the policy's.
func TestDispatcherCallsOncePerTaskLeavingRetriesToThePolicy(t *testing.T) {
	var o options
	fs := flag.NewFlagSet("dispatcher", flag.ContinueOnError)
	defineFlags(fs, &o)
	if err := fs.Parse([]string{"--bootstrap", "d1.json", "--work", "0s"}); err != nil {
		t.Fatal(err)
	}
	work := &refusingWork{}
	oc := dispatch(context.Background(), work, leaseholdv1.NewFencingClient(nil), "t1", o)
	if n := work.calls.Load(); n != 1 {
		t.Errorf("%d calls for one task refused UNAVAILABLE, want 1", n)
	}
	if oc.Result != "failed" || !strings.Contains(oc.Error, "Unavailable") {
		t.Errorf("outcome %+v, want failed with the refusal", oc)
	}
}

// Bad flags are refused naming each flag; good ones pass.
func TestOptionsValidate(t *testing.T) {
	good := options{task: "work", bootstrap: "d1.json", rate: 5, work: time.Second, timeout: time.Second, maxInFlight: 1}
	if err := good.validate(); err != nil {
		t.Fatalf("valid options refused: %v", err)
	}
	bad := options{task: "a/b", rate: 0, work: -1, count: -1, timeout: 0, maxInFlight: 0}
	t.Setenv(bootstrapEnv, "")
	t.Setenv("GRPC_XDS_BOOTSTRAP_CONFIG", "")
	err := bad.validate()
	if err == nil {
		t.Fatal("invalid options accepted")
	}
	for _, f := range []string{"--task", "--rate", "--work", "--count", "--timeout", "--max-in-flight", "--bootstrap"} {
		if !strings.Contains(err.Error(), f) {
			t.Errorf("error does not name %s: %v", f, err)
		}
	}
}

// refusingServer is a Work server that refuses every task, as an executor
// does when it did not start it (trailers only, UNAVAILABLE).
type refusingServer struct{ workpb.UnimplementedWorkServer }

func (refusingServer) Run(context.Context, *workpb.RunRequest) (*workpb.RunResult, error) {
	return nil, status.Error(codes.Unavailable, "full")
}

// The attempts a client's retry policy makes are in the task's outcome: how
// many, and where each one before the last went and how it ended.
func TestOutcomeShowsThePolicysAttempts(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	workpb.RegisterWorkServer(srv, refusingServer{})
	go srv.Serve(lis)
	defer srv.Stop()
	conn, err := grpc.NewClient(lis.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithStatsHandler(attemptStats{}),
		grpc.WithDefaultServiceConfig(`{"methodConfig": [{"name": [{}], "retryPolicy": {
			"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
			"backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}]}`))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	o := options{task: "work", timeout: 5 * time.Second}
	oc := dispatch(context.Background(), workpb.NewWorkClient(conn),
		leaseholdv1.NewFencingClient(conn), "t1", o)
	if oc.Result != "failed" || oc.Attempts != 3 || len(oc.Retried) != 2 {
		t.Fatalf("outcome %+v, want failed after 3 attempts, 2 of them retried", oc)
	}
	for _, r := range oc.Retried {
		if r.Executor != lis.Addr().String() || r.Code != "Unavailable" || r.Message != "full" {
			t.Errorf("retried attempt %+v, want %s Unavailable (full)", r, lis.Addr())
		}
	}
	if note := retriedNote(oc.Retried); !strings.Contains(note, "after 2 failed attempts") ||
		!strings.Contains(note, lis.Addr().String()+" Unavailable (full)") {
		t.Errorf("table note %q", note)
	}
}

// --retries is gone (the dispatch policy retries): given, it is refused
// naming the flag and saying where the retries went, not ignored.
func TestRetriesFlagIsRefusedPointingAtTheDispatchPolicy(t *testing.T) {
	var o options
	fs := flag.NewFlagSet("dispatcher", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	defineFlags(fs, &o)
	err := fs.Parse([]string{"--bootstrap", "d1.json", "--retries", "3"})
	if err == nil || !strings.Contains(err.Error(), "retries") ||
		!strings.Contains(err.Error(), "dispatch policy") {
		t.Errorf("--retries 3: %v, want it refused pointing at the dispatch policy", err)
	}
}

// Failed tasks or refused results end the run in an error (exit status 1)
// that points at leasehold explain; a run where every task was confirmed
// ends without one.
func TestFailedTasksEndInAnErrorPointingAtExplain(t *testing.T) {
	if err := outcomeError(map[string]int{"confirmed": 5, "skipped": 1}, "work"); err != nil {
		t.Fatalf("every task confirmed: %v", err)
	}
	for _, counts := range []map[string]int{{"confirmed": 3, "failed": 2}, {"refused": 1}} {
		err := outcomeError(counts, "work")
		if err == nil || !strings.Contains(err.Error(), "leasehold explain --task work") {
			t.Errorf("%v: error %v, want one pointing at leasehold explain", counts, err)
		}
	}
	if h := failureHint(codes.Unavailable, "work"); !strings.Contains(h, "leasehold explain") {
		t.Errorf("no executor routable: hint %q", h)
	}
	if h := failureHint(codes.InvalidArgument, "work"); h != "" {
		t.Errorf("a bad request is not about routing: hint %q", h)
	}
}
