package health

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/Masterminds/semver/v3"
)

// Cordon is an operator's order that some executors get no new work,
// without touching the executors themselves. It selects by instance id, by
// version constraint and/or by task type (every given field must match).
type Cordon struct {
	ID                string `json:"id"`
	Instance          string `json:"instance_id,omitempty"`
	VersionConstraint string `json:"version_constraint,omitempty"`
	Task              string `json:"task,omitempty"`
	Reason            string `json:"reason"`
	By                string `json:"by"`
	// ByAccessor is the accessor id of the Consul ACL token that created the
	// cordon, when Consul said who acted; "" when By is only what --by said
	// (ACLs off: a name anyone can type).
	ByAccessor string    `json:"by_accessor,omitempty"`
	At         time.Time `json:"at"`
	ApprovedBy string    `json:"approved_by,omitempty"`
	// ApprovedByAccessor is the approving token's accessor id, as ByAccessor.
	ApprovedByAccessor string    `json:"approved_by_accessor,omitempty"`
	ApprovedAt         time.Time `json:"approved_at,omitzero"`

	constraint *semver.Constraints
}

// CordonRemoval is who removed a cordon and why: `leasehold uncordon`
// stores it beside the removal, in the same transaction, so that every
// replica's audit log can name who removed it (the removal alone says
// nothing of who).
type CordonRemoval struct {
	ID         string    `json:"id"`
	By         string    `json:"by"`
	ByAccessor string    `json:"by_accessor,omitempty"` // as Cordon.ByAccessor
	At         time.Time `json:"at"`
	Reason     string    `json:"reason,omitempty"`
}

// Validate checks a cordon; errors name the field.
func (c *Cordon) Validate() error {
	var errs []error
	if c.ID == "" || strings.ContainsAny(c.ID, "/ ") {
		errs = append(errs, fmt.Errorf("id: %q: want a non-empty id without '/' or spaces", c.ID))
	}
	if c.Instance == "" && c.VersionConstraint == "" && c.Task == "" {
		errs = append(errs,
			errors.New("selector: give an instance id, a version constraint and/or a task type"))
	}
	if c.Instance != "" {
		if err := ValidateInstanceID(c.Instance); err != nil {
			errs = append(errs, fmt.Errorf("instance_id: %w", err))
		}
	}
	if c.VersionConstraint != "" {
		vc, err := ParseConstraint(c.VersionConstraint)
		if err != nil {
			errs = append(errs, fmt.Errorf("version_constraint: %q: %w", c.VersionConstraint, err))
		}
		c.constraint = vc
	}
	if c.Task != "" {
		if fe := ValidateTask(c.Task); fe != nil {
			errs = append(errs, fmt.Errorf("task: %s", fe.Error()))
		}
	}
	if strings.TrimSpace(c.Reason) == "" {
		errs = append(errs, errors.New("reason: required (why, for the audit log and explain)"))
	}
	if strings.TrimSpace(c.By) == "" {
		errs = append(errs, errors.New("by: required (who)"))
	}
	return errors.Join(errs...)
}

// Selector describes what the cordon selects, for logs and explain.
func (c *Cordon) Selector() string {
	var parts []string
	if c.Instance != "" {
		parts = append(parts, "instance "+c.Instance)
	}
	if c.VersionConstraint != "" {
		parts = append(parts, "version "+c.VersionConstraint)
	}
	if c.Task != "" {
		parts = append(parts, "task "+c.Task)
	}
	return strings.Join(parts, ", ")
}

// Matches reports whether the cordon selects e.
func (c *Cordon) Matches(e *Executor) bool {
	if e.Err != nil {
		return false
	}
	if c.Instance != "" && c.Instance != e.InstanceID {
		return false
	}
	if c.Task != "" && c.Task != e.Task {
		return false
	}
	if c.VersionConstraint != "" {
		if c.constraint == nil {
			if err := c.Validate(); err != nil {
				return false
			}
		}
		v := e.SemVer()
		if v == nil || !c.constraint.Check(v) {
			return false
		}
	}
	return true
}

// CordonStatus is what became of one cordon.
type CordonStatus struct {
	Cordon   Cordon `json:"cordon"`
	Matched  int    `json:"matched"`  // executors it selects
	Applied  int    `json:"applied"`  // taken out of routing
	Held     int    `json:"held"`     // kept routed by the safety limit
	Pending  bool   `json:"pending"`  // waiting for a second person's approval
	Approved bool   `json:"approved"` // approved (or needing no approval)
	// HeldBy are the executor pools whose safety limit kept some of the
	// executors it selects routed, in the order they first held one.
	HeldBy []PoolLimit `json:"held_by,omitempty"`
	// ApprovalRefused says why the approval it carries does not count
	// ("": none given, or it counts).
	ApprovalRefused string `json:"approval_refused,omitempty"`
}

