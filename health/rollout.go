package health

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
)

// Mode is how an exclusion rule applies.
type Mode string

const (
	// ModeEnforce means the rule excludes (the default).
	ModeEnforce Mode = "enforce"
	// ModeObserve means the verdict is still computed, explained and counted as
	// "would have excluded", but the executor stays routed.
	ModeObserve Mode = "observe"
)

// ObservableRules are the rules a rollout may put in observe mode. The
// lease (lapsed), bad metadata and fencing are always enforced: an executor
// without a valid lease may be paused or gone, one whose metadata cannot be
// read cannot be addressed at all, and a fenced session is one whose results
// the fencing API refuses (STALE) — routing new work to any of them loses
// it, which no staged rollout can make safe.
var ObservableRules = []Reason{ReasonUnhealthy, ReasonVersion, ReasonLabels, ReasonDraining,
	ReasonFull, ReasonCordoned}

// ruleNames are the names a configuration uses for rules (the reason
// strings are accepted too).
var ruleNames = map[string]Reason{
	"unhealthy": ReasonUnhealthy, "fencing": ReasonFenced, "version": ReasonVersion,
	"labels":   ReasonLabels,
	"draining": ReasonDraining, "capacity": ReasonFull, "cordon": ReasonCordoned,
	"lease": ReasonLapsed, "metadata": ReasonBadMetadata,
}

// RuleName is the name a configuration gives rule (version, labels,
// capacity, …), which metrics use too, so that an operator reads the words of
// the rules file; a reason no rule has is its own string.
func RuleName(rule Reason) string {
	best := ""
	for n, r := range ruleNames {
		if r == rule && (best == "" || n < best) {
			best = n
		}
	}
	if best == "" {
		return string(rule)
	}
	return best
}

// alwaysEnforced says why a known rule cannot be observed; a mode entry
// naming one is refused in observe mode and changes nothing in enforce mode
// (so a configuration staging fencing in enforce mode parses).
var alwaysEnforced = map[Reason]string{
	ReasonLapsed: "is always enforced: an executor without a valid lease may be paused or gone",
	ReasonBadMetadata: "is always enforced: an executor whose metadata cannot be read cannot be " +
		"addressed",
	ReasonFenced: "cannot be observed: the fencing API calls a fenced session STALE and " +
		"refuses its results, so it must never receive new work",
	ReasonUnconfirmed: "is always enforced: a registration its instance's generation key does " +
		"not confirm may be forged by another instance",
	ReasonNoLease: "is always enforced: without a lease check nothing says the executor is alive",
}

// observableNames lists the configuration names of ObservableRules, for
// errors.
func observableNames() string {
	var names []string
	for _, rule := range ObservableRules {
		for n, r := range ruleNames {
			if r == rule {
				names = append(names, n)
			}
		}
	}
	slices.Sort(names)
	return strings.Join(names, ", ")
}

// ScopedMode sets one rule's mode, optionally only for some task types
// and/or one constraint set.
type ScopedMode struct {
	Rule  Reason   `json:"rule"`
	Mode  Mode     `json:"mode"`
	Tasks []string `json:"tasks,omitempty"` // empty: every task type
	// ConstraintSet selects the dispatchers by their constraints (empty:
	// every set): the same fields as their node metadata.
	ConstraintSet *SetSelector `json:"constraint_set,omitempty"`
}

// SetSelector names a constraint set by its constraints.
type SetSelector struct {
	VersionConstraint string            `json:"version_constraint,omitempty"`
	Labels            map[string]string `json:"labels,omitempty"`

	key string // the set's base key (no grant)
}

// CordonApproval says which cordons need a second person's approval.
type CordonApproval struct {
	// Required makes cordons of more than MaxExecutors executors, or of a
	// whole version, stay pending until approved by someone other than their
	// author.
	Required     bool `json:"required"`
	MaxExecutors int  `json:"max_executors"`
}

// Rollout is the operators' configuration of how rules apply.
type Rollout struct {
	Modes []ScopedMode `json:"modes"`
	// SafetyLimit is the largest fraction (0..1] of a task's live executors
	// that cordons may take out of routing at once; default 0.5. Beyond it
	// the rest stay routed and an alert is raised.
	SafetyLimit float64        `json:"safety_limit,omitempty"`
	Approval    CordonApproval `json:"approval"`
	// LoadBalancing chooses each task type's load-balancing policy.
	LoadBalancing *LoadBalancing `json:"load_balancing,omitempty"`
	// Dispatch sets each task type's dispatch policy (dispatchpolicy.go).
	Dispatch *DispatchRules `json:"dispatch,omitempty"`

	dispatch *resolvedDispatch // Dispatch merged, by validate
}

// DefaultSafetyLimit is the safety limit when none is configured.
const DefaultSafetyLimit = 0.5

