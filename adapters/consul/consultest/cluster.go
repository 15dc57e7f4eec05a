package consultest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
)

// Cluster is a real Consul datacenter on loopback: servers (not -dev: raft
// with bootstrap_expect, each with its own data dir) and client agents, all
// joined to each other with retry_join on their serf LAN ports.
type Cluster struct {
	Servers []*Agent
	Clients []*Agent

	mu    sync.Mutex
	polls map[*Agent]*api.Client // one client (one connection pool) per agent for the status polls
}

// poll is the client the cluster's own status polls use for a: Agent.Client
// builds a new connection pool each time, and polling through fresh pools
// every 20 ms leaves idle connections behind until Consul answers 429 (at
// most 200 connections per client IP).
func (c *Cluster) poll(a *Agent) *api.Client {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.polls == nil {
		c.polls = map[*Agent]*api.Client{}
	}
	if cl, ok := c.polls[a]; ok {
		return cl
	}
	cl := a.Client()
	c.polls[a] = cl
	return cl
}

// clusterMember is the part of an agent's configuration that makes it a
// member of a StartCluster cluster.
type clusterMember struct {
	server bool
	expect int   // bootstrap_expect, servers only
	join   []int // serf LAN ports of the servers
}

// hcl is tuned for speed as far as Consul 1.13 allows: raft timing at
// raft_multiplier 1 (1 s heartbeat and election timeouts, 500 ms leader
// lease: a dead leader is replaced in a few seconds), joins retried every
// 200 ms, gossip every 100 ms (failure detection keeps its defaults: a false
// "node failed" on a loaded test machine would fail a session for good), and
// no leave on SIGTERM so the cluster stops at once. reconnect_timeout cannot
// go below 8 h, so it is left alone: a killed member stays "failed".
func (m *clusterMember) hcl() string {
	joins := make([]string, len(m.join))
	for i, p := range m.join {
		joins[i] = fmt.Sprintf("%q", fmt.Sprintf("127.0.0.1:%d", p))
	}
	s := fmt.Sprintf(`retry_join = [%s]
retry_interval = "200ms"
leave_on_terminate = false
performance {
  raft_multiplier = 1
}
gossip_lan {
  gossip_interval = "100ms"
}
`, strings.Join(joins, ", "))
	if m.server {
		return s + fmt.Sprintf(`server = true
bootstrap_expect = %d
autopilot {
  server_stabilization_time = "1s"
}
`, m.expect)
	}
	return s + "server = false\n"
}

// StartCluster starts servers Consul servers and clients client agents for
// the test, waits until the cluster has elected a leader that every member
// knows and every member is alive, and stops them all when the test ends.
func StartCluster(t testing.TB, servers, clients int) *Cluster {
	t.Helper()
	if servers < 1 {
		t.Fatal("StartCluster: at least one server")
	}
	bin := RequireBinary(t)
	root := t.TempDir()
	prefix := "lh-" + sanitize(t.Name())
	c := &Cluster{}
	t.Cleanup(func() {
		// Clients first, then servers; each group at once (no leave on
		// SIGTERM, so this is quick).
		stopAll(c.Clients)
		stopAll(c.Servers)
		if t.Failed() || os.Getenv("LEASEHOLD_CONSUL_LOG") != "" {
			for _, a := range append(append([]*Agent(nil), c.Servers...), c.Clients...) {
				t.Logf("consul agent %s log (tail):\n%s", a.Node, a.log.String())
			}
		}
	})

	var err error
	for attempt := 0; attempt < 3; attempt++ { // a chosen port can be taken between probe and bind
		dir := filepath.Join(root, fmt.Sprintf("try%d", attempt))
		if c.Servers, err = startServers(t, bin, dir, prefix, servers); err == nil {
			break
		}
		t.Logf("consul cluster: servers did not start (attempt %d): %v", attempt+1, err)
		stopAll(c.Servers)
		c.Servers = nil
	}
	if err != nil {
		t.Fatalf("start consul servers: %v", err)
	}
	join := make([]int, len(c.Servers))
	for i, s := range c.Servers {
		join[i] = s.Ports.SerfLAN
	}
	errs := make([]error, clients)
	c.Clients = make([]*Agent, clients)
	var wg sync.WaitGroup
	for i := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m := &clusterMember{join: join}
			for attempt := 0; attempt < 3; attempt++ {
				node := fmt.Sprintf("%s-c%d", prefix, i)
				if attempt > 0 { // a new node: the failed attempt may have joined
					node += fmt.Sprintf("-%d", attempt)
				}
				a, err := newMember(
					t,
					bin,
					filepath.Join(root, fmt.Sprintf("client%d-%d", i, attempt)),
					node,
					false,
				)
				if err != nil {
					errs[i] = err
					return
				}
				c.Clients[i] = a
				if errs[i] = a.configure(Options{member: m}); errs[i] != nil {
					return
				}
				if errs[i] = a.start(); errs[i] == nil {
					return
				}
				a.Stop()
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("start consul client agents: %v", err)
	}
	c.WaitHealthy(t, 60*time.Second)
	return c
}

func newMember(t testing.TB, bin, dir, node string, server bool) (*Agent, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	return &Agent{
		t:      t,
		bin:    bin,
		dir:    dir,
		Node:   node,
		server: server,
		log:    newTailBuffer(64 << 10),
	}, nil
}

