// Package consultest starts real Consul dev agents for tests: every port is
// chosen free on loopback (never the default 8500), the agent is stopped and
// its data dir removed when the test ends.
package consultest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
)

// BinaryEnv overrides where the consul binary is found.
const BinaryEnv = "LEASEHOLD_CONSUL"

// Ports are the agent's listening ports, all on 127.0.0.1.
type Ports struct {
	HTTP, DNS, GRPC, SerfLAN, SerfWAN, Server int
	HTTPS                                     int // only with Options.TLS
}

// Options tune an agent. The zero value is a plain dev agent.
type Options struct {
	// ExtraHCL is appended to the generated configuration (e.g. ACL settings).
	ExtraHCL string
	// NodeName defaults to a unique name derived from the test.
	NodeName string
	// JoinClientOf, when set, starts a client agent (not a dev server) that
	// joins that agent's datacenter: a second node of the same cluster.
	JoinClientOf *Agent
	// ACLManagementToken, when set, enables ACLs with default deny; the
	// agent's own Config and Client use this token.
	ACLManagementToken string
	// TLS, when set, also serves the HTTP API over HTTPS (HTTPSAddr) with
	// these PEM files; client certificates are verified when given.
	TLS *TLSFiles
	// ConsulCheckUpdates keeps Consul's default check_update_interval (5
	// min: output-only check changes reach the catalog that late). Without
	// it, test agents sync every check change at once.
	ConsulCheckUpdates bool
	// Datacenter names the agent's datacenter (default dc1); a client agent
	// takes the datacenter of the agent it joins.
	Datacenter string
	// FederateWith, for a dev server, joins that dev server's datacenter
	// over WAN (another Datacenter): ?dc= reads then work through either.
	FederateWith *Agent
	// Server starts a server that is not -dev: bootstrap_expect 1 with raft
	// on disk, as a production server runs. A -dev agent indents every JSON
	// answer (DevMode pretty-prints), so what a watch costs it — the
	// encoding, the bytes, their gzip — is not what it costs a real server:
	// benchmarks of Consul's load use this. Not with JoinClientOf.
	Server bool
	// DataParent is the directory the agent's data dir is made in (default:
	// the system's temporary directory). On a tmpfs (/dev/shm) a server's
	// raft log is written to memory: its commits then wait for no disk.
	DataParent string

	member *clusterMember // set by StartCluster: a non-dev server or client of a cluster
}

// TLSFiles are an agent's PEM files.
type TLSFiles struct {
	CA, Cert, Key string
}

// Agent is a running (or stopped) Consul agent: a dev agent unless it is a
// client or a server that is not -dev.
type Agent struct {
	client  bool // a client agent joined to a server
	server  bool // a server that is not -dev (StartCluster's, or Options.Server)
	t       testing.TB
	bin     string
	dir     string
	cfgPath string
	Ports   Ports
	Node    string
	DC      string // the agent's datacenter
	token   string // management token when ACLs are on

	mu      sync.Mutex
	started time.Time
	cmd     *exec.Cmd
	done    chan struct{}
	log     *tailBuffer
}

// Binary locates the consul binary: $LEASEHOLD_CONSUL, then bin/consul in the
// repository (found by walking up from the working directory), then $PATH.
func Binary() (string, error) {
	if p := os.Getenv(BinaryEnv); p != "" {
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("%s=%s: %w", BinaryEnv, p, err)
		}
		return p, nil
	}
	if dir, err := os.Getwd(); err == nil {
		for {
			p := filepath.Join(dir, "bin", "consul")
			if st, err := os.Stat(p); err == nil && !st.IsDir() {
				return p, nil
			}
			if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
				b, _ := os.ReadFile(filepath.Join(dir, "go.mod"))
				if bytes.HasPrefix(b, []byte("module github.com/leasehold/leasehold\n")) {
					break // repository root reached
				}
			}
			parent := filepath.Dir(dir)
			if parent == dir {
				break
			}
			dir = parent
		}
	}
	if p, err := exec.LookPath("consul"); err == nil {
		return p, nil
	}
	return "", errors.New(
		"consul binary not found (bin/consul, $" + BinaryEnv + " or $PATH): run `make consul` to " +
			"build it",
	)
}

