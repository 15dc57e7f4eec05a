package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
)

// replica is a leasehold serve of a drill with several, run as a process of
// its own (the test binary in serve's mode) so that the drill can kill it as
// a crash would: no GOAWAY, no graceful end of its streams.
type replica struct {
	admin  string
	cmd    *exec.Cmd
	exited chan struct{}
}

// startReplica runs leasehold serve against a with its xDS port at xdsAddr,
// and waits until it is ready.
func startReplica(t *testing.T, a *consultest.Agent, name, xdsAddr string) *replica {
	t.Helper()
	r := &replica{
		admin:  net.JoinHostPort("127.0.0.1", freePortOn(t, "127.0.0.1")),
		exited: make(chan struct{}),
	}
	args, _ := json.Marshal([]string{"serve", "--consul-addr", a.HTTPAddr(),
		"--xds-addr", xdsAddr, "--admin-addr", r.admin, "--service-tag", "leasehold",
		"--consul-max-conns", "8"})
	out := &syncBuffer{}
	r.cmd = exec.Command(os.Args[0], "-test.run=^$")
	r.cmd.Env = append(os.Environ(), mainArgsEnv+"="+string(args))
	r.cmd.Stdout, r.cmd.Stderr = out, out
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { r.cmd.Wait(); close(r.exited) }()
	t.Cleanup(func() {
		r.kill()
		if t.Failed() {
			t.Logf("%s's output:\n%s", name, out.String())
		}
	})
	consultest.WaitFor(t, 30*time.Second, name+" ready", func() bool {
		return readyzStatus(r.admin) == http.StatusOK
	})
	return r
}

// kill ends the replica's process with SIGKILL and waits for it.
func (r *replica) kill() {
	r.cmd.Process.Kill()
	<-r.exited
}

// streamView is one dispatcher's stream as a replica's /debug/dispatchers
// shows it: per resource type, the version it last ACKed.
type streamView struct {
	NodeID string `json:"node_id"`
	Types  map[string]struct {
		LastAcked string `json:"last_acked_version"`
	} `json:"types"`
}

// streamsOf is the xDS streams open on a replica by node id (nil: the
// replica does not answer).
func streamsOf(admin string) map[string]streamView {
	resp, err := http.Get("http://" + admin + "/debug/dispatchers")
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	var body struct {
		Dispatchers []streamView `json:"dispatchers"`
	}
	if json.NewDecoder(resp.Body).Decode(&body) != nil {
		return nil
	}
	out := map[string]streamView{}
	for _, d := range body.Dispatchers {
		out[d.NodeID] = d
	}
	return out
}

// ackedOf is, per resource type, the version node's stream on a replica last
// ACKed; ok once every one of the xDS types a grpc-go dispatcher follows
// (listener, route, cluster, endpoints) has one.
func ackedOf(admin, node string) (acked map[string]string, ok bool) {
	s, open := streamsOf(admin)[node]
	if !open {
		return nil, false
	}
	acked = map[string]string{}
	for typ, ti := range s.Types {
		if ti.LastAcked != "" {
			acked[typ] = ti.LastAcked
		}
	}
	for _, typ := range []string{resource.ListenerType, resource.RouteType,
		resource.ClusterType, resource.EndpointType} {
		if acked[typ] == "" {
			return acked, false
		}
	}
	return acked, true
}

// Replicas behind one name: two leasehold replicas on 127.0.0.1:P and
// 127.0.0.2:P, registered in Consul as one service, and a real grpc-go
// dispatcher whose bootstrap names them through Consul's DNS
// (dns://<agent>/leasehold-xds.service.consul:P). An executor falls silent and
// the replica the dispatcher is connected to is killed, so the lapse that
// follows can reach the dispatcher only through the other replica:
//   - the dispatcher's xDS client re-resolves the name and moves to the other
//     replica;
//   - it never calls the lapsed executor 300 ms after its lapse: the time
//     the move takes is not excused, so a move slower than the lease's
//     remainder fails the drill;
//   - the other replica serves it the very versions it had ACKed before the
//     kill (identical content versions: a replica that versioned the same
//     content otherwise would have it ACK new ones), and it NACKs nothing;
//   - a lapse after the move is followed as on any replica.
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
	const node = "dispatcher-replicas"
	uri := fmt.Sprintf("dns://127.0.0.1:%d/leasehold-xds.service.consul:%s", a.Ports.DNS, port)
	start := time.Now()
	d := startDispatcher(t, uri, node, map[string]any{})
	d.await(t, start, 30*time.Second, "calls to every executor", func(cs []callResult) bool {
		m := servedBy(cs)
		return m["e1"] > 0 && m["e2"] > 0 && m["e3"] > 0 && m["e4"] > 0
	})
	var on, other string
	for ip, r := range replicas {
		if _, open := streamsOf(r.admin)[node]; open {
			on = ip
		} else {
			other = ip
		}
	}
	if on == "" || other == "" {
		t.Fatalf("the dispatcher's stream is on no replica, or on both")
	}
	var before map[string]string
	consultest.WaitFor(t, 10*time.Second, "the dispatcher's ACKs on its replica", func() bool {
		var ok bool
		before, ok = ackedOf(replicas[on].admin, node)
		return ok
	})

	// e1 falls silent and the dispatcher's replica is killed. Meanwhile the
	// move is timed, and the versions the dispatcher ACKs on the other
	// replica are read as soon as it has ACKed every type there.
	type arrival struct {
		moved, read time.Time
		acked       map[string]string
	}
	arrived := make(chan arrival, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	execs["e1"].silent.Store(true)
	replicas[on].kill()
	killed := time.Now()
	go func() {
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		var got arrival
		for {
			if got.moved.IsZero() {
				if _, open := streamsOf(replicas[other].admin)[node]; open {
					got.moved = time.Now()
				}
			}
			if !got.moved.IsZero() {
				if acked, ok := ackedOf(replicas[other].admin, node); ok {
					got.read, got.acked = time.Now(), acked
					arrived <- got
					return
				}
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	lapsed := awaitCheck(t, c, "e1", api.HealthCritical)
	var got arrival
	select {
	case got = <-arrived:
	case <-ctx.Done():
		t.Fatal("the dispatcher did not move to the other replica and ACK there within 30 s")
	}
	t.Logf("moved to %s %s after the kill (every type ACKed there after %s); e1 lapsed %s after it",
		other, got.moved.Sub(killed).Round(time.Millisecond),
		got.read.Sub(killed).Round(time.Millisecond), lapsed.Sub(killed).Round(time.Millisecond))
	for typ, v := range before {
		if typ == resource.EndpointType && !got.read.Before(lapsed.Add(-100*time.Millisecond)) {
			// e1's lapse may have changed the endpoints meanwhile.
			t.Logf("endpoints' versions not compared: read %s after e1's lapse",
				got.read.Sub(lapsed).Round(time.Millisecond))
			continue
		}
		if got.acked[typ] != v {
			t.Errorf("%s: the dispatcher ACKed %q on the killed replica and %q on the other "+
				"for the same fleet", typ, v, got.acked[typ])
		}
	}
	d.await(t, time.Now().Add(time.Second), 10*time.Second, "calls after the move",
		func(cs []callResult) bool { return len(cs) > 50 })
	if n := servedBy(d.since(lapsed.Add(300 * time.Millisecond)))["e1"]; n > 0 {
		t.Fatalf("%d calls reached e1 more than 300 ms after its lapse (moved %s after the kill)",
			n, got.moved.Sub(killed).Round(time.Millisecond))
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
	if f := scrape(t, replicas[other].admin)["leasehold_xds_nacks_total"]; f != nil &&
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
