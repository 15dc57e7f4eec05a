package consultest

import (
	"io"
	"net/http"
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

// A server started with Options.Server is not -dev: its JSON answers are
// not indented, as a production server's are not, while a dev agent indents
// every answer. Benchmarks of what Consul pays for leasehold's reads depend
// on the difference; a client agent joins the server as it joins a dev one.
func TestAServerIsNotDevAndAnswersUnindented(t *testing.T) {
	body := func(a *Agent) string {
		t.Helper()
		resp, err := http.Get("http://" + a.HTTPAddr() + "/v1/catalog/nodes")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("catalog nodes: %d %v", resp.StatusCode, err)
		}
		return string(b)
	}
	server := Start(t, Options{Server: true})
	if b := body(server); strings.Contains(b, "\n") || !strings.Contains(b, `"Node":"`) {
		t.Fatalf("a server that is not -dev answered indented JSON (or none): %q", b)
	}
	if self, err := server.Client().Agent().Self(); err != nil ||
		self["DebugConfig"]["DevMode"] != false || self["DebugConfig"]["ServerMode"] != true ||
		self["DebugConfig"]["ConnectEnabled"] != true {
		t.Fatalf("not a server out of dev mode with Connect on: DevMode %v, ServerMode %v, "+
			"ConnectEnabled %v (%v)", self["DebugConfig"]["DevMode"],
			self["DebugConfig"]["ServerMode"], self["DebugConfig"]["ConnectEnabled"], err)
	}
	client := Start(t, Options{NodeName: "client-of-server", JoinClientOf: server})
	if nodes, _, err := client.Client().Catalog().Nodes(nil); err != nil || len(nodes) != 2 {
		t.Fatalf("nodes through the client: %v %v", nodes, err)
	}
	dev := Start(t, Options{NodeName: "dev"})
	if b := body(dev); !strings.Contains(b, "\n    ") {
		t.Fatalf("a dev agent no longer indents (the case Options.Server is for): %q", b)
	}
	both, err := Launch(RequireBinary(t), Options{Server: true, JoinClientOf: server})
	if both != nil {
		both.Close() // had it started, the agent would outlive the test
	}
	if err == nil || !strings.Contains(err.Error(), "Options.Server and JoinClientOf") {
		t.Fatalf("a server and a client at once: %v", err)
	}
}

// A server started with Options.Server keeps its raft state on disk: after
// RestartKeepingState it still holds what was written (a -dev agent's raft is
// in memory), while Restart wipes the state and the server bootstraps again.
func TestAServerKeepsItsRaftStateOnlyAcrossRestartKeepingState(t *testing.T) {
	server := Start(t, Options{Server: true})
	if _, err := server.Client().KV().Put(&api.KVPair{Key: "kept", Value: []byte("v")},
		nil); err != nil {
		t.Fatal(err)
	}
	server.RestartKeepingState()
	if kv, _, err := server.Client().KV().Get("kept", nil); err != nil || kv == nil ||
		string(kv.Value) != "v" {
		t.Fatalf("after RestartKeepingState: %v %v, want the key kept", kv, err)
	}
	server.Restart()
	if kv, _, err := server.Client().KV().Get("kept", nil); err != nil || kv != nil {
		t.Fatalf("after Restart: %v %v, want the key gone", kv, err)
	}
	if self, err := server.Client().Agent().Self(); err != nil ||
		self["DebugConfig"]["DevMode"] != false {
		t.Fatalf("restarted as a -dev agent: DevMode %v (%v)", self["DebugConfig"]["DevMode"], err)
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

// Two dev servers in datacenters of their own federate over WAN on
// loopback; a client agent of each; a registration in dc2 is read through
// dc1's client agent with ?dc=dc2, as serve --datacenters reads it.
func TestTwoDatacentersFederate(t *testing.T) {
	dc1 := Start(t, Options{Datacenter: "dc1"})
	dc2 := Start(t, Options{Datacenter: "dc2", FederateWith: dc1})
	c1 := Start(t, Options{NodeName: "dc1-client", JoinClientOf: dc1})
	c2 := Start(t, Options{NodeName: "dc2-client", JoinClientOf: dc2})
	if c1.DC != "dc1" || c2.DC != "dc2" {
		t.Fatalf("client datacenters %q %q", c1.DC, c2.DC)
	}
	err := c2.Client().Agent().ServiceRegister(&api.AgentServiceRegistration{ID: "w2", Name: "work",
		Port: 9002})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		es, _, err := c1.Client().
			Health().
			Service("work", "", false, &api.QueryOptions{Datacenter: "dc2"})
		if err == nil && len(es) == 1 && es[0].Node.Datacenter == "dc2" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("dc2's registration never read through dc1's client agent: %v %v", es, err)
		}
		time.Sleep(200 * time.Millisecond) // federation settles; no event to wait on
	}
	if es, _, err := c1.Client().Health().Service("work", "", false, nil); err != nil ||
		len(es) != 0 {
		t.Fatalf("dc1 has its own catalog: %v %v", es, err)
	}
}