// RequireBinary returns the consul binary or ends the test. A missing binary
// fails the test (under CI=true always); only `go test -short` outside CI
// skips, and says why.
func RequireBinary(t testing.TB) string {
	t.Helper()
	bin, err := Binary()
	if err == nil {
		return bin
	}
	if testing.Short() && os.Getenv("CI") != "true" {
		t.Skip(err.Error())
	}
	t.Fatal(err.Error())
	return ""
}

// Start runs an agent for the test (a dev agent unless opts say otherwise)
// and waits until it has a leader and its own node is in the catalog. It is
// stopped when the test ends.
func Start(t testing.TB, opts ...Options) *Agent {
	t.Helper()
	var o Options
	if len(opts) > 0 {
		o = opts[0]
	}
	if o.NodeName == "" {
		o.NodeName = "lh-" + sanitize(t.Name())
	}
	a, err := Launch(RequireBinary(t), o)
	if a != nil {
		a.t = t
		t.Cleanup(func() {
			a.Stop()
			if t.Failed() || os.Getenv("LEASEHOLD_CONSUL_LOG") != "" {
				t.Logf("consul agent %s log (tail):\n%s", a.Node, a.log.String())
			}
			a.Close()
		})
	}
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// Launch starts an agent outside a test (demo, benchmarks; a dev agent unless
// o says otherwise) and waits until it is ready. Close stops it and removes
// its data dir. On error the returned Agent, if any, still needs Close.
func Launch(bin string, o Options) (*Agent, error) {
	dir, err := os.MkdirTemp(o.DataParent, "leasehold-consul-")
	if err != nil {
		return nil, err
	}
	if o.Server && o.JoinClientOf != nil {
		os.RemoveAll(dir)
		return nil, errors.New("consultest: Options.Server and JoinClientOf: an agent is a server or a client")
	}
	a := &Agent{bin: bin, dir: dir, Node: o.NodeName, client: o.JoinClientOf != nil,
		server: o.Server}
	if a.Node == "" {
		a.Node = "lh-" + sanitize("agent")
	}
	var lastErr error
	for attempt := 0; attempt < 3; attempt++ { // a chosen port can be taken between probe and bind
		if lastErr = a.configure(o); lastErr != nil {
			break
		}
		if lastErr = a.start(); lastErr == nil {
			return a, nil
		}
		a.Stop()
	}
	return a, fmt.Errorf("start consul agent: %w\n%s", lastErr, a.log.String())
}

// Close stops the agent and removes its data dir.
func (a *Agent) Close() {
	a.Stop()
	os.RemoveAll(a.dir)
}

// PID is the agent process's id (0 when it is not running).
func (a *Agent) PID() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cmd == nil || a.cmd.Process == nil {
		return 0
	}
	return a.cmd.Process.Pid
}

// Log is the tail of the agent's output.
func (a *Agent) Log() string { return a.log.String() }

func (a *Agent) configure(o Options) error {
	ports, err := freePorts(7)
	if err != nil {
		return err
	}
	a.Ports = Ports{
		HTTP:    ports[0],
		DNS:     ports[1],
		GRPC:    ports[2],
		SerfLAN: ports[3],
		SerfWAN: ports[4],
		Server:  ports[5],
		HTTPS:   -1,
	}
	if o.TLS != nil {
		a.Ports.HTTPS = ports[6]
	}
	return a.writeConfig(o)
}

// writeConfig writes the agent's configuration for the ports already chosen.
func checkUpdates(o Options) string {
	if o.ConsulCheckUpdates {
		return ""
	}
	return "check_update_interval = \"0s\"\n"
}

