package health

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestDispatchPolicyDefaultsWhenNothingIsConfigured(t *testing.T) {
	want := TaskDispatch{RetryOn: []string{"UNAVAILABLE", "RESOURCE_EXHAUSTED"}, NumRetries: 2,
		BackoffBase: 25 * time.Millisecond, BackoffMax: 250 * time.Millisecond}
	var none *Rollout
	empty, err := ParseRollout([]byte(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	emptySection, err := ParseRollout([]byte(`{"dispatch":{}}`))
	if err != nil {
		t.Fatal(err)
	}
	for name, r := range map[string]*Rollout{"no rules": none, "no section": empty,
		"empty section": emptySection} {
		if got := r.DispatchOf("work"); !reflect.DeepEqual(got, want) {
			t.Errorf("%s: %+v, want %+v", name, got, want)
		}
	}
}

// A task's policy is merged over the default field by field, the default
// over DefaultDispatch; retry.on is replaced whole.
func TestDispatchPolicyMergesTheTaskOverTheDefault(t *testing.T) {
	r, err := ParseRollout([]byte(`{"dispatch":{
		"default":{"retry":{"num_retries":3,"backoff":{"base":"100ms"}},"deadline":"30s",
			"outlier":{"failure_percentage":{"threshold":50,"minimum_hosts":2}}},
		"tasks":{
			"work":{"retry":{"on":["UNAVAILABLE"]},"max_requests":8,
				"outlier":{"failure_percentage":{"request_volume":10},"max_ejection_percent":34}},
			"batch":{"retry":{"num_retries":0},"outlier":{"enabled":false}},
			"slow":{"deadline":"2h","retry":{"backoff":{"max":"5s"}}}}}}`))
	if err != nil {
		t.Fatal(err)
	}
	def := TaskDispatch{RetryOn: []string{"UNAVAILABLE", "RESOURCE_EXHAUSTED"}, NumRetries: 3,
		BackoffBase: 100 * time.Millisecond, BackoffMax: time.Second, Deadline: 30 * time.Second,
		Outlier: &Ejection{FailurePercentage: 50, MinimumHosts: 2, RequestVolume: 50,
			Interval: 10 * time.Second, BaseEjectionTime: 30 * time.Second, MaxEjectionPercent: 10}}
	work := def
	work.RetryOn, work.MaxRequests = []string{"UNAVAILABLE"}, 8
	work.Outlier = &Ejection{FailurePercentage: 50, MinimumHosts: 2, RequestVolume: 10,
		Interval: 10 * time.Second, BaseEjectionTime: 30 * time.Second, MaxEjectionPercent: 34}
	batch := def
	batch.NumRetries, batch.Outlier = 0, nil
	slow := def
	slow.Deadline, slow.BackoffMax = 2*time.Hour, 5*time.Second
	for task, want := range map[string]TaskDispatch{"other": def, "work": work, "batch": batch,
		"slow": slow} {
		if got := r.DispatchOf(task); !reflect.DeepEqual(got, want) {
			t.Errorf("%s:\n got %+v %+v\nwant %+v %+v", task, got, got.Outlier, want, want.Outlier)
		}
	}
	// The default's ejection is not changed by a task's merge.
	if got := r.DispatchOf("other").Outlier.RequestVolume; got != 50 {
		t.Errorf("a task's merge changed the default's ejection: request_volume %d", got)
	}
	// retry.on is kept in a canonical order, so equal sets are equal policies.
	r2, err := ParseRollout([]byte(
		`{"dispatch":{"default":{"retry":{"on":["RESOURCE_EXHAUSTED","UNAVAILABLE"]}}}}`))
	if err != nil {
		t.Fatal(err)
	}
	if a, b := r2.DispatchOf("work").Key(), DefaultDispatch().Key(); a != b {
		t.Errorf("the same codes in another order: key %s, want %s", a, b)
	}
}

func TestDispatchPolicyRefusesNamingTheField(t *testing.T) {
	for _, tt := range []struct{ doc, field, why string }{
		{`{"retry":{"on":["UNAVAILABLE","BOGUS"]}}`, `dispatch.tasks["work"].retry.on[1]`,
			"not a gRPC status code"},
		{`{"retry":{"on":["DEADLINE_EXCEEDED"]}}`, `dispatch.tasks["work"].retry.on[0]`,
			"never retried"},
		{`{"retry":{"on":["UNAVAILABLE","ABORTED"]}}`, `dispatch.tasks["work"].retry.on[1]`,
			"run it twice"},
		{`{"retry":{"on":["UNKNOWN"]}}`, `retry.on[0]`, "never retried"},
		{`{"retry":{"on":["INTERNAL"]}}`, `retry.on[0]`, "never retried"},
		{`{"retry":{"on":["CANCELLED"]}}`, `retry.on[0]`, "never retried"},
		{`{"retry":{"on":["unavailable"]}}`, `retry.on[0]`, "upper case, UNAVAILABLE"},
		{`{"retry":{"on":["resource-exhausted"]}}`, `retry.on[0]`, "RESOURCE_EXHAUSTED"},
		{`{"retry":{"on":["NOT_FOUND"]}}`, `retry.on[0]`, "no xDS client retries on it"},
		{`{"retry":{"on":["UNAVAILABLE","UNAVAILABLE"]}}`, `retry.on[1]`, "repeats"},
		{`{"retry":{"on":[]}}`, `retry.on`, "at least one code"},
		{`{"retry":{"num_retries":-1}}`, `retry.num_retries`, "want 0..4"},
		{`{"retry":{"num_retries":5}}`, `retry.num_retries`, "at most 5 attempts"},
		{`{"retry":{"num_retries":10}}`, `retry.num_retries`, "want 0..4"},
		{`{"retry":{"backoff":{"base":"0s"}}}`, `retry.backoff.base`, "more than 0"},
		{`{"retry":{"backoff":{"base":"-1s"}}}`, `retry.backoff.base`, "more than 0"},
		{`{"retry":{"backoff":{"base":"soon"}}}`, `retry.backoff.base`, "Go duration"},
		{`{"retry":{"backoff":{"max":"10ms"}}}`, `retry.backoff.max`, "below base 25ms"},
		{`{"retry":{"backoff":{"base":"1s","max":"500ms"}}}`, `retry.backoff.max`, "below base"},
		{`{"retry":{"backoff":{"max":"2m"}}}`, `retry.backoff.max`, "at most 1m0s"},
		{`{"max_requests":0}`, `dispatch.tasks["work"].max_requests`, "want 1.."},
		{`{"max_requests":-3}`, `max_requests`, "want 1.."},
		{`{"deadline":"0s"}`, `dispatch.tasks["work"].deadline`, "more than 0"},
		{`{"deadline":"25h"}`, `deadline`, "at most 24h0m0s"},
		{`{"deadline":"5"}`, `deadline`, "Go duration"},
		{`{"outlier":{"max_ejection_percent":101}}`, `outlier.max_ejection_percent`, "1..100"},
		{`{"outlier":{"max_ejection_percent":0}}`, `outlier.max_ejection_percent`,
			"eject no executor"},
		{`{"outlier":{"failure_percentage":{"threshold":0}}}`,
			`outlier.failure_percentage.threshold`, "1..100"},
		{`{"outlier":{"failure_percentage":{"threshold":150}}}`,
			`outlier.failure_percentage.threshold`, "1..100"},
		{`{"outlier":{"failure_percentage":{"minimum_hosts":-1}}}`,
			`outlier.failure_percentage.minimum_hosts`, "want 1.."},
		{`{"outlier":{"failure_percentage":{"request_volume":0}}}`,
			`outlier.failure_percentage.request_volume`, "want 1.."},
		{`{"outlier":{"consecutive_failures":0}}`, `outlier.consecutive_failures`, "want 1.."},
		{`{"outlier":{"interval":"0s"}}`, `outlier.interval`, "more than 0"},
		{`{"outlier":{"base_ejection_time":"2h"}}`, `outlier.base_ejection_time`, "at most 5m"},
		// Envoy refuses a base_ejection_time above max_ejection_time, unset: 300 s.
		{`{"outlier":{"base_ejection_time":"5m1s"}}`, `outlier.base_ejection_time`,
			"max_ejection_time"},
		// Ejection turned off still has what is written checked.
		{`{"outlier":{"enabled":false,"failure_percentage":{"threshold":500}}}`,
			`outlier.failure_percentage.threshold`, "1..100"},
		{`{"outlier":{"enabled":false,"interval":"soon"}}`, `outlier.interval`, "Go duration"},
		{`{"retries":3}`, `retries`, "unknown field"},
	} {
		doc := `{"dispatch":{"tasks":{"work":` + tt.doc + `}}}`
		_, err := ParseRollout([]byte(doc))
		if err == nil || !strings.Contains(err.Error(), tt.field) ||
			!strings.Contains(err.Error(), tt.why) {
			t.Errorf("%s: %v, want an error naming %s saying %q", tt.doc, err, tt.field, tt.why)
		}
	}
	for _, tt := range []struct{ doc, field string }{
		{`{"dispatch":{"default":{"retry":{"num_retries":7}}}}`, "dispatch.default.retry.num_retries"},
		{`{"dispatch":{"tasks":{"bad task":{}}}}`, `dispatch.tasks["bad task"]`},
		{`{"dispatch":{"tasks":{"work":null}}}`, `dispatch.tasks["work"]: null`},
		// The merge is checked: the task's max under the default's base.
		{`{"dispatch":{"default":{"retry":{"backoff":{"base":"1s"}}},` +
			`"tasks":{"work":{"retry":{"backoff":{"max":"100ms"}}}}}}`,
			`dispatch.tasks["work"].retry.backoff.max`},
	} {
		_, err := ParseRollout([]byte(tt.doc))
		if err == nil || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("%s: %v, want an error naming %s", tt.doc, err, tt.field)
		}
	}
}

// Keys differ with every field the policy emits and are equal for equal
// policies.
func TestDispatchPolicyKeyFollowsEveryField(t *testing.T) {
	base := DefaultDispatch()
	base.Outlier = &Ejection{FailurePercentage: 50, MinimumHosts: 2, RequestVolume: 10,
		Interval: time.Second, BaseEjectionTime: time.Second, MaxEjectionPercent: 10}
	variants := []func(p *TaskDispatch){
		func(p *TaskDispatch) { p.RetryOn = []string{"UNAVAILABLE"} },
		func(p *TaskDispatch) { p.NumRetries = 1 },
		func(p *TaskDispatch) { p.BackoffBase = time.Millisecond },
		func(p *TaskDispatch) { p.BackoffMax = time.Second },
		func(p *TaskDispatch) { p.MaxRequests = 3 },
		func(p *TaskDispatch) { p.Deadline = time.Second },
		func(p *TaskDispatch) { p.Outlier = nil },
		func(p *TaskDispatch) { p.Outlier.FailurePercentage = 51 },
		func(p *TaskDispatch) { p.Outlier.MinimumHosts = 3 },
		func(p *TaskDispatch) { p.Outlier.RequestVolume = 11 },
		func(p *TaskDispatch) { p.Outlier.ConsecutiveFailures = 5 },
		func(p *TaskDispatch) { p.Outlier.Interval = 2 * time.Second },
		func(p *TaskDispatch) { p.Outlier.BaseEjectionTime = 2 * time.Second },
		func(p *TaskDispatch) { p.Outlier.MaxEjectionPercent = 11 },
	}
	seen := map[string]int{base.Key(): -1}
	for i, f := range variants {
		p := base
		o := *base.Outlier
		p.Outlier = &o
		f(&p)
		if j, dup := seen[p.Key()]; dup {
			t.Errorf("variant %d has the key of %d: %s", i, j, p.Key())
		}
		seen[p.Key()] = i
	}
}

// The section round-trips through JSON (the rules applied are logged and
// shown in /debug/config as written).
func TestDispatchSectionIsEncodedAsWritten(t *testing.T) {
	doc := `{"modes":null,"approval":{"required":false,"max_executors":0},` +
		`"dispatch":{"tasks":{"work":{"retry":{"on":["UNAVAILABLE"],"num_retries":1},` +
		`"deadline":"5s"}}}}`
	r, err := ParseRollout([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != doc {
		t.Fatalf("encoded %s\nwant    %s", b, doc)
	}
}

// The edges of every bound are accepted, and yield what they say.
func TestDispatchPolicyAcceptsTheEdgesOfEveryBound(t *testing.T) {
	r, err := ParseRollout([]byte(`{"dispatch":{"tasks":{"work":{
		"retry":{"num_retries":4,"backoff":{"base":"1m","max":"1m"}},
		"max_requests":1048576,"deadline":"24h",
		"outlier":{"failure_percentage":{"threshold":1,"minimum_hosts":10000,
			"request_volume":1048576},"consecutive_failures":1000,"interval":"1h",
			"base_ejection_time":"5m","max_ejection_percent":100}}}}}`))
	if err != nil {
		t.Fatal(err)
	}
	p := r.DispatchOf("work")
	if p.NumRetries != 4 || p.BackoffBase != time.Minute || p.BackoffMax != time.Minute ||
		p.MaxRequests != 1<<20 || p.Deadline != 24*time.Hour || p.Outlier == nil ||
		p.Outlier.BaseEjectionTime != 5*time.Minute || p.Outlier.MaxEjectionPercent != 100 ||
		p.Outlier.FailurePercentage != 1 {
		t.Fatalf("edges: %+v %+v", p, p.Outlier)
	}
}
