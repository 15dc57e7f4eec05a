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
		base("b", "old", "t1",
			func(e *Executor) { e.Fenced, e.NewerSessionID, e.NewerGeneration = true, "new", 7 }),
		base("b", "new", "t1", nil),
		base("c", "s1", "t1", func(e *Executor) { e.LeaseStatus = StatusCritical }),
		base("d", "s1", "t1", func(e *Executor) { e.LapseSeen = true }),
		base("e", "s1", "t1", func(e *Executor) { e.State = StateDraining }),
		base("f", "s1", "t1",
			func(e *Executor) { e.NodeFailed, e.NodeChecks = true, StatusCritical }),
		// A node check of the operator's: not routed, still current.
		base("f2", "s1", "t1", func(e *Executor) { e.NodeChecks = StatusCritical }),
		base("g", "s1", "t1", nil),
		base("g", "s1", "t2", func(e *Executor) { e.LeaseStatus = StatusCritical }), // worst wins
		base("h", "s1", "t1", func(e *Executor) { e.Err = errTest }),
		// Full is still current.
		base("i", "s1", "t1", func(e *Executor) { e.LeaseStatus = StatusWarning }),
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
		{"f", "s1", SessionLapsed}, {"f2", "s1", SessionCurrent}, {"g", "s1", SessionLapsed},
		{"h", "s1", SessionUnknown},
		{"i", "s1", SessionCurrent}, {"zz", "s1", SessionUnknown}, {"a", "other", SessionUnknown},
		{"j", "s1", SessionStale}, {"j", "s2", SessionCurrent}, {"k", "s1", SessionLapsed},
		{"l", "s1", SessionUnknown},
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
		// Newer than the one naming s1.
		reg("b", "s5", 5, nil, func(e *Executor) { e.Task = "other" }),
		reg("c", "s2", 2, []string{"s1"}, func(e *Executor) { e.Err = errTest }),
		// A lapsed namer is still newer.
		reg("d", "s2", 2, []string{"s1"}, func(e *Executor) { e.LeaseStatus = StatusCritical }),
	}, []PastSession{
		// Remembered above its namer: the generation orders it (the namer broke the contract).
		{InstanceID: "a", SessionID: "s1", Generation: 9, Lapsed: true},
		{InstanceID: "a", SessionID: "s0", Generation: 9, Lapsed: true},
	})
	for _, tt := range []struct {
		inst, sess string
		want       SessionState
		newer      string
	}{
		{"a", "s1", SessionLapsed, ""}, {"a", "s2", SessionStale, "s3"},
		{"a", "s3", SessionCurrent, ""},
		{"a", "s0", SessionLapsed, ""}, {"a", "s4", SessionUnknown, ""},
		{"b", "s1", SessionStale, "s5"},
		// A registration that breaks the contract vouches for nothing.
		{"c", "s1", SessionUnknown, ""},
		{"d", "s1", SessionStale, "s2"},
	} {
		got := ix.Check(tt.inst, tt.sess)
		if got.State != tt.want || got.NewerSessionID != tt.newer || got.Detail == "" {
			t.Errorf("%s/%s = %s newer %q (%q), want %s newer %q", tt.inst, tt.sess, got.State,
				got.NewerSessionID, got.Detail, tt.want, tt.newer)
		}
	}
}

