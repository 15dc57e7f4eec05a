package consul

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/internal/testproc"
)

// The pause drill runs the Registrar in a child process (this test binary
// re-executed) so the whole process can be SIGSTOPped, as a GC pause or a
// frozen VM would stop it.
const childEnv = "LEASEHOLD_REGISTRAR_CHILD"

func TestMain(m *testing.M) {
	if addr := os.Getenv(childEnv); addr != "" {
		os.Exit(runChild(addr))
	}
	os.Exit(m.Run())
}

type childEvent struct {
	Event   string `json:"event"` // registered, lost
	Session string `json:"session"`
	Reason  string `json:"reason,omitempty"`
}

func runChild(addr string) int {
	cfg := api.DefaultConfig()
	cfg.Address = addr
	c, err := api.NewClient(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	enc := json.NewEncoder(os.Stdout)
	reg, err := NewRegistrar(NewAPIAgent(c), Config{
		InstanceID: "paused-1", Tasks: []string{"transcode"}, Address: "127.0.0.1", Port: 9100,
		Version: "1.2.3", Capacity: 1, Lease: shortLease,
		OnLeaseLost: func(l LeaseLoss) {
			enc.Encode(childEvent{Event: "lost", Session: l.SessionID, Reason: string(l.Reason)})
		},
		Logger: slog.New(slog.NewTextHandler(os.Stderr, nil)),
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		var prev *Session
		for {
			s, err := reg.WaitSession(ctx, prev)
			if err != nil {
				return
			}
			enc.Encode(childEvent{Event: "registered", Session: s.ID})
			prev = s
		}
	}()
	go func() { testproc.WaitForExit(); cancel() }() // the parent closes stdin
	reg.Run(ctx)
	return 0
}

func TestConsulPausedProcessLosesLeaseAndComesBackFresh(t *testing.T) {
	a := consultest.Start(t)
	a.SettleSync() // lapse timing is measured below
	c := a.Client()
	child := testproc.Start(t, "child", childEnv+"="+a.HTTPAddr())
	events := make(chan childEvent, 16)
	go func() {
		for line := range child.Lines {
			var e childEvent
			if json.Unmarshal(line, &e) == nil {
				events <- e
			}
		}
		close(events)
	}()
	next := func(want string) childEvent {
		t.Helper()
		select {
		case e, ok := <-events:
			if !ok || e.Event != want {
				t.Fatalf("child event = %+v (open %v), want %s", e, ok, want)
			}
			return e
		case <-time.After(15 * time.Second):
			t.Fatalf("child reported no %s", want)
		}
		return childEvent{}
	}

	s1 := next("registered").Session
	waitCheck(t, c, s1, api.HealthPassing, 10*time.Second)

	paused := time.Now()
	if err := child.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitCheck(t, c, s1, api.HealthCritical, 5*time.Second)
	lapse := time.Since(paused)
	t.Logf(
		"critical %s after SIGSTOP at %s (lease %s)",
		lapse,
		paused.Format("15:04:05.000"),
		shortLease.TTL,
	)
	if lapse > shortLease.TTL+750*time.Millisecond {
		t.Errorf("lapse took %s, want ≤ lease + 750ms", lapse)
	}
	// The drill: stay stopped for two whole leases, then resume.
	<-time.After(2*shortLease.TTL - time.Since(paused))
	if err := child.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	lost := next("lost")
	if lost.Session != s1 || lost.Reason != string(LossExpired) {
		t.Fatalf("lost = %+v", lost)
	}
	s2 := next("registered").Session
	if s2 == s1 {
		t.Fatal("came back under the old session")
	}
	es := waitCheck(t, c, s2, api.HealthPassing, 10*time.Second)
	_ = es
	all, _, err := c.Health().Service("transcode", "", false, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range all {
		if _, ch := entryOf([]*api.ServiceEntry{e}, s1); ch != nil &&
			ch.Status == api.HealthPassing {
			t.Fatalf("old session back to passing: %s", consultest.Describe(all))
		}
	}
}
