package main

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
)

// Bad flags are refused naming each flag; good ones pass.
func TestOptionsValidate(t *testing.T) {
	good := options{task: "work", bootstrap: "d1.json", rate: 5, work: time.Second, timeout: time.Second, maxInFlight: 1}
	if err := good.validate(); err != nil {
		t.Fatalf("valid options refused: %v", err)
	}
	bad := options{task: "a/b", rate: 0, work: -1, count: -1, timeout: 0, maxInFlight: 0, retries: -1}
	t.Setenv(bootstrapEnv, "")
	t.Setenv("GRPC_XDS_BOOTSTRAP_CONFIG", "")
	err := bad.validate()
	if err == nil {
		t.Fatal("invalid options accepted")
	}
	for _, f := range []string{"--task", "--rate", "--work", "--count", "--timeout", "--max-in-flight", "--retries", "--bootstrap"} {
		if !strings.Contains(err.Error(), f) {
			t.Errorf("error does not name %s: %v", f, err)
		}
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
