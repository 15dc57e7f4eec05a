package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// A real registry cluster — three Consul servers (raft, not -dev) and three
// client agents on loopback. leasehold watches through one client agent;
// executors register through the other two. While a dispatcher's ADS stream
// watches EDS and a fencing client polls CheckSession for every session, the
// raft leader is killed (SIGKILL) and, during the election, four executors
// with 2 s leases stop heartbeating: two for good (they must lapse), two
// because they are replaced by new processes under new sessions (one on the
// same agent, one on the other). leasehold must follow the new leader
// without a restart, never send an endpoint of a session it has answered
// LAPSED or STALE, apply the lapses and the new sessions after the election,
// keep routing the executors that stayed healthy, and never turn a session's
// fencing answer back from STALE/LAPSED to CURRENT (UNKNOWN is neutral) nor
// its consul_index back.
func TestClusterLeaderFailoverDrill(t *testing.T) {
	began := time.Now()
	cl := consultest.StartCluster(t, 3, 3)
	watchAgent, agentA, agentB := cl.Clients[0], cl.Clients[1], cl.Clients[2]
	t.Logf("cluster of 3 servers and 3 clients healthy after %s",
		time.Since(began).Round(time.Millisecond))

	// one port per instance: every session of an instance has the same address
	ports := map[string]int{}
	execs := map[string]*drillExecutor{}
	launch := func(name, instance string, a *consultest.Agent, lease health.Lease) *drillExecutor {
		if ports[instance] == 0 {
			ports[instance] = freeTCPPort(t)
		}
		e := launchDrillExecutor(t, a, instance, ports[instance], lease)
		execs[name] = e
		return e
	}
	// Executors that must keep their leases get one that outlasts the
	// election: a client agent holds its local state locked while it syncs a
	// change to the servers, and during an election that sync waits for a
	// leader (up to rpc_hold_timeout, 7 s), so every heartbeat through that
	// agent waits too. The lapses below are such changes. The others have
	// the short leases of the other drills.
	long := health.Lease{
		TTL:             10 * time.Second,
		Heartbeat:       time.Second,
		DeregisterAfter: time.Minute,
	}
	short := health.Lease{
		TTL:             2 * time.Second,
		Heartbeat:       500 * time.Millisecond,
		DeregisterAfter: time.Minute,
	}
	launch("stay-a", "stay-a", agentA, long)
	launch("stay-b", "stay-b", agentB, long)
	launch("lapse-a", "lapse-a", agentA, short)
	launch("lapse-b", "lapse-b", agentB, short)
	launch("same-agent", "same-agent", agentA, short)   // restarted on agent A under a new session
	launch("other-agent", "other-agent", agentA, short) // restarted on agent B under a new session
	sessions := map[string]*consul.Session{}            // by executor name
	for name, e := range execs {
		sessions[name] = e.waitSession(t, 15*time.Second)
	}

	// The fencing API answers UNKNOWN once its view is older than 3 s (the
	// least allowed; about the short leases here): elections take about as
	// long, so some runs see UNKNOWN answers during one, which are neutral.
	addrs := startServeTo(t, watchAgent, testWriter{t, "serve"},
		func(cfg *serveConfig) { cfg.staleAfter = 3 * time.Second })
	eds := recordEDS(t, addrs.xds)
	fence := pollFencing(t, fencingClient(t, addrs.xds))
	for name, s := range sessions {
		fence.add(execs[name].instance, s.ID)
	}
	initial := endpoints{}
	for name, s := range sessions {
		initial[execs[name].endpoint(s)]++
	}
	eds.await(t, 20*time.Second, "the six executors routed: "+initial.String(), initial.equal)
	for name, s := range sessions {
		fence.await(t, 10*time.Second, execs[name].instance, s.ID, leaseholdv1.SessionState_CURRENT)
	}
	agentA.SettleSync() // past the agents' start-up hold-back of check syncs
	agentB.SettleSync()
	steady := eds.count()

	// The leader dies; during the election four executors stop
	// heartbeating and two of them come back as new processes.
	leader := cl.Leader()
	if leader == nil {
		t.Fatal("no agreed raft leader before the drill")
	}
	killed := time.Now()
	leader.Kill()
	for _, name := range []string{"lapse-a", "lapse-b", "same-agent", "other-agent"} {
		execs[name].silent.Store(true) // a frozen or crashed process: no heartbeat
	}
	launch("same-agent-2", "same-agent", agentA, short)
	launch("other-agent-2", "other-agent", agentB, short)
	newLeader := cl.WaitLeader(t, 30*time.Second, leader)
	elected := time.Now()
	t.Logf("leader %s killed; %s elected after %s",
		leader.Node, newLeader.Node, elected.Sub(killed).Round(time.Millisecond))
	for _, name := range []string{"same-agent-2", "other-agent-2"} {
		sessions[name] = execs[name].waitSession(t, 20*time.Second)
		fence.add(execs[name].instance, sessions[name].ID)
	}
	registered := time.Now()
	for _, name := range []string{"stay-a", "stay-b"} {
		if n := execs[name].losses.Load(); n > 0 {
			t.Fatalf(
				"%s lost its %s lease during the election (heartbeats through its agent waited "+
					"longer than that for a leader): the drill needs a longer one on this machine",
				name, long.TTL)
		}
	}

	// (2) After the election the lapses and the new sessions are applied by
	// the same leasehold, on the same stream.
	final := endpoints{}
	for _, name := range []string{"stay-a", "stay-b", "same-agent-2", "other-agent-2"} {
		final[execs[name].endpoint(sessions[name])]++
	}
	eds.await(t, 30*time.Second, "the lapses and the new sessions applied: "+final.String(),
		final.equal)
	converged := time.Now()
	// readiness follows the new leader too (/readyz has no watch API: poll it)
	consultest.WaitFor(t, 10*time.Second, "/readyz 200 after the election",
		func() bool { return readyzStatus(addrs.admin) == http.StatusOK })
	terminal := []leaseholdv1.SessionState{
		leaseholdv1.SessionState_LAPSED,
		leaseholdv1.SessionState_STALE,
	}
	fence.await(t, 10*time.Second, "lapse-a", sessions["lapse-a"].ID,
		leaseholdv1.SessionState_LAPSED)
	fence.await(t, 10*time.Second, "lapse-b", sessions["lapse-b"].ID,
		leaseholdv1.SessionState_LAPSED)
	fence.await(t, 10*time.Second, "same-agent", sessions["same-agent"].ID, terminal...)
	fence.await(t, 10*time.Second, "other-agent", sessions["other-agent"].ID,
		leaseholdv1.SessionState_STALE)
	for _, name := range []string{"stay-a", "stay-b", "same-agent-2", "other-agent-2"} {
		fence.await(t, 10*time.Second, execs[name].instance, sessions[name].ID,
			leaseholdv1.SessionState_CURRENT)
	}
	recs, answers, pollErrs := eds.snapshot(), fence.snapshot(), fence.errors()
	t.Logf(
		"new sessions registered %s after the kill; leasehold converged %s after the kill (%s "+
			"after the election); %d EDS responses, %d during the drill",
		registered.Sub(killed).Round(
			time.Millisecond,
		),
		converged.Sub(killed).Round(time.Millisecond),
		converged.Sub(elected).Round(time.Millisecond), len(recs), len(recs)-steady)
	t.Log(timeline(killed, recs, answers))

	// (1) no EDS response built after a session was answered LAPSED or
	// STALE routes it. A response is built from the cache after the request
	// it answers (the ACK of the previous one) reached the server, and
	// leasehold puts a removal into the cache before its fencing answer
	// changes: no session answered LAPSED or STALE before that request was
	// sent may be in it.
	for ref, as := range answers {
		first := slices.IndexFunc(as,
			func(a fenceAnswer) bool { return slices.Contains(terminal, a.State) })
		if first < 0 {
			continue
		}
		seen := as[first]
		for i, r := range recs {
			if r.Requested.After(seen.At) && r.Set.has(ref.Instance, ref.Session) {
				t.Errorf(
					"EDS response #%d (version %s), requested %s after the kill, routes %s/%s: "+
						"answered %s %s after the kill",
					i, r.Version, r.Requested.Sub(killed).Round(time.Millisecond), ref.Instance,
					ref.Session, seen.State, seen.At.Sub(killed).Round(time.Millisecond))
			}
		}
	}
	for i, r := range recs {
		for e, n := range r.Set {
			if n > 1 {
				t.Errorf("EDS response #%d lists %s/%s@%s %d times",
					i, e.instance, e.session, e.addr, n)
			}
		}
	}
	// the executors that kept their leases were routed throughout, on the
	// same stream (fail static during the election, no spurious removal)
	for i, r := range recs[steady-1:] {
		for _, name := range []string{"stay-a", "stay-b"} {
			if r.Set[execs[name].endpoint(sessions[name])] == 0 {
				t.Errorf(
					"EDS response #%d (%s after the kill) dropped %s, whose lease never lapsed "+
						"(losses seen by its registrar: %d)",
					steady-1+i, r.At.Sub(killed).Round(time.Millisecond), name,
					execs[name].losses.Load())
			}
		}
	}
	// (3) fencing answers never go backwards: STALE/LAPSED are final
	// (UNKNOWN is neutral: not yet seen, or leasehold's view is too old)
	for ref, as := range answers {
		var over *fenceAnswer // the first STALE or LAPSED answer
		for i := range as {
			a := &as[i]
			switch a.State {
			case leaseholdv1.SessionState_LAPSED, leaseholdv1.SessionState_STALE:
				if over == nil {
					over = a
				}
			case leaseholdv1.SessionState_CURRENT, leaseholdv1.SessionState_DRAINING:
				if over != nil {
					t.Errorf("%s/%s answered %s %s after the kill, then %s %s after the kill (%q)",
						ref.Instance, ref.Session, over.State,
						over.At.Sub(killed).Round(time.Millisecond), a.State,
						a.At.Sub(killed).Round(time.Millisecond), a.Detail)
				}
			}
		}
	}
	for _, err := range pollErrs {
		t.Errorf("fencing: %s", err)
	}
	// (4) the whole drill, cluster included, in well under a minute
	if d := time.Since(began); d > 50*time.Second {
		t.Errorf("the drill took %s", d.Round(time.Millisecond))
	}
}