// PoolLimit is the safety limit of one pool: the live executors of a task
// type that one constraint set in use may route to.
type PoolLimit struct {
	// ConstraintSet is the set's key without its datacenter and grant
	// ("v=" : no constraints, which is every executor of the task type).
	ConstraintSet string `json:"constraint_set"`
	Task          string `json:"task"`
	Live          int    `json:"live"`    // live executors in the pool
	Allowed       int    `json:"allowed"` // at most this many of them cordoned at once
}

// String names the pool and its limit for people.
func (p PoolLimit) String() string {
	set := "constraint set " + p.ConstraintSet
	if p.ConstraintSet == (Dispatcher{}).baseKey() {
		set = "every executor (the set without constraints)"
	}
	return fmt.Sprintf("task %s, %s: %d live executor(s), at most %d cordoned at once",
		p.Task, set, p.Live, p.Allowed)
}

// CordonOptions are what ApplyCordons decides with besides the cordons.
type CordonOptions struct {
	// Sets are the constraint sets in use (the connected dispatchers'). The
	// set without constraints is always counted, so a task type keeps
	// routed executors for any dispatcher that connects later, as before.
	Sets []Dispatcher
	// AttributedApprovals counts only approvals Consul attributed: the
	// cordon created and approved with Consul ACL tokens, two different
	// ones (serve --require-acl-approvals). A name given with --by proves
	// nothing: anyone can type any name.
	AttributedApprovals bool
}

// NeedsApproval reports whether a cordon selecting matched executors needs
// a second person's approval under the rollout's approval settings.
func (c *Cordon) NeedsApproval(r *Rollout, matched int) bool {
	if r == nil || !r.Approval.Required {
		return false
	}
	return matched > r.Approval.MaxExecutors || (c.VersionConstraint != "" && c.Instance == "")
}

// approval reports whether the approval the cordon carries counts, and why
// not when one is given but refused.
func (c *Cordon) approval(attributed bool) (ok bool, refused string) {
	switch {
	case c.ApprovedBy == "":
		return false, ""
	case c.ApprovedBy == c.By ||
		(c.ByAccessor != "" && c.ByAccessor == c.ApprovedByAccessor):
		return false, fmt.Sprintf("approved by its own author %s: a different identity must "+
			"approve it", c.ApprovedBy)
	case !attributed:
		return true, ""
	case c.ApprovedByAccessor == "":
		return false, fmt.Sprintf("approved by %q, a name given with --by that Consul cannot "+
			"attribute (ACLs off); this replica counts only approvals made with a Consul ACL "+
			"token (serve --require-acl-approvals)", c.ApprovedBy)
	case c.ByAccessor == "":
		return false, fmt.Sprintf("created by %q, a name given with --by that Consul cannot "+
			"attribute, so no approval can show a second person; this replica counts only "+
			"cordons created and approved with two different Consul ACL tokens (serve "+
			"--require-acl-approvals): uncordon it and cordon again with a token", c.By)
	}
	return true, ""
}

// pools are the executor pools the safety limit counts: for each
// constraint set in use and each task type it may see, the live executors
// it routes to unless cordoned. A set whose cordon rule is observed for a
// task type has no pool of it: cordons take nothing out of it.
type pools struct {
	limit   []PoolLimit
	of      [][]int // per executor: the pools it is live in
	applied []int   // per pool: executors cordoned so far
}

func newPools(es []Executor, r *Rollout, sets []Dispatcher) *pools {
	// Sets differing only in datacenter or grant route to the same
	// executors (priorities aside): one pool per constraints and task,
	// for the task types any of them may see.
	type set struct {
		d      Dispatcher
		grants []Dispatcher
	}
	var uniq []*set
	byBase := map[string]*set{}
	for _, d := range append([]Dispatcher{{}}, sets...) {
		k := d.baseKey()
		if byBase[k] == nil {
			byBase[k] = &set{d: d}
			uniq = append(uniq, byBase[k])
		}
		byBase[k].grants = append(byBase[k].grants, d)
	}
	allows := func(s *set, task string) bool {
		for _, g := range s.grants {
			if g.AllowsTask(task) {
				return true
			}
		}
		return false
	}
	p := &pools{of: make([][]int, len(es))}
	index := map[string]int{}
	for i := range es {
		e := &es[i]
		if !isLive(e) {
			continue
		}
		for _, s := range uniq {
			if !allows(s, e.Task) || !inSet(e, s.d, r) {
				continue
			}
			k := s.d.baseKey() + "\x00" + e.Task
			n, ok := index[k]
			if !ok {
				n = len(p.limit)
				index[k] = n
				p.limit = append(p.limit, PoolLimit{ConstraintSet: s.d.baseKey(), Task: e.Task})
			}
			p.limit[n].Live++
			p.of[i] = append(p.of[i], n)
		}
	}
	for n := range p.limit {
		p.limit[n].Allowed = int(math.Floor(r.Limit()*float64(p.limit[n].Live) + 1e-9))
	}
	p.applied = make([]int, len(p.limit))
	return p
}

