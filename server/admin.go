package server

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/pprof"
	"net/url"
	"slices"
	"sort"
	"strings"
	"time"

	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/fleet"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// Readiness is what /readyz reports.
type Readiness interface {
	Ready() bool
}

// readinessReason is a Readiness that says why it is not ready
// (*fleet.Syncer).
type readinessReason interface {
	Readiness() fleet.Readiness
}

// AdminConfig is what the admin HTTP handler serves from. Nil fields turn
// their endpoints off.
type AdminConfig struct {
	Ready       Readiness
	LastContact func() time.Time
	Syncer      *fleet.Syncer // /debug/executors, /debug/snapshot
	XDS         *XDS          // /debug/dispatchers, /debug/snapshot
	Fencing     *Fencing      // /v1/session
	LRS         *LRS          // dispatch outcomes in /debug/executors
	Metrics     http.Handler  // /metrics (Prometheus text)
}

// AdminHandler serves /healthz (the process is up), /readyz (the fleet has
// been read and Consul answers; 503 otherwise, naming the reason —
// dispatchers keep the last snapshot meanwhile), the fencing API as JSON and
// the /debug views.
func AdminHandler(cfg AdminConfig) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		serveReadyz(w, cfg)
	})
	if cfg.Fencing != nil {
		mux.Handle("GET /v1/session", cfg.Fencing)
	}
	if cfg.Metrics != nil {
		mux.Handle("GET /metrics", cfg.Metrics)
	}
	// Go profiles, for the admin port's operators (loopback by default).
	mux.HandleFunc("GET /debug/pprof/", pprof.Index)
	mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("GET /debug/pprof/trace", pprof.Trace)
	if cfg.Syncer != nil {
		mux.HandleFunc("GET /debug/executors", func(w http.ResponseWriter, r *http.Request) {
			q := r.URL.Query()
			task := q.Get("task")
			if task != "" {
				if fe := health.ValidateTask(task); fe != nil {
					writeJSON(w, http.StatusBadRequest, map[string]string{"error": fe.Error()})
					return
				}
			}
			asked, err := askedDispatcher(q)
			if err != nil {
				writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
				return
			}
			body := explainExecutors(cfg.Syncer.View(), task, asked...)
			if cfg.LRS != nil {
				d := cfg.LRS.Outcomes(task)
				body.DispatchOutcomes = &d
			}
			writeJSON(w, http.StatusOK, body)
		})
	}
	if cfg.Syncer != nil {
		mux.HandleFunc("GET /debug/config", func(w http.ResponseWriter, r *http.Request) {
			writeJSON(w, http.StatusOK, cfg.Syncer.View().Control)
		})
	}
	if cfg.XDS != nil {
		mux.HandleFunc("GET /debug/dispatchers", func(w http.ResponseWriter, r *http.Request) {
			writeJSON(w, http.StatusOK, debugDispatchers(cfg.XDS, cfg.Syncer))
		})
	}
	if cfg.XDS != nil && cfg.Syncer != nil {
		mux.HandleFunc("GET /debug/snapshot", func(w http.ResponseWriter, r *http.Request) {
			node := r.URL.Query().Get("node")
			if node == "" {
				writeJSON(w, http.StatusBadRequest,
					map[string]string{"error": "node: required (an xDS node id)"})
				return
			}
			body, ok := nodeSnapshot(cfg.XDS, cfg.Syncer, node)
			if !ok {
				writeJSON(w, http.StatusNotFound,
					map[string]string{"error": "node " + node + ": no open stream"})
				return
			}
			writeJSON(w, http.StatusOK, body)
		})
	}
	return mux
}

// ReasonConsulSilent is /readyz's reason while Consul has not answered for
// longer than the staleness bound.
const ReasonConsulSilent = "consul_silent"