func (a *Agent) writeConfig(o Options) error {
	hcl := fmt.Sprintf(`node_name = %q
data_dir = %q
bind_addr = "127.0.0.1"
advertise_addr = "127.0.0.1"
client_addr = "127.0.0.1"
disable_update_check = true
log_level = %q
%sports {
  http = %d
  https = %d
  dns = %d
  grpc = %d
  serf_lan = %d
  serf_wan = %d
  server = %d
}
%s
`, a.Node, filepath.Join(a.dir, "data"), logLevel(), checkUpdates(o),
		a.Ports.HTTP, a.Ports.HTTPS, a.Ports.DNS, a.Ports.GRPC, a.Ports.SerfLAN, a.Ports.SerfWAN,
		a.Ports.Server, o.ExtraHCL)
	if t := o.TLS; t != nil {
		hcl += fmt.Sprintf(`tls {
  defaults {
    ca_file = %q
    cert_file = %q
    key_file = %q
    verify_incoming = false
  }
}
`, t.CA, t.Cert, t.Key)
	}
	if o.ACLManagementToken != "" {
		a.token = o.ACLManagementToken
		hcl += fmt.Sprintf(`acl {
  enabled = true
  default_policy = "deny"
  enable_token_persistence = false
  tokens {
    initial_management = %q
    agent = %q
  }
}
`, o.ACLManagementToken, o.ACLManagementToken)
	}
	a.DC = o.Datacenter
	if j := o.JoinClientOf; j != nil {
		hcl += fmt.Sprintf("server = false\nretry_join = [\"127.0.0.1:%d\"]\n", j.Ports.SerfLAN)
		a.DC = j.DC
	}
	if a.DC == "" {
		a.DC = "dc1"
	}
	hcl += fmt.Sprintf("datacenter = %q\n", a.DC)
	if f := o.FederateWith; f != nil {
		hcl += fmt.Sprintf("retry_join_wan = [\"127.0.0.1:%d\"]\n", f.Ports.SerfWAN)
	}
	if m := o.member; m != nil {
		hcl += m.hcl()
	}
	if o.Server {
		// What -dev would give that tests rely on: raft at full speed and
		// Connect (Consul's own xDS) on.
		hcl += "server = true\nbootstrap_expect = 1\nperformance {\n  raft_multiplier = 1\n}\n" +
			"connect {\n  enabled = true\n}\n"
	}
	a.cfgPath = filepath.Join(a.dir, "agent.hcl")
	return os.WriteFile(a.cfgPath, []byte(hcl), 0o600)
}

func (a *Agent) start() error {
	a.mu.Lock()
	a.log = newTailBuffer(64 << 10)
	args := []string{"agent", "-dev", "-config-file", a.cfgPath}
	if a.client || a.server {
		args = []string{"agent", "-config-file", a.cfgPath}
	}
	cmd := exec.Command(a.bin, args...)
	cmd.Stdout, cmd.Stderr = a.log, a.log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		a.mu.Unlock()
		return err
	}
	done := make(chan struct{})
	a.cmd, a.done, a.started = cmd, done, time.Now()
	a.mu.Unlock()
	go func() { cmd.Wait(); close(done) }()
	return a.waitReady(done, 60*time.Second)
}

// waitReady polls the agent until it has a leader and its node's serfHealth
// is in the catalog, or the process exits, or the deadline passes.
func (a *Agent) waitReady(exited <-chan struct{}, timeout time.Duration) error {
	c := a.Client()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		leader, err := c.Status().Leader()
		if err == nil && leader != "" {
			checks, _, err := c.Health().Node(a.Node, nil)
			if err == nil && len(checks) > 0 && checks[0].Status == api.HealthPassing {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("agent not ready after %s (last error: %v)", timeout, err)
		}
		select {
		case <-exited:
			return errors.New("agent exited during start-up")
		case <-tick.C:
		}
	}
}

// serverUpStagger is Consul's agent/ae serverUpIntv: when a server joins (as
// the agent's own does at start), the agent holds back check syncs to the
// catalog for a random time up to this long.
const serverUpStagger = 3 * time.Second

