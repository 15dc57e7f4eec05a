package server

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

type readyWith struct{ r fleet.Readiness }

func (r readyWith) Ready() bool                { return r.r.Ready }
func (r readyWith) Readiness() fleet.Readiness { return r.r }

type plainReady bool

func (r plainReady) Ready() bool { return bool(r) }

// /readyz's 503 names its reason and what to fix; the fields it had stay.
func TestReadyzNamesItsReason(t *testing.T) {
	contact := time.Now().Add(-3 * time.Second)
	get := func(r Readiness) (int, map[string]any) {
		t.Helper()
		h := AdminHandler(AdminConfig{Ready: r, LastContact: func() time.Time { return contact }})
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("GET", "/readyz", nil))
		var body map[string]any
		if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
			t.Fatalf("%v: %s", err, w.Body)
		}
		return w.Code, body
	}
	right := `key_prefix "leasehold/control/" { policy = "read" }`
	for _, tt := range []fleet.Readiness{
		{Reason: fleet.ReasonFirstRead, Detail: "waiting for the task types"},
		{Reason: "consul_unreachable", Detail: "dial tcp 127.0.0.1:8500: connect: connection refused", Source: "dc2"},
		{Reason: "acl", Detail: right, Source: fleet.ControlSource},
		{Reason: "tls", Detail: "x509: certificate signed by unknown authority"},
	} {
		code, body := get(readyWith{tt})
		if code != 503 || body["ready"] != false || body["reason"] != tt.Reason ||
			body["detail"] != tt.Detail {
			t.Errorf("%s: %d %v", tt.Reason, code, body)
		}
		if _, ok := body["source"]; ok != (tt.Source != "") || (ok && body["source"] != tt.Source) {
			t.Errorf("%s: source %v, want %q", tt.Reason, body["source"], tt.Source)
		}
		if _, ok := body["consul_contact_age_seconds"]; !ok {
			t.Errorf("%s: the contact age is gone: %v", tt.Reason, body)
		}
	}
	code, body := get(readyWith{fleet.Readiness{Ready: true}})
	if _, ok := body["reason"]; code != 200 || body["ready"] != true || ok ||
		body["consul_last_contact"] == nil {
		t.Errorf("ready: %d %v", code, body)
	}
	if code, body := get(plainReady(false)); code != 503 || body["ready"] != false {
		t.Errorf("a Readiness without reasons: %d %v", code, body)
	}
}

// Consul hung (no query fails, none is answered) past the staleness bound:
// /readyz is 503 consul_silent with the age; at the next answer it is ready
// again. The bound is the fencing bound, or the shortest lease declared when
// shorter (here 6 s).
func TestReadyzUnreadyWhileConsulIsSilent(t *testing.T) {
	s := leaseSyncer(t)
	fc := newFreshClock()
	f := NewFencing(s, fc.freshAsOf, FencingOptions{Clock: fc.clock})
	h := AdminHandler(
		AdminConfig{
			Ready:       s,
			LastContact: func() time.Time { return fc.freshAsOf("") },
			Syncer:      s,
			Fencing:     f,
		},
	)
	get := func() (int, map[string]any) {
		t.Helper()
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("GET", "/readyz", nil))
		var body map[string]any
		if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
			t.Fatalf("%v: %s", err, w.Body)
		}
		return w.Code, body
	}
	fc.silentFor(time.Second)
	if code, body := get(); code != 200 {
		t.Fatalf("Consul answering: %d %v", code, body)
	}
	fc.silentFor(46 * time.Second)
	code, body := get()
	if detail, _ := body["detail"].(string); code != 503 || body["reason"] != ReasonConsulSilent ||
		!strings.Contains(detail, "46s") {
		t.Fatalf("Consul silent for 46 s: %d %v, want 503 consul_silent with the age", code, body)
	}
	fc.silentFor(7 * time.Second)
	if code, body := get(); code != 503 || !strings.Contains(body["detail"].(string), "lease_ttl") {
		t.Fatalf("silent for 7 s with a 6 s lease declared: %d %v", code, body)
	}
	fc.silentFor(0) // Consul answers again
	if code, body := get(); code != 200 {
		t.Fatalf("Consul answering again: %d %v", code, body)
	}
}

