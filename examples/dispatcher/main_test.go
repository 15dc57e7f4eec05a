package main

import (
	"strings"
	"testing"
	"time"
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
