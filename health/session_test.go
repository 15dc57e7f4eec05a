package health

import (
	"reflect"
	"strings"
	"testing"
)

func TestIndexSessions(t *testing.T) {
	base := func(inst, sess, task string, mut func(*Executor)) Executor {
		e := exec(func(e *Executor) { e.InstanceID, e.SessionID, e.Task = inst, sess, task })
		if mut != nil {
			mut(&e)
		}
		return e
	}
	ix := IndexSessions([]Executor{
		base("a", "s1", "t1", nil),
		base("a", "s1", "t2", nil),
		base("b", "old", "t1", func(e *Executor) { e.Fenced, e.NewerSessionID, e.NewerGeneration = true, "new", 7 }),
		base("b", "new", "t1", nil),
		base("c", "s1", "t1", func(e *Executor) { e.LeaseStatus = StatusCritical }),
		base("d", "s1", "t1", func(e *Executor) { e.LapseSeen = true }),
		base("e", "s1", "t1", func(e *Executor) { e.State = StateDraining }),
		base("f", "s1", "t1", func(e *Executor) { e.NodeFailed, e.NodeChecks = true, StatusCritical }),
		base("f2", "s1", "t1", func(e *Executor) { e.NodeChecks = StatusCritical }), // a node check of the operator's: not routed, still current
		base("g", "s1", "t1", nil),
		base("g", "s1", "t2", func(e *Executor) { e.LeaseStatus = StatusCritical }), // worst wins
		base("h", "s1", "t1", func(e *Executor) { e.Err = errTest }),
		base("i", "s1", "t1", func(e *Executor) { e.LeaseStatus = StatusWarning }), // full is still current
		base("j", "s2", "t1", func(e *Executor) { e.Generation = 5 }),
	}, []PastSession{
		{InstanceID: "j", SessionID: "s1", Generation: 4}, // replaced on its agent
		{InstanceID: "k", SessionID: "s1", Generation: 1, Lapsed: true},
		{InstanceID: "l", SessionID: "s1", Generation: 1}, // drained away
	})
	for _, tt := range []struct {
		inst, sess string
		want       SessionState
	}{
		{"a", "s1", SessionCurrent}, {"b", "old", SessionStale}, {"b", "new", SessionCurrent},
		{"c", "s1", SessionLapsed}, {"d", "s1", SessionLapsed}, {"e", "s1", SessionDraining},
		{"f", "s1", SessionLapsed}, {"f2", "s1", SessionCurrent}, {"g", "s1", SessionLapsed}, {"h", "s1", SessionUnknown},
		{"i", "s1", SessionCurrent}, {"zz", "s1", SessionUnknown}, {"a", "other", SessionUnknown},
		{"j", "s1", SessionStale}, {"j", "s2", SessionCurrent}, {"k", "s1", SessionLapsed}, {"l", "s1", SessionUnknown},
	} {
		got := ix.Check(tt.inst, tt.sess)
		if got.State != tt.want || got.Detail == "" {
			t.Errorf("%s/%s = %s (%q), want %s", tt.inst, tt.sess, got.State, got.Detail, tt.want)
		}
	}
	a := ix.Check("a", "s1")
	if !reflect.DeepEqual(a.Tasks, []string{"t1", "t2"}) || a.Version != "1.4.2" {
		t.Fatalf("a = %+v", a)
	}
	if b := ix.Check("b", "old"); b.NewerSessionID != "new" || b.NewerGeneration != 7 {
		t.Fatalf("stale answer %+v", b)
	}
	if j := ix.Check("j", "s1"); j.NewerSessionID != "s2" || j.NewerGeneration != 5 {
		t.Fatalf("replaced answer %+v", j)
	}
}

// TestSessionsNamedAsReplacedAreStale: a session this index never saw is
// STALE when a present registration of its instance names it in replaces;
// anything else unknown stays UNKNOWN.
func TestSessionsNamedAsReplacedAreStale(t *testing.T) {
	reg := func(inst, sess string, gen uint64, replaces []string, mut func(*Executor)) Executor {
		return exec(func(e *Executor) {
			e.InstanceID, e.SessionID, e.Generation, e.Replaces = inst, sess, gen, replaces
			if mut != nil {
				mut(e)
			}
		})
	}
	ix := IndexSessions([]Executor{
		reg("a", "s3", 3, []string{"s2", "s1"}, nil),
		reg("b", "s2", 2, []string{"s1"}, nil),
		reg("b", "s5", 5, nil, func(e *Executor) { e.Task = "other" }), // newer than the one naming s1
		reg("c", "s2", 2, []string{"s1"}, func(e *Executor) { e.Err = errTest }),
		reg("d", "s2", 2, []string{"s1"}, func(e *Executor) { e.LeaseStatus = StatusCritical }), // a lapsed namer is still newer
	}, []PastSession{
		{InstanceID: "a", SessionID: "s1", Generation: 9, Lapsed: true}, // remembered above its namer: the generation orders it (the namer broke the contract)
		{InstanceID: "a", SessionID: "s0", Generation: 9, Lapsed: true},
	})
	for _, tt := range []struct {
		inst, sess string
		want       SessionState
		newer      string
	}{
		{"a", "s1", SessionLapsed, ""}, {"a", "s2", SessionStale, "s3"}, {"a", "s3", SessionCurrent, ""},
		{"a", "s0", SessionLapsed, ""}, {"a", "s4", SessionUnknown, ""},
		{"b", "s1", SessionStale, "s5"},
		{"c", "s1", SessionUnknown, ""}, // a registration that breaks the contract vouches for nothing
		{"d", "s1", SessionStale, "s2"},
	} {
		got := ix.Check(tt.inst, tt.sess)
		if got.State != tt.want || got.NewerSessionID != tt.newer || got.Detail == "" {
			t.Errorf("%s/%s = %s newer %q (%q), want %s newer %q", tt.inst, tt.sess, got.State, got.NewerSessionID, got.Detail, tt.want, tt.newer)
		}
	}
}

func TestValidateSessionQuery(t *testing.T) {
	for _, tt := range []struct{ inst, sess, field string }{
		{"", "s", "instance_id"}, {"a", "", "session_id"}, {strings.Repeat("x", 200), "s", "instance_id"}, {"a", "s/../x", "session_id"},
	} {
		err := ValidateSessionQuery(tt.inst, tt.sess)
		if f := Fields(err); len(f) != 1 || f[0] != tt.field {
			t.Errorf("(%q,%q) fields %v, want %s", tt.inst, tt.sess, f, tt.field)
		}
	}
	if err := ValidateSessionQuery("exec-1", "abc"); err != nil {
		t.Fatal(err)
	}
}