// serveReadyz answers /readyz with 200 when ready, or else with 503, the
// reason (first_read_pending, consul_unreachable, acl, tls, consul_silent),
// its detail and its source. Either way it reports Consul's last contact and
// each datacenter's reach.
func serveReadyz(w http.ResponseWriter, cfg AdminConfig) {
	ready := cfg.Ready.Ready()
	body := map[string]any{"ready": ready}
	if rr, ok := cfg.Ready.(readinessReason); ok {
		// One load, so that ready and its reason agree.
		why := rr.Readiness()
		ready = why.Ready
		body["ready"] = ready
		if !ready {
			body["reason"] = why.Reason // first_read_pending, consul_unreachable, acl, tls
			// The detail names what is pending, the error, the missing rights or
			// the certificate problem.
			body["detail"] = why.Detail
			if why.Source != "" {
				body["source"] = why.Source // a datacenter, or the operator controls
			}
		}
	}
	if ready && cfg.Fencing != nil && cfg.Syncer != nil {
		// While Consul is silent (hung or frozen) past the staleness bound, no
		// answer leasehold gives can be vouched for, although no query failed.
		if silent, detail, _ := cfg.Fencing.Silence(cfg.Syncer.View()); silent {
			ready = false
			body["ready"], body["reason"], body["detail"] = false, ReasonConsulSilent, detail
		}
	}
	if t := cfg.LastContact(); !t.IsZero() {
		body["consul_last_contact"] = t.UTC().Format(time.RFC3339Nano)
		body["consul_contact_age_seconds"] = time.Since(t).Seconds()
	}
	if cfg.Syncer != nil {
		if dcs := datacenterReach(cfg.Syncer.View()); dcs != nil {
			body["datacenters"] = dcs
		}
	}
	status := http.StatusOK
	if !ready {
		status = http.StatusServiceUnavailable
	}
	writeJSON(w, status, body)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	// People read these views: a constraint such as <2.0.0 stays <2.0.0,
	// not \u003c2.0.0 (the escaping only matters inside HTML).
	enc.SetEscapeHTML(false)
	enc.Encode(v)
}

// ExplainExecutors is the body of /debug/executors.
//
// Tasks are the task types of every registration in the view (whatever
// ?task= selects). Asked is the index in ConstraintSets of the constraint
// set a question named (?version_constraint=, ?label=, ?datacenter=): a set
// in use, or one added to answer what a dispatcher with it would get.
// LoadMaxAgeSeconds is how old each executor's load can be. Dispatch is the
// recent dispatch outcomes of the task types (of ?task=) as dispatchers
// reported them over LRS; absent from a replica without the LRS server.
type ExplainExecutors struct {
	ConsulIndex       uint64            `json:"consul_index"`
	ConstraintSets    []ConstraintSet   `json:"constraint_sets"`
	Asked             *int              `json:"asked,omitempty"`
	Tasks             []string          `json:"tasks"`
	LoadMaxAgeSeconds float64           `json:"load_max_age_seconds"`
	Executors         []ExplainExecutor `json:"executors"`
	// DispatchOutcomes is each task type's recent dispatch outcomes, as
	// dispatchers report them over LRS.
	DispatchOutcomes *DispatchOutcomes `json:"dispatch_outcomes,omitempty"`
	// RulesVersion is the content version of the rules in force.
	RulesVersion string `json:"rules_version,omitempty"`
	// DispatchPolicy is the dispatch policy in force for each task type
	// shown, in words (health.TaskDispatch.String).
	DispatchPolicy map[string]string `json:"dispatch_policy,omitempty"`
}

// ConstraintSet is one dispatcher constraint set. Datacenter is the
// dispatchers' datacenter, whose executors they get at priority 0.
// Hypothetical is set on a set no dispatcher uses, decided for a question.
type ConstraintSet struct {
	Key               string            `json:"key"`
	VersionConstraint string            `json:"version_constraint,omitempty"`
	Labels            map[string]string `json:"labels,omitempty"`
	Datacenter        string            `json:"datacenter,omitempty"`
	Hypothetical      bool              `json:"hypothetical,omitempty"`
}

// LoadMaxAge is how old the load /debug/executors shows can be. It is the
// lease check's output as Consul's catalog has it, and a Consul agent syncs
// a check change that leaves the status alone (a new load, not full or free
// again) only after check_update_interval/2 plus up to a whole
// check_update_interval at random: up to 7.5 minutes with the default of 5.
// leasehold has no fresher figure: executors report their current load over
// ORCA to dispatchers, never to leasehold.
const LoadMaxAge = 3 * consulCheckUpdateInterval / 2

// consulCheckUpdateInterval is Consul's default check_update_interval.
const consulCheckUpdateInterval = 5 * time.Minute

// askedDispatcher is the constraint set a /debug/executors question names
// (version_constraint, label=key=value repeated, datacenter), or none; errors
// name the parameter.
func askedDispatcher(q url.Values) ([]health.Dispatcher, error) {
	if !q.Has("version_constraint") && !q.Has("label") && !q.Has("datacenter") {
		return nil, nil
	}
	labels := map[string]string{}
	for _, l := range q["label"] {
		k, v, ok := strings.Cut(l, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("label %q: want key=value", l)
		}
		if _, dup := labels[k]; dup {
			return nil, fmt.Errorf("label %q: key %q given twice", l, k)
		}
		labels[k] = v
	}
	d, err := health.NewDispatcher(q.Get("version_constraint"), labels)
	if err != nil {
		return nil, err
	}
	if dc := q.Get("datacenter"); dc != "" {
		dc = health.NormalizeDatacenter(dc)
		if err := health.ValidateDatacenter("datacenter", dc); err != nil {
			return nil, err
		}
		d = d.InDatacenter(dc)
	}
	return []health.Dispatcher{d}, nil
}

