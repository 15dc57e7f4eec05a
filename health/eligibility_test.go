package health

import (
	"errors"
	"fmt"
	"reflect"
	"testing"
)

func exec(mut func(*Executor)) Executor {
	e := Executor{
		Registration: validReg(),
		ServiceID:    "transcode:exec-1", Node: "n1",
		LeaseStatus: StatusPassing, LeaseFound: true, NodeChecks: StatusPassing,
	}
	if mut != nil {
		mut(&e)
	}
	return e
}

func mustDispatcher(t *testing.T, vc string, labels map[string]string) Dispatcher {
	t.Helper()
	d, err := NewDispatcher(vc, labels)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestEligibleEveryRuleAndReason(t *testing.T) {
	any := mustDispatcher(t, "", nil)
	v14 := mustDispatcher(t, ">=1.4.0, <2.0.0", nil)
	v15 := mustDispatcher(t, ">=1.5.0", nil)
	eu := mustDispatcher(t, "", map[string]string{"zone": "eu-1"})
	us := mustDispatcher(t, "", map[string]string{"zone": "us-1"})
	gpu := mustDispatcher(t, "", map[string]string{"accel": "gpu"})

	tests := []struct {
		name   string
		e      Executor
		d      Dispatcher
		route  Route
		reason Reason
	}{
		{"healthy", exec(nil), any, RouteHealthy, ReasonNone},
		{"healthy in version range", exec(nil), v14, RouteHealthy, ReasonNone},
		{"healthy with label selector", exec(nil), eu, RouteHealthy, ReasonNone},
		{"bad metadata", exec(func(e *Executor) { e.Err = errors.New("capacity: not an integer") }),
			any, RouteNone, ReasonBadMetadata},
		{"lease critical", exec(func(e *Executor) { e.LeaseStatus = StatusCritical }), any,
			RouteNone, ReasonLapsed},
		{"lease check missing",
			exec(func(e *Executor) { e.LeaseFound = false; e.LeaseStatus = "" }), any, RouteNone,
			ReasonNoLease},
		{"lease check missing, seen lapsed before",
			exec(func(e *Executor) { e.LeaseFound, e.LeaseStatus, e.LapseSeen = false, "", true }),
			any, RouteNone, ReasonLapsed},
		{"unconfirmed by its generation key",
			exec(func(e *Executor) { e.Unconfirmed = "generation 9 is above its key" }), any,
			RouteNone, ReasonUnconfirmed},
		{"unconfirmed beats lapsed",
			exec(func(e *Executor) { e.Unconfirmed, e.LeaseStatus = "forged", StatusCritical }),
			any, RouteNone, ReasonUnconfirmed},
		{"lease unknown status", exec(func(e *Executor) { e.LeaseStatus = "maintenance" }), any,
			RouteNone, ReasonLapsed},
		{"node failed (serfHealth critical)",
			exec(func(e *Executor) { e.NodeFailed = true; e.NodeChecks = StatusCritical }), any,
			RouteNone, ReasonLapsed},
		{"another node check critical: unhealthy, not a lapse",
			exec(func(e *Executor) { e.NodeChecks = StatusCritical }), any, RouteNone,
			ReasonUnhealthy},
		{"lapse observed, passing again", exec(func(e *Executor) { e.LapseSeen = true }), any,
			RouteNone, ReasonLapsed},
		{"other service check failing", exec(func(e *Executor) { e.Other = StatusCritical }), any,
			RouteNone, ReasonUnhealthy},
		{"node check warning", exec(func(e *Executor) { e.NodeChecks = StatusWarning }), any,
			RouteNone, ReasonUnhealthy},
		{"fenced",
			exec(func(e *Executor) {
				e.Fenced = true
				e.NewerSessionID = "s2"
				e.NewerGeneration = 4
			}),
			any, RouteNone, ReasonFenced},
		{"version too old", exec(nil), v15, RouteNone, ReasonVersion},
		{"version too new", exec(func(e *Executor) { e.Version = "2.0.0" }), v14, RouteNone,
			ReasonVersion},
		{"prerelease excluded by range", exec(func(e *Executor) { e.Version = "1.5.0-rc.1" }), v14,
			RouteNone, ReasonVersion},
		{"label mismatch", exec(nil), us, RouteNone, ReasonLabels},
		{"label missing", exec(nil), gpu, RouteNone, ReasonLabels},
		{"draining", exec(func(e *Executor) { e.State = StateDraining }), any, RouteDraining,
			ReasonDraining},
		{"draining and full",
			exec(func(e *Executor) { e.State = StateDraining; e.LeaseStatus = StatusWarning }), any,
			RouteDraining, ReasonDraining},
		{"draining but version excluded", exec(func(e *Executor) { e.State = StateDraining }), v15,
			RouteNone, ReasonVersion},
		{"full", exec(func(e *Executor) { e.LeaseStatus = StatusWarning; e.Load = 4 }), any,
			RouteNone, ReasonFull},
		{"lapsed beats draining",
			exec(func(e *Executor) { e.State = StateDraining; e.LeaseStatus = StatusCritical }),
			any, RouteNone, ReasonLapsed},
		{"fenced beats full",
			exec(func(e *Executor) { e.Fenced = true; e.LeaseStatus = StatusWarning }), any,
			RouteNone, ReasonFenced},
		{"unhealthy beats fenced",
			exec(func(e *Executor) { e.Fenced = true; e.Other = StatusWarning }), any, RouteNone,
			ReasonUnhealthy},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v := Eligible(tt.e, tt.d)
			if v.Route != tt.route || v.Reason != tt.reason {
				t.Fatalf("verdict = %+v, want %s/%s", v, tt.route, tt.reason)
			}
			if tt.reason != ReasonNone && v.Detail == "" {
				t.Fatal("ineligible verdict without detail")
			}
		})
	}
}