// edsRecorder is a dispatcher's ADS stream for task work's endpoints that
// records every response (ACKing each once recorded) for the whole test.
type edsRecorder struct {
	mu      sync.Mutex
	recs    []edsRecord
	err     error
	changed chan struct{} // closed and replaced on every response or error
}

type edsRecord struct {
	Requested time.Time // when the request it answers (the ACK of the previous response) was sent
	At        time.Time // when it was received
	Version   string
	Set       endpoints
}

func recordEDS(t *testing.T, xdsAddr string) *edsRecorder {
	t.Helper()
	s := dialADS(t, xdsAddr, &corev3.Node{Id: "cluster-drill"})
	r := &edsRecorder{changed: make(chan struct{})}
	note := func(rec *edsRecord, err error) {
		r.mu.Lock()
		defer r.mu.Unlock()
		if rec != nil {
			r.recs = append(r.recs, *rec)
		}
		if err != nil && r.err == nil {
			r.err = err
		}
		close(r.changed)
		r.changed = make(chan struct{})
	}
	ended := s.Follow(resource.EndpointType, []string{"work"},
		func(resp *discovery.DiscoveryResponse, requested, received time.Time) {
			note(
				&edsRecord{
					Requested: requested,
					At:        received,
					Version:   resp.VersionInfo,
					Set:       endpointsOf(resp),
				},
				nil,
			)
		},
	)
	go func() { note(nil, <-ended) }()
	return r
}

