package consul

import (
	"testing"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
)

// TestAttack17WatchersAcceptADatacenterConsulCannotAnswer (fixed; failed before, LOW):
// a real agent of datacenter dc1 answers ?dc=dc1 but refuses ?dc=DC1
// (Consul's datacenter names are lowercase: "No path to datacenter"), yet
// NewWatchers (and so serve --datacenters) accepts "DC1": its watches can
// only ever fail. The same check then refuses duplicates that differ only
// in case ("dc1" and "DC1": one datacenter, or none).
func TestAttack17WatchersAcceptADatacenterConsulCannotAnswer(t *testing.T) {
	a := consultest.Start(t, consultest.Options{Datacenter: "dc1"})
	c := a.Client()
	if _, _, err := c.Catalog().Services(&api.QueryOptions{Datacenter: "dc1"}); err != nil {
		t.Fatalf("?dc=dc1: %v", err)
	}
	_, _, err := c.Catalog().Services(&api.QueryOptions{Datacenter: "DC1"})
	if err == nil {
		t.Skip("this Consul answers ?dc=DC1: capitals are a datacenter it knows")
	}
	t.Logf("?dc=DC1: %v", err)
	for _, dcs := range [][]string{{"DC1"}, {"dc1", "DC1"}} {
		if _, err := NewWatchers(c, WatchConfig{}, dcs); err == nil {
			t.Errorf("NewWatchers(%q) accepted: Consul refuses ?dc=DC1", dcs)
		}
	}
}
