package health

import (
	"errors"
	"strings"
	"testing"
)

func TestValidateIP(t *testing.T) {
	for _, tt := range []struct {
		address string
		field   bool // the address field is named
	}{
		{"10.0.0.7", false},
		{"::1", false},
		{"::ffff:10.0.0.7", false},
		{"2001:db8::7", false},
		{"exec-7.internal", true},
		{"localhost", true},
		{"", false},            // ValidateHost names it
		{"0.0.0.0", false},     // ValidateHost names it
		{"not a host!", false}, // ValidateHost names it
	} {
		fe := ValidateIP(tt.address)
		if (fe != nil) != tt.field {
			t.Errorf("ValidateIP(%q) = %v, want an error: %v", tt.address, fe, tt.field)
		}
		if fe != nil && (fe.Field != "address" || !strings.Contains(fe.Error(), "IP address")) {
			t.Errorf("ValidateIP(%q) = %v, want the address field named and why", tt.address, fe)
		}
	}
}

func TestAddressNotIPIsExcluded(t *testing.T) {
	any := mustDispatcher(t, "", nil)
	for _, tt := range []struct {
		name   string
		e      Executor
		route  Route
		reason Reason
	}{
		{"IPv4", exec(nil), RouteHealthy, ReasonNone},
		{"IPv6", exec(func(e *Executor) { e.Address = "2001:db8::7" }), RouteHealthy, ReasonNone},
		{"host name", exec(func(e *Executor) { e.Address = "exec-1.internal" }), RouteNone,
			ReasonAddressNotIP},
		{"host name, draining",
			exec(func(e *Executor) { e.Address = "exec-1.internal"; e.State = StateDraining }),
			RouteNone, ReasonAddressNotIP},
		{"host name beats lapsed",
			exec(func(e *Executor) {
				e.Address = "exec-1.internal"
				e.LeaseStatus = StatusCritical
			}),
			RouteNone, ReasonAddressNotIP},
		{"bad metadata beats host name",
			exec(func(e *Executor) {
				e.Address = "exec-1.internal"
				e.Err = errors.New("capacity: bad")
			}),
			RouteNone, ReasonBadMetadata},
	} {
		t.Run(tt.name, func(t *testing.T) {
			v := Eligible(tt.e, any)
			if v.Route != tt.route || v.Reason != tt.reason {
				t.Fatalf("verdict = %+v, want %s/%s", v, tt.route, tt.reason)
			}
			if tt.reason == ReasonAddressNotIP && !strings.HasPrefix(v.Detail, "address ") {
				t.Fatalf("detail %q does not name the address field", v.Detail)
			}
		})
	}
	// The registration itself is valid: it still takes part in fencing.
	r := validReg()
	r.Address = "exec-1.internal"
	if err := r.Validate(); err != nil {
		t.Fatalf("a host name breaks the contract's syntax: %v", err)
	}
	doc := `{"modes":[{"rule":"address-not-ip","mode":"observe"}]}`
	if _, err := ParseRollout([]byte(doc)); err == nil {
		t.Fatal("address-not-ip accepted as an observable rule")
	}
}

func TestClaimBeats(t *testing.T) {
	c := func(inst, sess string, gen, create uint64, node, svc string) Claim {
		return Claim{InstanceID: inst, SessionID: sess, Generation: gen, CreateIndex: create,
			Node: node, ServiceID: svc}
	}
	for _, tt := range []struct {
		name string
		a, b Claim // a beats b
	}{
		{"two instances: the first claim", c("b", "s9", 9, 1, "n", "x"),
			c("a", "s1", 1, 9, "n", "x")},
		{"two instances claiming at once: lowest instance id", c("a", "s1", 1, 5, "n", "x"),
			c("b", "s9", 9, 5, "n", "x")},
		{"one instance: newest generation", c("a", "new", 2, 1, "n", "x"),
			c("a", "old", 1, 9, "n", "x")},
		{"same generation: create index", c("a", "s1", 2, 9, "n", "x"),
			c("a", "s2", 2, 1, "n", "x")},
		{"then session id", c("a", "s2", 2, 1, "n", "x"), c("a", "s1", 2, 1, "n", "x")},
		{"one session on two nodes: lowest node", c("a", "s", 1, 1, "n1", "x"),
			c("a", "s", 1, 1, "n2", "x")},
		{"then service id", c("a", "s", 1, 1, "n", "t1:a"), c("a", "s", 1, 1, "n", "t2:a")},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if !tt.a.Beats(tt.b) || tt.b.Beats(tt.a) {
				t.Fatalf("%+v should beat %+v, and not the other way", tt.a, tt.b)
			}
		})
	}
	if x := c("a", "s", 1, 1, "n", "x"); x.Beats(x) {
		t.Fatal("a claim beats itself")
	}
}

