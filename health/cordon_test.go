package health

import (
	"slices"
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
	st := ApplyCordons(es, []Cordon{one, all}, nil, CordonOptions{})
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
	if st := ApplyCordons(es, []Cordon{byVersion}, r, CordonOptions{}); !st[0].Pending ||
		st[0].Applied != 0 {
		t.Fatalf("version cordon without approval: %+v", st[0])
	}
	self := byVersion
	self.ApprovedBy = "alice"
	if st := ApplyCordons(es, []Cordon{self}, r, CordonOptions{}); !st[0].Pending {
		t.Fatal("approved by its own author: must stay pending")
	}
	ok := byVersion
	ok.ApprovedBy = "bob"
	if st := ApplyCordons(es, []Cordon{ok}, r, CordonOptions{}); st[0].Pending ||
		st[0].Applied != 2 {
		t.Fatalf("approved by bob: %+v", st[0])
	}
	if err := (&Cordon{ID: "x", Reason: "", By: ""}).Validate(); err == nil ||
		!strings.Contains(err.Error(), "selector") || !strings.Contains(err.Error(), "reason") {
		t.Errorf("invalid cordon: %v", err)
	}
}

// set is a constraint set for the safety-limit tests.
func set(t *testing.T, constraint string, labels map[string]string) Dispatcher {
	t.Helper()
	d, err := NewDispatcher(constraint, labels)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestSafetyLimitCountsEachConstraintSetInUse: the safety limit counts the
// live executors of every constraint set in use (a connected dispatcher's,
// decided by its version constraint and labels), not only the task type's:
// a cordon that would leave a set with more cordoned than the limit allows
// — a set with one live executor with none — is held, and the status names
// the pool that held it. The set without constraints is always counted.
func TestSafetyLimitCountsEachConstraintSetInUse(t *testing.T) {
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	labelled := func(e Executor, zone string) Executor {
		e.Labels = map[string]string{"zone": zone}
		return e
	}
	// e1 is the only 1.x executor; e1 and e2 are the zone=a ones.
	fleet := func() []Executor {
		return []Executor{labelled(live("e1", "1.0.0"), "a"), labelled(live("e2", "2.0.0"), "a"),
			labelled(live("e3", "2.0.0"), "b"), labelled(live("e4", "2.0.0"), "b")}
	}
	byInstance := func(id string, minute int) Cordon {
		return Cordon{ID: "c-" + id, Instance: id, Reason: "disk", By: "alice",
			At: at.Add(time.Duration(minute) * time.Minute)}
	}
	everything := Cordon{ID: "c-all", Task: "work", Reason: "bad build", By: "alice", At: at}
	lapsedE2 := func(es []Executor) { es[1].LeaseStatus = StatusCritical }
	observeVersion, err := ParseRollout([]byte(
		`{"modes":[{"rule":"version","mode":"observe","constraint_set":` +
			`{"version_constraint":"<2.0.0"}}]}`))
	if err != nil {
		t.Fatal(err)
	}
	old := set(t, "<2.0.0", nil)
	for _, tt := range []struct {
		name    string
		cordons []Cordon
		sets    []Dispatcher
		rollout *Rollout
		change  func([]Executor)
		// cordoned are the instances taken out of routing, held those kept
		// routed by the limit; heldBy the pools named (set/task/live/allowed).
		cordoned, held []string
		heldBy         []PoolLimit
	}{
		{name: "no dispatcher connected: the task type's limit alone",
			cordons: []Cordon{byInstance("e1", 0)}, cordoned: []string{"e1"}},
		{name: "a <2.0.0 dispatcher: its only executor is kept",
			cordons: []Cordon{byInstance("e1", 0)}, sets: []Dispatcher{old},
			held:   []string{"e1"},
			heldBy: []PoolLimit{{ConstraintSet: "v=<2.0.0", Task: "work", Live: 1}}},
		{name: "the same set from two datacenters is one pool",
			cordons: []Cordon{byInstance("e1", 0)},
			sets:    []Dispatcher{old.InDatacenter("dc1"), old.InDatacenter("dc2")},
			held:    []string{"e1"},
			heldBy:  []PoolLimit{{ConstraintSet: "v=<2.0.0", Task: "work", Live: 1}}},
		{name: "a set granted other task types only does not count work",
			cordons: []Cordon{byInstance("e1", 0)},
			sets:    []Dispatcher{old.WithTasks([]string{"other"})}, cordoned: []string{"e1"}},
		{name: "version observed for the set: it routes to every executor",
			cordons: []Cordon{byInstance("e1", 0)}, sets: []Dispatcher{old},
			rollout: observeVersion, cordoned: []string{"e1"}},
		{name: "labels: zone=a keeps one of its two, the task type two of four",
			cordons: []Cordon{everything}, sets: []Dispatcher{set(t, "", map[string]string{
				"zone": "a"})},
			cordoned: []string{"e1", "e3"}, held: []string{"e2", "e4"},
			heldBy: []PoolLimit{{ConstraintSet: "v=;zone=a", Task: "work", Live: 2, Allowed: 1},
				{ConstraintSet: "v=", Task: "work", Live: 4, Allowed: 2}}},
		{name: "an earlier cordon takes the set's room",
			cordons:  []Cordon{byInstance("e1", 0), byInstance("e2", 1)},
			sets:     []Dispatcher{set(t, "", map[string]string{"zone": "a"})},
			cordoned: []string{"e1"}, held: []string{"e2"},
			heldBy: []PoolLimit{{ConstraintSet: "v=;zone=a", Task: "work", Live: 2,
				Allowed: 1}}},
		{name: "a lapsed executor does not count: zone=a has one live",
			cordons: []Cordon{byInstance("e1", 0)},
			sets:    []Dispatcher{set(t, "", map[string]string{"zone": "a"})}, change: lapsedE2,
			held:   []string{"e1"},
			heldBy: []PoolLimit{{ConstraintSet: "v=;zone=a", Task: "work", Live: 1}}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			es := fleet()
			if tt.change != nil {
				tt.change(es)
			}
			st := ApplyCordons(es, tt.cordons, tt.rollout, CordonOptions{Sets: tt.sets})
			var cordoned, held []string
			for _, e := range es {
				if e.CordonID != "" {
					cordoned = append(cordoned, e.InstanceID)
				}
				if e.CordonHeld != "" {
					held = append(held, e.InstanceID)
				}
			}
			var heldBy []PoolLimit
			for _, s := range st {
				heldBy = append(heldBy, s.HeldBy...)
			}
			if !slices.Equal(cordoned, tt.cordoned) || !slices.Equal(held, tt.held) ||
				!slices.Equal(heldBy, tt.heldBy) {
				t.Fatalf("cordoned %v, held %v by %+v; want %v, %v by %+v", cordoned, held,
					heldBy, tt.cordoned, tt.held, tt.heldBy)
			}
		})
	}
	one := PoolLimit{ConstraintSet: "v=<2.0.0", Task: "work", Live: 1}
	if got := one.String(); !strings.Contains(got, "constraint set v=<2.0.0") ||
		!strings.Contains(got, "1 live executor(s), at most 0 cordoned") {
		t.Errorf("pool named as %q", got)
	}
}