// One registration (any token that may register the task type can write one)
// declares a lease_ttl of 1 ms. A healthy Consul's watches answer every
// fraction of a second, not every millisecond: /readyz stays ready while
// Consul answers within a second — no registration makes the readiness bound
// tighter than leasehold's floor.
func TestReadyzIgnoresATinyLeaseTTL(t *testing.T) {
	x := member("work", "x", 9001, "1.0.0")
	x.LeaseTTL = time.Millisecond
	s := syncedReplica(t,
		health.Observation{Data: &health.TaskList{Index: 1, Tasks: []string{"work"}}},
		health.Observation{Data: &health.NonPassing{Index: 2}},
		health.Observation{Data: &health.Generations{Index: 3}},
		health.Observation{
			Data: &health.TaskMembers{
				Task:    "work",
				Index:   11,
				Members: []health.Member{x, member("work", "y", 9002, "1.0.0")},
			},
		},
	)
	fc := newFreshClock()
	f := NewFencing(s, fc.freshAsOf, FencingOptions{Clock: fc.clock})
	h := AdminHandler(
		AdminConfig{
			Ready:       s,
			LastContact: func() time.Time { return fc.freshAsOf("") },
			Syncer:      s,
			Fencing:     f,
		},
	)
	fc.silentFor(time.Second)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("GET", "/readyz", nil))
	if w.Code != 200 {
		t.Fatalf("Consul last answered a second ago, a 1 ms lease_ttl declared: %d %s",
			w.Code, w.Body)
	}
}

// Explain shows what the load assignments hold: of two registrations
// claiming one socket, the one not sent is excluded as duplicate-address,
// and a host-name address as address-not-ip.
func TestExplainShowsAddressExclusions(t *testing.T) {
	ex := func(inst, address string, port int) health.Executor {
		m := member("work", inst, port, "1.0.0")
		e := health.Join(m, health.NewNonPassingSet(health.NonPassing{}))
		e.Address = address
		return e
	}
	v := fleet.NewView(
		[]health.Executor{
			ex("b", "127.0.0.1", 9001),
			ex("a", "127.0.0.1", 9001),
			ex("c", "127.0.0.1", 9002),
			ex("d", "exec-d.internal", 9003),
		},
	)
	want := map[string]string{
		"a": "",
		"b": string(health.ReasonDuplicateAddress),
		"c": "",
		"d": string(health.ReasonAddressNotIP),
	}
	out := explainExecutors(v, "work")
	if len(out.Executors) != len(want) {
		t.Fatalf("%d executors explained, want %d", len(out.Executors), len(want))
	}
	for _, e := range out.Executors {
		if got := e.Verdicts[0].Reason; got != want[e.InstanceID] {
			t.Errorf("%s: reason %q (%s), want %q",
				e.InstanceID, got, e.Verdicts[0].Detail, want[e.InstanceID])
		}
	}
}

// /debug/executors (and so `leasehold explain`) shows the replaces meta of a
// registration with its other contract fields: it is what makes sessions
// leasehold never saw STALE, so an operator asking why a session is answered
// STALE after a restart can see which registration names it.
func TestExplainShowsReplaces(t *testing.T) {
	m := member("work", "a", 9001, "1.0.0")
	m.Replaces = []string{"s-old"}
	v := fleet.NewView(
		[]health.Executor{health.Join(m, health.NewNonPassingSet(health.NonPassing{}))})
	b, err := json.Marshal(explainExecutors(v, "work"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), "s-old") {
		t.Fatalf("/debug/executors does not show the replaces meta: %s", b)
	}
}

// getAdmin GETs path from h and decodes the JSON answer into v.
func getAdmin(t *testing.T, h http.Handler, path string, v any) int {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	if err := json.Unmarshal(rec.Body.Bytes(), v); err != nil {
		t.Fatalf("%s: %d %q: %v", path, rec.Code, rec.Body.String(), err)
	}
	return rec.Code
}

// awaitExecutors waits until h's /debug/executors shows n registrations.
func awaitExecutors(t *testing.T, h http.Handler, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		var ex ExplainExecutors
		getAdmin(t, h, "/debug/executors", &ex)
		if len(ex.Executors) == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d executors in the view, want %d", len(ex.Executors), n)
		}
		<-time.After(10 * time.Millisecond) // the view has no watch API for tests
	}
}

