package health

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestParseRolloutNamesTheField(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{`{"modes":[{"rule":"lease","mode":"observe"}]}`,
			"modes[0].rule: \"lease\" is always enforced"},
		{`{"modes":[{"rule":"lapsed","mode":"observe"}]}`,
			"modes[0].rule: \"lapsed\" is always enforced"},
		{`{"modes":[{"rule":"version","mode":"observe"},{"rule":"unhealthy","mode":"observe"},{"rule":"fencing","mode":"observe"}]}`,
			"modes[2].rule: \"fencing\" cannot be observed: the fencing API calls a fenced " +
				"session STALE"},
		{`{"modes":[{"rule":"fenced-by-newer-session","mode":"observe","tasks":["work"]}]}`,
			"modes[0].rule: \"fenced-by-newer-session\" cannot be observed"},
		// What applies anyway.
		{`{"modes":[{"rule":"fencing","mode":"enforce"},{"rule":"lease","mode":"enforce"}]}`, ""},
		{`{"modes":[{"rule":"speed","mode":"observe"}]}`,
			"modes[0].rule: \"speed\": want one of capacity, cordon, draining, labels, " +
				"unhealthy, version"},
		{`{"modes":[{"rule":"version","mode":"maybe"}]}`, "modes[0].mode"},
		{`{"modes":[{"rule":"version","mode":"observe","tasks":["bad task"]}]}`,
			"modes[0].tasks[0]"},
		{`{"modes":[{"rule":"version","mode":"observe","constraint_set":{"version_constraint":"not a version"}}]}`,
			"modes[0].constraint_set"},
		{`{"modes":[{"rule":"capacity","mode":"observe"},{"rule":"full","mode":"enforce"}]}`,
			"modes[1]"},
		{`{"safety_limit":1.5}`, "safety_limit"},
		{`{"approval":{"required":true,"max_executors":-1}}`, "approval.max_executors"},
		{`{"mode":[]}`, "unknown field"},
		{`{"modes":[{"rule":"version","mode":"observe","tasks":["work"]}],"safety_limit":0.3,"approval":{"required":true,"max_executors":2}}`,
			""},
	} {
		_, err := ParseRollout([]byte(c.in))
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%s refused: %v", c.in, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%s: want an error naming %s, got %v", c.in, c.want, err)
		}
	}
}

func TestModeOfMostSpecificWins(t *testing.T) {
	r, err := ParseRollout([]byte(`{"modes":[
		{"rule":"version","mode":"observe"},
		{"rule":"version","mode":"enforce","tasks":["transcode"]},
		{"rule":"version","mode":"observe","tasks":["transcode"],"constraint_set":{"version_constraint":">=2.0.0"}},
		{"rule":"labels","mode":"observe","constraint_set":{"labels":{"zone":"eu"}}}
	]}`))
	if err != nil {
		t.Fatal(err)
	}
	v2, _ := NewDispatcher(">=2.0.0", nil)
	eu, _ := NewDispatcher("", map[string]string{"zone": "eu"})
	granted := eu.WithTasks([]string{"work"}) // a grant does not change which set it is
	for _, c := range []struct {
		rule Reason
		task string
		d    Dispatcher
		want Mode
	}{
		{ReasonVersion, "work", Dispatcher{}, ModeObserve},
		{ReasonVersion, "transcode", Dispatcher{}, ModeEnforce},
		{ReasonVersion, "transcode", v2, ModeObserve},
		{ReasonLabels, "work", eu, ModeObserve},
		{ReasonLabels, "work", granted, ModeObserve},
		{ReasonLabels, "work", v2, ModeEnforce},
		{ReasonFull, "work", Dispatcher{}, ModeEnforce},
	} {
		if got := r.ModeOf(c.rule, c.task, c.d); got != c.want {
			t.Errorf("%s for %s under %q: %s, want %s", c.rule, c.task, c.d.Key(), got, c.want)
		}
	}
	var none *Rollout
	if none.ModeOf(ReasonVersion, "work", Dispatcher{}) != ModeEnforce ||
		none.Limit() != DefaultSafetyLimit {
		t.Error("no rollout: every rule enforced, default safety limit")
	}
}