func TestExcludeDuplicates(t *testing.T) {
	at := func(inst, sess string, gen uint64, address string, port int,
		mut func(*Executor)) Executor {
		return exec(func(e *Executor) {
			e.InstanceID, e.SessionID, e.Generation = inst, sess, gen
			e.Address, e.Port = address, port
			e.ServiceID = ServiceID(inst, e.Task)
			if mut != nil {
				mut(e)
			}
		})
	}
	any := mustDispatcher(t, "", nil)
	v1 := mustDispatcher(t, "<2.0.0", nil)
	for _, tt := range []struct {
		name string
		es   []Executor
		d    Dispatcher
		want []Reason // per executor
	}{
		{"distinct sockets",
			[]Executor{at("a", "s", 1, "10.0.0.1", 9000, nil),
				at("b", "s", 1, "10.0.0.1", 9001, nil)}, any,
			[]Reason{ReasonNone, ReasonNone}},
		{"two instances, one socket: lowest instance id",
			[]Executor{at("b", "s", 1, "10.0.0.1", 9000, nil),
				at("a", "s", 1, "10.0.0.1", 9000, nil)}, any,
			[]Reason{ReasonDuplicateAddress, ReasonNone}},
		{"one instance, two sessions (fencing observed): newest",
			[]Executor{at("a", "new", 2, "10.0.0.1", 9000, nil),
				at("a", "old", 1, "10.0.0.1", 9000, nil)}, any,
			[]Reason{ReasonNone, ReasonDuplicateAddress}},
		{"one IP spelled two ways",
			[]Executor{at("b", "s", 1, "::ffff:10.0.0.1", 9000, nil),
				at("a", "s", 1, "10.0.0.1", 9000, nil)}, any,
			[]Reason{ReasonDuplicateAddress, ReasonNone}},
		{"draining ones are sent too",
			[]Executor{at("b", "s", 1, "10.0.0.1", 9000, nil),
				at("a", "s", 1, "10.0.0.1", 9000, func(e *Executor) { e.State = StateDraining })},
			any,
			[]Reason{ReasonDuplicateAddress, ReasonDraining}},
		{"an excluded one claims nothing",
			[]Executor{at("b", "s", 1, "10.0.0.1", 9000, nil),
				at("a", "s", 1, "10.0.0.1", 9000,
					func(e *Executor) { e.LeaseStatus = StatusCritical })}, any,
			[]Reason{ReasonNone, ReasonLapsed}},
		{"per constraint set",
			[]Executor{at("b", "s", 1, "10.0.0.1", 9000, nil),
				at("a", "s", 1, "10.0.0.1", 9000, func(e *Executor) { e.Version = "2.0.0" })}, v1,
			[]Reason{ReasonNone, ReasonVersion}},
		{"per task type",
			[]Executor{at("b", "s", 1, "10.0.0.1", 9000, nil),
				at("a", "s", 1, "10.0.0.1", 9000, func(e *Executor) { e.Task = "other" })}, any,
			[]Reason{ReasonNone, ReasonNone}},
		{"three claimants",
			[]Executor{at("c", "s", 1, "10.0.0.1", 9000, nil),
				at("a", "s", 1, "10.0.0.1", 9000, nil), at("b", "s", 1, "10.0.0.1", 9000, nil)},
			any,
			[]Reason{ReasonDuplicateAddress, ReasonNone, ReasonDuplicateAddress}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			vs := make([]Verdict, len(tt.es))
			for i, e := range tt.es {
				vs[i] = Eligible(e, tt.d)
			}
			ExcludeDuplicates(tt.es, vs)
			for i, v := range vs {
				if v.Reason != tt.want[i] {
					t.Fatalf("executor %d (%s/%s): %s (%s), want %s", i, tt.es[i].InstanceID,
						tt.es[i].SessionID, v.Reason, v.Detail, tt.want[i])
				}
				if v.Reason == ReasonDuplicateAddress &&
					(v.Route != RouteNone || !strings.Contains(v.Detail, "also claimed by")) {
					t.Fatalf("duplicate verdict %+v", v)
				}
			}
		})
	}
}

// TestALaterClaimOfAnExecutorsSocketDoesNotUnrouteIt: exec-2 is routed at
// 10.0.0.2:9000. exec-1's token — any token that may register the task
// type — later registers its own instance at that socket, draining (no key
// rule stops it: addresses are not the instance's to prove). The socket's
// executor must not lose its work to a claim that came after it: it stays
// routed, and the later claim is the duplicate.
func TestALaterClaimOfAnExecutorsSocketDoesNotUnrouteIt(t *testing.T) {
	victim := exec(func(e *Executor) {
		e.InstanceID, e.SessionID, e.CreateIndex = "exec-2", "s2", 10
		e.Address, e.Port = "10.0.0.2", 9000
		e.ServiceID = ServiceID(e.InstanceID, e.Task)
	})
	claim := exec(func(e *Executor) {
		e.InstanceID, e.SessionID, e.CreateIndex, e.State = "exec-1", "s1", 50, StateDraining
		e.Address, e.Port = "10.0.0.2", 9000
		e.ServiceID, e.Node = ServiceID(e.InstanceID, e.Task), "n9"
	})
	es := []Executor{victim, claim}
	d := mustDispatcher(t, "", nil)
	vs := []Verdict{Eligible(es[0], d), Eligible(es[1], d)}
	ExcludeDuplicates(es, vs)
	if vs[0].Route != RouteHealthy {
		t.Fatalf("exec-2 at its own socket: %s %s (%s), want routed: a later claim of its "+
			"address took its work", vs[0].Route, vs[0].Reason, vs[0].Detail)
	}
}