// A question naming a constraint set no dispatcher uses is answered as a
// stream with that set would be served, for every executor, with why not;
// a set in use is answered as that set, not added again; a bad question
// is a 400 naming the parameter.
func TestExplainAnswersForADispatcherNotConnected(t *testing.T) {
	f := startXDS(t)
	c := member("work", "c", 9003, "1.5.0")
	c.Labels = map[string]string{"zone": "a"}
	f.members("work", member("work", "a", 9001, "1.0.0"), member("work", "b", 9002, "2.0.0"), c)
	h := AdminHandler(AdminConfig{Syncer: f.sync, XDS: f.xds})
	awaitExecutors(t, h, 4)

	var ex ExplainExecutors
	q := "/debug/executors?task=work&version_constraint=" + url.QueryEscape("<2.0.0") +
		"&label=zone%3Da"
	if code := getAdmin(t, h, q, &ex); code != http.StatusOK || ex.Asked == nil {
		t.Fatalf("%d, asked %v", code, ex.Asked)
	}
	cs := ex.ConstraintSets[*ex.Asked]
	if !cs.Hypothetical || cs.VersionConstraint != "<2.0.0" || cs.Labels["zone"] != "a" {
		t.Fatalf("asked set %+v", cs)
	}
	want := map[string]health.Reason{"a": health.ReasonLabels, "b": health.ReasonVersion,
		"c": health.ReasonNone}
	for _, e := range ex.Executors {
		v := e.Verdicts[*ex.Asked]
		if health.Reason(v.Reason) != want[e.InstanceID] || (v.Reason != "") != (v.Detail != "") {
			t.Errorf("%s: %s %q (%s), want reason %q", e.InstanceID, v.Route, v.Reason, v.Detail,
				want[e.InstanceID])
		}
	}
	if !slices.Equal(ex.Tasks, []string{"other", "work"}) {
		t.Errorf("tasks %v, want every task type registered", ex.Tasks)
	}

	// A connected dispatcher's set is the one answered.
	s := f.ads(node("d-old", map[string]any{"version_constraint": "<2.0.0"}))
	s.Subscribe(resource.EndpointType, "work")
	s.ACK(s.Next(), "work")
	for deadline := time.Now().Add(5 * time.Second); ; {
		ex = ExplainExecutors{}
		getAdmin(t, h, "/debug/executors?version_constraint="+url.QueryEscape("<2.0.0"), &ex)
		if !ex.ConstraintSets[*ex.Asked].Hypothetical || time.Now().After(deadline) {
			break
		}
		<-time.After(10 * time.Millisecond) // the view has no watch API for tests
	}
	if ex.Asked == nil || ex.ConstraintSets[*ex.Asked].Hypothetical ||
		ex.ConstraintSets[*ex.Asked].VersionConstraint != "<2.0.0" ||
		slices.ContainsFunc(ex.ConstraintSets,
			func(c ConstraintSet) bool { return c.Hypothetical }) {
		t.Fatalf("set in use asked again: asked %v of %+v", ex.Asked, ex.ConstraintSets)
	}

	for q, field := range map[string]string{
		"version_constraint=banana": "version_constraint",
		"label=zone":                "label",
		"datacenter=" + url.QueryEscape("no such dc!"): "datacenter",
	} {
		var e map[string]string
		if code := getAdmin(t, h, "/debug/executors?"+q, &e); code != http.StatusBadRequest ||
			!strings.Contains(e["error"], field) {
			t.Errorf("%s: %d %q, want 400 naming %s", q, code, e["error"], field)
		}
	}
}

// /debug/dispatchers lists each stream's constraint set and datacenter and
// the refused streams with why.
func TestDebugDispatchersListsConstraintsAndRefusals(t *testing.T) {
	f := startXDS(t)
	h := AdminHandler(AdminConfig{Syncer: f.sync, XDS: f.xds})
	s := f.ads(node("d-1", map[string]any{"version_constraint": "<2.0.0",
		"labels": map[string]any{"zone": "a"}}))
	s.Subscribe(resource.EndpointType, "work")
	s.ACK(s.Next(), "work")
	bad := f.ads(node("bad-meta", map[string]any{"version_constraint": ">= banana"}))
	bad.Subscribe(resource.ListenerType, "work")
	if _, err := bad.Recv(); err == nil {
		t.Fatal("invalid metadata accepted")
	}
	var d DebugDispatchers
	for deadline := time.Now().Add(5 * time.Second); ; {
		d = DebugDispatchers{}
		getAdmin(t, h, "/debug/dispatchers", &d)
		acked := len(d.Dispatchers) == 1 && d.Dispatchers[0].Types[resource.EndpointType] != nil &&
			d.Dispatchers[0].Types[resource.EndpointType].LastAcked != ""
		if (acked && d.RefusedTotal > 0) || time.Now().After(deadline) {
			break
		}
		<-time.After(10 * time.Millisecond) // the ACK and the refusal are handled apart
	}
	if len(d.Dispatchers) != 1 || d.Dispatchers[0].VersionConstraint != "<2.0.0" ||
		d.Dispatchers[0].Labels["zone"] != "a" || d.Dispatchers[0].Peer == "" {
		t.Errorf("dispatchers %+v", d.Dispatchers)
	}
	if typ := d.Dispatchers[0].Types[resource.EndpointType]; typ == nil || typ.LastAcked == "" {
		t.Errorf("endpoints not shown ACKed: %+v", d.Dispatchers[0].Types)
	}
	if d.RefusedTotal != 1 || len(d.Refused) != 1 || d.Refused[0].NodeID != "bad-meta" ||
		d.Refused[0].Reason != RefusedInvalidNode {
		t.Errorf("refused %+v (total %d)", d.Refused, d.RefusedTotal)
	}
}