// ExplainExecutor is one registration and its verdict per constraint set.
//
// Reach is set (unanswered or lost) when its datacenter does not answer.
// Replaces are the older sessions its registration names as replaced.
// LapseObserved is health.Executor.LapseSeen under its older wire name,
// which stays. Cordon is the cordon taking it out of routing; CordonHeld is a
// cordon that the safety limit did not apply.
type ExplainExecutor struct {
	InstanceID     string            `json:"instance_id"`
	SessionID      string            `json:"session_id"`
	Generation     uint64            `json:"generation"`
	Task           string            `json:"task"`
	Node           string            `json:"node"`
	Datacenter     string            `json:"datacenter,omitempty"`
	Reach          string            `json:"datacenter_reach,omitempty"`
	ServiceID      string            `json:"service_id"`
	Address        string            `json:"address"`
	Port           int               `json:"port"`
	Version        string            `json:"version"`
	Capacity       int               `json:"capacity"`
	Load           int               `json:"load"`
	LoadReported   bool              `json:"load_reported"` // false: no load reached Consul yet
	State          string            `json:"state"`
	Labels         map[string]string `json:"labels,omitempty"`
	Replaces       []string          `json:"replaces,omitempty"`
	LeaseCheck     string            `json:"lease_check"`
	NodeChecks     string            `json:"node_checks"`
	OtherChecks    string            `json:"other_checks,omitempty"`
	LapseObserved  bool              `json:"lapse_observed,omitempty"`
	NewerSessionID string            `json:"newer_session_id,omitempty"`
	CreateIndex    uint64            `json:"create_index"`
	MetadataError  string            `json:"metadata_error,omitempty"`
	Cordon         string            `json:"cordon,omitempty"`
	CordonHeld     string            `json:"cordon_held,omitempty"`
	Verdicts       []ExplainVerdict  `json:"verdicts"`
}

// ExplainVerdict is the decision for one constraint set.
type ExplainVerdict struct {
	ConstraintSet string `json:"constraint_set"`
	Route         string `json:"route"`
	Reason        string `json:"reason,omitempty"`
	Detail        string `json:"detail,omitempty"`
	// Cluster is the shard it is sent in, when its task type is split into
	// shards for this set (translator.ShardName); empty otherwise.
	Cluster string `json:"cluster,omitempty"`
	// WouldExclude are the rules in observe mode that would have excluded it.
	WouldExclude []health.Exclusion `json:"would_exclude,omitempty"`
}

// DatacenterReach is one watched datacenter as /readyz reports it.
type DatacenterReach struct {
	// Reach is reached, unanswered (its sessions are answered UNKNOWN) or lost
	// (its executors are not routed).
	Reach       string `json:"reach"`
	Detail      string `json:"detail,omitempty"`
	ConsulIndex uint64 `json:"consul_index"`
}

// datacenterReach is every watched datacenter's reach, or nil when only one
// is watched.
func datacenterReach(v *fleet.View) map[string]DatacenterReach {
	dcs := v.Datacenters()
	if len(dcs) < 2 {
		return nil
	}
	out := make(map[string]DatacenterReach, len(dcs))
	for _, dc := range dcs {
		i, _ := v.Datacenter(dc)
		out[dc] = DatacenterReach{Reach: i.Reach.String(), Detail: i.ReachDetail,
			ConsulIndex: i.ConsulIndex}
	}
	return out
}

