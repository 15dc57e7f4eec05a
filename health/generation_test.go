package health

import (
	"reflect"
	"strings"
	"testing"
)

func TestParseGenerationRecord(t *testing.T) {
	for _, tt := range []struct {
		value string
		want  GenerationRecord
		ok    bool
	}{
		{"7/s-1", GenerationRecord{Generation: 7, SessionID: "s-1"}, true},
		// The bare form, written before keys named their session.
		{"7", GenerationRecord{Generation: 7}, true},
		{"9007199254740991/a", GenerationRecord{Generation: MaxGeneration - 1, SessionID: "a"},
			true},
		{"0/s", GenerationRecord{}, false},
		{"9007199254740992/s", GenerationRecord{}, false}, // 2^53: garbage, as in a registration
		{"7/", GenerationRecord{}, false},
		{"7/s/x", GenerationRecord{}, false},
		{"7/-s", GenerationRecord{}, false},
		{"x/s", GenerationRecord{}, false},
		{"", GenerationRecord{}, false},
		{" 7/s", GenerationRecord{}, false},
	} {
		got, err := ParseGenerationRecord(tt.value)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("ParseGenerationRecord(%q) = %+v, %v; want %+v (ok %v)", tt.value, got, err,
				tt.want, tt.ok)
		}
		if err != nil && !strings.Contains(err.Error(), "generation key") {
			t.Errorf("ParseGenerationRecord(%q): error %q does not name the generation key",
				tt.value, err)
		}
		if err == nil && got.Value() != tt.value {
			t.Errorf("Value() = %q, want %q (round trip)", got.Value(), tt.value)
		}
	}
}

func TestGenerationKeyJudges(t *testing.T) {
	named := GenerationRecord{Generation: 5, SessionID: "s5"}
	bare := GenerationRecord{Generation: 5}
	for _, tt := range []struct {
		name string
		key  GenerationRecord
		gen  uint64
		sess string
		want Standing
	}{
		{"the key's session", named, 5, "s5", KeyConfirms},
		{"its generation under another session", named, 5, "forged", KeyDenies},
		{"above the key", named, 6, "s6", KeyDenies},
		{"below the key", named, 4, "s4", KeyIsNewer},
		{"the key's session below its generation (a copy of its id)", named, 4, "s5", KeyDenies},
		{"the key's session above its generation", named, 6, "s5", KeyDenies},
		{"bare key: its generation, any session (unprotected)", bare, 5, "any", KeyConfirms},
		{"bare key: above it", bare, 99, "forged", KeyDenies},
		{"bare key: below it", bare, 1, "old", KeyIsNewer},
		{"no key: unprotected", GenerationRecord{}, 99, "any", KeyConfirms},
	} {
		if got := tt.key.Judge(tt.gen, tt.sess); got != tt.want {
			t.Errorf("%s: Judge(%d, %s) = %d, want %d", tt.name, tt.gen, tt.sess, got, tt.want)
		}
	}
}

// reg is a registration of instance a on a node, for the fencing tables.
func reg(sess string, gen, create uint64, node string) Executor {
	return exec(func(e *Executor) {
		e.InstanceID, e.SessionID, e.Generation = "a", sess, gen
		e.CreateIndex, e.Node, e.Task = create, node, "t"
	})
}

// regIn is e registered in datacenter dc.
func regIn(dc string, e Executor) Executor { e.Datacenter = dc; return e }

