package main

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
)

// replica is a leasehold serve of a drill with several, stopped on demand.
type replica struct {
	addrs listening
	stop  func()
}

// startReplica runs leasehold serve against a with its xDS port at xdsAddr.
func startReplica(t *testing.T, a *consultest.Agent, name, xdsAddr string) *replica {
	t.Helper()
	addrs, stop := startServeStoppableAs(t, a, name,
		func(c *serveConfig) { c.xdsAddr = xdsAddr })
	return &replica{addrs: addrs, stop: stop}
}

// streamsOf is the node ids of the xDS streams open on a replica.
func streamsOf(admin string) map[string]bool {
	resp, err := http.Get("http://" + admin + "/debug/dispatchers")
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	var body struct {
		Dispatchers []struct {
			NodeID string `json:"node_id"`
		} `json:"dispatchers"`
	}
	if json.NewDecoder(resp.Body).Decode(&body) != nil {
		return nil
	}
	out := map[string]bool{}
	for _, d := range body.Dispatchers {
		out[d.NodeID] = true
	}
	return out
}

// Replicas behind one name: two leasehold replicas on 127.0.0.1:P and
// 127.0.0.2:P, registered in Consul as one service, and a real grpc-go
// dispatcher whose bootstrap names them through Consul's DNS
// (dns://<agent>/leasehold-xds.service.consul:P). The replica it is connected
// to is stopped while an executor lapses: the dispatcher's xDS client
// re-resolves the name, moves to the other replica, never calls the lapsed
// executor after its lapse + 300 ms (once moved), and never calls another
// that lapses after the move; the other replica accepts the versions the
// dispatcher had ACKed (identical content versions), NACKing nothing.
func TestADispatcherMovesToAnotherReplicaBehindOneName(t *testing.T) {
	a := consultest.Start(t)
	a.SettleSync()
	c := a.Client()
	execs := map[string]*e2eExecutor{}
	for _, n := range []string{"e1", "e2", "e3", "e4"} {
		execs[n] = startExecutor(t, a, n, "1.0.0")
	}
	port := freePortOn(t, "127.0.0.1", "127.0.0.2")
	replicas := map[string]*replica{
		"127.0.0.1": startReplica(t, a, "replica-1", net.JoinHostPort("127.0.0.1", port)),
		"127.0.0.2": startReplica(t, a, "replica-2", net.JoinHostPort("127.0.0.2", port)),
	}
	p, _ := strconv.Atoi(port)
	for ip := range replicas {
		if err := c.Agent().ServiceRegister(&api.AgentServiceRegistration{
			ID: "leasehold-xds-" + ip, Name: "leasehold-xds", Address: ip, Port: p,
		}); err != nil {
			t.Fatal(err)
		}
	}
	uri := fmt.Sprintf("dns://127.0.0.1:%d/leasehold-xds.service.consul:%s", a.Ports.DNS, port)
	start := time.Now()
	d := startDispatcher(t, uri, "dispatcher-replicas", map[string]any{})
	d.await(t, start, 30*time.Second, "calls to every executor", func(cs []callResult) bool {
		m := servedBy(cs)
		return m["e1"] > 0 && m["e2"] > 0 && m["e3"] > 0 && m["e4"] > 0
	})
	var on, other string
	for ip, r := range replicas {
		if streamsOf(r.addrs.admin)["dispatcher-replicas"] {
			on = ip
		} else {
			other = ip
		}
	}
	if on == "" || other == "" {
		t.Fatalf("the dispatcher's stream is on no replica, or on both")
	}

	// Its replica stops; e1 lapses meanwhile.
	replicas[on].stop()
	stopped := time.Now()
	execs["e1"].silent.Store(true)
	lapsed := awaitCheck(t, c, "e1", api.HealthCritical)
	consultest.WaitFor(t, 30*time.Second, "the dispatcher's stream on the other replica",
		func() bool { return streamsOf(replicas[other].addrs.admin)["dispatcher-replicas"] })
	moved := time.Now()
	t.Logf("moved to %s %s after its replica stopped; e1 lapsed %s after the stop",
		other, moved.Sub(stopped).Round(time.Millisecond), lapsed.Sub(stopped).Round(time.Millisecond))
	bound := lapsed
	if moved.After(bound) {
		bound = moved
	}
	d.await(t, time.Now().Add(time.Second), 10*time.Second, "calls after the move",
		func(cs []callResult) bool { return len(cs) > 50 })
	if n := servedBy(d.since(bound.Add(300 * time.Millisecond)))["e1"]; n > 0 {
		t.Fatalf("%d calls reached e1 more than 300 ms after its lapse and the move", n)
	}

	// A lapse after the move: as on any replica.
	execs["e2"].silent.Store(true)
	lapsed = awaitCheck(t, c, "e2", api.HealthCritical)
	d.await(t, time.Now().Add(time.Second), 10*time.Second, "calls after e2's lapse",
		func(cs []callResult) bool { return len(cs) > 50 })
	if n := servedBy(d.since(lapsed.Add(300 * time.Millisecond)))["e2"]; n > 0 {
		t.Fatalf("%d calls reached e2 more than 300 ms after its lapse", n)
	}
	if m := servedBy(d.since(lapsed.Add(300 * time.Millisecond))); m["e3"] == 0 || m["e4"] == 0 {
		t.Fatalf("calls after the move %v: e3 and e4 must still be called", m)
	}
	if f := scrape(t, replicas[other].addrs.admin)["leasehold_xds_nacks_total"]; f != nil &&
		sum(f) > 0 {
		t.Fatalf("the dispatcher NACKed %v responses of the other replica", sum(f))
	}
}

// freePortOn is a port free on every one of ips.
func freePortOn(t *testing.T, ips ...string) string {
	t.Helper()
	for range 50 {
		l, err := net.Listen("tcp", net.JoinHostPort(ips[0], "0"))
		if err != nil {
			t.Fatal(err)
		}
		_, port, _ := net.SplitHostPort(l.Addr().String())
		free := true
		for _, ip := range ips[1:] {
			o, err := net.Listen("tcp", net.JoinHostPort(ip, port))
			if err != nil {
				free = false
				break
			}
			o.Close()
		}
		l.Close()
		if free {
			return port
		}
	}
	t.Fatal("no port free on every address")
	return ""
}