// await waits until the latest response satisfies cond.
func (r *edsRecorder) await(t *testing.T, timeout time.Duration, what string,
	cond func(endpoints) bool) {
	t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		r.mu.Lock()
		err, ch := r.err, r.changed
		var last endpoints
		if n := len(r.recs); n > 0 {
			last = r.recs[n-1].Set
		}
		r.mu.Unlock()
		if err != nil {
			t.Fatalf("waiting for %s: the EDS stream failed: %v", what, err)
		}
		if last != nil && cond(last) {
			return
		}
		select {
		case <-ch:
		case <-deadline.C:
			t.Fatalf("timed out after %s waiting for %s; last EDS response routes %s",
				timeout, what, last)
		}
	}
}

func (r *edsRecorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.recs)
}

func (r *edsRecorder) snapshot() []edsRecord {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.recs)
}

// fencePoller asks CheckSession for every session it was given, every 50 ms,
// as a dispatcher confirming results would, and records each change of the
// answer (state, and when it was received).
type fencePoller struct {
	fc leaseholdv1.FencingClient

	mu        sync.Mutex
	refs      []sessionRef
	answers   map[sessionRef][]fenceAnswer
	errs      []string
	lastIndex uint64 // highest consul_index answered so far
	changed   chan struct{}
}

type sessionRef struct{ Instance, Session string }

type fenceAnswer struct {
	At     time.Time
	State  leaseholdv1.SessionState
	Index  uint64
	Detail string
}

