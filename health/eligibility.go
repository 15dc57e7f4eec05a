package health

import (
	"fmt"
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
)

// Verdict is the decision for one executor and one dispatcher constraint set.
type Verdict struct {
	Route  Route
	Reason Reason
	Detail string // human explanation for explain views and logs
}

// Eligible reports whether executor e may receive new work from dispatchers
// with constraint set d, and why not. Rules, first match wins:
//
//	bad metadata → none; lease critical or missing, node critical, or lapse
//	observed before → lapsed; another check failing → unhealthy; an older
//	session than the instance's newest → fenced; version or labels not
//	matching → none; draining → DRAINING; lease warning (full) → none.
func Eligible(e Executor, d Dispatcher) Verdict {
	switch {
	case e.Err != nil:
		return Verdict{RouteNone, ReasonBadMetadata, e.Err.Error()}
	case !e.LeaseFound:
		return Verdict{RouteNone, ReasonLapsed, "no lease check " + CheckID(e.InstanceID, e.SessionID, e.Task)}
	case e.LapseObserved:
		return Verdict{RouteNone, ReasonLapsed, "session " + e.SessionID + " was seen lapsed; a resumed process must register a new session"}
	case e.Lease == StatusCritical:
		return Verdict{RouteNone, ReasonLapsed, "lease check critical"}
	case e.NodeChecks == StatusCritical:
		return Verdict{RouteNone, ReasonLapsed, "node " + e.Node + " failing (serfHealth or another node check critical)"}
	case e.Lease != StatusPassing && e.Lease != StatusWarning:
		return Verdict{RouteNone, ReasonLapsed, fmt.Sprintf("lease check status %q", e.Lease)}
	case e.NodeChecks == StatusWarning || (e.Other != "" && e.Other != StatusPassing):
		return Verdict{RouteNone, ReasonUnhealthy, fmt.Sprintf("node checks %q, other service checks %q", e.NodeChecks, e.Other)}
	case e.Fenced:
		return Verdict{RouteNone, ReasonFenced, fmt.Sprintf("session %s (generation %d) is newer", e.NewerSessionID, e.NewerGeneration)}
	case !d.versionOK(e.Version):
		return Verdict{RouteNone, ReasonVersion, fmt.Sprintf("version %s does not satisfy %q", e.Version, d.VersionConstraint)}
	}
	if ok, k := d.labelsOK(e.Labels); !ok {
		have, present := e.Labels[k]
		if !present {
			return Verdict{RouteNone, ReasonLabels, fmt.Sprintf("label %s missing, want %q", k, d.Labels[k])}
		}
		return Verdict{RouteNone, ReasonLabels, fmt.Sprintf("label %s=%q, want %q", k, have, d.Labels[k])}
	}
	switch {
	case e.State == StateDraining:
		return Verdict{RouteDraining, ReasonDraining, "executor is draining: in-flight work finishes, no new work"}
	case e.Lease == StatusWarning:
		return Verdict{RouteNone, ReasonFull, fmt.Sprintf("full (load %d of capacity %d)", e.Load, e.Capacity)}
	}
	return Verdict{Route: RouteHealthy}
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
