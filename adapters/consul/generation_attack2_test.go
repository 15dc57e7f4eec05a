package consul

import (
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

// junkRegistration registers, on the same agent under another service id, a
// registration of instance victim whose generation is above 2^53 — garbage
// by the contract and for leasehold (ParseRegistration refuses it, so it
// orders nothing: health.Executor.Orders is false). A buggy sidecar that
// uses a nanosecond timestamp as its generation writes exactly such a value;
// so can any token allowed to register the task's service. With passing, it
// carries a passing lease check of its own.
func junkRegistration(t *testing.T, c *api.Client, generation uint64, passing bool) {
	t.Helper()
	reg := &api.AgentServiceRegistration{
		ID: "junk-victim", Name: "transcode", Tags: []string{health.DefaultTag}, Address: "127.0.0.1", Port: 9999,
		Meta: map[string]string{health.MetaInstanceID: "victim", health.MetaSessionID: "junk", health.MetaGeneration: strconv.FormatUint(generation, 10),
			health.MetaVersion: "1.2.3", health.MetaCapacity: "1", health.MetaState: "active"},
	}
	if passing {
		reg.Checks = api.AgentServiceChecks{{CheckID: health.CheckID("victim", "junk", "transcode"), Name: "lease", TTL: "1h", Status: api.HealthPassing}}
	}
	if err := c.Agent().ServiceRegister(reg); err != nil {
		t.Fatal(err)
	}
	e, err := health.ParseRegistration("transcode", "127.0.0.1", 9999, reg.Meta)
	if err == nil || (health.Executor{Registration: e, Err: err}).Orders() {
		t.Fatalf("premise: leasehold takes generation %d as valid (err %v)", generation, err)
	}
}

// TestAttack2GarbageRegistrationGenerationSupersedes: the same registration
// with a passing lease check of its own makes the Registrar's fence check
// report LossSuperseded and Run return ErrSuperseded: the executor process
// stops for good ("a newer session of this instance is alive"), although
// leasehold ignores that registration and calls the executor's session
// CURRENT.
func TestAttack2GarbageRegistrationGenerationSupersedes(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	ex := runLive(t, a, "victim", nil)
	ex.session(t, nil)
	junkRegistration(t, c, health.MaxGeneration+1, true)
	select {
	case err := <-ex.done:
		if errors.Is(err, ErrSuperseded) {
			t.Fatalf("a registration with generation 2^53+1 (garbage for leasehold, which keeps the executor's session CURRENT) made Run return: %v", err)
		}
		t.Fatalf("Run returned: %v", err)
	case <-time.After(4 * shortLease.TTL):
	}
}