// SettleSync waits out that start-up stagger, so that a test measuring how
// fast a check change reaches the catalog measures the steady state.
func (a *Agent) SettleSync() {
	a.mu.Lock()
	started := a.started
	a.mu.Unlock()
	<-time.After(time.Until(started.Add(serverUpStagger + 200*time.Millisecond)))
}

// HTTPSAddr is host:port of the agent's HTTPS API (Options.TLS).
func (a *Agent) HTTPSAddr() string { return fmt.Sprintf("127.0.0.1:%d", a.Ports.HTTPS) }

// HTTPAddr is host:port of the agent's HTTP API.
func (a *Agent) HTTPAddr() string { return fmt.Sprintf("127.0.0.1:%d", a.Ports.HTTP) }

// Config is an API config for this agent.
func (a *Agent) Config() *api.Config {
	cfg := api.DefaultConfig()
	cfg.Address = a.HTTPAddr()
	cfg.Scheme = "http"
	cfg.Token, cfg.TokenFile = a.token, "" // never a token of the environment's
	return cfg
}

// Client is an API client for this agent.
func (a *Agent) Client() *api.Client {
	c, err := api.NewClient(a.Config())
	if err != nil { // only a bad TLS configuration fails, and there is none
		panic(err)
	}
	return c
}

// Stop terminates the agent (SIGTERM, then SIGKILL after 10 s) and waits for
// it to exit. A frozen agent is thawed for it (see Freeze).
func (a *Agent) Stop() { a.signal(syscall.SIGTERM) }

// Kill ends the agent with SIGKILL: no graceful leave, as when its machine
// dies. Its node's serfHealth turns critical once the others notice.
func (a *Agent) Kill() { a.signal(syscall.SIGKILL) }

// Freeze stops the agent's process (SIGSTOP) without ending it: a hung node,
// a long GC or VM pause, or — for a datacenter's only server — a partitioned
// datacenter, without touching the network. Unlike a cut network, the
// kernel still completes TCP connects to its ports and buffers what is
// written to them, but nothing is read or answered: peers wait out their own
// RPC and gossip timeouts. Thaw resumes it. Stop, Kill and the test's cleanup end
// a frozen agent as promptly as a running one. An error says the agent is
// not running (stopped through this Agent) or the signal failed.
func (a *Agent) Freeze() error { return a.pause(syscall.SIGSTOP) }

// Thaw resumes a frozen agent (SIGCONT); on a running agent it does nothing.
func (a *Agent) Thaw() error { return a.pause(syscall.SIGCONT) }

func (a *Agent) pause(sig syscall.Signal) error {
	a.mu.Lock()
	cmd := a.cmd
	a.mu.Unlock()
	if cmd == nil || cmd.Process == nil {
		return fmt.Errorf("consul agent %s is not running", a.Node)
	}
	if err := syscall.Kill(-cmd.Process.Pid, sig); err != nil {
		return fmt.Errorf("consul agent %s: %v: %w", a.Node, sig, err)
	}
	return nil
}

func (a *Agent) signal(sig syscall.Signal) {
	a.mu.Lock()
	cmd, done := a.cmd, a.done
	a.cmd = nil
	a.mu.Unlock()
	if cmd == nil || cmd.Process == nil {
		return
	}
	// A frozen (SIGSTOPped) process would hold SIGTERM pending until
	// continued (SIGKILL ends it either way): continue it first.
	syscall.Kill(-cmd.Process.Pid, syscall.SIGCONT)
	syscall.Kill(-cmd.Process.Pid, sig)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
	}
}

// Restart stops the agent and starts it again on the same ports and node
// name with its data dir wiped: every local registration is forgotten, as on
// an agent that lost its state.
func (a *Agent) Restart() {
	a.Stop()
	if err := os.RemoveAll(filepath.Join(a.dir, "data")); err != nil {
		a.fail(err)
	}
	a.restart()
}