// startServers starts n servers at once (none elects a leader before
// bootstrap_expect of them have joined) on ports chosen together, so each
// one's retry_join names all of them.
func startServers(t testing.TB, bin, root, prefix string, n int) ([]*Agent, error) {
	ports, err := freePorts(6 * n)
	if err != nil {
		return nil, err
	}
	m := &clusterMember{server: true, expect: n}
	agents := make([]*Agent, n)
	for i := range n {
		p := ports[6*i:]
		a, err := newMember(
			t,
			bin,
			filepath.Join(root, fmt.Sprintf("server%d", i)),
			fmt.Sprintf("%s-s%d", prefix, i),
			true,
		)
		if err != nil {
			return agents, err
		}
		agents[i] = a
		agents[i].Ports = Ports{
			HTTP:    p[0],
			DNS:     p[1],
			GRPC:    p[2],
			SerfLAN: p[3],
			SerfWAN: p[4],
			Server:  p[5],
			HTTPS:   -1,
		}
		m.join = append(m.join, p[3])
	}
	for _, a := range agents {
		if err := a.writeConfig(Options{member: m}); err != nil {
			return agents, err
		}
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, a := range agents {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = a.start() }()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			return agents, fmt.Errorf("%s: %w\n%s", agents[i].Node, err, agents[i].log.String())
		}
	}
	return agents, nil
}

func stopAll(agents []*Agent) {
	var wg sync.WaitGroup
	for _, a := range agents {
		if a != nil {
			wg.Add(1)
			go func() { defer wg.Done(); a.Stop() }()
		}
	}
	wg.Wait()
}

// Running reports whether the agent's process is running (not stopped or
// killed through this Agent).
func (a *Agent) Running() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.cmd != nil
}

// Leader is the server that the running servers agree is the raft leader,
// or nil while they do not (during an election, or while they disagree).
func (c *Cluster) Leader() *Agent {
	l, _ := c.leader()
	return l
}

// leader also says what each running server reports.
func (c *Cluster) leader() (*Agent, string) {
	var views []string
	agreed, leader := true, ""
	for _, s := range c.Servers {
		if !s.Running() {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		l, err := c.poll(s).Status().LeaderWithQueryOptions((&api.QueryOptions{}).WithContext(ctx))
		cancel()
		views = append(
			views,
			fmt.Sprintf("%s (server port %d): leader %q %v", s.Node, s.Ports.Server, l, err),
		)
		if err != nil || l == "" || (leader != "" && l != leader) {
			agreed = false
		}
		leader = l
	}
	view := strings.Join(views, "; ")
	if !agreed {
		return nil, view
	}
	for _, s := range c.Servers {
		if s.Running() && leader == fmt.Sprintf("127.0.0.1:%d", s.Ports.Server) {
			return s, view
		}
	}
	return nil, view
}

// WaitLeader waits until the running servers agree on a running leader
// other than not (nil: any) and returns it.
func (c *Cluster) WaitLeader(t testing.TB, timeout time.Duration, not *Agent) *Agent {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		l, view := c.leader()
		if l != nil && l != not {
			return l
		}
		if time.Now().After(deadline) {
			t.Fatalf(
				"no raft leader that every running server agrees on after %s: %s",
				timeout,
				view,
			)
		}
		<-time.After(20 * time.Millisecond) // no blocking query for this
	}
}

// WaitHealthy waits until the cluster has a leader every running member
// knows, the raft configuration holds every server as a voter, and every
// running member is alive in the LAN gossip pool.
func (c *Cluster) WaitHealthy(t testing.TB, timeout time.Duration) {
	t.Helper()
	all := append(append([]*Agent(nil), c.Servers...), c.Clients...)
	var last string
	deadline := time.Now().Add(timeout)
	healthy := func() bool {
		leader, view := c.leader() // again each time: it may change while the cluster settles
		if leader == nil {
			last = "no agreed leader: " + view
			return false
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		q := (&api.QueryOptions{}).WithContext(ctx)
		raft, err := c.poll(leader).Operator().RaftGetConfiguration(q)
		if err != nil {
			last = err.Error()
			return false
		}
		voters := 0
		for _, s := range raft.Servers {
			if s.Voter {
				voters++
			}
		}
		if voters != len(c.Servers) {
			last = fmt.Sprintf("%d raft voters", voters)
			return false
		}
		members, err := c.poll(leader).Agent().Members(false) // local to the agent: answers at once
		if err != nil {
			last = err.Error()
			return false
		}
		alive := map[string]bool{}
		for _, m := range members {
			alive[m.Name] = m.Status == 1 // serf StatusAlive
		}
		for _, a := range all {
			if !a.Running() {
				continue
			}
			if !alive[a.Node] {
				last = a.Node + " not alive in gossip"
				return false
			}
			if l, err := c.poll(a).Status().LeaderWithQueryOptions(q); err != nil ||
				l != fmt.Sprintf("127.0.0.1:%d", leader.Ports.Server) {
				last = fmt.Sprintf("%s sees leader %q (%v)", a.Node, l, err)
				return false
			}
		}
		return true
	}
	for !healthy() {
		if time.Now().After(deadline) {
			t.Fatalf("consul cluster not healthy after %s: %s", timeout, last)
		}
		<-time.After(50 * time.Millisecond) // membership has no blocking query
	}
}
