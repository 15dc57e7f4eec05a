package consul

import (
	"context"
	"testing"

	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/health"
)

// TestAttackDeadNewerRegistrationWithoutKVFencesForEver: leasehold fences a
// session when any registration of its instance carries a higher generation,
// whatever its lease status (health.Fence ignores it). The Registrar's fence
// check acts on a higher generation only when that session is not critical
// (superseded) or when Consul KV holds it (overtaken). When the KV key does
// not hold it — the operator deleted the generation keys (README: "Deleting
// the keys fences nothing for ever"), KV was restored from an older
// snapshot, or a registration was written without the check-and-set — a
// dead newer registration (a crashed process's, lingering critical until
// DeregisterCriticalServiceAfter; for ever when it was registered without
// one, or straight into the catalog) keeps the live session STALE in
// leasehold while the Registrar never notices and never takes a newer
// generation (which, through highestGeneration, it would).
func TestAttackDeadNewerRegistrationWithoutKVFencesForEver(t *testing.T) {
	// leasehold's side: the live session is STALE.
	live := health.Executor{Registration: health.Registration{InstanceID: "exec-1", SessionID: "mine", Generation: 5, Task: "work"}, LeaseStatus: health.StatusPassing, LeaseFound: true}
	dead := health.Executor{Registration: health.Registration{InstanceID: "exec-1", SessionID: "crashed", Generation: 6, Task: "work"}, LeaseStatus: health.StatusCritical, LeaseFound: true}
	es := []health.Executor{live, dead}
	health.Fence(es, nil) // no generation key
	if !es[0].Fenced {
		t.Fatal("premise: leasehold does not fence the live session")
	}

	// The Registrar's side: its fence check, lease after lease.
	clock := clockwork.NewFakeClock()
	agent := newFakeAgent()
	cfg := baseConfig()
	cfg.Clock = clock
	r, err := NewRegistrar(agent, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.own["mine"] = true
	sess := &Session{ID: "mine", Generation: 5}
	agent.mu.Lock()
	agent.others = []RemoteSession{
		{Node: "n1", SessionID: "mine", Generation: 5, Status: health.StatusPassing},
		{Node: "n2", SessionID: "crashed", Generation: 6, Status: health.StatusCritical},
	}
	agent.gens["exec-1"] = 0 // the key is gone
	agent.mu.Unlock()
	var st fenceState
	for range 5 {
		if got, _ := r.fenceCheck(context.Background(), sess, &st); got != "" {
			return // the Registrar moves on: fine
		}
		clock.Advance(r.cfg.Lease.TTL)
	}
	t.Fatalf("leasehold calls session mine (generation 5) STALE because of the dead registration at generation 6, but after %d leases the Registrar's fence check still sees nothing to do: the live executor is never routed again", 5)
}
