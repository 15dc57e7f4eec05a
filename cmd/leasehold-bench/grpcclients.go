package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"time"

	v3statuspb "github.com/envoyproxy/go-control-plane/envoy/service/status/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	_ "google.golang.org/grpc/xds" // the xds:/// resolver
	"google.golang.org/grpc/xds/csds"
)

// grpcChildEnv switches the harness binary into a real grpc-go dispatcher:
// it dials xds:///<task> through leasehold and reports, from its own xDS
// client's state (CSDS), which executors its EDS resource holds whenever
// that changes. These few real clients check that the light ADS clients
// measure what a real dispatcher sees.
const grpcChildEnv = "LEASEHOLD_BENCH_GRPC_CHILD"

const claType = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"

// grpcUpdate is one line a child prints: the executors its EDS holds.
type grpcUpdate struct {
	At      time.Time `json:"at"`
	Version string    `json:"version"`
	Hosts   []string  `json:"hosts"`
}

func runGRPCChild(target string) int {
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer conn.Close()
	conn.Connect() // resolve now (LDS → RDS → CDS → EDS), with no RPC needed
	status, err := csds.NewClientStatusDiscoveryServer()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	enc := json.NewEncoder(os.Stdout)
	// A sharded task type is several load assignments: each is followed by
	// its own version, and what the child holds is the union of their hosts.
	versions := map[string]string{}      // load assignment → its version
	held := map[string]map[string]bool{} // load assignment → its healthy hosts
	stdin := make(chan struct{})
	go func() { // the parent closes stdin to stop us
		bufio.NewReader(os.Stdin).ReadString('\n')
		close(stdin)
	}()
	// A tick is the resolution of its lapse → stop, and no finer, to be lighter
	// on the shared cores.
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-stdin:
			return 0
		case <-tick.C:
		}
		resp, err := status.FetchClientStatus(context.Background(),
			&v3statuspb.ClientStatusRequest{})
		if err != nil {
			continue
		}
		changed := ""
		for _, cfg := range resp.GetConfig() {
			for _, x := range cfg.GetGenericXdsConfigs() {
				if x.GetTypeUrl() != claType || x.GetXdsConfig() == nil ||
					versions[x.GetName()] == x.GetVersionInfo() {
					continue
				}
				versions[x.GetName()] = x.GetVersionInfo()
				set := map[string]bool{}
				healthyHosts(x.GetXdsConfig().GetValue(), set)
				held[x.GetName()] = set
				changed = x.GetVersionInfo()
			}
		}
		if changed == "" {
			continue
		}
		u := grpcUpdate{At: time.Now(), Version: changed}
		union := map[string]bool{}
		for _, set := range held {
			for h := range set {
				if !union[h] {
					union[h] = true
					u.Hosts = append(u.Hosts, h)
				}
			}
		}
		enc.Encode(u)
	}
}

// grpcClients are the real grpc-go dispatchers, each a child process;
// child i dials xds:///tasks[i % len(tasks)].
type grpcClients struct {
	mu      sync.Mutex
	notify  chan struct{}
	tasks   []string          // the task type each child dials
	current []map[string]bool // the hosts each child's EDS holds
	goneAt  []map[string]time.Time
	procs   []*exec.Cmd
	stdins  []interface{ Close() error }
}

func startGRPCClients(xdsAddr string, n int, tasks []string) (*grpcClients, error) {
	g := &grpcClients{notify: make(chan struct{}, 1)}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	for i := range n {
		boot := fmt.Sprintf(`{"xds_servers":[{"server_uri":%q,`+
			`"channel_creds":[{"type":"insecure"}],"server_features":["xds_v3"]}],`+
			`"node":{"id":"bench-grpc-%d"}}`, xdsAddr, i)
		cmd := exec.Command(self)
		task := tasks[i%len(tasks)]
		cmd.Env = append(os.Environ(), grpcChildEnv+"=xds:///"+task,
			"GRPC_XDS_BOOTSTRAP_CONFIG="+boot)
		cmd.Stderr = os.Stderr
		in, err := cmd.StdinPipe()
		if err != nil {
			return nil, err
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			return nil, err
		}
		if err := cmd.Start(); err != nil {
			return nil, err
		}
		g.procs, g.stdins, g.tasks = append(g.procs, cmd),
			append(g.stdins, in), append(g.tasks, task)
		g.current = append(g.current, map[string]bool{})
		g.goneAt = append(g.goneAt, map[string]time.Time{})
		go func(i int) {
			sc := bufio.NewScanner(out)
			sc.Buffer(make([]byte, 1<<20), 64<<20)
			for sc.Scan() {
				var u grpcUpdate
				if json.Unmarshal(sc.Bytes(), &u) != nil {
					continue
				}
				now := map[string]bool{}
				for _, h := range u.Hosts {
					now[h] = true
				}
				g.mu.Lock()
				for h := range g.current[i] {
					if !now[h] {
						g.goneAt[i][h] = u.At
					}
				}
				g.current[i] = now
				g.mu.Unlock()
				select {
				case g.notify <- struct{}{}:
				default:
				}
			}
		}(i)
	}
	return g, nil
}

// awaitAll waits until cond holds for every child's hosts (given the task
// type it dials).
func (g *grpcClients) awaitAll(
	cond func(task string, set map[string]bool) bool, timeout time.Duration,
) error {
	return awaitNotified(&g.mu, g.notify, timeout, func() bool {
		for i, c := range g.current {
			if !cond(g.tasks[i], c) {
				return false
			}
		}
		return true
	})
}

// goneFromAll is when the last child's EDS dropped host.
func (g *grpcClients) goneFromAll(host string) time.Time {
	g.mu.Lock()
	defer g.mu.Unlock()
	var last time.Time
	for _, m := range g.goneAt {
		if t := m[host]; t.After(last) {
			last = t
		}
	}
	return last
}

func (g *grpcClients) stop() {
	for i, in := range g.stdins {
		in.Close()
		done := make(chan struct{})
		go func() { g.procs[i].Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(3 * time.Second):
			g.procs[i].Process.Kill()
			<-done
		}
	}
}
