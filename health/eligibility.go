package health

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
)

// Executor is one registration as leasehold sees it: the contract fields
// (possibly partial when Err is set), where it runs and the state of its
// checks, plus what leasehold has concluded across registrations (fencing)
// and remembers (lapses seen).
type Executor struct {
	Registration
	ServiceID string
	Node      string
	// Datacenter is the Consul datacenter the registration was read from
	// (set by the watch, not by the executor; "" with a single datacenter
	// whose name is not known, as in tests).
	Datacenter  string
	Err         error // bad metadata: the registration cannot be trusted at all
	CreateIndex uint64
	// LeaseCreateIndex is the catalog's CreateIndex of the session's lease
	// check as its membership read saw it (set by Join; 0: missing). The
	// state owner compares it with the first one it saw (LeaseCheckRecreated).
	LeaseCreateIndex uint64

	LeaseStatus CheckStatus // the status of the session's lease check; "" when missing
	LeaseFound  bool
	NodeChecks  CheckStatus // worst node-level check (serfHealth, ...); "" = none
	// NodeFailed is set when the node's serfHealth check is critical: Consul lost
	// contact with the executor's agent. Like a critical lease it ends the
	// session for ever (the process may be alive on the far side of a
	// partition while its tasks are dispatched again).
	NodeFailed bool
	Other      CheckStatus // worst other check of the service; "" = none
	Load       int         // from the lease check's output, when known
	// LoadReported says the lease check's output carried a load (Load is 0
	// until one does: a new check's output reaches the catalog only with
	// Consul's next output sync, minutes after the registration).
	LoadReported bool

	// Set by Fence: a newer session of the instance exists.
	Fenced          bool
	NewerSessionID  string
	NewerGeneration uint64
	// Unconfirmed, set by Fence, says why the instance's generation key
	// does not confirm this registration ("" when it does): it is never
	// routed, fences no other session and is answered UNKNOWN.
	Unconfirmed string
	// Set by the state owner: this session was once seen lapsed.
	LapseSeen bool
	// Set by the state owner: whether Consul in the executor's datacenter
	// answers (Reach) and, when not, since when and why (ReachDetail).
	Reach       Reach
	ReachDetail string
	// Set by the state owner: an operator's cordon applies (its id and
	// reason), or would but the safety limit keeps the executor routed.
	CordonID, CordonReason string
	CordonHeld             string // a cordon the safety limit did not apply
}

// Route says how a dispatcher may use an executor.
type Route string

const (
	RouteHealthy Route = "HEALTHY" // eligible for new work
	// In-flight work finishes, no new work (Envoy DRAINING; gRPC skips).
	RouteDraining Route = "DRAINING"
	RouteNone     Route = "NONE" // not sent at all
)

// Reason names why an executor is not eligible for new work.
type Reason string

const (
	ReasonNone        Reason = ""
	ReasonBadMetadata Reason = "bad-metadata"
	ReasonLapsed      Reason = "lapsed"
	// ReasonUnconfirmed means the instance's generation key names another
	// session (or a lower generation): the registration may be forged.
	ReasonUnconfirmed Reason = "generation-unconfirmed"
	// ReasonNoLease means the registration has no lease check of its session.
	ReasonNoLease   Reason = "no-lease-check"
	ReasonUnhealthy Reason = "unhealthy" // a non-lease check of the service or node is not passing
	ReasonFenced    Reason = "fenced-by-newer-session"
	ReasonVersion   Reason = "version-incompatible"
	ReasonLabels    Reason = "label-mismatch"
	ReasonDraining  Reason = "draining"
	ReasonFull      Reason = "full"
	ReasonCordoned  Reason = "cordoned" // an operator's cordon: no new work (DRAINING)
	// ReasonUnreachable means the executor's datacenter has not answered for
	// longer than a lease while others do.
	ReasonUnreachable Reason = "datacenter-unreachable"
)

// Reach says whether leasehold hears from an executor's datacenter.
type Reach uint8

const (
	// Reached means Consul in its datacenter answers.
	Reached Reach = iota
	// Unanswered means its datacenter does not answer now. The executor is
	// routed as last known (its lease rules hold); its session is
	// answered UNKNOWN, since a lapse may be going unseen.
	Unanswered
	// Lost means its datacenter has not answered for longer than a lease while
	// other datacenters do (a WAN partition usually cuts dispatchers off
	// from it too): no new work, until it answers itself. When no
	// datacenter answers, none becomes Lost: the last known snapshot stays
	// (fail static).
	Lost
)

func (r Reach) String() string {
	switch r {
	case Reached:
		return "reached"
	case Unanswered:
		return "unanswered"
	default:
		return "lost"
	}
}

