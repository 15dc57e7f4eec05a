package fleet

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
)

// awaitReadiness waits (on view changes: every batch publishes one) until
// the syncer's readiness satisfies cond.
func awaitReadiness(t *testing.T, s *Syncer, what string, cond func(Readiness) bool) Readiness {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		v := s.View()
		if r := s.Readiness(); cond(r) {
			if r.Ready != s.Ready() {
				t.Fatalf("%s: Readiness %+v, Ready %v", what, r, s.Ready())
			}
			return r
		}
		select {
		case <-v.Changed():
		case <-deadline:
			t.Fatalf("%s: readiness %+v", what, s.Readiness())
		}
	}
}

func reason(want, detail string) func(Readiness) bool {
	return func(r Readiness) bool {
		return !r.Ready && r.Reason == want && strings.Contains(r.Detail, detail)
	}
}

// /readyz's reason: the first read pending (and what it waits for, the
// operators' controls included), a missing right (of the control watch or
// a datacenter's), a certificate problem, an unreachable Consul — the one
// that tells most first. Nothing is served before the controls are read.
func TestReadinessNamesItsReason(t *testing.T) {
	pubs := make(chan string, 16)
	s := NewSyncer(SyncConfig{AwaitControl: true, Clock: clockwork.NewFakeClock(),
		Logger:    slog.New(slog.NewTextHandler(testLog{t}, nil)),
		OnPublish: func(g string, _ *cache.Snapshot) { pubs <- g }})
	obs := make(chan health.Observation, 16)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx, obs); close(done) }()
	t.Cleanup(func() { cancel(); <-done })

	if r := s.Readiness(); r.Ready || r.Reason != ReasonFirstRead {
		t.Fatalf("before any answer: %+v", r)
	}
	go s.Subscribe(dispatcher(t, ""))
	obs <- health.Observation{Data: &health.Generations{Index: 1}}
	obs <- health.Observation{Data: &health.TaskList{Index: 2, Tasks: []string{"work"}}}
	awaitReadiness(t, s, "members pending",
		reason(ReasonFirstRead, "the members of 1 of 1 task types, the non-passing checks"))
	obs <- health.Observation{Data: &health.TaskMembers{Task: "work", Index: 3,
		Members: []health.Member{fleettest.Member("work", "e1", "s1", 1, 9001, "1.0.0",
			health.StatusPassing, 3)}}}
	obs <- health.Observation{Data: &health.NonPassing{Index: 3}}
	awaitReadiness(t, s, "the controls pending", reason(ReasonFirstRead, "operators' controls"))
	select {
	case g := <-pubs:
		t.Fatalf("group %s published before the cordons were read", g)
	default:
	}

	right := `key_prefix "leasehold/control/" { policy = "read" }`
	obs <- health.Observation{Data: &health.ControlContact{Err: errors.New("filtered"),
		Problem: health.ProblemACL, Detail: right}}
	r := awaitReadiness(t, s, "the control read refused", reason(string(health.ProblemACL), right))
	if r.Source != ControlSource {
		t.Errorf("source %q, want %q", r.Source, ControlSource)
	}

	obs <- health.Observation{Data: &health.CordonSet{Index: 4, Raw: map[string][]byte{}}}
	obs <- health.Observation{Data: &health.ControlContact{OK: true}}
	awaitReadiness(t, s, "ready", func(r Readiness) bool { return r.Ready && r.Reason == "" })
	select {
	case <-pubs:
	case <-time.After(5 * time.Second):
		t.Fatal("nothing published once the controls were read")
	}

	// The control watch fails, unreachable, and then a datacenter's
	// certificate problem (applied in this order): the certificate problem
	// tells more.
	obs <- health.Observation{Data: &health.ControlContact{Err: errors.New("connection refused"),
		Problem: health.ProblemUnreachable}}
	obs <- health.Observation{Data: &health.Contact{Err: errors.New("tls: x509"),
		Problem: health.ProblemTLS, Detail: "x509: certificate signed by unknown authority"}}
	awaitReadiness(t, s, "TLS", reason(string(health.ProblemTLS), "unknown authority"))
	obs <- health.Observation{Data: &health.Contact{OK: true}}
	r = awaitReadiness(t, s, "the controls unreachable",
		reason(string(health.ProblemUnreachable), "connection refused"))
	if r.Source != ControlSource {
		t.Errorf("source %q, want %q", r.Source, ControlSource)
	}
	obs <- health.Observation{Data: &health.ControlContact{OK: true}}
	awaitReadiness(t, s, "ready again", func(r Readiness) bool { return r.Ready })
}

