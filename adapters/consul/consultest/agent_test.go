package consultest

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
)

func TestStartAndRestart(t *testing.T) {
	t0 := time.Now()
	a := Start(t)
	t.Logf("agent ready in %s on %+v", time.Since(t0), a.Ports)
	if a.Ports.HTTP == 8500 {
		t.Fatal("default HTTP port used")
	}
	if leader, err := a.Client().Status().Leader(); err != nil || leader == "" {
		t.Fatalf("leader %q %v", leader, err)
	}
	a.Restart()
	if leader, err := a.Client().Status().Leader(); err != nil || leader == "" {
		t.Fatalf("after restart: leader %q %v", leader, err)
	}
	dir := a.dir
	a.Stop()
	if _, err := a.Client().Status().Leader(); err == nil {
		t.Fatal("agent still answers after Stop")
	}
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("data dir removed before cleanup: %v", err)
	}
}

func TestMissingBinarySaysMakeConsul(t *testing.T) {
	t.Setenv(BinaryEnv, "/nonexistent/consul")
	_, err := Binary()
	if err == nil {
		t.Fatal("found a binary that does not exist")
	}
	t.Setenv(BinaryEnv, "")
	t.Setenv("PATH", "")
	t.Chdir(t.TempDir())
	_, err = Binary()
	if err == nil || !strings.Contains(err.Error(), "make consul") {
		t.Fatalf("error %v does not say `make consul`", err)
	}
}

func TestClientAgentJoins(t *testing.T) {
	server := Start(t)
	client := Start(t, Options{NodeName: "second-node", JoinClientOf: server})
	nodes, _, err := server.Client().Catalog().Nodes(nil)
	if err != nil || len(nodes) != 2 {
		t.Fatalf("nodes %v %v", nodes, err)
	}
	if leader, err := client.Client().Status().Leader(); err != nil || leader == "" {
		t.Fatalf("client sees no leader: %q %v", leader, err)
	}
}

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
	if _, err := c.Clients[0].Client().KV().Put(&api.KVPair{Key: "after-election", Value: []byte("x")}, nil); err != nil {
		t.Fatalf("write through the client agent after the election: %v", err)
	}
}
