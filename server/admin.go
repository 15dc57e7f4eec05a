package server

import (
	"encoding/json"
	"net/http"
	"net/http/pprof"
	"sort"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/fleet"
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
			task := r.URL.Query().Get("task")
			if task != "" {
				if fe := health.ValidateTask(task); fe != nil {
					writeJSON(w, http.StatusBadRequest, map[string]string{"error": fe.Error()})
					return
				}
			}
			writeJSON(w, http.StatusOK, explainExecutors(cfg.Syncer.View(), task))
		})
	}
	if cfg.Syncer != nil {
		mux.HandleFunc("GET /debug/config", func(w http.ResponseWriter, r *http.Request) {
			writeJSON(w, http.StatusOK, cfg.Syncer.View().Control)
		})
	}
	if cfg.XDS != nil {
		mux.HandleFunc("GET /debug/dispatchers", func(w http.ResponseWriter, r *http.Request) {
			writeJSON(w, http.StatusOK, map[string]any{"dispatchers": cfg.XDS.Dispatchers()})
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
type ExplainExecutors struct {
	ConsulIndex    uint64            `json:"consul_index"`
	ConstraintSets []ConstraintSet   `json:"constraint_sets"`
	Executors      []ExplainExecutor `json:"executors"`
}

// ConstraintSet is one dispatcher constraint set. Datacenter is the
// dispatchers' datacenter, whose executors they get at priority 0.
type ConstraintSet struct {
	Key               string            `json:"key"`
	VersionConstraint string            `json:"version_constraint,omitempty"`
	Labels            map[string]string `json:"labels,omitempty"`
	Datacenter        string            `json:"datacenter,omitempty"`
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

func explainExecutors(v *fleet.View, task string) ExplainExecutors {
	out := ExplainExecutors{ConsulIndex: v.ConsulIndex, Executors: []ExplainExecutor{}}
	verdicts := make([][]health.Verdict, len(v.Groups))
	for i, d := range v.Groups {
		out.ConstraintSets = append(out.ConstraintSets, ConstraintSet{Key: d.Key(),
			VersionConstraint: d.VersionConstraint, Labels: d.Labels, Datacenter: d.Datacenter})
		verdicts[i] = v.DecideAll(d)
	}
	for ei, e := range v.Executors() {
		if task != "" && e.Task != task {
			continue
		}
		x := ExplainExecutor{
			InstanceID: e.InstanceID, SessionID: e.SessionID, Generation: e.Generation,
			Task: e.Task, Node: e.Node, ServiceID: e.ServiceID, Address: e.Address,
			Port: e.Port, Version: e.Version, Capacity: e.Capacity, Load: e.Load,
			State: string(e.State), Labels: e.Labels, LeaseCheck: string(e.LeaseStatus),
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
		for gi, d := range v.Groups {
			verdict := verdicts[gi][ei]
			x.Verdicts = append(x.Verdicts, ExplainVerdict{ConstraintSet: d.Key(),
				Route: string(verdict.Route), Reason: string(verdict.Reason),
				Detail: verdict.Detail, WouldExclude: verdict.Observed})
		}
		out.Executors = append(out.Executors, x)
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
			if len(want) == 0 || want[n] {
				names = append(names, n)
			}
		}
		sort.Strings(names)
		var list []json.RawMessage
		for _, n := range names {
			b, err := protojson.Marshal(res[n])
			if err == nil {
				list = append(list, b)
			}
		}
		types[typeURL] = map[string]any{"version": snap.GetVersion(typeURL), "resources": list}
	}
	body["resources"] = types
	return body, true
}