// The admin port's JSON is read by people: a constraint such as <2.0.0 (and
// labels with & or >) is written as it is, not as \u003c2.0.0, in the views
// and in the protobuf resources /debug/dispatchers embeds.
func TestAdminJSONIsNotHTMLEscaped(t *testing.T) {
	rec := httptest.NewRecorder()
	writeJSON(rec, 200, map[string]any{"constraint_set": "<2.0.0 & >=1.0.0",
		"resources": []json.RawMessage{json.RawMessage(`{"name":"<2.0.0"}`)}})
	body := rec.Body.String()
	if !strings.Contains(body, `"<2.0.0 & >=1.0.0"`) ||
		!strings.Contains(body, `"name": "<2.0.0"`) || strings.Contains(body, `\u00`) {
		t.Fatalf("escaped for HTML:\n%s", body)
	}
}

// /debug/executors carries each task type's recent dispatch outcomes from
// the LRS server (?task= selects one), for explain.
func TestExplainExecutorsCarriesDispatchOutcomes(t *testing.T) {
	f := startLRS(t, lrsOpts{})
	f.mustOpen("d").report(
		clusterStats("work", 1, localityStats("", "z1", 3, 1, 2, 6)),
		clusterStats("other", 0, localityStats("", "", 5, 0, 0, 5)))
	h := AdminHandler(AdminConfig{Syncer: f.sync, LRS: f.lrs})
	get := func(path string) ExplainExecutors {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("GET", path, nil))
		var body ExplainExecutors
		if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
			t.Fatalf("%s: %v: %s", path, err, w.Body)
		}
		return body
	}
	all := get("/debug/executors").DispatchOutcomes
	if all == nil || len(all.Tasks) != 2 || all.WindowSeconds != 60 || all.Reporters != 1 {
		t.Fatalf("dispatch outcomes %+v", all)
	}
	work := get("/debug/executors?task=work").DispatchOutcomes
	if work == nil || len(work.Tasks) != 1 {
		t.Fatalf("?task=work: %+v", work)
	}
	r := work.Tasks[0]
	if r.Task != "work" || r.Succeeded != 3 || r.Failed != 1 || r.Dropped != 1 ||
		r.InFlight != 2 || r.FailureRate == nil || *r.FailureRate != 0.25 {
		t.Fatalf("work's outcomes %+v", r)
	}
	if d := AdminHandler(AdminConfig{Syncer: f.sync}); d != nil {
		w := httptest.NewRecorder()
		d.ServeHTTP(w, httptest.NewRequest("GET", "/debug/executors", nil))
		if strings.Contains(w.Body.String(), `"dispatch_outcomes"`) {
			t.Errorf("dispatch outcomes without an LRS server: %s", w.Body)
		}
	}
}

// /debug/executors (and so `leasehold explain`) shows the version of the
// rules in force and each task type's dispatch policy in force.
func TestExplainShowsTheRulesVersionAndDispatchPolicy(t *testing.T) {
	r, err := health.ParseRollout([]byte(
		`{"dispatch":{"tasks":{"work":{"max_requests":8,"deadline":"30s"}}}}`))
	if err != nil {
		t.Fatal(err)
	}
	join := func(m health.Member) health.Executor {
		return health.Join(m, health.NewNonPassingSet(health.NonPassing{}))
	}
	v := fleet.NewView([]health.Executor{join(member("work", "a", 9001, "1.0.0")),
		join(member("batch", "b", 9002, "1.0.0"))})
	v.Control = &fleet.ControlState{Rollout: r, RulesVersion: r.ContentVersion()}
	out := explainExecutors(v, "")
	if out.RulesVersion != r.ContentVersion() {
		t.Errorf("rules version %q, want %s", out.RulesVersion, r.ContentVersion())
	}
	if want := r.DispatchOf("work").String(); out.DispatchPolicy["work"] != want ||
		!strings.Contains(want, "max_requests 8") || !strings.Contains(want, "deadline 30s") {
		t.Errorf("work's policy %q, want %q", out.DispatchPolicy["work"], want)
	}
	if want := health.DefaultDispatch().String(); out.DispatchPolicy["batch"] != want {
		t.Errorf("batch's policy %q, want the default %q", out.DispatchPolicy["batch"], want)
	}
	if only := explainExecutors(v, "batch"); len(only.DispatchPolicy) != 1 {
		t.Errorf("asked about batch: policies of %v", only.DispatchPolicy)
	}
}