func TestValidateSessionQuery(t *testing.T) {
	for _, tt := range []struct{ inst, sess, field string }{
		{"", "s", "instance_id"}, {"a", "", "session_id"},
		{strings.Repeat("x", 200), "s", "instance_id"}, {"a", "s/../x", "session_id"},
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

// A replaces claim is only as good as the generations leasehold knows: a
// session whose own generation is known and is not below its namer's is not
// older than it, whatever the namer says. Answering it STALE would be a lie (a
// newer session reported with a lower generation than the session itself) and
// would make a dispatcher discard the results of what may be the instance's
// newest session.

// namer is a registration of inst/sess at generation gen naming the sessions
// it replaces, changed by mut when mut is not nil.
func namer(inst, sess string, gen uint64, replaces []string, mut func(*Executor)) Executor {
	return exec(func(e *Executor) {
		e.InstanceID, e.SessionID, e.Generation, e.Replaces = inst, sess, gen, replaces
		if mut != nil {
			mut(e)
		}
	})
}

// staleConsistent fails the test when a STALE answer names a newer session
// whose generation is not above the session's own (when that is known).
func staleConsistent(t *testing.T, st SessionStatus) {
	t.Helper()
	if st.State == SessionStale && st.Generation != 0 && st.NewerGeneration <= st.Generation {
		t.Errorf("%s/%s answered STALE (generation %d) with newer session %s of generation %d: %s",
			st.InstanceID, st.SessionID, st.Generation, st.NewerSessionID, st.NewerGeneration,
			st.Detail)
	}
}

// TestRememberedSessionNamedByAnOlderOneIsNotStale: the instance's newest
// session x (generation 5) drained away (remembered, not lapsed); an older
// session y (generation 3) still registered names x in its replaces meta (a
// buggy or hostile executor, or the older process of a concurrent pair). x is
// replaced by nothing leasehold knows: it is answered UNKNOWN (deregistered),
// not STALE with y as "newer".
//
// TestSessionsNamedAsReplacedAreStale, by contrast, lets the name order a
// remembered session above its namer when the namer's generation is unknown
// ("KV lost: the name still orders it"). The Registrar never names a session
// at or above its own generation, so only an executor breaking the contract
// (or one following it with the KV lost) meets either case.
func TestRememberedSessionNamedByAnOlderOneIsNotStale(t *testing.T) {
	ix := IndexSessions([]Executor{
		namer("a", "y", 3, []string{"x"}, nil),
		namer("b", "y", 3, []string{"x"}, nil),
	}, []PastSession{
		{InstanceID: "a", SessionID: "x", Generation: 5},
		{InstanceID: "b", SessionID: "x", Generation: 5, Lapsed: true},
	})
	a := ix.Check("a", "x")
	staleConsistent(t, a)
	if a.State != SessionUnknown {
		t.Errorf("a/x = %s newer %s/%d (%s), want UNKNOWN (deregistered): y is older than x",
			a.State, a.NewerSessionID, a.NewerGeneration, a.Detail)
	}
	b := ix.Check("b", "x")
	staleConsistent(t, b)
	if b.State != SessionLapsed {
		t.Errorf("b/x = %s newer %s/%d (%s), want LAPSED: y is older than x",
			b.State, b.NewerSessionID, b.NewerGeneration, b.Detail)
	}
	// A namer above the remembered generation still makes it STALE.
	ix = IndexSessions([]Executor{namer("a", "y", 6, []string{"x"}, nil)},
		[]PastSession{{InstanceID: "a", SessionID: "x", Generation: 5, Lapsed: true}})
	if got := ix.Check("a", "x"); got.State != SessionStale || got.NewerSessionID != "y" {
		t.Errorf("a/x named by a newer y = %s newer %q, want STALE newer y", got.State,
			got.NewerSessionID)
	}
}

// TestNewestSessionWithBadMetadataNamedByAnOlderOneIsNotStale: x (generation
// 5) is registered with bad metadata (a bad capacity: it is not routed and is
// answered UNKNOWN, but its generation orders the instance: it is the newest).
// An older y (generation 3, fenced by x) names x. x is not STALE: the only
// "newer" session would be x itself.
func TestNewestSessionWithBadMetadataNamedByAnOlderOneIsNotStale(t *testing.T) {
	ix := IndexSessions([]Executor{
		namer("a", "x", 5, nil, func(e *Executor) { e.Err = FieldErrors{errTest} }),
		namer("a", "y", 3, []string{"x"}, func(e *Executor) {
			e.Fenced, e.NewerSessionID, e.NewerGeneration = true, "x", 5
		}),
	}, nil)
	got := ix.Check("a", "x")
	if got.State == SessionStale {
		t.Errorf("a/x (the newest session, generation 5) = STALE newer %s/%d (%s), want UNKNOWN",
			got.NewerSessionID, got.NewerGeneration, got.Detail)
	}
	if got := ix.Check("a", "y"); got.State != SessionStale {
		t.Errorf("a/y = %s, want STALE", got.State)
	}
	// With a namer above it, the badly registered session is STALE.
	ix = IndexSessions([]Executor{
		namer("a", "x", 5, nil,
			func(e *Executor) { e.Err = FieldErrors{errTest}; e.Fenced = true }),
		namer("a", "y", 7, []string{"x"}, nil),
	}, nil)
	if got := ix.Check("a", "x"); got.State != SessionStale || got.NewerSessionID != "y" {
		t.Errorf("a/x named by a newer y = %s newer %q, want STALE newer y", got.State,
			got.NewerSessionID)
	}
}

// TestSessionStaleByNameHasItsNamersTasksAndDatacenter: a session answered
// STALE only because a registration names it takes the task types of the
// sessions of its instance naming it, and the newest namer's datacenter. The
// fencing API answers a session none of whose task types the caller is
// granted as never seen, so without task types every such answer would be
// UNKNOWN under --authz-policy; and its freshness is judged by the namer's
// datacenter, not leasehold's own.
func TestSessionStaleByNameHasItsNamersTasksAndDatacenter(t *testing.T) {
	ix := IndexSessions([]Executor{
		namer("a", "y", 3, []string{"x"}, func(e *Executor) { e.Task, e.Datacenter = "t2", "dc2" }),
		namer("a", "y", 3, []string{"x"}, func(e *Executor) { e.Task, e.Datacenter = "t1", "dc2" }),
		namer("a", "z", 2, []string{"x"}, func(e *Executor) {
			e.Task, e.Datacenter, e.Fenced = "t3", "dc1", true
		}),
	}, nil)
	got := ix.Check("a", "x")
	if got.State != SessionStale || got.NewerSessionID != "y" {
		t.Fatalf("a/x = %s newer %q", got.State, got.NewerSessionID)
	}
	want := []string{"t1", "t2", "t3"}
	if len(got.Tasks) != len(want) || got.Tasks[0] != "t1" || got.Tasks[1] != "t2" ||
		got.Tasks[2] != "t3" {
		t.Errorf("a/x tasks %v, want %v (the task types of its instance's sessions naming it)",
			got.Tasks, want)
	}
	if got.Datacenter != "dc2" {
		t.Errorf("a/x datacenter %q, want dc2 (the newest namer's)", got.Datacenter)
	}
}
