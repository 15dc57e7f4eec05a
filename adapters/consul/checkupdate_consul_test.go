package consul

import (
	"context"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

// TestConsulDefersOutputOnlyCheckChanges documents what the contract may
// promise about a heartbeat's output (the load): with Consul's default
// check_update_interval (5 min) an agent syncs a TTL check's output-only
// change to the catalog that late — the agent's own view has it at once,
// the catalog (what leasehold reads) does not — while a status change
// (passing → warning: full) reaches the catalog at once. So leasehold takes
// "full" from the status, and the load itself travels over ORCA.
func TestConsulDefersOutputOnlyCheckChanges(t *testing.T) {
	a := consultest.Start(t, consultest.Options{ConsulCheckUpdates: true})
	a.SettleSync()
	c := a.Client()
	const checkID = "ttl-probe"
	probe := &api.AgentServiceRegistration{ID: "probe", Name: "probe", Port: 9000,
		Check: &api.AgentServiceCheck{CheckID: checkID, TTL: "1m"}}
	if err := c.Agent().ServiceRegister(probe); err != nil {
		t.Fatal(err)
	}
	if err := c.Agent().UpdateTTL(checkID, health.LoadOutput(1), api.HealthPassing); err != nil {
		t.Fatal(err)
	}
	// The catalog has the passing check with load=1.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	index := awaitCatalogCheck(t, ctx, c, checkID, 0, func(hc *api.HealthCheck) bool {
		return hc.Status == api.HealthPassing && hc.Output == health.LoadOutput(1)
	})

	// Output only: the agent has it at once, the catalog not within 3 s
	// (a blocking query on the check's service returns unchanged).
	if err := c.Agent().UpdateTTL(checkID, health.LoadOutput(3), api.HealthPassing); err != nil {
		t.Fatal(err)
	}
	local, err := c.Agent().Checks()
	if err != nil {
		t.Fatal(err)
	}
	if got := local[checkID].Output; got != health.LoadOutput(3) {
		t.Fatalf("agent's own view: output %q", got)
	}
	q := &api.QueryOptions{WaitIndex: index, WaitTime: 3 * time.Second}
	checks, meta, err := c.Health().Checks("probe", q.WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	if meta.LastIndex != index || len(checks) != 1 || checks[0].Output != health.LoadOutput(1) {
		t.Fatalf(
			"an output-only change reached the catalog within 3 s (index %d → %d, %v): "+
				"check_update_interval no longer defers it — docs/contract.md's load freshness can be "+
				"revisited",
			index,
			meta.LastIndex,
			checks,
		)
	}

	// A status change (full) reaches the catalog at once.
	if err := c.Agent().UpdateTTL(checkID, health.LoadOutput(4), api.HealthWarning); err != nil {
		t.Fatal(err)
	}
	started := time.Now()
	awaitCatalogCheck(
		t,
		ctx,
		c,
		checkID,
		index,
		func(hc *api.HealthCheck) bool { return hc.Status == api.HealthWarning },
	)
	t.Logf("status change in the catalog after %v", time.Since(started))
}

// awaitCatalogCheck blocks on the catalog until the check satisfies ok;
// returns the index it did at.
func awaitCatalogCheck(
	t *testing.T,
	ctx context.Context,
	c *api.Client,
	checkID string,
	index uint64,
	ok func(*api.HealthCheck) bool,
) uint64 {
	t.Helper()
	for {
		q := &api.QueryOptions{WaitIndex: index, WaitTime: 5 * time.Second}
		checks, meta, err := c.Health().Checks("probe", q.WithContext(ctx))
		if err != nil {
			t.Fatalf("waiting for check %s in the catalog: %v", checkID, err)
		}
		for _, hc := range checks {
			if hc.CheckID == checkID && ok(hc) {
				return meta.LastIndex
			}
		}
		index = meta.LastIndex
	}
}