// TestAttributedApprovals: with AttributedApprovals (serve
// --require-acl-approvals) an approval counts only when Consul attributed
// both the cordon and its approval to ACL tokens, two different ones; a
// name given with --by is refused, saying why. Without it --by counts, and
// its own author never does.
func TestAttributedApprovals(t *testing.T) {
	r, err := ParseRollout([]byte(`{"approval":{"required":true,"max_executors":0}}`))
	if err != nil {
		t.Fatal(err)
	}
	base := Cordon{ID: "c1", Instance: "e1", Reason: "disk", By: "alice",
		At: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	with := func(f func(*Cordon)) Cordon { c := base; f(&c); return c }
	tokens := func(c *Cordon) {
		c.By, c.ByAccessor = "token:alice (aaaa)", "aaaa"
		c.ApprovedBy, c.ApprovedByAccessor = "token:bob (bbbb)", "bbbb"
	}
	for _, tt := range []struct {
		name       string
		c          Cordon
		attributed bool
		pending    bool
		refused    string // in ApprovalRefused; "" : none
	}{
		{"not approved", base, true, true, ""},
		{"--by approval, not required", with(func(c *Cordon) { c.ApprovedBy = "bob" }), false,
			false, ""},
		{"--by approval, required", with(func(c *Cordon) { c.ApprovedBy = "bob" }), true, true,
			"a name given with --by that Consul cannot attribute"},
		{"token approval of a --by cordon", with(func(c *Cordon) {
			c.ApprovedBy, c.ApprovedByAccessor = "token:bob (bbbb)", "bbbb"
		}), true, true, `created by "alice", a name given with --by`},
		{"two tokens", with(tokens), true, false, ""},
		{"the same token under two names", with(func(c *Cordon) {
			tokens(c)
			c.ApprovedByAccessor = "aaaa"
		}), true, true, "its own author"},
		{"its own author by name", with(func(c *Cordon) { c.ApprovedBy = "alice" }), false, true,
			"its own author"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			es := []Executor{live("e1", "1.0.0"), live("e2", "1.0.0")}
			st := ApplyCordons(es, []Cordon{tt.c}, r,
				CordonOptions{AttributedApprovals: tt.attributed})[0]
			if st.Pending != tt.pending || (tt.refused == "") != (st.ApprovalRefused == "") ||
				!strings.Contains(st.ApprovalRefused, tt.refused) {
				t.Fatalf("pending %v, refused %q; want %v, %q", st.Pending, st.ApprovalRefused,
					tt.pending, tt.refused)
			}
			if !st.Pending && es[0].CordonID != "c1" {
				t.Fatalf("approved, yet not applied: %+v", st)
			}
		})
	}
}
