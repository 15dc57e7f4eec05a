package server

import (
	"encoding/json"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

type readyWith struct{ r fleet.Readiness }

func (r readyWith) Ready() bool                { return r.r.Ready }
func (r readyWith) Readiness() fleet.Readiness { return r.r }

type plainReady bool

func (r plainReady) Ready() bool { return bool(r) }

// /readyz's 503 names its reason and what to fix; the fields it had stay.
func TestReadyzNamesItsReason(t *testing.T) {
	contact := time.Now().Add(-3 * time.Second)
	get := func(r Readiness) (int, map[string]any) {
		t.Helper()
		h := AdminHandler(AdminConfig{Ready: r, LastContact: func() time.Time { return contact }})
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("GET", "/readyz", nil))
		var body map[string]any
		if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
			t.Fatalf("%v: %s", err, w.Body)
		}
		return w.Code, body
	}
	right := `key_prefix "leasehold/control/" { policy = "read" }`
	for _, tt := range []fleet.Readiness{
		{Reason: fleet.ReasonFirstRead, Detail: "waiting for the task types"},
		{Reason: "consul_unreachable", Detail: "dial tcp 127.0.0.1:8500: connect: connection refused", Source: "dc2"},
		{Reason: "acl", Detail: right, Source: fleet.ControlSource},
		{Reason: "tls", Detail: "x509: certificate signed by unknown authority"},
	} {
		code, body := get(readyWith{tt})
		if code != 503 || body["ready"] != false || body["reason"] != tt.Reason || body["detail"] != tt.Detail {
			t.Errorf("%s: %d %v", tt.Reason, code, body)
		}
		if _, ok := body["source"]; ok != (tt.Source != "") || (ok && body["source"] != tt.Source) {
			t.Errorf("%s: source %v, want %q", tt.Reason, body["source"], tt.Source)
		}
		if _, ok := body["consul_contact_age_seconds"]; !ok {
			t.Errorf("%s: the contact age is gone: %v", tt.Reason, body)
		}
	}
	code, body := get(readyWith{fleet.Readiness{Ready: true}})
	if _, ok := body["reason"]; code != 200 || body["ready"] != true || ok || body["consul_last_contact"] == nil {
		t.Errorf("ready: %d %v", code, body)
	}
	if code, body := get(plainReady(false)); code != 503 || body["ready"] != false {
		t.Errorf("a Readiness without reasons: %d %v", code, body)
	}
}

// TestReadyzUnreadyWhileConsulIsSilent: Consul hung (no query fails, none
// is answered) past the staleness bound: /readyz is 503 consul_silent with
// the age; at the next answer it is ready again. The bound is the fencing
// bound, or the shortest lease declared when shorter (here 6 s).
func TestReadyzUnreadyWhileConsulIsSilent(t *testing.T) {
	s := leaseSyncer(t)
	fc := newFreshClock()
	f := NewFencing(s, fc.freshAsOf, FencingOptions{Clock: fc.clock})
	h := AdminHandler(AdminConfig{Ready: s, LastContact: func() time.Time { return fc.freshAsOf("") }, Syncer: s, Fencing: f})
	get := func() (int, map[string]any) {
		t.Helper()
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("GET", "/readyz", nil))
		var body map[string]any
		if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
			t.Fatalf("%v: %s", err, w.Body)
		}
		return w.Code, body
	}
	fc.silentFor(time.Second)
	if code, body := get(); code != 200 {
		t.Fatalf("Consul answering: %d %v", code, body)
	}
	fc.silentFor(46 * time.Second)
	code, body := get()
	if detail, _ := body["detail"].(string); code != 503 || body["reason"] != ReasonConsulSilent || !strings.Contains(detail, "46s") {
		t.Fatalf("Consul silent for 46 s: %d %v, want 503 consul_silent with the age", code, body)
	}
	fc.silentFor(7 * time.Second)
	if code, body := get(); code != 503 || !strings.Contains(body["detail"].(string), "lease_ttl") {
		t.Fatalf("silent for 7 s with a 6 s lease declared: %d %v", code, body)
	}
	fc.silentFor(0) // Consul answers again
	if code, body := get(); code != 200 {
		t.Fatalf("Consul answering again: %d %v", code, body)
	}
}

// TestReadyzIgnoresATinyLeaseTTL: one registration (any token that may
// register the task type can write one) declares a lease_ttl of 1 ms. A
// healthy Consul's watches answer every fraction of a second, not every
// millisecond: /readyz stays ready while Consul answers within a second —
// no registration makes the readiness bound tighter than leasehold's floor.
func TestReadyzIgnoresATinyLeaseTTL(t *testing.T) {
	x := member("work", "x", 9001, "1.0.0")
	x.LeaseTTL = time.Millisecond
	s, _ := attack2Replica(t,
		health.Observation{Tasks: &health.TaskList{Index: 1, Tasks: []string{"work"}}},
		health.Observation{NonPassing: &health.NonPassing{Index: 2}},
		health.Observation{Generations: &health.Generations{Index: 3}},
		health.Observation{Members: &health.TaskMembers{Task: "work", Index: 11, Members: []health.Member{x, member("work", "y", 9002, "1.0.0")}}},
	)
	fc := newFreshClock()
	f := NewFencing(s, fc.freshAsOf, FencingOptions{Clock: fc.clock})
	h := AdminHandler(AdminConfig{Ready: s, LastContact: func() time.Time { return fc.freshAsOf("") }, Syncer: s, Fencing: f})
	fc.silentFor(time.Second)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("GET", "/readyz", nil))
	if w.Code != 200 {
		t.Fatalf("Consul last answered a second ago, a 1 ms lease_ttl declared: %d %s", w.Code, w.Body)
	}
}