func pollFencing(t *testing.T, fc leaseholdv1.FencingClient) *fencePoller {
	p := &fencePoller{fc: fc, answers: map[sessionRef][]fenceAnswer{}, changed: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			p.mu.Lock()
			refs := slices.Clone(p.refs)
			p.mu.Unlock()
			for _, ref := range refs {
				cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
				resp, err := fc.CheckSession(cctx,
					&leaseholdv1.CheckSessionRequest{
						InstanceId: ref.Instance,
						SessionId:  ref.Session,
					},
				)
				ccancel()
				if ctx.Err() != nil {
					return
				}
				p.record(ref, resp, err)
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	return p
}

func (p *fencePoller) add(instance, session string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refs = append(p.refs, sessionRef{instance, session})
}

func (p *fencePoller) record(ref sessionRef, resp *leaseholdv1.CheckSessionResponse, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		p.errs = append(p.errs, fmt.Sprintf("%s/%s: %v", ref.Instance, ref.Session, err))
		return
	}
	if resp.ConsulIndex < p.lastIndex { // the cluster kept its state: its index never goes back
		p.errs = append(p.errs,
			fmt.Sprintf("%s/%s answered %s at consul_index %d after an answer at %d",
				ref.Instance, ref.Session, resp.State, resp.ConsulIndex, p.lastIndex),
		)
	}
	p.lastIndex = max(p.lastIndex, resp.ConsulIndex)
	as := p.answers[ref]
	if n := len(as); n > 0 && as[n-1].State == resp.State {
		return
	}
	p.answers[ref] = append(as,
		fenceAnswer{
			At:     time.Now(),
			State:  resp.State,
			Index:  resp.ConsulIndex,
			Detail: resp.Detail,
		},
	)
	close(p.changed)
	p.changed = make(chan struct{})
}

// await waits until the latest answer for the session is one of want.
func (p *fencePoller) await(t *testing.T, timeout time.Duration, instance, session string,
	want ...leaseholdv1.SessionState) {
	t.Helper()
	ref := sessionRef{instance, session}
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		p.mu.Lock()
		as, ch := p.answers[ref], p.changed
		p.mu.Unlock()
		var last fenceAnswer
		if len(as) > 0 {
			last = as[len(as)-1]
			if slices.Contains(want, last.State) {
				return
			}
		}
		select {
		case <-ch:
		case <-deadline.C:
			t.Fatalf("timed out after %s waiting for %s/%s to be answered %v; last answer %s %q",
				timeout, instance, session, want, last.State, last.Detail)
		}
	}
}

func (p *fencePoller) snapshot() map[sessionRef][]fenceAnswer {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[sessionRef][]fenceAnswer, len(p.answers))
	for k, v := range p.answers {
		out[k] = slices.Clone(v)
	}
	return out
}

func (p *fencePoller) errors() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.errs)
}

// timeline renders the drill's EDS responses and fencing changes relative to
// the kill, for the log.
func timeline(zero time.Time, recs []edsRecord, answers map[sessionRef][]fenceAnswer) string {
	type line struct {
		at   time.Time
		text string
	}
	var lines []line
	for i, r := range recs {
		lines = append(lines,
			line{r.At, fmt.Sprintf("EDS #%d version %s: %s", i, r.Version, r.Set)})
	}
	for ref, as := range answers {
		for _, a := range as {
			lines = append(lines,
				line{
					a.At,
					fmt.Sprintf("fencing %s/%s: %s (index %d) %s",
						ref.Instance, ref.Session, a.State, a.Index, a.Detail),
				},
			)
		}
	}
	sort.SliceStable(lines, func(i, j int) bool { return lines[i].at.Before(lines[j].at) })
	var b strings.Builder
	b.WriteString("timeline (relative to the leader's kill):")
	for _, l := range lines {
		fmt.Fprintf(&b, "\n  %+8.3fs %s", l.at.Sub(zero).Seconds(), l.text)
	}
	return b.String()
}

// drillExecutor is an executor process reduced to its Registrar (the drill's
// dispatcher reads endpoints, it never calls them); silent stops its
// heartbeats, as a frozen or crashed process.
type drillExecutor struct {
	instance string
	port     int
	reg      *consul.Registrar
	silent   atomic.Bool
	losses   atomic.Int32
}

func launchDrillExecutor(t *testing.T, a *consultest.Agent, instance string, port int,
	lease health.Lease) *drillExecutor {
	t.Helper()
	e := &drillExecutor{instance: instance, port: port}
	reg, err := consul.NewRegistrar(consul.NewAPIAgent(a.Client()), consul.Config{
		InstanceID: instance, Tasks: []string{"work"}, Address: "127.0.0.1", Port: port,
		Version: "1.0.0", Capacity: 2,
		Lease:       lease,
		OnLeaseLost: func(consul.LeaseLoss) { e.losses.Add(1) },
		Probe: func(context.Context) error {
			if e.silent.Load() {
				return fmt.Errorf("silenced by the drill")
			}
			return nil
		},
		Logger: slog.New(slog.NewTextHandler(testWriter{t, instance}, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	e.reg = reg
	ctx, cancel := context.WithCancel(context.Background())
	go reg.Run(ctx)
	t.Cleanup(func() { cancel(); <-reg.Done() })
	return e
}

func (e *drillExecutor) waitSession(t *testing.T, timeout time.Duration) *consul.Session {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	s, err := e.reg.WaitSession(ctx, nil)
	if err != nil {
		t.Fatalf("%s never registered: %v", e.instance, err)
	}
	return s
}

func (e *drillExecutor) endpoint(s *consul.Session) endpoint {
	return endpoint{
		instance: e.instance,
		session:  s.ID,
		addr:     net.JoinHostPort("127.0.0.1", strconv.Itoa(e.port)),
	}
}

// freeTCPPort is a loopback port nothing listens on now (the drill's
// executors only need distinct addresses).
func freeTCPPort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