// Without a control watch (AwaitControl off) readiness is the fleet's
// alone, and a datacenter's failure before the first read is the reason.
func TestReadinessWithoutControlWatch(t *testing.T) {
	h := startSyncer(t)
	h.obs <- health.Observation{Data: &health.Contact{Err: errors.New("dial tcp: connection " +
		"refused")}}
	awaitReadiness(t, h.s, "unreachable before the first read",
		reason(string(health.ProblemUnreachable), "connection refused"))
	h.obs <- health.Observation{Data: &health.Contact{OK: true}}
	h.tasks()
	h.nonPassing()
	awaitReadiness(t, h.s, "ready", func(r Readiness) bool { return r.Ready })
}

// Every right missing anywhere is named once, with whose reads lack them.
func TestReadinessNamesEveryMissingRight(t *testing.T) {
	h := startSyncer(t)
	gen := `key_prefix "leasehold/generation/" { policy = "read" }`
	ctl := `key_prefix "leasehold/control/" { policy = "read" }`
	svc := `service_prefix "" { policy = "read" }`
	h.obs <- health.Observation{Data: &health.Contact{Err: errors.New("acl"),
		Problem: health.ProblemACL, Detail: svc + " and " + gen}}
	h.obs <- health.Observation{Data: &health.ControlContact{Err: errors.New("acl"),
		Problem: health.ProblemACL, Detail: ctl}}
	r := awaitReadiness(t, h.s, "both", reason(string(health.ProblemACL), ctl))
	if want := ctl + " and " + gen + " and " + svc; r.Detail != want ||
		r.Source != ControlSource+", fleet" {
		t.Fatalf("%+v, want detail %q from both", r, want)
	}
}

// logSink is a log buffer safe for the syncer's goroutine.
type logSink struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *logSink) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logSink) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// "serving the last known snapshot" is said only once a snapshot was served:
// Consul failing before the fleet was first read says nothing is served yet.
func TestUnreachableSaysServingOnlyOnceSomethingWasServed(t *testing.T) {
	var logs logSink
	s := NewSyncer(SyncConfig{Clock: clockwork.NewFakeClock(),
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	obs := make(chan health.Observation, 16)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx, obs); close(done) }()
	t.Cleanup(func() { cancel(); <-done })

	refused := health.Contact{Err: errors.New("connection refused"),
		Problem: health.ProblemUnreachable}
	obs <- health.Observation{Data: &refused}
	awaitReadiness(t, s, "unreachable first", reason(string(health.ProblemUnreachable), ""))
	if out := logs.String(); strings.Contains(out, "serving the last known snapshot") ||
		!strings.Contains(out, "consul unreachable: nothing served yet") {
		t.Fatalf("before anything was served:\n%s", out)
	}
	obs <- health.Observation{Data: &health.Contact{OK: true}}
	obs <- health.Observation{Data: &health.Generations{Index: 1}}
	obs <- health.Observation{Data: &health.TaskList{Index: 2, Tasks: []string{"work"}}}
	obs <- health.Observation{Data: &health.TaskMembers{Task: "work", Index: 3,
		Members: []health.Member{fleettest.Member("work", "e1", "s1", 1, 9001, "1.0.0",
			health.StatusPassing, 3)}}}
	obs <- health.Observation{Data: &health.NonPassing{Index: 3}}
	awaitReadiness(t, s, "ready", func(r Readiness) bool { return r.Ready })
	obs <- health.Observation{Data: &refused}
	awaitReadiness(t, s, "unreachable after", reason(string(health.ProblemUnreachable), ""))
	if out := logs.String(); !strings.Contains(out, "consul unreachable: serving the last known") {
		t.Fatalf("once served:\n%s", out)
	}
}