func session(instance, session string, gen, create uint64, task string) Executor {
	return exec(func(e *Executor) {
		e.InstanceID, e.SessionID, e.Task = instance, session, task
		e.Generation, e.CreateIndex = gen, create
	})
}

func fenced(es []Executor) []string {
	var out []string
	for _, e := range es {
		if e.Fenced {
			out = append(out, e.InstanceID+"/"+e.SessionID+"/"+e.Task)
		}
	}
	return out
}

// Deciding a routed executor allocates nothing: the rules are direct calls,
// so the executor (440 bytes) stays on the stack. The executors gauge and
// every full build decide the whole fleet.
func TestEligibleAllocatesNothingForARoutedExecutor(t *testing.T) {
	e := exec(nil)
	// As the watch reads it: its version parsed with the rest.
	reg, err := ParseRegistration(e.Task, e.Address, e.Port, e.Meta())
	if err != nil {
		t.Fatal(err)
	}
	e.Registration = reg
	d := mustDispatcher(t, ">=1.0.0", map[string]string{"zone": "eu-1"})
	if v := Eligible(e, d); v.Route != RouteHealthy {
		t.Fatalf("the executor is not routed: %+v", v)
	}
	if n := testing.AllocsPerRun(100, func() { _ = EligibleObserving(e, d, nil) }); n != 0 {
		t.Fatalf("%.0f allocations per decision", n)
	}
}

func TestFence(t *testing.T) {
	tests := []struct {
		name string
		es   []Executor
		keys map[string]GenerationRecord
		want []string
	}{
		{"one session, two tasks",
			[]Executor{session("a", "s1", 1, 10, "t1"), session("a", "s1", 1, 11, "t2")}, nil, nil},
		{"newer generation wins",
			[]Executor{session("a", "s1", 1, 10, "t"), session("a", "s2", 2, 5, "t")}, nil,
			[]string{"a/s1/t"}},
		{"not by create index: re-synced old registration",
			[]Executor{session("a", "old", 3, 900, "t"), session("a", "new", 4, 100, "t")}, nil,
			[]string{"a/old/t"}},
		{"instances are independent",
			[]Executor{session("a", "s1", 1, 1, "t"), session("b", "s9", 9, 2, "t")}, nil, nil},
		{"floor: newest session gone", []Executor{session("a", "s1", 1, 1, "t")},
			map[string]GenerationRecord{"a": {Generation: 2}}, []string{"a/s1/t"}},
		{"floor equal to present session", []Executor{session("a", "s2", 2, 1, "t")},
			map[string]GenerationRecord{"a": {Generation: 2}}, nil},
		{"tie broken by create index",
			[]Executor{session("a", "x", 5, 7, "t"), session("a", "y", 5, 8, "t")}, nil,
			[]string{"a/x/t"}},
		{"bad metadata ignored", []Executor{session("a", "s1", 1, 1, "t"), exec(func(e *Executor) {
			e.InstanceID = "a"
			e.SessionID = "junk"
			e.Generation = 99
			e.Err = errors.New("bad")
		})}, nil, nil},
		{"a newer generation with bad metadata elsewhere still fences",
			[]Executor{session("a", "s1", 1, 1, "t"), exec(func(e *Executor) {
				e.InstanceID, e.SessionID, e.Generation, e.Task = "a", "s2", 2, "t"
				e.Err = fmt.Errorf("registration x: %w",
					FieldErrors{{Field: MetaCapacity, Value: "lots", Reason: "not an integer"}})
			})}, nil, []string{"a/s1/t"}},
		{"bad generation takes no part",
			[]Executor{session("a", "s1", 1, 1, "t"), exec(func(e *Executor) {
				// ParseRegistration puts 1 for garbage.
				e.InstanceID, e.SessionID, e.Generation, e.Task = "a", "s2", 1, "t"
				e.Err = FieldErrors{{Field: MetaGeneration, Value: "x",
					Reason: "not a positive integer"}}
			})}, nil, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			Fence(tt.es, tt.keys)
			if got := fenced(tt.es); !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("fenced = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestFenceResetsPreviousMarks(t *testing.T) {
	es := []Executor{session("a", "s1", 1, 1, "t"), session("a", "s2", 2, 2, "t")}
	Fence(es, nil)
	es = es[:1] // s2 deregistered and nothing remembers it
	Fence(es, nil)
	if es[0].Fenced {
		t.Fatal("mark not recomputed")
	}
	Fence(es, map[string]GenerationRecord{"a": {Generation: 2}}) // the state owner remembers it
	if !es[0].Fenced || es[0].NewerGeneration != 2 {
		t.Fatalf("key ignored: %+v", es[0])
	}
}

var errTest = &FieldError{Field: "capacity", Reason: "test"}
