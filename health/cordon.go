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
	ID                string    `json:"id"`
	Instance          string    `json:"instance_id,omitempty"`
	VersionConstraint string    `json:"version_constraint,omitempty"`
	Task              string    `json:"task,omitempty"`
	Reason            string    `json:"reason"`
	By                string    `json:"by"`
	At                time.Time `json:"at"`
	ApprovedBy        string    `json:"approved_by,omitempty"`
	ApprovedAt        time.Time `json:"approved_at,omitzero"`

	constraint *semver.Constraints
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
}

// NeedsApproval reports whether a cordon selecting matched executors needs
// a second person's approval under the rollout's approval settings.
func (c *Cordon) NeedsApproval(r *Rollout, matched int) bool {
	if r == nil || !r.Approval.Required {
		return false
	}
	return matched > r.Approval.MaxExecutors || (c.VersionConstraint != "" && c.Instance == "")
}

// ApplyCordons marks the executors that cordons take out of routing
// (CordonID), honouring approvals and the safety limit: per task type, at
// most the limit's fraction of its live executors (lease valid, not fenced)
// are cordoned at once, earlier cordons first, the rest marked CordonHeld
// and kept routed. Lapsed executors are never counted nor limited.
func ApplyCordons(es []Executor, cordons []Cordon, r *Rollout) []CordonStatus {
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
	live := map[string]int{}
	for i := range es {
		if isLive(&es[i]) {
			live[es[i].Task]++
		}
	}
	cordoned := map[string]int{}
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
		st.Pending = c.NeedsApproval(r, len(hits)) && (c.ApprovedBy == "" || c.ApprovedBy == c.By)
		st.Approved = !st.Pending
		if st.Pending {
			out[k] = st
			continue
		}
		slices.SortFunc(hits,
			func(a, b int) int { return strings.Compare(es[a].InstanceID, es[b].InstanceID) })
		for _, i := range hits {
			e := &es[i]
			if e.CordonID != "" || !isLive(e) {
				continue // already cordoned, or out of routing anyway
			}
			allowed := int(math.Floor(r.Limit()*float64(live[e.Task]) + 1e-9))
			if cordoned[e.Task] >= allowed {
				e.CordonHeld = c.ID
				st.Held++
				continue
			}
			e.CordonID, e.CordonReason = c.ID, c.Reason
			cordoned[e.Task]++
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