// Verdict is the decision for one executor and one dispatcher constraint set.
type Verdict struct {
	Route  Route
	Reason Reason
	Detail string // human explanation for explain views and logs
	// Observed are the rules in observe mode that would have excluded the
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
//	bad metadata → none; lease critical or missing, node failed (serfHealth
//	critical), or lapse seen before → lapsed; its datacenter lost →
//	datacenter-unreachable; another check of the
//	service or node not passing → unhealthy; an older
//	session than the instance's newest → fenced; version or labels not
//	matching → none; cordoned by an operator → DRAINING; draining →
//	DRAINING; lease warning (full) → none.
func Eligible(e Executor, d Dispatcher) Verdict { return EligibleObserving(e, d, nil) }

// EligibleObserving is Eligible with some rules in observe mode: each of
// them that would exclude e is recorded in Verdict.Observed and skipped, and
// the next rule decides. Only ObservableRules can be skipped: lapsed, bad
// metadata and fenced always exclude, whatever observe holds.
func EligibleObserving(e Executor, d Dispatcher, observe []Reason) Verdict {
	var observed []Exclusion
	for i := range ruleCount {
		v, excluded := rule(i, &e, d)
		if !excluded {
			continue
		}
		if slices.Contains(observe, v.Reason) && slices.Contains(ObservableRules, v.Reason) {
			observed = append(observed, Exclusion{v.Reason, v.Detail})
			continue
		}
		v.Observed = observed
		return v
	}
	return Verdict{Route: RouteHealthy, Observed: observed}
}

// rules in order: rule i reports its verdict and whether it excludes. A
// switch of direct calls, not a slice of functions: through a function value
// the executor escapes, and every decision copied it to the heap (440 bytes:
// at 10,000 executors, 4.4 MB per decision of the fleet, which the executors
// gauge makes at every collection; TestEligibleAllocatesNothingForARoutedExecutor).
// The last rule's table test fails when ruleCount is short of the cases.
const ruleCount = 12

func rule(i int, e *Executor, d Dispatcher) (Verdict, bool) {
	switch i {
	case 0:
		return badMetadataRule(e, d)
	case 1:
		return unconfirmedRule(e, d)
	case 2:
		return addressRule(e, d)
	case 3:
		return leaseRule(e, d)
	case 4:
		return reachRule(e, d)
	case 5:
		return healthRule(e, d)
	case 6:
		return fencedRule(e, d)
	case 7:
		return versionRule(e, d)
	case 8:
		return labelsRule(e, d)
	case 9:
		return cordonRule(e, d)
	case 10:
		return drainingRule(e, d)
	case 11:
		return fullRule(e, d)
	}
	panic("no rule " + strconv.Itoa(i)) // ruleCount is wrong: every decision fails
}

func badMetadataRule(e *Executor, _ Dispatcher) (Verdict, bool) {
	if e.Err != nil {
		return Verdict{Route: RouteNone, Reason: ReasonBadMetadata, Detail: e.Err.Error()}, true
	}
	return Verdict{}, false
}

func unconfirmedRule(e *Executor, _ Dispatcher) (Verdict, bool) {
	if e.Unconfirmed != "" {
		return Verdict{Route: RouteNone, Reason: ReasonUnconfirmed, Detail: e.Unconfirmed}, true
	}
	return Verdict{}, false
}

func leaseRule(e *Executor, _ Dispatcher) (Verdict, bool) {
	lapsed := func(detail string) (Verdict, bool) {
		return Verdict{Route: RouteNone, Reason: ReasonLapsed, Detail: detail}, true
	}
	switch {
	case e.LapseSeen:
		return lapsed("session " + e.SessionID + " was seen lapsed; a resumed process must " +
			"register a new session")
	case !e.LeaseFound:
		// Not "lapsed", which is final: a missing check is no proof
		// the lease ended, and the session is answered UNKNOWN.
		return Verdict{Route: RouteNone, Reason: ReasonNoLease,
			Detail: "no lease check " + CheckID(e.InstanceID, e.SessionID, e.Task) +
				" of this session: not routed, and the fencing API answers it UNKNOWN"}, true
	case e.LeaseStatus == StatusCritical:
		return lapsed("lease check critical")
	case e.NodeFailed:
		return lapsed("node " + e.Node + " failed (serfHealth critical): Consul lost contact " +
			"with its agent")
	case e.LeaseStatus != StatusPassing && e.LeaseStatus != StatusWarning:
		return lapsed(fmt.Sprintf("lease check status %q", e.LeaseStatus))
	}
	return Verdict{}, false
}

func reachRule(e *Executor, _ Dispatcher) (Verdict, bool) {
	if e.Reach == Lost {
		return Verdict{Route: RouteNone, Reason: ReasonUnreachable, Detail: e.ReachDetail}, true
	}
	return Verdict{}, false
}

func healthRule(e *Executor, _ Dispatcher) (Verdict, bool) {
	if (e.NodeChecks != "" && e.NodeChecks != StatusPassing) ||
		(e.Other != "" && e.Other != StatusPassing) {
		return Verdict{Route: RouteNone, Reason: ReasonUnhealthy,
			Detail: fmt.Sprintf("node checks %q, other service checks %q", e.NodeChecks,
				e.Other)}, true
	}
	return Verdict{}, false
}

func fencedRule(e *Executor, _ Dispatcher) (Verdict, bool) {
	if e.Fenced {
		return Verdict{Route: RouteNone, Reason: ReasonFenced,
			Detail: fmt.Sprintf("session %s (generation %d) is newer", e.NewerSessionID,
				e.NewerGeneration)}, true
	}
	return Verdict{}, false
}

func versionRule(e *Executor, d Dispatcher) (Verdict, bool) {
	if !d.versionOK(&e.Registration) {
		return Verdict{Route: RouteNone, Reason: ReasonVersion,
			Detail: fmt.Sprintf("version %s does not satisfy %q", e.Version,
				d.VersionConstraint)}, true
	}
	return Verdict{}, false
}

func labelsRule(e *Executor, d Dispatcher) (Verdict, bool) {
	ok, k := d.labelsOK(e.Labels)
	if ok {
		return Verdict{}, false
	}
	have, present := e.Labels[k]
	if !present {
		return Verdict{Route: RouteNone, Reason: ReasonLabels,
			Detail: fmt.Sprintf("label %s missing, want %q", k, d.Labels[k])}, true
	}
	return Verdict{Route: RouteNone, Reason: ReasonLabels,
		Detail: fmt.Sprintf("label %s=%q, want %q", k, have, d.Labels[k])}, true
}

func cordonRule(e *Executor, _ Dispatcher) (Verdict, bool) {
	if e.CordonID != "" {
		return Verdict{Route: RouteDraining, Reason: ReasonCordoned,
			Detail: "cordoned by an operator (" + e.CordonID + "): " + e.CordonReason}, true
	}
	return Verdict{}, false
}

func drainingRule(e *Executor, _ Dispatcher) (Verdict, bool) {
	if e.State == StateDraining {
		return Verdict{Route: RouteDraining, Reason: ReasonDraining,
			Detail: "executor is draining: in-flight work finishes, no new work"}, true
	}
	return Verdict{}, false
}

func fullRule(e *Executor, _ Dispatcher) (Verdict, bool) {
	if e.LeaseStatus == StatusWarning {
		return Verdict{Route: RouteNone, Reason: ReasonFull,
			Detail: fmt.Sprintf("full (load %d of capacity %d)", e.Load, e.Capacity)}, true
	}
	return Verdict{}, false
}

// Fence marks every executor whose session is older than the newest session
// of its instance, and every one its instance's generation key does not
// confirm. keys holds, per instance, its key in Consul KV
// (leasehold/generation/<instance_id>), which every session start takes
// before it registers: the key is the authority on which session is newest,
// so an old session never becomes newest again because a newer one
// deregistered, every replica orders the same way, and a registration that
// claims more than the key holds (a generation above it, or its generation
// under another session) is unconfirmed — only the instance's own identity
// may write its key, whereas any token that may register the task type may
// register any instance id. Without a key (never written, or deleted)
// sessions are ordered among their registrations, unprotected: equal
// generations (only possible when the contract was broken) by Consul's
// CreateIndex, then session id, so every replica decides the same.
//
// A registration with bad metadata takes part whenever its instance, session
// and generation are valid (Orders): a newer generation fences older sessions
// whatever else is wrong with it.
func Fence(es []Executor, keys map[string]GenerationRecord) {
	byInstance := map[string][]*Executor{}
	for i := range es {
		byInstance[es[i].InstanceID] = append(byInstance[es[i].InstanceID], &es[i])
	}
	for inst, group := range byInstance {
		FenceInstance(group, keys[inst])
	}
}

// FenceInstance is Fence for the registrations of one instance (every one
// Consul lists) and its generation key (the zero record: none): what a state
// owner calls when only that instance changed.
func FenceInstance(es []*Executor, key GenerationRecord) {
	var best struct {
		gen     uint64
		session string
		create  uint64
	}
	found := false
	// Sessions registered at the key's generation: whatever the key's form,
	// such a session has that generation, and a registration of its id
	// under another one is a copy (KeyDenies says so of the named form).
	atKey := map[string]bool{}
	for _, e := range es {
		if e.Orders() && key.Present() && e.Generation == key.Generation &&
			key.Judge(e.Generation, e.SessionID) == KeyConfirms {
			atKey[e.SessionID] = true
		}
	}
	// Where each of them registered first: a copy elsewhere is not it (the
	// key's session in the named form; every one at its generation in the
	// bare form, which cannot tell them apart otherwise).
	type place struct{ dc, node string }
	homes := map[string]place{}
	for sess := range atKey {
		at := GenerationRecord{Generation: key.Generation, SessionID: sess}
		if key.SessionID != "" {
			// The key is that session's: it registers where it took it.
			at.Datacenter = key.Datacenter
		}
		if h, ok := keyHome(es, at); ok {
			homes[sess] = place(h)
		}
	}
	for _, e := range es {
		e.Fenced, e.NewerSessionID, e.NewerGeneration, e.Unconfirmed = false, "", 0, ""
		if !e.Orders() {
			continue
		}
		if atKey[e.SessionID] && e.Generation != key.Generation {
			e.Unconfirmed = fmt.Sprintf("session %s is registered at generation %d, its "+
				"instance's generation key's (%s = %q); a registration of its id under "+
				"generation %d is not the session",
				e.SessionID, key.Generation, GenerationKey(e.InstanceID), key.Value(), e.Generation)
			continue
		}
		switch key.Judge(e.Generation, e.SessionID) {
		case KeyDenies:
			e.Unconfirmed = key.denial(e.InstanceID, e.Generation, e.SessionID)
			continue
		case KeyConfirms:
			if home, homed := homes[e.SessionID]; homed &&
				(e.Datacenter != home.dc || e.Node != home.node) {
				if home.node == "" {
					e.Unconfirmed = fmt.Sprintf("session %s took its generation key in "+
						"datacenter %s, where it registers; a copy on node %s%s is not trusted "+
						"(a session is one process on one agent)",
						e.SessionID, home.dc, e.Node, inDC(e.Datacenter))
				} else {
					e.Unconfirmed = fmt.Sprintf("session %s is registered on node %s%s first; a "+
						"copy on node %s%s is not trusted (a session is one process on one agent)",
						e.SessionID, home.node, inDC(home.dc), e.Node, inDC(e.Datacenter))
				}
				continue
			}
		}
		if !found ||
			newer(e.Generation, e.CreateIndex, e.SessionID, best.gen, best.create, best.session) {
			best.gen, best.session, best.create = e.Generation, e.SessionID, e.CreateIndex
			found = true
		}
	}
	if key.Generation > best.gen {
		best.gen, best.session = key.Generation, key.SessionID
		if best.session == "" {
			best.session = GoneSession
		}
	}
	for _, e := range es {
		if !e.Orders() || e.Unconfirmed != "" {
			continue
		}
		if best.session != e.SessionID || best.gen != e.Generation {
			e.Fenced, e.NewerSessionID, e.NewerGeneration = true, best.session, best.gen
		}
	}
}

// keyHome is where the session a generation key names registered first
// (the lowest CreateIndex, then datacenter and node): every registration of
// a session comes from one process through one agent, so a copy elsewhere —
// registered by another instance that read the session id in the catalog —
// is not the session. Where the key's datacenter is known, the session is
// in it: CreateIndexes of two datacenters are unrelated, and a copy in one
// whose Raft log is younger would otherwise come "first" (home.node is ""
// when no registration of the session is listed there). homed is false
// when the key names no session or no registration of it is listed.
func keyHome(es []*Executor, key GenerationRecord) (home struct{ dc, node string }, homed bool) {
	if key.SessionID == "" {
		return home, false
	}
	var create uint64
	elsewhere := false
	for _, e := range es {
		if !e.Orders() || e.Generation != key.Generation || e.SessionID != key.SessionID {
			continue
		}
		if key.Datacenter != "" && e.Datacenter != key.Datacenter {
			elsewhere = true
			continue
		}
		if !homed || e.CreateIndex < create ||
			(e.CreateIndex == create &&
				(e.Datacenter < home.dc || (e.Datacenter == home.dc && e.Node < home.node))) {
			home.dc, home.node, create, homed = e.Datacenter, e.Node, e.CreateIndex, true
		}
	}
	if !homed && elsewhere { // only copies: the session's home is the key's datacenter
		home.dc, homed = key.Datacenter, true
	}
	return home, homed
}

func inDC(dc string) string {
	if dc == "" {
		return ""
	}
	return " in " + dc
}

// GoneSession stands for the session of a generation taken in Consul KV in
// the bare form (the key does not name its session) that no registration
// carries (it deregistered, or has not registered yet).
const GoneSession = "(gone)"

// Orders reports whether e's instance, session and generation are valid, so
// that it takes part in ordering the sessions of its instance even when other
// fields of its metadata are bad.
func (e Executor) Orders() bool {
	if e.Err == nil {
		return true
	}
	var fes FieldErrors
	if !errors.As(e.Err, &fes) {
		return false
	}
	for _, f := range fes {
		switch f.Field {
		case MetaInstanceID, MetaSessionID, MetaGeneration:
			return false
		}
	}
	return true
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
