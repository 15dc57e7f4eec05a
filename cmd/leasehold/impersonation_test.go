package main

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/server"
)

// keyReads is an Agent that reports each read of the generation key: the
// Registrar's fence checks read it once per check.
type keyReads struct {
	consul.Agent
	reads chan struct{}
}

func (k keyReads) Generation(
	ctx context.Context, instanceID string,
) (health.GenerationRecord, error) {
	rec, err := k.Agent.Generation(ctx, instanceID)
	select {
	case k.reads <- struct{}{}:
	default:
	}
	return rec, err
}

// tokenClient is a Consul client of a with token.
func tokenClient(t *testing.T, a *consultest.Agent, token string) *api.Client {
	t.Helper()
	c, err := api.NewClient(&api.Config{Address: a.HTTPAddr(), Token: token})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// forge registers, through c, a registration of task "work" claiming
// instance exec-1's identity: its own service id, instance_id exec-1,
// session and generation as given, with a passing lease check.
func forge(t *testing.T, c *api.Client, serviceID, session string, gen uint64, port int) {
	t.Helper()
	r := health.Registration{InstanceID: "exec-1", SessionID: session,
		Generation: gen, Task: "work", Address: "127.0.0.1", Port: port,
		Version: "1.0.0", Capacity: 2, State: health.StateActive}
	err := c.Agent().ServiceRegister(&api.AgentServiceRegistration{ID: serviceID, Name: "work",
		Tags: []string{"leasehold"}, Address: r.Address, Port: r.Port, Meta: r.Meta(),
		Checks: api.AgentServiceChecks{{CheckID: health.CheckID("exec-1", session, "work"),
			TTL: "1h", Status: api.HealthPassing}}})
	if err != nil {
		t.Fatalf("the forged registration %s was refused: %v (the executor policy lets any "+
			"instance register the task type)", serviceID, err)
	}
}

// TestAnotherInstanceCannotFenceAnExecutor: with ACLs on, two executors of
// one task type hold tokens of the example executor policy, each for its own
// instance. Consul lets exec-2's token register exec-1's instance id (ACLs
// restrict service names, not ids or meta), with a higher generation and
// with exec-1's own generation under another session; it refuses exec-2's
// write of exec-1's generation key. exec-1 stays routed and CURRENT, its
// Registrar goes on with its session, and the forgeries are never routed
// (generation-unconfirmed) nor vouched for (UNKNOWN).
func TestAnotherInstanceCannotFenceAnExecutor(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t,
		consultest.Options{ACLManagementToken: "7c1b0c1e-0000-4000-8000-0000000000c7"})
	root := a.Client()
	execRules := consultest.ExamplePolicy(t, "executor-policy.hcl")
	if !strings.Contains(execRules, `key "leasehold/generation/exec-1"`) {
		t.Fatalf("the example executor policy has no per-instance key rule:\n%s", execRules)
	}
	tok1 := policyToken(t, root, "exec-1", execRules, "executor exec-1")
	tok2 := policyToken(t, root, "exec-2",
		strings.ReplaceAll(execRules, "exec-1", "exec-2"), "executor exec-2")
	lhTok := policyToken(t, root, "leasehold",
		consultest.ExamplePolicy(t, "leasehold-policy.hcl"), "leasehold serve")
	c1, c2 := tokenClient(t, a, tok1), tokenClient(t, a, tok2)

	reads := keyReads{Agent: consul.NewAPIAgent(c1), reads: make(chan struct{}, 1)}
	e1 := startExecutorVia(t, reads, "exec-1", "1.0.0")
	e2 := startExecutorVia(t, consul.NewAPIAgent(c2), "exec-2", "1.0.0")
	s1 := e1.reg.Session()
	t.Setenv("CONSUL_HTTP_ADDR", a.HTTPAddr())
	t.Setenv("CONSUL_HTTP_TOKEN", lhTok)
	t.Setenv("CONSUL_HTTP_TOKEN_FILE", "")
	l := startServe(t, a)
	fc := fencingClient(t, l.xds)
	awaitState(t, fc, "exec-1", s1.ID, leaseholdv1.SessionState_CURRENT)
	awaitState(t, fc, "exec-2", e2.reg.Session().ID, leaseholdv1.SessionState_CURRENT)

	// exec-1's key names its session; exec-2 may not write it.
	pair, _, err := root.KV().Get(health.GenerationKey("exec-1"), nil)
	if err != nil || pair == nil ||
		string(pair.Value) != strconv.FormatUint(s1.Generation, 10)+"/"+s1.ID {
		t.Fatalf("exec-1's generation key = %v, %v: want %d/%s", pair, err, s1.Generation, s1.ID)
	}
	_, err = c2.KV().Put(&api.KVPair{Key: health.GenerationKey("exec-1"),
		Value: []byte("999/forged-hi")}, nil)
	var se api.StatusError
	if !errors.As(err, &se) || se.Code != 403 {
		t.Fatalf("exec-2's token wrote exec-1's generation key: %v", err)
	}

	forge(t, c2, "work:exec-1-hi", "forged-hi", s1.Generation+50, 1)
	forge(t, c2, "work:exec-1-eq", "forged-eq", s1.Generation, 2)
	for _, sess := range []string{"forged-hi", "forged-eq"} {
		consultest.WaitFor(t, 10*time.Second, sess+" seen and unconfirmed", func() bool {
			return verdictOf(t, l.admin, "exec-1", sess,
				"v=").Reason == string(health.ReasonUnconfirmed)
		})
		st, err := fc.CheckSession(context.Background(),
			&leaseholdv1.CheckSessionRequest{InstanceId: "exec-1", SessionId: sess})
		if err != nil || st.State != leaseholdv1.SessionState_UNKNOWN ||
			!strings.Contains(st.Detail, "generation key") {
			t.Fatalf("exec-1/%s = %v, %v: want UNKNOWN naming the generation key", sess, st, err)
		}
	}
	if v := verdictOf(t, l.admin, "exec-1", s1.ID, "v="); v.Route != "HEALTHY" {
		t.Fatalf("exec-1's own session: %+v, want routed", v)
	}
	st, err := fc.CheckSession(context.Background(),
		&leaseholdv1.CheckSessionRequest{InstanceId: "exec-1", SessionId: s1.ID})
	if err != nil || st.State != leaseholdv1.SessionState_CURRENT {
		t.Fatalf("exec-1/%s = %v, %v: want CURRENT", s1.ID, st, err)
	}
	if out := cli(t, 0, "explain", "--admin-addr", l.admin,
		"--instance", "exec-1"); !strings.Contains(out, string(health.ReasonUnconfirmed)) {
		t.Errorf("explain does not show the forgeries unconfirmed:\n%s", out)
	}

	// exec-1's Registrar checks for a newer session once per lease: after
	// three checks it still holds its session.
	for range 3 {
		select {
		case <-reads.reads:
		case <-time.After(10 * time.Second):
			t.Fatal("exec-1's Registrar made no fence check")
		}
	}
	if got := e1.reg.Session(); got == nil || got.ID != s1.ID || got.Err() != nil {
		t.Fatalf("exec-1's session %s ended (now %v): a forged registration fenced it", s1.ID, got)
	}
	awaitState(t, fc, "exec-1", s1.ID, leaseholdv1.SessionState_CURRENT)
}