// inSet reports whether a live executor is one set d routes to but for
// cordons: its version and labels match, or the rule is observed there.
func inSet(e *Executor, d Dispatcher, r *Rollout) bool {
	if r.ModeOf(ReasonCordoned, e.Task, d) == ModeObserve {
		return false
	}
	if !d.versionOK(&e.Registration) && r.ModeOf(ReasonVersion, e.Task, d) != ModeObserve {
		return false
	}
	if ok, _ := d.labelsOK(e.Labels); !ok && r.ModeOf(ReasonLabels, e.Task, d) != ModeObserve {
		return false
	}
	return true
}

// full are the pools of executor i that have no room for one more cordoned.
func (p *pools) full(i int) []int {
	var out []int
	for _, n := range p.of[i] {
		if p.applied[n] >= p.limit[n].Allowed {
			out = append(out, n)
		}
	}
	return out
}

// ApplyCordons marks the executors that cordons take out of routing
// (CordonID), honouring approvals and the safety limit: in every pool — a
// task type's live executors (lease valid, not fenced, datacenter not lost)
// that one constraint set in use routes to, the set without constraints
// always among them — at most the limit's fraction are cordoned at once,
// rounded down, earlier cordons first. An executor whose cordon would take
// any of its pools past that is marked CordonHeld and kept routed, so no
// connected dispatcher is left with fewer executors than the limit keeps
// (a pool of one live executor is never emptied). Lapsed executors are
// never counted nor limited.
func ApplyCordons(es []Executor, cordons []Cordon, r *Rollout, o CordonOptions) []CordonStatus {
	for i := range es {
		es[i].CordonID, es[i].CordonReason, es[i].CordonHeld = "", "", ""
	}
	cs := slices.Clone(cordons)
	slices.SortFunc(cs, func(a, b Cordon) int {
		if c := a.At.Compare(b.At); c != 0 {
			return c
		}
		return strings.Compare(a.ID, b.ID)
	})
	var p *pools // counted once a cordon applies
	out := make([]CordonStatus, len(cs))
	for k := range cs {
		c := &cs[k]
		st := CordonStatus{Cordon: *c}
		var hits []int
		for i := range es {
			if c.Matches(&es[i]) {
				hits = append(hits, i)
			}
		}
		st.Matched = len(hits)
		if c.NeedsApproval(r, len(hits)) {
			ok, refused := c.approval(o.AttributedApprovals)
			st.Pending, st.ApprovalRefused = !ok, refused
		}
		st.Approved = !st.Pending
		if st.Pending {
			out[k] = st
			continue
		}
		if p == nil {
			p = newPools(es, r, o.Sets)
		}
		slices.SortFunc(hits,
			func(a, b int) int { return strings.Compare(es[a].InstanceID, es[b].InstanceID) })
		for _, i := range hits {
			e := &es[i]
			if e.CordonID != "" || !isLive(e) {
				continue // already cordoned, or out of routing anyway
			}
			if full := p.full(i); len(full) > 0 {
				e.CordonHeld = c.ID
				st.Held++
				for _, n := range full {
					if !slices.Contains(st.HeldBy, p.limit[n]) {
						st.HeldBy = append(st.HeldBy, p.limit[n])
					}
				}
				continue
			}
			e.CordonID, e.CordonReason = c.ID, c.Reason
			for _, n := range p.of[i] {
				p.applied[n]++
			}
			st.Applied++
		}
		out[k] = st
	}
	return out
}

// isLive reports whether e holds a valid lease, is its instance's newest
// session, and its datacenter is not lost (its executors take no work, so they cannot stand
// in for the ones a cordon takes out).
func isLive(e *Executor) bool {
	v := Eligible(Executor{Registration: e.Registration, Err: e.Err, LeaseStatus: e.LeaseStatus,
		LeaseFound: e.LeaseFound, NodeChecks: e.NodeChecks, NodeFailed: e.NodeFailed,
		LapseSeen: e.LapseSeen, Fenced: e.Fenced, Unconfirmed: e.Unconfirmed, Reach: e.Reach,
		ReachDetail: e.ReachDetail}, Dispatcher{})
	switch v.Reason {
	case ReasonLapsed, ReasonNoLease, ReasonBadMetadata, ReasonFenced, ReasonUnconfirmed,
		ReasonUnreachable:
		return false
	}
	return true
}
