package server

import (
	"encoding/json"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/leasehold/leasehold/fleet"
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
