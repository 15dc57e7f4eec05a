package server

import (
	"testing"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// Explain shows what the load assignments hold: of two registrations
// claiming one socket, the one not sent is excluded as duplicate-address,
// and a host-name address as address-not-ip.
func TestExplainShowsAddressExclusions(t *testing.T) {
	ex := func(inst, address string, port int) health.Executor {
		m := member("work", inst, port, "1.0.0")
		e := health.Join(m, health.NewNonPassingSet(health.NonPassing{}))
		e.Address = address
		return e
	}
	v := fleet.NewView([]health.Executor{ex("b", "127.0.0.1", 9001), ex("a", "127.0.0.1", 9001), ex("c", "127.0.0.1", 9002), ex("d", "exec-d.internal", 9003)})
	want := map[string]string{"a": "", "b": string(health.ReasonDuplicateAddress), "c": "", "d": string(health.ReasonAddressNotIP)}
	out := explainExecutors(v, "work")
	if len(out.Executors) != len(want) {
		t.Fatalf("%d executors explained, want %d", len(out.Executors), len(want))
	}
	for _, e := range out.Executors {
		if got := e.Verdicts[0].Reason; got != want[e.InstanceID] {
			t.Errorf("%s: reason %q (%s), want %q", e.InstanceID, got, e.Verdicts[0].Detail, want[e.InstanceID])
		}
	}
}
