package main

import (
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// The wire scan must agree with a full unmarshal.
func TestHealthyHosts(t *testing.T) {
	var es []health.Executor
	for i, state := range []health.State{health.StateActive, health.StateDraining, health.StateActive} {
		es = append(es, health.Executor{
			Registration: health.Registration{InstanceID: []string{"a", "b", "c"}[i], SessionID: "s", Generation: 1, Task: "work", Address: "127.0.0.1", Port: 9000 + i, Version: "1.0.0", Capacity: 2, State: state},
			LeaseStatus:  health.StatusPassing, LeaseFound: true, NodeChecks: health.StatusPassing,
		})
	}
	cla := translator.Endpoints("work", es, health.Dispatcher{})
	b, err := proto.Marshal(cla)
	if err != nil {
		t.Fatal(err)
	}
	set := map[string]bool{}
	healthyHosts(b, set)
	if len(set) != 2 || !set["a"] || !set["c"] || set["b"] {
		t.Fatalf("scan = %v, want a and c (b is draining)", set)
	}
}
