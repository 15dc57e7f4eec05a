package consultest

import (
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
)

func TestClusterElectsANewLeader(t *testing.T) {
	t0 := time.Now()
	c := StartCluster(t, 3, 1)
	t.Logf("3 servers and a client healthy in %s", time.Since(t0))
	old := c.Leader()
	if old == nil {
		t.Fatal("no leader after StartCluster")
	}
	killed := time.Now()
	old.Kill()
	l := c.WaitLeader(t, 30*time.Second, old)
	t.Logf("leader %s killed; %s elected in %s", old.Node, l.Node, time.Since(killed))
	_, err := c.Clients[0].Client().KV().Put(&api.KVPair{Key: "after-election", Value: []byte("x")},
		nil)
	if err != nil {
		t.Fatalf("write through the client agent after the election: %v", err)
	}
}