// explainExecutors explains the view's executors of task ("": all) for
// every constraint set in use and, when asked names one, for that set too —
// decided exactly as a stream with it would be.
func explainExecutors(v *fleet.View, task string, asked ...health.Dispatcher) ExplainExecutors {
	out := ExplainExecutors{ConsulIndex: v.ConsulIndex, Executors: []ExplainExecutor{},
		Tasks: []string{}, LoadMaxAgeSeconds: LoadMaxAge.Seconds()}
	groups := v.Groups
	for _, a := range asked {
		i := slices.IndexFunc(groups, func(d health.Dispatcher) bool { return d.Key() == a.Key() })
		if i < 0 {
			i = len(groups)
			groups = append(slices.Clip(groups), a)
		}
		out.Asked = &i
	}
	verdicts := make([][]health.Verdict, len(groups))
	for i, d := range groups {
		out.ConstraintSets = append(out.ConstraintSets, ConstraintSet{Key: d.Key(),
			VersionConstraint: d.VersionConstraint, Labels: d.Labels, Datacenter: d.Datacenter,
			Hypothetical: i >= len(v.Groups)})
		verdicts[i] = v.DecideAll(d)
	}
	for ei, e := range v.Executors() {
		if !slices.Contains(out.Tasks, e.Task) {
			out.Tasks = append(out.Tasks, e.Task)
		}
		if task != "" && e.Task != task {
			continue
		}
		x := ExplainExecutor{
			InstanceID: e.InstanceID, SessionID: e.SessionID, Generation: e.Generation,
			Task: e.Task, Node: e.Node, ServiceID: e.ServiceID, Address: e.Address,
			Port: e.Port, Version: e.Version, Capacity: e.Capacity, Load: e.Load,
			LoadReported: e.LoadReported,
			State:        string(e.State), Labels: e.Labels, LeaseCheck: string(e.LeaseStatus),
			NodeChecks: string(e.NodeChecks), OtherChecks: string(e.Other),
			LapseObserved: e.LapseSeen, NewerSessionID: e.NewerSessionID,
			CreateIndex: e.CreateIndex, Replaces: e.Replaces,
		}
		if !e.LeaseFound && e.Err == nil {
			x.LeaseCheck = "missing"
		}
		if e.Err != nil {
			x.MetadataError = e.Err.Error()
		}
		x.Cordon, x.CordonHeld = e.CordonID, e.CordonHeld
		x.Datacenter = e.Datacenter
		if e.Reach != health.Reached {
			x.Reach = e.Reach.String() + ": " + e.ReachDetail
		}
		for gi, d := range groups {
			verdict := verdicts[gi][ei]
			ev := ExplainVerdict{ConstraintSet: d.Key(),
				Route: string(verdict.Route), Reason: string(verdict.Reason),
				Detail: verdict.Detail, WouldExclude: verdict.Observed}
			if c := v.ClusterOf(e, d); c != e.Task {
				ev.Cluster = c
			}
			x.Verdicts = append(x.Verdicts, ev)
		}
		out.Executors = append(out.Executors, x)
	}
	sort.Strings(out.Tasks)
	out.RulesVersion = v.RulesVersion()
	var rules *health.Rollout
	if v.Control != nil {
		rules = v.Control.Rollout
	}
	out.DispatchPolicy = map[string]string{}
	for _, t := range out.Tasks {
		if task == "" || t == task {
			out.DispatchPolicy[t] = rules.DispatchOf(t).String()
		}
	}
	return out
}

// DebugDispatchers is the body of /debug/dispatchers: the connected streams,
// the recent kinds of refused stream (newest first; at most 32, each counted)
// and how many streams were refused since the start. LocalDatacenter is
// leasehold's own, which streams naming no datacenter run in.
type DebugDispatchers struct {
	Dispatchers     []StreamInfo `json:"dispatchers"`
	Refused         []Refusal    `json:"refused"`
	RefusedTotal    int          `json:"refused_total"`
	LocalDatacenter string       `json:"local_datacenter,omitempty"`
}

func debugDispatchers(x *XDS, syncer *fleet.Syncer) DebugDispatchers {
	out := DebugDispatchers{Dispatchers: x.Dispatchers()}
	out.Refused, out.RefusedTotal = x.Refusals()
	if syncer != nil {
		out.LocalDatacenter = syncer.View().Local
	}
	return out
}

// nodeSnapshot is what a node currently gets: the resources of its
// constraint set's snapshot that it subscribed to, per type, as protojson.
func nodeSnapshot(x *XDS, syncer *fleet.Syncer, node string) (map[string]any, bool) {
	var info *StreamInfo
	for _, s := range x.Dispatchers() {
		if s.NodeID == node {
			info = &s
			break
		}
	}
	if info == nil {
		return nil, false
	}
	snap, ok := syncer.Snapshot(info.Group)
	body := map[string]any{"node_id": node, "constraint_set": info.Group}
	if !ok {
		body["resources"] = map[string]any{}
		return body, true
	}
	types := map[string]any{}
	for typeURL, t := range info.Types {
		want := map[string]bool{}
		for _, n := range t.Subscribed {
			want[n] = true
		}
		res := snap.GetResources(typeURL)
		names := make([]string, 0, len(res))
		for n := range res {
			if t.Wildcard || want[n] {
				names = append(names, n)
			}
		}
		sort.Strings(names)
		var list []json.RawMessage
		for _, n := range names {
			m := res[n]
			if cla, ok := m.(*endpointv3.ClusterLoadAssignment); ok {
				m = translator.Expand(cla) // its endpoints are held encoded
			}
			b, err := protojson.Marshal(m)
			if err == nil {
				list = append(list, b)
			}
		}
		types[typeURL] = map[string]any{"version": snap.GetVersion(typeURL), "resources": list}
	}
	body["resources"] = types
	return body, true
}
