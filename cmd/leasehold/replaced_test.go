package main

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// crashingAgent never deregisters: a process that dies leaves its
// registration behind, as a killed executor does.
type crashingAgent struct{ consul.Agent }

func (crashingAgent) Deregister(context.Context, string) error { return nil }

// runProcess starts a Registrar of instance x for task work on agent and
// returns its first session and a stop.
func runProcess(t *testing.T, agent consul.Agent, name string) (*consul.Session, func()) {
	t.Helper()
	reg, err := consul.NewRegistrar(agent, consul.Config{
		InstanceID: "x", Tasks: []string{"work"}, Address: "127.0.0.1",
		Port: 9301, Version: "1.0.0", Capacity: 2,
		Lease: health.Lease{TTL: 2 * time.Second,
			Heartbeat: 500 * time.Millisecond, DeregisterAfter: time.Minute},
		Logger: slog.New(slog.NewTextHandler(testWriter{t, name}, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go reg.Run(ctx)
	stop := func() { cancel(); <-reg.Done() }
	t.Cleanup(stop)
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	s, err := reg.WaitSession(wctx, nil)
	if err != nil {
		t.Fatalf("%s never registered: %v", name, err)
	}
	return s, stop
}

// A replaced session is STALE across restarts and replicas: executor x's
// process (session s1) crashes and a new process registers s2 on the same
// agent, replacing s1's registration while no leasehold runs. A leasehold
// started afterwards never saw s1, yet answers it STALE with s2 as the
// newer session (s2's registration names s1 in its replaces meta), not
// UNKNOWN.
func TestReplacedSessionIsStaleAcrossRestarts(t *testing.T) {
	a := consultest.Start(t)
	first, stop := startServeStoppable(t, a)
	s1, crash := runProcess(t, crashingAgent{consul.NewAPIAgent(a.Client())}, "process-1")
	awaitState(t, fencingClient(t, first.xds), "x", s1.ID, leaseholdv1.SessionState_CURRENT)
	stop()
	crash()

	s2, _ := runProcess(t, consul.NewAPIAgent(a.Client()), "process-2")
	if len(s2.Replaces) == 0 || s2.Replaces[0] != s1.ID {
		t.Fatalf("s2 replaces %v, want %s first", s2.Replaces, s1.ID)
	}
	for _, name := range []string{"restarted", "a replica started later"} {
		l := startServe(t, a)
		fc := fencingClient(t, l.xds)
		awaitState(t, fc, "x", s2.ID, leaseholdv1.SessionState_CURRENT)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		r, err := fc.CheckSession(ctx,
			&leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: s1.ID})
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		if r.State != leaseholdv1.SessionState_STALE ||
			r.NewerSessionId != s2.ID || r.NewerGeneration != s2.Generation {
			t.Fatalf("%s: x/s1 = %s newer %s/%d (%s), want STALE newer %s/%d", name, r.State,
				r.NewerSessionId, r.NewerGeneration, r.Detail, s2.ID, s2.Generation)
		}
		t.Logf("%s: x/s1 %s (%s)", name, r.State, r.Detail)
	}
}