func TestEligibleObserving(t *testing.T) {
	d, _ := NewDispatcher("<2.0.0", nil)
	e := live("e1", "2.1.0")
	e.LeaseStatus = StatusWarning // full too
	v := EligibleObserving(e, d, nil)
	if v.Reason != ReasonVersion || v.Route != RouteNone {
		t.Fatalf("enforced: %+v", v)
	}
	v = EligibleObserving(e, d, []Reason{ReasonVersion})
	if v.Reason != ReasonFull || len(v.Observed) != 1 || v.Observed[0].Reason != ReasonVersion {
		t.Fatalf("version observed: the next rule (full) decides, version recorded: %+v", v)
	}
	v = EligibleObserving(e, d, []Reason{ReasonVersion, ReasonFull})
	if v.Route != RouteHealthy || len(v.Observed) != 2 {
		t.Fatalf("both observed: routed, both recorded: %+v", v)
	}
	e.LeaseStatus = StatusCritical
	if v := EligibleObserving(e, d, ObservableRules); v.Reason != ReasonLapsed {
		t.Fatalf("a lapsed lease is always enforced: %+v", v)
	}
}

func live(id, version string) Executor {
	return Executor{Registration: Registration{InstanceID: id, SessionID: "s-" + id, Generation: 1,
		Task: "work", Address: "127.0.0.1", Port: 9000, Version: version, Capacity: 4,
		State: StateActive},
		ServiceID: "work:" + id, Node: "n1", LeaseStatus: StatusPassing, LeaseFound: true,
		NodeChecks: StatusPassing}
}

// Lapsed, bad metadata and fencing exclude even when asked to be observed
// (a Rollout that skipped validation): a session the fencing API calls STALE,
// or one without a lease, never receives new work.
func TestAlwaysEnforcedRulesAreNeverObserved(t *testing.T) {
	d, _ := NewDispatcher("", nil)
	cases := map[Reason]func(*Executor){
		ReasonBadMetadata: func(e *Executor) { e.Err = errors.New("bad") },
		ReasonLapsed:      func(e *Executor) { e.LeaseStatus = StatusCritical },
		ReasonFenced: func(e *Executor) {
			e.Fenced, e.NewerSessionID, e.NewerGeneration = true, "s2", 2
		},
	}
	unvalidated := &Rollout{Modes: []ScopedMode{
		{Rule: ReasonBadMetadata, Mode: ModeObserve}, {Rule: ReasonLapsed, Mode: ModeObserve},
		{Rule: ReasonFenced, Mode: ModeObserve},
	}}
	for rule, mutate := range cases {
		if slices.Contains(ObservableRules, rule) {
			t.Errorf("%s is observable", rule)
		}
		e := live("e1", "1.0.0")
		mutate(&e)
		all := append([]Reason{rule}, ObservableRules...)
		if v := EligibleObserving(e, d, all); v.Reason != rule || v.Route != RouteNone {
			t.Errorf("%s asked to be observed: %+v, want excluded", rule, v)
		}
		if v := EligibleObserving(e, d, unvalidated.Observed("work", d)); v.Reason != rule ||
			v.Route != RouteNone {
			t.Errorf("%s in an unvalidated rollout: %+v, want excluded", rule, v)
		}
	}
}

