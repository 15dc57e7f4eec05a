package health

import (
	"errors"
	"fmt"
	"slices"
	"strings"
)

// LBPolicy is the load-balancing policy a task type's cluster asks
// dispatchers to apply among its routed endpoints. Eligibility (lease,
// fencing, full, draining…) decides which endpoints are sent; the policy only
// spreads new work among them.
type LBPolicy string

const (
	// LBWeightedRoundRobin weights endpoints by the load each reports to the
	// dispatcher itself over ORCA (gRFC A58; Envoy's
	// client_side_weighted_round_robin): current to the second, unlike
	// anything that travels through Consul. Clients without it fall back to
	// round robin.
	LBWeightedRoundRobin LBPolicy = "weighted_round_robin"
	// LBRoundRobin takes the endpoints in turn.
	LBRoundRobin LBPolicy = "round_robin"
	// LBLeastRequest sends to the endpoint with fewer requests in flight of
	// two picked at random; clients without it fall back to round robin.
	LBLeastRequest LBPolicy = "least_request"
)

// LBPolicies lists the policies, the default first.
var LBPolicies = []LBPolicy{LBWeightedRoundRobin, LBRoundRobin, LBLeastRequest}

// DefaultLBPolicy is the policy when nothing else is configured.
const DefaultLBPolicy = LBWeightedRoundRobin

// ParseLBPolicy validates a policy name; the error names field.
func ParseLBPolicy(field, v string) (LBPolicy, error) {
	p := LBPolicy(v)
	if !slices.Contains(LBPolicies, p) {
		names := make([]string, len(LBPolicies))
		for i, p := range LBPolicies {
			names[i] = string(p)
		}
		return "", fieldErr(field, v, "want one of %s", strings.Join(names, ", "))
	}
	return p, nil
}

// LoadBalancing chooses the policy per task type: Tasks, else Default, else
// the server's own default (its --lb-policy flag).
type LoadBalancing struct {
	Default LBPolicy            `json:"default,omitempty"`
	Tasks   map[string]LBPolicy `json:"tasks,omitempty"`
}

func (lb *LoadBalancing) validate() error {
	if lb == nil {
		return nil
	}
	var errs []error
	if lb.Default != "" {
		if _, err := ParseLBPolicy("load_balancing.default", string(lb.Default)); err != nil {
			errs = append(errs, err)
		}
	}
	tasks := make([]string, 0, len(lb.Tasks))
	for t := range lb.Tasks {
		tasks = append(tasks, t)
	}
	slices.Sort(tasks)
	for _, t := range tasks {
		field := fmt.Sprintf("load_balancing.tasks[%q]", t)
		if fe := ValidateTask(t); fe != nil {
			errs = append(errs, fmt.Errorf("%s: %s", field, fe.Error()))
		}
		if _, err := ParseLBPolicy(field, string(lb.Tasks[t])); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// LBPolicyOf is the policy for task: the rollout's per-task choice, else its
// default, else fallback.
func (r *Rollout) LBPolicyOf(task string, fallback LBPolicy) LBPolicy {
	if r != nil && r.LoadBalancing != nil {
		if p, ok := r.LoadBalancing.Tasks[task]; ok {
			return p
		}
		if r.LoadBalancing.Default != "" {
			return r.LoadBalancing.Default
		}
	}
	return fallback
}