// TestFenceByGenerationKey: where the instance has a key naming its
// session, only that session (or an older one, fenced) is believed; a
// registration claiming more — any instance's token can write one — is
// unconfirmed and fences nothing.
func TestFenceByGenerationKey(t *testing.T) {
	key := GenerationRecord{Generation: 5, SessionID: "real"}
	type outcome struct {
		sess        string
		fenced      bool
		newer       string
		unconfirmed bool
	}
	for _, tt := range []struct {
		name string
		key  GenerationRecord
		es   []Executor
		want []outcome
	}{
		{"a forged higher generation fences nothing", key,
			[]Executor{reg("real", 5, 10, "n1"), reg("forged", 99, 20, "evil")},
			[]outcome{{"real", false, "", false}, {"forged", false, "", true}}},
		{"the key's generation under another session, registered later", key,
			[]Executor{reg("real", 5, 10, "n1"), reg("forged", 5, 20, "evil")},
			[]outcome{{"real", false, "", false}, {"forged", false, "", true}}},
		{"the key's generation under another session wins no tie on CreateIndex", key,
			[]Executor{reg("real", 5, 10, "n1"), reg("zzz", 5, 99, "evil")},
			[]outcome{{"real", false, "", false}, {"zzz", false, "", true}}},
		{"an older session is fenced by the key's", key,
			[]Executor{reg("old", 4, 1, "n1"), reg("real", 5, 10, "n2")},
			[]outcome{{"old", true, "real", false}, {"real", false, "", false}}},
		{"the key's session not registered yet: older ones fenced by it", key,
			[]Executor{reg("old", 4, 1, "n1")},
			[]outcome{{"old", true, "real", false}}},
		{"a copy of the key's session on another node is not the session", key,
			[]Executor{reg("real", 5, 10, "n1"), reg("real", 5, 30, "evil")},
			[]outcome{{"real", false, "", false}, {"real", false, "", true}}},
		{"a copy of the key's session under a lower generation is not the session", key,
			[]Executor{reg("real", 5, 10, "n1"), reg("real", 3, 30, "evil")},
			[]outcome{{"real", false, "", false}, {"real", false, "", true}}},
		{"a copy of the key's session under a lower generation, listed first", key,
			[]Executor{reg("real", 3, 5, "evil"), reg("real", 5, 10, "n1")},
			[]outcome{{"real", false, "", true}, {"real", false, "", false}}},
		{"a copy in another datacenter is not the session, whatever its CreateIndex",
			GenerationRecord{Generation: 5, SessionID: "real", Datacenter: "dc2"},
			[]Executor{regIn("dc2", reg("real", 5, 5000, "n1")),
				regIn("dc1", reg("real", 5, 10, "evil"))},
			[]outcome{{"real", false, "", false}, {"real", false, "", true}}},
		{"only a copy, in another datacenter than the key's",
			GenerationRecord{Generation: 5, SessionID: "real", Datacenter: "dc2"},
			[]Executor{regIn("dc1", reg("real", 5, 10, "evil"))},
			[]outcome{{"real", false, "", true}}},
		{"bare key: a copy of its session under a lower generation is not the session",
			GenerationRecord{Generation: 5},
			[]Executor{reg("s5", 5, 10, "n1"), reg("s5", 3, 30, "evil")},
			[]outcome{{"s5", false, "", false}, {"s5", false, "", true}}},
		{"bare key: a copy of its session on another node is not the session",
			GenerationRecord{Generation: 5},
			[]Executor{reg("s5", 5, 10, "n1"), reg("s5", 5, 30, "evil")},
			[]outcome{{"s5", false, "", false}, {"s5", false, "", true}}},
		{"bare key: a forged higher generation fences nothing", GenerationRecord{Generation: 5},
			[]Executor{reg("s5", 5, 10, "n1"), reg("forged", 6, 20, "evil")},
			[]outcome{{"s5", false, "", false}, {"forged", false, "", true}}},
		{"no key: unprotected, the higher generation wins", GenerationRecord{},
			[]Executor{reg("s5", 5, 10, "n1"), reg("s6", 6, 20, "n2")},
			[]outcome{{"s5", true, "s6", false}, {"s6", false, "", false}}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ptrs := make([]*Executor, len(tt.es))
			for i := range tt.es {
				ptrs[i] = &tt.es[i]
			}
			FenceInstance(ptrs, tt.key)
			for i, w := range tt.want {
				e := tt.es[i]
				got := outcome{e.SessionID, e.Fenced, e.NewerSessionID, e.Unconfirmed != ""}
				if got != w {
					t.Errorf("%s on %s: %+v (%s), want %+v", e.SessionID, e.Node, got,
						e.Unconfirmed, w)
				}
				if v := Eligible(e, Dispatcher{}); w.unconfirmed && v.Reason != ReasonUnconfirmed {
					t.Errorf("%s on %s: verdict %s, want %s", e.SessionID, e.Node, v.Reason,
						ReasonUnconfirmed)
				}
			}
		})
	}
}

// TestUnconfirmedSessionsAreUnknownAndNameNothing: the fencing answer for
// a session only an unconfirmed registration carries is UNKNOWN, and what
// that registration claims (a higher generation, replaced sessions) changes
// no other session's answer.
func TestUnconfirmedSessionsAreUnknownAndNameNothing(t *testing.T) {
	key := GenerationRecord{Generation: 5, SessionID: "real"}
	real := reg("real", 5, 10, "n1")
	forged := reg("forged", 99, 20, "evil")
	forged.Replaces = []string{"real"}
	es := []Executor{real, forged}
	Fence(es, map[string]GenerationRecord{"a": key})
	ix := IndexSessions(es, nil)
	if st := ix.Check("a", "real"); st.State != SessionCurrent {
		t.Fatalf("a/real = %s (%s), want CURRENT: an unconfirmed registration fenced it", st.State,
			st.Detail)
	}
	st := ix.Check("a", "forged")
	if st.State != SessionUnknown || !strings.Contains(st.Detail, "generation key") {
		t.Fatalf("a/forged = %s (%s), want UNKNOWN naming the generation key", st.State, st.Detail)
	}
	if !reflect.DeepEqual(st.Tasks, []string{"t"}) {
		t.Fatalf("a/forged tasks %v", st.Tasks)
	}
}

