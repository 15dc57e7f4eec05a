package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	grpchealth "google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/testproc"
)

const executorEnv = "LEASEHOLD_TEST_EXECUTOR" // child mode: "<consul addr>,<instance id>"

type executorEvent struct {
	Event   string `json:"event"` // registered, lost
	Session string `json:"session"`
}

// runExecutorChild is a real executor process: a gRPC server whose answers
// name its instance and session, registered with the Registrar (1 s lease).
func runExecutorChild(spec string) int {
	consulAddr, instance, _ := strings.Cut(spec, ",")
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	var reg *consul.Registrar
	g := grpc.NewServer(grpc.UnaryInterceptor(func(
		ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler,
	) (any, error) {
		sess := ""
		if s := reg.Session(); s != nil {
			sess = s.ID
		}
		grpc.SetHeader(ctx, metadata.Pairs("x-instance", instance, "x-session", sess))
		return h(ctx, req)
	}))
	healthpb.RegisterHealthServer(g, grpchealth.NewServer())
	go g.Serve(lis)
	client, err := consul.NewClient(consulAddr, 8)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	enc := json.NewEncoder(os.Stdout)
	reg, err = consul.NewRegistrar(consul.NewAPIAgent(client), consul.Config{
		InstanceID: instance, Tasks: []string{"work"},
		Address: "127.0.0.1", Port: lis.Addr().(*net.TCPAddr).Port,
		Version: "1.0.0", Capacity: 2,
		Lease: health.Lease{TTL: time.Second,
			Heartbeat: 250 * time.Millisecond, DeregisterAfter: time.Minute},
		OnLeaseLost: func(l consul.LeaseLoss) {
			enc.Encode(executorEvent{Event: "lost", Session: l.SessionID})
		},
		Logger: slog.New(slog.NewTextHandler(os.Stderr, nil)),
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() { testproc.WaitForExit(); cancel() }() // the parent closes stdin
	go func() {
		var prev *consul.Session
		for {
			s, err := reg.WaitSession(ctx, prev)
			if err != nil {
				return
			}
			enc.Encode(executorEvent{Event: "registered", Session: s.ID})
			prev = s
		}
	}()
	reg.Run(ctx)
	return 0
}

// TestGCPauseDrill: an executor process is frozen (SIGSTOP) longer than its
// lease while dispatchers call it; it is removed from their endpoints within
// the lease and a margin, its old session is never routed again, and on
// SIGCONT it reports the loss and comes back under a new session, which is
// routed.
func TestGCPauseDrill(t *testing.T) {
	a := consultest.Start(t)
	a.SettleSync()
	startExecutor(t, a, "steady", "1.0.0") // keeps calls flowing
	child := testproc.Start(t, "paused", executorEnv+"="+a.HTTPAddr()+",paused")
	events := make(chan executorEvent, 16)
	go func() {
		for line := range child.Lines {
			var e executorEvent
			if json.Unmarshal(line, &e) == nil {
				events <- e
			}
		}
	}()
	next := func(want string) executorEvent {
		t.Helper()
		select {
		case e := <-events:
			if e.Event != want {
				t.Fatalf("executor event %+v, want %s", e, want)
			}
			return e
		case <-time.After(15 * time.Second):
			t.Fatalf("executor reported no %s", want)
		}
		return executorEvent{}
	}
	s1 := next("registered").Session

	addrs := startServe(t, a)
	d := startDispatcher(t, addrs.xds, "dispatcher", map[string]any{})
	d.await(t, time.Now(), 20*time.Second, "calls to both", func(cs []callResult) bool {
		m := servedBy(cs)
		return m["paused"] > 0 && m["steady"] > 0
	})

	frozen := time.Now()
	if err := child.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	// removed within lease + margin: calls keep succeeding, on "steady" only
	removedBy := frozen.Add(time.Second + time.Second)
	d.await(t, removedBy.Add(time.Second), 15*time.Second, "calls after the removal",
		func(cs []callResult) bool { return servedBy(cs)["steady"] > 20 })
	for _, c := range d.since(removedBy) {
		if c.Err != "" {
			t.Fatalf("call failed after the frozen executor should have been removed: %s", c.Err)
		}
		if c.Instance == "paused" {
			t.Fatal("a call reached the frozen executor after lease + 1 s")
		}
	}
	<-time.After(time.Until(frozen.Add(2 * time.Second))) // the drill: frozen for two leases
	if err := child.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if lost := next("lost"); lost.Session != s1 {
		t.Fatalf("lost %s, want %s", lost.Session, s1)
	}
	s2 := next("registered").Session
	if s2 == s1 {
		t.Fatal("came back under the old session")
	}
	resumed := time.Now()
	d.await(t, resumed, 15*time.Second, "calls to the new session", func(cs []callResult) bool {
		for _, c := range cs {
			if c.Instance == "paused" && c.Session == s2 {
				return true
			}
		}
		return false
	})
	for _, c := range d.since(removedBy) {
		if c.Instance == "paused" && c.Session == s1 {
			t.Fatal("the old session was routed again")
		}
	}
}
