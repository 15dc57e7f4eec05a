package health

import (
	"fmt"
	"slices"
)

// Executor is one registration as leasehold sees it: the contract fields
// (possibly partial when Err is set), where it runs and the state of its
// checks, plus what leasehold has concluded across registrations (fencing)
// and remembers (observed lapses).
type Executor struct {
	Registration
	ServiceID   string
	Node        string
	Err         error // bad metadata: the registration cannot be trusted at all
	CreateIndex uint64

	Lease      CheckStatus // the session's lease check; "" when missing
	LeaseFound bool
	NodeChecks CheckStatus // worst node-level check (serfHealth, ...); "" = none
	Other      CheckStatus // worst other check of the service; "" = none
	Load       int         // from the lease check's output, when known

	// Set by Fence: a newer session of the instance exists.
	Fenced          bool
	NewerSessionID  string
	NewerGeneration uint64
	// Set by the state owner: this session was once seen lapsed.
	LapseObserved bool
	// Set by the state owner: an operator's cordon applies (its id and
	// reason), or would but the safety limit keeps the executor routed.
	CordonID, CordonReason string
	CordonHeld             string // a cordon the safety limit did not apply
}

// Route says how a dispatcher may use an executor.
type Route string

const (
	RouteHealthy  Route = "HEALTHY"  // eligible for new work
	RouteDraining Route = "DRAINING" // in-flight work finishes, no new work (Envoy DRAINING; gRPC skips)
	RouteNone     Route = "NONE"     // not sent at all
)

// Reason names why an executor is not eligible for new work.
type Reason string

const (
	ReasonNone        Reason = ""
	ReasonBadMetadata Reason = "bad-metadata"
	ReasonLapsed      Reason = "lapsed"
	ReasonUnhealthy   Reason = "unhealthy" // a non-lease check of the service or node is not passing
	ReasonFenced      Reason = "fenced-by-newer-session"
	ReasonVersion     Reason = "version-incompatible"
	ReasonLabels      Reason = "label-mismatch"
	ReasonDraining    Reason = "draining"
	ReasonFull        Reason = "full"
	ReasonCordoned    Reason = "cordoned" // an operator's cordon: no new work (DRAINING)
)

// Verdict is the decision for one executor and one dispatcher constraint set.
type Verdict struct {
	Route  Route
	Reason Reason
	Detail string // human explanation for explain views and logs
	// Observed: rules in observe mode that would have excluded the
	// executor (it is routed as if they passed).
	Observed []Exclusion
}

// Exclusion is one rule's exclusion, with its explanation.
type Exclusion struct {
	Reason Reason `json:"reason"`
	Detail string `json:"detail"`
}

// Eligible reports whether executor e may receive new work from dispatchers
// with constraint set d, and why not. Rules, first match wins:
//
//	bad metadata → none; lease critical or missing, node critical, or lapse
//	observed before → lapsed; another check failing → unhealthy; an older
//	session than the instance's newest → fenced; version or labels not
//	matching → none; cordoned by an operator → DRAINING; draining →
//	DRAINING; lease warning (full) → none.
func Eligible(e Executor, d Dispatcher) Verdict { return EligibleObserving(e, d, nil) }

// EligibleObserving is Eligible with some rules in observe mode: each of
// them that would exclude e is recorded in Verdict.Observed and skipped, and
// the next rule decides. Lapsed and bad metadata are never skipped.
func EligibleObserving(e Executor, d Dispatcher, observe []Reason) Verdict {
	var observed []Exclusion
	for _, rule := range rules {
		v, excluded := rule(&e, d)
		if !excluded {
			continue
		}
		if slices.Contains(observe, v.Reason) {
			observed = append(observed, Exclusion{v.Reason, v.Detail})
			continue
		}
		v.Observed = observed
		return v
	}
	return Verdict{Route: RouteHealthy, Observed: observed}
}

