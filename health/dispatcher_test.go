package health

import (
	"strings"
	"testing"
)

// Constraint sets that differ get different keys, however their label
// values and grants are spelled: a shared key would hand one set endpoints
// chosen for the other.
func TestDispatcherKeysNeverCollide(t *testing.T) {
	with := func(vc string, labels map[string]string, tasks []string) Dispatcher {
		d := mustDispatcher(t, vc, labels)
		if tasks != nil {
			d = d.WithTasks(tasks)
		}
		return d
	}
	for _, c := range []struct {
		name string
		a, b Dispatcher
	}{
		{"label delimiters in a value", with("", map[string]string{"zone": "a;zz=y"}, nil),
			with("", map[string]string{"zone": "a", "zz": "y"}, nil)},
		{"a grant spelled in a value", with("", map[string]string{"zone": "a&tasks=work"}, nil),
			with("", map[string]string{"zone": "a"}, []string{"work"})},
		{"a grant, in the old spelling, in a value",
			with("", map[string]string{"zone": "a|tasks=work"}, nil),
			with("", map[string]string{"zone": "a"}, []string{"work"})},
		{"an escape spelled in a value", with("", map[string]string{"zone": "a%3B"}, nil),
			with("", map[string]string{"zone": "a;"}, nil)},
		{"a task list in a task", with("", nil, []string{"a,b"}),
			with("", nil, []string{"a", "b"})},
		{"no task granted, or the empty one", with("", nil, []string{}),
			with("", nil, []string{""})},
		{"empty grant, or none", with("", nil, []string{}), with("", nil, nil)},
		{"an empty value, or no label", with("", map[string]string{"zone": ""}, nil),
			with("", nil, nil)},
		{"invalid UTF-8, or its replacement", with("", map[string]string{"zone": "\xff"}, nil),
			with("", map[string]string{"zone": "\uFFFD"}, nil)},
		{"an OR constraint, or one branch", with(">=1.0.0 || >=3.0.0", nil, nil),
			with(">=1.0.0", nil, nil)},
	} {
		if c.a.Key() == c.b.Key() {
			t.Errorf("%s: both keyed %q", c.name, c.a.Key())
		}
	}
}

// Common keys stay readable (they are snapshot group ids, and explain and
// the logs show them); only delimiters and unprintable bytes are escaped.
func TestDispatcherKeySpelling(t *testing.T) {
	for _, c := range []struct {
		vc     string
		labels map[string]string
		tasks  []string
		want   string
	}{
		{"", nil, nil, "v="},
		{"<2.0.0", map[string]string{"zone": "eu-1"}, nil, "v=<2.0.0;zone=eu-1"},
		{">=1.0.0 || >=3.0.0", nil, []string{"work", "transcode"},
			"v=>=1.0.0 || >=3.0.0&tasks=transcode,work"},
		{"", map[string]string{"zone": "a;zz=y"}, nil, "v=;zone=a%3Bzz%3Dy"},
		{"", map[string]string{"zone": "a|b,c\"&%\n\u2028", "city": "zürich"}, nil,
			"v=;city=zürich;zone=a|b,c\"%26%25%0A%E2%80%A8"},
		{"", nil, []string{}, "v=&tasks="},
		{"", nil, []string{"", "a,b", "work"}, `v=&tasks="",a%2Cb,work`},
	} {
		d := mustDispatcher(t, c.vc, c.labels)
		if c.tasks != nil {
			d = d.WithTasks(c.tasks)
		}
		if d.Key() != c.want {
			t.Errorf("NewDispatcher(%q, %v).WithTasks(%q): key %q, want %q", c.vc, c.labels,
				c.tasks, d.Key(), c.want)
		}
	}
}

// A rollout mode scoped to a constraint set applies to that set, whatever
// its constraint or label values hold, and with or without a grant.
func TestRolloutScopeMatchesDelimiterSpellings(t *testing.T) {
	r, err := ParseRollout([]byte(`{"modes":[
		{"rule":"version","mode":"observe","constraint_set":{"version_constraint":">=1.0.0 || >=3.0.0"}},
		{"rule":"labels","mode":"observe","constraint_set":{"labels":{"pool":"gpu|cpu"}}},
		{"rule":"draining","mode":"observe","constraint_set":{"labels":{"zone":"a;zz=y"}}}
	]}`))
	if err != nil {
		t.Fatal(err)
	}
	or := mustDispatcher(t, ">=1.0.0 || >=3.0.0", nil)
	pipe := mustDispatcher(t, "", map[string]string{"pool": "gpu|cpu"})
	semi := mustDispatcher(t, "", map[string]string{"zone": "a;zz=y"})
	lookalike := mustDispatcher(t, "", map[string]string{"zone": "a", "zz": "y"})
	for _, c := range []struct {
		name string
		rule Reason
		d    Dispatcher
		want Mode
	}{
		{"OR constraint", ReasonVersion, or, ModeObserve},
		{"OR constraint, granted", ReasonVersion, or.WithTasks([]string{"work"}), ModeObserve},
		{"one branch of it", ReasonVersion, mustDispatcher(t, ">=1.0.0", nil), ModeEnforce},
		{"'|' in a label value", ReasonLabels, pipe, ModeObserve},
		{"'|' in a label value, granted", ReasonLabels, pipe.WithTasks([]string{"work"}),
			ModeObserve},
		{"the value before the '|'", ReasonLabels,
			mustDispatcher(t, "", map[string]string{"pool": "gpu"}), ModeEnforce},
		{"';' and '=' in a label value", ReasonDraining, semi, ModeObserve},
		{"the two labels it once looked like", ReasonDraining, lookalike, ModeEnforce},
	} {
		if got := r.ModeOf(c.rule, "work", c.d); got != c.want {
			t.Errorf("%s: %s under %q: %s, want %s", c.name, c.rule, c.d.Key(), got, c.want)
		}
	}
}

func TestNewDispatcherNamesTheField(t *testing.T) {
	for _, tt := range []struct {
		vc     string
		labels map[string]string
		field  string
	}{
		{">= banana", nil, "version_constraint"},
		{"", map[string]string{"a.b": "x"}, "labels.a.b"},
		{"", map[string]string{"": "x"}, "labels."},
		{"", map[string]string{"k": strings.Repeat("v", 513)}, "labels.k"},
	} {
		_, err := NewDispatcher(tt.vc, tt.labels)
		if got := Fields(err); len(got) != 1 || got[0] != tt.field {
			t.Errorf("NewDispatcher(%q, %v) fields %v, want %s (%v)", tt.vc, tt.labels, got,
				tt.field, err)
		}
	}
}

func TestDispatcherKeyIsCanonical(t *testing.T) {
	a := mustDispatcher(t, ">=1.4.0,<2.0.0", map[string]string{"zone": "eu", "gpu": "yes"})
	b := mustDispatcher(t, " >=1.4.0, <2.0.0 ", map[string]string{"gpu": "yes", "zone": "eu"})
	c := mustDispatcher(t, ">=1.4.0", map[string]string{"gpu": "yes", "zone": "eu"})
	if a.Key() != b.Key() {
		t.Fatalf("equal sets, keys %q and %q", a.Key(), b.Key())
	}
	if a.Key() == c.Key() || mustDispatcher(t, "", nil).Key() == a.Key() {
		t.Fatal("different sets share a key")
	}
	if (Dispatcher{}).Key() != mustDispatcher(t, "", nil).Key() {
		t.Fatal("zero Dispatcher differs from the unconstrained set")
	}
}