// ParseRollout reads a rollout configuration (JSON) and validates it;
// errors name the field (modes[2].rule). Unknown fields are errors.
func ParseRollout(b []byte) (*Rollout, error) {
	var r Rollout
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&r); err != nil {
		return nil, fmt.Errorf("parse: %w", err)
	}
	// One document: what follows it is an error, not silently dropped.
	if err := dec.Decode(&struct{}{}); err != io.EOF {
		return nil, errors.New("parse: content after the rules object")
	}
	if err := r.validate(); err != nil {
		return nil, err
	}
	return &r, nil
}

func (r *Rollout) validate() error {
	var errs []error
	type scope struct {
		rule       Reason
		tasks, set string
	}
	seen := map[scope]int{}
	for i := range r.Modes {
		m := &r.Modes[i]
		at := fmt.Sprintf("modes[%d]", i)
		asked := m.Rule // as written, for the error
		if r, ok := ruleNames[string(m.Rule)]; ok {
			m.Rule = r
		}
		if why, ok := alwaysEnforced[m.Rule]; ok {
			if m.Mode == ModeObserve { // enforce is accepted: it is what applies anyway
				errs = append(errs, fmt.Errorf("%s.rule: %q %s", at, asked, why))
			}
		} else if !slices.Contains(ObservableRules, m.Rule) {
			errs = append(errs,
				fmt.Errorf("%s.rule: %q: want one of %s", at, asked, observableNames()))
		}
		if m.Mode != ModeEnforce && m.Mode != ModeObserve {
			errs = append(errs, fmt.Errorf("%s.mode: %q: want enforce or observe", at, m.Mode))
		}
		for k, t := range m.Tasks {
			if fe := ValidateTask(t); fe != nil {
				errs = append(errs, fmt.Errorf("%s.tasks[%d]: %s", at, k, fe.Error()))
			}
		}
		slices.Sort(m.Tasks)
		if m.ConstraintSet != nil {
			d, err := NewDispatcher(m.ConstraintSet.VersionConstraint, m.ConstraintSet.Labels)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s.constraint_set: %w", at, err))
			} else {
				m.ConstraintSet.key = d.baseKey()
			}
		}
		sc := scope{m.Rule, strings.Join(m.Tasks, "\x00"), m.setKey()}
		if j, dup := seen[sc]; dup {
			errs = append(errs, fmt.Errorf("%s: same rule and scope as modes[%d]", at, j))
		}
		seen[sc] = i
	}
	if r.SafetyLimit < 0 || r.SafetyLimit > 1 {
		errs = append(errs,
			fmt.Errorf("safety_limit: %v: want a fraction in (0, 1]", r.SafetyLimit))
	}
	if r.Approval.MaxExecutors < 0 {
		errs = append(errs,
			fmt.Errorf("approval.max_executors: %d: want >= 0", r.Approval.MaxExecutors))
	}
	if err := r.LoadBalancing.validate(); err != nil {
		errs = append(errs, err)
	}
	if d, err := r.Dispatch.validate(); err != nil {
		errs = append(errs, err)
	} else {
		r.dispatch = d
	}
	return errors.Join(errs...)
}

// ContentVersion is the content version of the rules: a hash of their
// encoding, so equal rules have equal versions on every replica however the
// document was laid out, and no rules (the defaults) the version of an
// empty document.
func (r *Rollout) ContentVersion() string {
	if r == nil {
		r = &Rollout{}
	}
	b, err := json.Marshal(r) // encoding/json sorts map keys: deterministic
	if err != nil {
		panic(fmt.Sprintf("encode rules: %v", err)) // plain data, always encodable
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}

func (m *ScopedMode) setKey() string {
	if m.ConstraintSet == nil {
		return ""
	}
	return m.ConstraintSet.key
}

// Limit is the safety limit in force.
func (r *Rollout) Limit() float64 {
	if r == nil || r.SafetyLimit == 0 {
		return DefaultSafetyLimit
	}
	return r.SafetyLimit
}

// ModeOf is the mode of rule for task under constraint set d: the most
// specific matching entry wins (task and set, then set, then task, then
// neither); nothing matching means enforce.
func (r *Rollout) ModeOf(rule Reason, task string, d Dispatcher) Mode {
	if r == nil {
		return ModeEnforce
	}
	set := d.baseKey()
	best, bestScore := ModeEnforce, -1
	for i := range r.Modes {
		m := &r.Modes[i]
		if m.Rule != rule {
			continue
		}
		score := 0
		if len(m.Tasks) > 0 {
			if !slices.Contains(m.Tasks, task) {
				continue
			}
			score++
		}
		if m.ConstraintSet != nil {
			if m.setKey() != set {
				continue
			}
			score += 2
		}
		if score > bestScore {
			best, bestScore = m.Mode, score
		}
	}
	return best
}

// Observed is the set of rules in observe mode for task under d, sorted
// (empty: every rule enforced).
func (r *Rollout) Observed(task string, d Dispatcher) []Reason {
	var out []Reason
	for _, rule := range ObservableRules {
		if r.ModeOf(rule, task, d) == ModeObserve {
			out = append(out, rule)
		}
	}
	return out
}