// rules in order; each reports its verdict and whether it excludes.
var rules = []func(e *Executor, d Dispatcher) (Verdict, bool){
	func(e *Executor, _ Dispatcher) (Verdict, bool) {
		if e.Err != nil {
			return Verdict{Route: RouteNone, Reason: ReasonBadMetadata, Detail: e.Err.Error()}, true
		}
		return Verdict{}, false
	},
	addressRule, // address.go
	func(e *Executor, _ Dispatcher) (Verdict, bool) {
		lapsed := func(detail string) (Verdict, bool) {
			return Verdict{Route: RouteNone, Reason: ReasonLapsed, Detail: detail}, true
		}
		switch {
		case !e.LeaseFound:
			return lapsed("no lease check " + CheckID(e.InstanceID, e.SessionID, e.Task))
		case e.LapseObserved:
			return lapsed("session " + e.SessionID + " was seen lapsed; a resumed process must register a new session")
		case e.Lease == StatusCritical:
			return lapsed("lease check critical")
		case e.NodeChecks == StatusCritical:
			return lapsed("node " + e.Node + " failing (serfHealth or another node check critical)")
		case e.Lease != StatusPassing && e.Lease != StatusWarning:
			return lapsed(fmt.Sprintf("lease check status %q", e.Lease))
		}
		return Verdict{}, false
	},
	func(e *Executor, _ Dispatcher) (Verdict, bool) {
		if e.NodeChecks == StatusWarning || (e.Other != "" && e.Other != StatusPassing) {
			return Verdict{Route: RouteNone, Reason: ReasonUnhealthy, Detail: fmt.Sprintf("node checks %q, other service checks %q", e.NodeChecks, e.Other)}, true
		}
		return Verdict{}, false
	},
	func(e *Executor, _ Dispatcher) (Verdict, bool) {
		if e.Fenced {
			return Verdict{Route: RouteNone, Reason: ReasonFenced, Detail: fmt.Sprintf("session %s (generation %d) is newer", e.NewerSessionID, e.NewerGeneration)}, true
		}
		return Verdict{}, false
	},
	func(e *Executor, d Dispatcher) (Verdict, bool) {
		if !d.versionOK(e.Version) {
			return Verdict{Route: RouteNone, Reason: ReasonVersion, Detail: fmt.Sprintf("version %s does not satisfy %q", e.Version, d.VersionConstraint)}, true
		}
		return Verdict{}, false
	},
	func(e *Executor, d Dispatcher) (Verdict, bool) {
		ok, k := d.labelsOK(e.Labels)
		if ok {
			return Verdict{}, false
		}
		have, present := e.Labels[k]
		if !present {
			return Verdict{Route: RouteNone, Reason: ReasonLabels, Detail: fmt.Sprintf("label %s missing, want %q", k, d.Labels[k])}, true
		}
		return Verdict{Route: RouteNone, Reason: ReasonLabels, Detail: fmt.Sprintf("label %s=%q, want %q", k, have, d.Labels[k])}, true
	},
	func(e *Executor, _ Dispatcher) (Verdict, bool) {
		if e.CordonID != "" {
			return Verdict{Route: RouteDraining, Reason: ReasonCordoned, Detail: "cordoned by an operator (" + e.CordonID + "): " + e.CordonReason}, true
		}
		return Verdict{}, false
	},
	func(e *Executor, _ Dispatcher) (Verdict, bool) {
		if e.State == StateDraining {
			return Verdict{Route: RouteDraining, Reason: ReasonDraining, Detail: "executor is draining: in-flight work finishes, no new work"}, true
		}
		return Verdict{}, false
	},
	func(e *Executor, _ Dispatcher) (Verdict, bool) {
		if e.Lease == StatusWarning {
			return Verdict{Route: RouteNone, Reason: ReasonFull, Detail: fmt.Sprintf("full (load %d of capacity %d)", e.Load, e.Capacity)}, true
		}
		return Verdict{}, false
	},
}

// Fence marks every executor whose session is older than the newest session
// of its instance. Sessions are ordered by generation; floor holds, per
// instance, the highest generation known from elsewhere (Consul KV, or
// sessions seen before that are gone now), so an old session never becomes
// newest again because a newer one deregistered. Equal generations (only
// possible when the contract was broken) are ordered by Consul's CreateIndex,
// then session id, so every replica decides the same. Executors with bad
// metadata take no part.
func Fence(es []Executor, floor map[string]uint64) {
	type newest struct {
		gen     uint64
		session string
		create  uint64
	}
	best := map[string]newest{}
	for _, e := range es {
		if e.Err != nil {
			continue
		}
		cand := newest{e.Generation, e.SessionID, e.CreateIndex}
		cur, ok := best[e.InstanceID]
		if !ok || newer(cand.gen, cand.create, cand.session, cur.gen, cur.create, cur.session) {
			best[e.InstanceID] = cand
		}
	}
	for i := range es {
		e := &es[i]
		e.Fenced, e.NewerSessionID, e.NewerGeneration = false, "", 0
		if e.Err != nil {
			continue
		}
		b := best[e.InstanceID]
		if f := floor[e.InstanceID]; f > b.gen {
			b = newest{gen: f, session: "(gone)"}
		}
		if b.session != e.SessionID || b.gen != e.Generation {
			e.Fenced, e.NewerSessionID, e.NewerGeneration = true, b.session, b.gen
		}
	}
}

func newer(g1, c1 uint64, s1 string, g2, c2 uint64, s2 string) bool {
	if g1 != g2 {
		return g1 > g2
	}
	if c1 != c2 {
		return c1 > c2
	}
	return s1 > s2
}