// Every observable rule, alone: enforced it excludes (or drains) with its
// reason; observed it routes the executor HEALTHY and records the reason.
func TestEveryObservableRuleObserveVsEnforce(t *testing.T) {
	d, _ := NewDispatcher("<2.0.0", map[string]string{"zone": "eu"})
	base := func() Executor {
		e := live("e1", "1.0.0")
		e.Labels = map[string]string{"zone": "eu"}
		return e
	}
	cases := map[Reason]func(*Executor){
		ReasonUnhealthy: func(e *Executor) { e.Other = StatusWarning },
		ReasonVersion:   func(e *Executor) { e.Version = "2.1.0" },
		ReasonLabels:    func(e *Executor) { e.Labels = map[string]string{"zone": "us"} },
		ReasonCordoned:  func(e *Executor) { e.CordonID, e.CordonReason = "c1", "test" },
		ReasonDraining:  func(e *Executor) { e.State = StateDraining },
		ReasonFull:      func(e *Executor) { e.LeaseStatus = StatusWarning },
	}
	if len(cases) != len(ObservableRules) {
		t.Fatalf("cases for %d rules, %d observable", len(cases), len(ObservableRules))
	}
	for _, rule := range ObservableRules {
		e := base()
		cases[rule](&e)
		enforced := EligibleObserving(e, d, nil)
		if enforced.Reason != rule || enforced.Route == RouteHealthy {
			t.Errorf("%s enforced: %+v", rule, enforced)
		}
		observed := EligibleObserving(e, d, []Reason{rule})
		if observed.Route != RouteHealthy || len(observed.Observed) != 1 ||
			observed.Observed[0].Reason != rule || observed.Observed[0].Detail == "" {
			t.Errorf("%s observed: %+v", rule, observed)
		}
	}
}

// TestParseRolloutRefusesTrailingContent: a rules document is one JSON object.
// What follows it is not ignored: an operator who pasted two documents, or a
// truncated edit, gets an error, not the first half silently applied.
func TestParseRolloutRefusesTrailingContent(t *testing.T) {
	for _, doc := range []string{
		`{"load_balancing":{"default":"round_robin"}} {"load_balancing":{"default":"least_request"}}`,
		`{"load_balancing":{"default":"round_robin"}}]`,
		`{"load_balancing":{"default":"round_robin"}} garbage`,
	} {
		if _, err := ParseRollout([]byte(doc)); err == nil {
			t.Errorf("%s: accepted", doc)
		}
	}
	for _, doc := range []string{"{}\n", "  {\"load_balancing\":null}  \n\t"} {
		if _, err := ParseRollout([]byte(doc)); err != nil {
			t.Errorf("%q: %v", doc, err)
		}
	}
}

// A metric's rule label is the word the rules file uses, and every rule a
// rollout may observe has one that parses back to it.
func TestRuleNameIsTheRulesFilesWord(t *testing.T) {
	want := map[Reason]string{ReasonVersion: "version", ReasonLabels: "labels",
		ReasonFull: "capacity", ReasonCordoned: "cordon", ReasonUnhealthy: "unhealthy",
		ReasonDraining: "draining"}
	for _, rule := range ObservableRules {
		if got := RuleName(rule); got != want[rule] || ruleNames[got] != rule {
			t.Errorf("RuleName(%s) = %q, want %q", rule, got, want[rule])
		}
	}
	if got := RuleName("no-such-reason"); got != "no-such-reason" {
		t.Errorf("RuleName of an unknown reason = %q", got)
	}
}

// The rules' content version follows their content, not the document's
// layout: equal rules have equal versions (on every replica), no rules the
// version of an empty document, and any change a new version.
func TestRolloutContentVersionFollowsTheContent(t *testing.T) {
	parse := func(doc string) *Rollout {
		t.Helper()
		r, err := ParseRollout([]byte(doc))
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	a := parse(`{"safety_limit":0.5,"dispatch":{"tasks":{"work":{"max_requests":4},"batch":{}}}}`)
	b := parse("{\n  \"dispatch\": {\"tasks\": {\"batch\": {}, \"work\": {\"max_requests\": 4}}},\n" +
		"  \"safety_limit\": 0.5\n}")
	if a.ContentVersion() != b.ContentVersion() {
		t.Error("the same rules laid out differently have different versions")
	}
	if (*Rollout)(nil).ContentVersion() != parse(`{}`).ContentVersion() {
		t.Error("no rules and an empty document differ")
	}
	c := parse(`{"safety_limit":0.5,"dispatch":{"tasks":{"work":{"max_requests":5},"batch":{}}}}`)
	if c.ContentVersion() == a.ContentVersion() {
		t.Error("a changed max_requests kept the version")
	}
	if len(a.ContentVersion()) != 16 {
		t.Errorf("version %q: want 16 hex digits", a.ContentVersion())
	}
}