// TestACopyOfTheKeysSessionUnderALowerGenerationChangesNothing: another
// instance's token copies the live session's id into a registration with a
// lower generation (its lease check critical): the session the key names
// stays CURRENT, neither STALE (the copy is no older session of it) nor
// LAPSED (the copy's lease is not the session's).
func TestACopyOfTheKeysSessionUnderALowerGenerationChangesNothing(t *testing.T) {
	key := GenerationRecord{Generation: 5, SessionID: "real"}
	real := reg("real", 5, 10, "n1")
	copied := reg("real", 3, 30, "evil")
	copied.LeaseStatus = StatusCritical
	es := []Executor{real, copied}
	Fence(es, map[string]GenerationRecord{"a": key})
	if es[1].Unconfirmed == "" {
		t.Fatalf("the copy at generation 3 is confirmed (fenced %v by %s): it shares the "+
			"session's id, so its verdicts are the session's", es[1].Fenced, es[1].NewerSessionID)
	}
	if st := IndexSessions(es, nil).Check("a", "real"); st.State != SessionCurrent {
		t.Fatalf("a/real = %s (%s), want CURRENT: a copy under a lower generation changed the "+
			"live session's answer", st.State, st.Detail)
	}
}

func TestBadMetadataSessionIsKnownAndExcluded(t *testing.T) {
	bad := reg("s1", 1, 1, "n1")
	bad.Err = FieldErrors{{Field: MetaCapacity, Value: "lots", Reason: "not an integer"}}
	ix := IndexSessions([]Executor{bad}, nil)
	st := ix.Check("a", "s1")
	if st.State != SessionUnknown || !strings.Contains(st.Detail, "bad metadata") ||
		!strings.Contains(st.Detail, "capacity") {
		t.Fatalf("a/s1 = %s (%s), want UNKNOWN saying it is registered with bad metadata "+
			"(capacity)", st.State, st.Detail)
	}
	if never := ix.Check("a", "s2"); !strings.Contains(never.Detail, "never seen") {
		t.Fatalf("a/s2 = %s", never.Detail)
	}
}

func TestNoLeaseCheckIsUnknownInFencingAndExplain(t *testing.T) {
	e := reg("s1", 1, 1, "n1")
	e.LeaseFound, e.LeaseStatus = false, ""
	if v := Eligible(e, Dispatcher{}); v.Reason != ReasonNoLease {
		t.Fatalf("verdict %s (%s), want %s", v.Reason, v.Detail, ReasonNoLease)
	}
	if st := IndexSessions([]Executor{e}, nil).Check("a", "s1"); st.State != SessionUnknown {
		t.Fatalf("fencing %s, want UNKNOWN", st.State)
	}
}

// TestACopyOfAReplacedSessionAboveTheKeyKeepsItStale: s1 was replaced by
// s2 (the key names s2) and its registration is gone — it answers STALE.
// Another instance's token registers a copy of s1's id above the key: the
// copy is unconfirmed, and s1 is still STALE, not UNKNOWN.
func TestACopyOfAReplacedSessionAboveTheKeyKeepsItStale(t *testing.T) {
	key := GenerationRecord{Generation: 2, SessionID: "s2"}
	past := []PastSession{{InstanceID: "a", SessionID: "s1", Generation: 1, Tasks: []string{"t"}}}
	es := []Executor{reg("s2", 2, 20, "n1")}
	Fence(es, map[string]GenerationRecord{"a": key})
	if st := IndexSessions(es, past).Check("a", "s1"); st.State != SessionStale {
		t.Fatalf("a/s1 = %s (%s), want STALE", st.State, st.Detail)
	}
	es = append(es, reg("s1", 9, 30, "evil"))
	Fence(es, map[string]GenerationRecord{"a": key})
	if es[1].Unconfirmed == "" {
		t.Fatal("the copy above the key is confirmed")
	}
	if st := IndexSessions(es, past).Check("a", "s1"); st.State != SessionStale ||
		st.NewerSessionID != "s2" {
		t.Fatalf("a/s1 with a copy above the key = %s newer %q (%s), want STALE newer s2: the "+
			"copy hid what leasehold knows of s1", st.State, st.NewerSessionID, st.Detail)
	}
}
