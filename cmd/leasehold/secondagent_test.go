package main

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// TestSecondAgentDrills: a restart reusing an instance id on another agent
// fences the old session (leasehold at once, the old process at its next
// fence check), and killing that agent's machine removes its executors when
// its serfHealth goes critical.
func TestSecondAgentDrills(t *testing.T) {
	server := consultest.Start(t)
	node2 := consultest.Start(t, consultest.Options{NodeName: "node-two", JoinClientOf: server})
	old := startExecutor(t, server, "x", "1.0.0")
	y := startExecutor(t, server, "y", "1.0.0") // keeps calls flowing throughout
	addrs := startServe(t, server)
	fc := fencingClient(t, addrs.xds)
	d := startDispatcher(t, addrs.xds, "dispatcher", map[string]any{})
	d.await(t, time.Now(), 20*time.Second, "calls to x and y", func(cs []callResult) bool {
		m := servedBy(cs)
		return m["x"] > 0 && m["y"] > 0
	})

	oldSession := old.reg.Session()
	newer := startExecutor(t, node2, "x", "1.0.0") // the same instance, another agent
	newSession := newer.reg.Session()
	if newSession.Generation <= oldSession.Generation {
		t.Fatalf("generation %d not above %d", newSession.Generation, oldSession.Generation)
	}
	stale := awaitState(t, fc, "x", oldSession.ID, leaseholdv1.SessionState_STALE)
	if stale.NewerGeneration < newSession.Generation || stale.NewerSessionId == oldSession.ID {
		t.Fatalf("stale answer %v, want a successor at generation ≥ %d",
			stale, newSession.Generation)
	}
	fenced := time.Now()
	// Both sessions of x are registered (one per agent): the old one is
	// never served again (its removal was in the cache before the answer
	// changed), and the newer one follows (STALE may come from its
	// generation in KV a moment before leasehold sees it registered).
	for next, want := openEDS(t, addrs.xds), endpointSet(newer.endpoint(), y.endpoint()); ; {
		got := next()
		if got.has("x", oldSession.ID) {
			t.Fatalf("after the restart on node two xDS serves the STALE session: %v", got)
		}
		if got.equal(want) {
			break
		}
	}
	// the old process notices at its next fence check and stops
	select {
	case <-old.reg.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the old process kept its session")
	}
	if !errors.Is(oldSession.Err(), consul.ErrLeaseLost) {
		t.Fatalf("old session cause %v", oldSession.Err())
	}
	d.await(t, fenced.Add(300*time.Millisecond), 10*time.Second, "calls to the new x",
		func(cs []callResult) bool {
			for _, c := range cs {
				if c.Instance == "x" && c.Session == newSession.ID {
					return true
				}
			}
			return false
		})
	for _, c := range d.since(fenced.Add(300 * time.Millisecond)) {
		if c.Instance == "x" && c.Session == oldSession.ID {
			t.Fatalf("call served by the fenced session")
		}
	}

	// node two dies: its executor goes when serfHealth turns critical
	node2.Kill()
	consultest.WaitService(t, server.Client(), "work", 60*time.Second,
		"node-two's executor failing", func(es []*api.ServiceEntry) bool {
			for _, e := range es {
				if e.Node.Node == "node-two" && e.Checks.AggregatedStatus() == api.HealthCritical {
					return true
				}
			}
			return false
		})
	critical := time.Now()
	d.await(t, critical.Add(time.Second), 10*time.Second, "calls after node two died",
		func(cs []callResult) bool { return servedBy(cs)["y"] > 20 })
	if n := servedBy(d.since(critical.Add(300 * time.Millisecond)))["x"]; n > 0 {
		t.Fatalf("%d calls reached the executor of a dead node", n)
	}
	if r, err := fc.CheckSession(context.Background(),
		&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: newSession.ID}); err != nil ||
		r.State != leaseholdv1.SessionState_LAPSED {
		t.Fatalf("session on the dead node: %v %v", r, err)
	}
}