// RestartKeepingState stops and starts the agent with its data dir intact:
// the agent restores local services and TTL check state from it.
func (a *Agent) RestartKeepingState() {
	a.Stop()
	a.restart()
}

func (a *Agent) restart() {
	if err := a.start(); err != nil {
		a.fail(fmt.Errorf("restart consul agent: %w\n%s", err, a.log.String()))
	}
}

// fail ends the test, or panics outside one (the demo treats it as fatal).
func (a *Agent) fail(err error) {
	if a.t != nil {
		a.t.Helper()
		a.t.Fatal(err)
	}
	panic(err)
}

// logLevel is warn unless $LEASEHOLD_CONSUL_LOG names one (e.g. debug).
func logLevel() string {
	if l := os.Getenv("LEASEHOLD_CONSUL_LOG"); l != "" && l != "1" {
		return l
	}
	return "warn"
}

func sanitize(name string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(name) {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') || r == '-' {
			b.WriteRune(r)
		} else {
			b.WriteByte('-')
		}
	}
	s := b.String()
	if len(s) > 40 {
		s = s[len(s)-40:]
	}
	return fmt.Sprintf("%s-%d", strings.Trim(s, "-"), time.Now().UnixNano()%100000)
}

// freePorts finds n distinct loopback ports free for both TCP and UDP (serf and
// DNS need both). Listeners are held until all are chosen so none repeats.
func freePorts(n int) ([]int, error) {
	var closers []func()
	defer func() {
		for _, c := range closers {
			c()
		}
	}()
	var ports []int
	for tries := 0; len(ports) < n && tries < 100; tries++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		u, err := net.ListenPacket("udp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			l.Close()
			continue
		}
		closers = append(closers, func() { l.Close(); u.Close() })
		ports = append(ports, port)
	}
	if len(ports) < n {
		return nil, errors.New("could not find free loopback ports")
	}
	return ports, nil
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func newTailBuffer(max int) *tailBuffer { return &tailBuffer{max: max} }

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if len(b.buf) > b.max {
		b.buf = append([]byte(nil), b.buf[len(b.buf)-b.max:]...)
	}
	return len(p), nil
}

func (b *tailBuffer) String() string {
	if b == nil {
		return ""
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}

// WaitFor polls cond every 20 ms until it returns true or the deadline passes,
// then fails the test with what. For state that only Consul can report.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		case <-tick.C:
		}
	}
}

// WaitService waits, with blocking queries (no polling), until cond holds for
// the health entries of service name (all statuses), and returns them.
func WaitService(
	t testing.TB,
	c *api.Client,
	name string,
	timeout time.Duration,
	what string,
	cond func([]*api.ServiceEntry) bool,
) []*api.ServiceEntry {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var index uint64
	var last []*api.ServiceEntry
	for {
		q := (&api.QueryOptions{WaitIndex: index, WaitTime: 5 * time.Second}).WithContext(ctx)
		entries, meta, err := c.Health().Service(name, "", false, q)
		if err == nil {
			last = entries
			if cond(entries) {
				return entries
			}
			if meta.LastIndex < index {
				index = 0
			} else {
				index = meta.LastIndex
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf(
				"timed out after %s waiting for %s; last entries: %s",
				timeout,
				what,
				Describe(last),
			)
			return nil
		default:
		}
		if err != nil { // agent briefly unavailable: don't spin
			select {
			case <-ctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
}

// Describe renders health entries for failure messages.
func Describe(entries []*api.ServiceEntry) string {
	var b strings.Builder
	for _, e := range entries {
		fmt.Fprintf(&b, "\n  %s %v", e.Service.ID, e.Service.Meta)
		for _, c := range e.Checks {
			fmt.Fprintf(&b, " [%s %s %q]", c.CheckID, c.Status, c.Output)
		}
	}
	if b.Len() == 0 {
		return "(none)"
	}
	return b.String()
}
