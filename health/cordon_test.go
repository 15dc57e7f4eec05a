package health

import (
	"strings"
	"testing"
	"time"
)

func TestApplyCordonsSafetyLimitAndApproval(t *testing.T) {
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	fleet := func() []Executor {
		es := []Executor{live("e1", "1.0.0"), live("e2", "1.0.0"), live("e3", "2.0.0"),
			live("e4", "2.0.0"), live("e5", "1.0.0")}
		es[4].LeaseStatus = StatusCritical // lapsed: neither counted nor limited
		return es
	}
	one := Cordon{ID: "c1", Instance: "e1", Reason: "disk", By: "alice", At: at}
	all := Cordon{ID: "c2", Task: "work", Reason: "bad rollout", By: "alice",
		At: at.Add(time.Minute)}

	es := fleet()
	st := ApplyCordons(es, []Cordon{one, all}, nil)
	// 4 live, limit 0.5: two cordoned at most, the earlier cordon first.
	if es[0].CordonID != "c1" || st[0].Applied != 1 {
		t.Fatalf("c1 not applied: %+v", st[0])
	}
	if st[1].Applied != 1 || st[1].Held != 2 {
		t.Fatalf("c2: want 1 applied and 2 held by the limit, got %+v", st[1])
	}
	cordoned := 0
	for _, e := range es {
		if e.CordonID != "" {
			cordoned++
		}
		if e.InstanceID == "e5" && (e.CordonID != "" || e.CordonHeld != "") {
			t.Error("a lapsed executor was counted by the safety limit")
		}
	}
	if cordoned != 2 {
		t.Fatalf("%d executors cordoned, limit allows 2", cordoned)
	}
	if v := Eligible(es[0], Dispatcher{}); v.Route != RouteDraining || v.Reason != ReasonCordoned {
		t.Errorf("a cordoned executor: %+v, want DRAINING cordoned", v)
	}

	// Approval: a version cordon waits for a second identity.
	doc := `{"approval":{"required":true,"max_executors":5},"safety_limit":1}`
	r, _ := ParseRollout([]byte(doc))
	byVersion := Cordon{ID: "c3", VersionConstraint: "=2.0.0", Reason: "bug", By: "alice", At: at}
	es = fleet()
	if st := ApplyCordons(es, []Cordon{byVersion}, r); !st[0].Pending || st[0].Applied != 0 {
		t.Fatalf("version cordon without approval: %+v", st[0])
	}
	self := byVersion
	self.ApprovedBy = "alice"
	if st := ApplyCordons(es, []Cordon{self}, r); !st[0].Pending {
		t.Fatal("approved by its own author: must stay pending")
	}
	ok := byVersion
	ok.ApprovedBy = "bob"
	if st := ApplyCordons(es, []Cordon{ok}, r); st[0].Pending || st[0].Applied != 2 {
		t.Fatalf("approved by bob: %+v", st[0])
	}
	if err := (&Cordon{ID: "x", Reason: "", By: ""}).Validate(); err == nil ||
		!strings.Contains(err.Error(), "selector") || !strings.Contains(err.Error(), "reason") {
		t.Errorf("invalid cordon: %v", err)
	}
}