// verdictOf is /debug/executors' verdict on instance's session for
// constraint set set (zero when absent).
func verdictOf(t *testing.T, admin, instance, session, set string) server.ExplainVerdict {
	t.Helper()
	var ex server.ExplainExecutors
	getBody(t, "http://"+admin+"/debug/executors", &ex)
	for _, e := range ex.Executors {
		if e.InstanceID != instance || e.SessionID != session {
			continue
		}
		for _, v := range e.Verdicts {
			if v.ConstraintSet == set {
				return v
			}
		}
	}
	return server.ExplainVerdict{}
}

// TestACopyOfAnExecutorsSessionOnAnotherAgentChangesNothing: with ACLs on,
// exec-2's token registers, through another agent (its own node), a copy of
// exec-1's live session — its session id, read from the catalog, under a
// lower generation — whose lease check is critical. The copy is not the
// session (a session is one process on one agent): exec-1 stays routed and
// CURRENT, no lapse is recorded for it, and its Registrar keeps its session.
func TestACopyOfAnExecutorsSessionOnAnotherAgentChangesNothing(t *testing.T) {
	consultest.RequireBinary(t)
	const mgmt = "7c1b0c1e-0000-4000-8000-0000000000c8"
	a := consultest.Start(t, consultest.Options{ACLManagementToken: mgmt})
	b := consultest.Start(t, consultest.Options{NodeName: "intruder",
		JoinClientOf: a, ACLManagementToken: mgmt})
	root := a.Client()
	execRules := consultest.ExamplePolicy(t, "executor-policy.hcl")
	tok1 := policyToken(t, root, "exec-1", execRules, "executor exec-1")
	tok2 := policyToken(t, root, "exec-2",
		strings.ReplaceAll(execRules, "exec-1", "exec-2"), "executor exec-2")
	lhTok := policyToken(t, root, "leasehold",
		consultest.ExamplePolicy(t, "leasehold-policy.hcl"), "leasehold serve")
	// exec-1 ran before: its next session takes generation 4.
	if _, err := root.KV().Put(&api.KVPair{Key: health.GenerationKey("exec-1"), Value: []byte("3")},
		nil); err != nil {
		t.Fatal(err)
	}
	reads := keyReads{Agent: consul.NewAPIAgent(tokenClient(t, a, tok1)),
		reads: make(chan struct{}, 1)}
	e1 := startExecutorVia(t, reads, "exec-1", "1.0.0")
	s1 := e1.reg.Session()
	if s1.Generation < 2 {
		t.Fatalf("exec-1's session took generation %d: want one with a lower one below it",
			s1.Generation)
	}
	t.Setenv("CONSUL_HTTP_ADDR", a.HTTPAddr())
	t.Setenv("CONSUL_HTTP_TOKEN", lhTok)
	t.Setenv("CONSUL_HTTP_TOKEN_FILE", "")
	l := startServe(t, a)
	fc := fencingClient(t, l.xds)
	awaitState(t, fc, "exec-1", s1.ID, leaseholdv1.SessionState_CURRENT)

	// exec-2's token, through the intruder's agent: a copy of exec-1's
	// session under generation 1, its lease check critical.
	c2 := tokenClient(t, b, tok2)
	r := health.Registration{InstanceID: "exec-1", SessionID: s1.ID,
		Generation: 1, Task: "work", Address: "127.0.0.1", Port: 1,
		Version: "1.0.0", Capacity: 2, State: health.StateActive}
	if err := c2.Agent().ServiceRegister(&api.AgentServiceRegistration{
		ID: health.ServiceID("exec-1", "work"), Name: "work", Tags: []string{"leasehold"},
		Address: r.Address, Port: r.Port, Meta: r.Meta(),
		Checks: api.AgentServiceChecks{{CheckID: health.CheckID("exec-1", s1.ID, "work"),
			TTL: "1h", Status: api.HealthCritical}}}); err != nil {
		t.Fatalf("the copy was refused: %v", err)
	}
	consultest.WaitService(t, root, "work", 10*time.Second, "the copy in the catalog",
		func(es []*api.ServiceEntry) bool {
			for _, e := range es {
				if e.Node.Node == "intruder" && e.Service.Meta[health.MetaSessionID] == s1.ID {
					return true
				}
			}
			return false
		})
	// exec-1's Registrar checks the catalog once per lease: three checks.
	for range 3 {
		select {
		case <-reads.reads:
		case <-time.After(10 * time.Second):
			t.Fatal("exec-1's Registrar made no fence check")
		}
	}
	if got := e1.reg.Session(); got == nil || got.ID != s1.ID || got.Err() != nil {
		t.Fatalf("exec-1's session %s ended (now %v): a copy of it on another agent ended it",
			s1.ID, got)
	}
	st, err := fc.CheckSession(context.Background(),
		&leaseholdv1.CheckSessionRequest{InstanceId: "exec-1", SessionId: s1.ID})
	if err != nil || st.State != leaseholdv1.SessionState_CURRENT {
		t.Fatalf("exec-1/%s = %v, %v: want CURRENT", s1.ID, st, err)
	}
	if pair, _, err := root.KV().Get(health.LapseMarkKey("exec-1", s1.ID), nil); err != nil ||
		pair != nil {
		t.Fatalf("a lapse of exec-1/%s was recorded (%v, %v): the copy's "+
			"critical lease is not the session's", s1.ID, pair, err)
	}
	var ex server.ExplainExecutors
	getBody(t, "http://"+l.admin+"/debug/executors", &ex)
	for _, e := range ex.Executors {
		if e.InstanceID != "exec-1" {
			continue
		}
		for _, v := range e.Verdicts {
			if v.ConstraintSet != "v=" {
				continue
			}
			copied := e.Node == "intruder"
			if copied && v.Reason != string(health.ReasonUnconfirmed) ||
				!copied && v.Route != "HEALTHY" {
				t.Fatalf("exec-1/%s on %s: %+v, want the copy %s and the session routed",
					e.SessionID, e.Node, v, health.ReasonUnconfirmed)
			}
		}
	}
}
