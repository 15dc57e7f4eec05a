package health

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"
)

// The dispatch policy: how dispatchers call a task type's executors, set by
// leasehold and kept by the dispatchers' own xDS clients — retries (RDS
// retry_policy, gRFC A44), a deadline (RDS max_stream_duration, gRFC A31), a
// limit on calls in flight (CDS circuit_breakers, gRFC A32) and the ejection
// of executors that keep failing (CDS outlier_detection, gRFC A50).
//
// The rules document's `dispatch` section holds a default and per-task
// policies. A task's policy is merged over the default field by field
// (nested objects too: a task setting only retry.num_retries keeps the
// default's retry.on and backoff; a list, retry.on, is replaced whole), and
// the default over DefaultDispatch. A task cannot clear a deadline or
// max_requests the default sets, only set its own; it turns retries off with
// retry.num_retries 0 and ejection with outlier.enabled false.

// DispatchRules is the rules document's dispatch section.
type DispatchRules struct {
	Default *DispatchPolicy            `json:"default,omitempty"`
	Tasks   map[string]*DispatchPolicy `json:"tasks,omitempty"`
}

// DispatchPolicy is one policy as written: every field optional (unset:
// inherited).
type DispatchPolicy struct {
	Retry *RetrySpec `json:"retry,omitempty"`
	// MaxRequests caps the calls one dispatcher has in flight to the task
	// (its queue's length; CDS circuit_breakers max_requests).
	MaxRequests *int `json:"max_requests,omitempty"`
	// Deadline is the longest a call may run (a Go duration).
	Deadline string       `json:"deadline,omitempty"`
	Outlier  *OutlierSpec `json:"outlier,omitempty"`
}

// RetrySpec is a policy's retries as written.
type RetrySpec struct {
	// On lists the gRPC status codes retried, upper-case
	// (UNAVAILABLE, RESOURCE_EXHAUSTED): only codes that mean "not
	// executed".
	On         []string     `json:"on,omitempty"`
	NumRetries *int         `json:"num_retries,omitempty"`
	Backoff    *BackoffSpec `json:"backoff,omitempty"`
}

// BackoffSpec is the backoff between attempts as written (Go durations):
// each wait is random up to base·2^n, capped at max.
type BackoffSpec struct {
	Base string `json:"base,omitempty"`
	Max  string `json:"max,omitempty"`
}

// OutlierSpec is a policy's outlier ejection as written.
type OutlierSpec struct {
	// Enabled is true when unset: an outlier section turns ejection on.
	Enabled           *bool                  `json:"enabled,omitempty"`
	FailurePercentage *FailurePercentageSpec `json:"failure_percentage,omitempty"`
	// ConsecutiveFailures ejects an executor after this many failures in a
	// row. Envoy applies it (consecutive_5xx); gRPC clients do not implement
	// it (gRFC A50 has failure percentage and success rate only), so for
	// them failure_percentage is what ejects.
	ConsecutiveFailures *int   `json:"consecutive_failures,omitempty"`
	Interval            string `json:"interval,omitempty"`
	BaseEjectionTime    string `json:"base_ejection_time,omitempty"`
	// MaxEjectionPercent is the largest share (1..100 %) of a task's
	// executors that may be ejected at once.
	MaxEjectionPercent *int `json:"max_ejection_percent,omitempty"`
}

// FailurePercentageSpec ejects, every interval, an executor whose failed
// calls exceed Threshold % of RequestVolume or more calls, when at least
// MinimumHosts executors had that many calls.
type FailurePercentageSpec struct {
	Threshold     *int `json:"threshold,omitempty"`
	MinimumHosts  *int `json:"minimum_hosts,omitempty"`
	RequestVolume *int `json:"request_volume,omitempty"`
}

// TaskDispatch is the policy in force for one task type: the merge resolved,
// every value set.
type TaskDispatch struct {
	// RetryOn are the codes retried, upper-case, in RetryableCodes order.
	RetryOn []string `json:"retry_on"`
	// NumRetries is how many times a call is retried (0: never).
	NumRetries  int           `json:"num_retries"`
	BackoffBase time.Duration `json:"-"`
	BackoffMax  time.Duration `json:"-"`
	// MaxRequests is the calls in flight per dispatcher (0: not set, the
	// clients' own default of 1024 applies).
	MaxRequests int           `json:"max_requests,omitempty"`
	Deadline    time.Duration `json:"-"`                 // 0: none
	Outlier     *Ejection     `json:"outlier,omitempty"` // nil: no ejection
}

// Ejection is outlier ejection in force.
type Ejection struct {
	FailurePercentage   int           `json:"failure_percentage"`
	MinimumHosts        int           `json:"minimum_hosts"`
	RequestVolume       int           `json:"request_volume"`
	ConsecutiveFailures int           `json:"consecutive_failures,omitempty"` // 0: off (Envoy only)
	Interval            time.Duration `json:"-"`
	BaseEjectionTime    time.Duration `json:"-"`
	MaxEjectionPercent  int           `json:"max_ejection_percent"`
}

// RetryableCodes are the codes a policy may retry: the executor contract
// says an executor answers them only for work it did not start.
var RetryableCodes = []string{"UNAVAILABLE", "RESOURCE_EXHAUSTED"}

// neverRetried says why a code is never retried: the call may have run.
var neverRetried = map[string]string{
	"DEADLINE_EXCEEDED": "the deadline may have run out while the executor ran the task",
	"ABORTED":           "the executor may have started the task and given it up part way",
	"UNKNOWN":           "nothing says the executor did not start the task",
	"INTERNAL":          "the executor may have failed while running the task",
	"CANCELLED":         "the caller gave the call up, possibly after the executor started it",
}

// grpcCodes are the other gRPC status names: valid, but no xDS client
// retries on them (retry_on knows cancelled, deadline-exceeded, internal,
// resource-exhausted and unavailable only).
var grpcCodes = []string{"OK", "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS",
	"PERMISSION_DENIED", "FAILED_PRECONDITION", "OUT_OF_RANGE", "UNIMPLEMENTED", "DATA_LOSS",
	"UNAUTHENTICATED"}

// Bounds of a policy. MaxNumRetries: gRPC clients make at most 5 attempts
// (gRFC A44: num_retries+1, clamped to 5; C-core and Java clamp, a
// grpc-go dial option lowers it), Envoy as many as configured, so more than
// 4 retries would mean different things to different dispatchers.
const (
	MaxNumRetries  = 4
	MaxBackoff     = time.Minute
	MaxDeadline    = 24 * time.Hour
	MaxMaxRequests = 1 << 20
	maxOutlierTime = time.Hour
	// maxBaseEjection is Envoy's max_ejection_time when unset (leasehold
	// leaves it unset): Envoy refuses a cluster whose base_ejection_time is
	// above it.
	maxBaseEjection = 5 * time.Minute
	maxConsecutive  = 1000
	maxHosts        = 10000
	maxVolume       = 1 << 20
)

// DefaultDispatch is the policy when nothing is configured: retries only on
// the codes that mean "not executed", twice, after 25 ms and up to 250 ms
// (the clients' own default backoff; three attempts in all stay within
// every client's cap), no limit on calls in flight beyond the clients' own,
// no deadline (leasehold cannot know how long a task takes) and no ejection
// (a fleet whose every executor is busy answers RESOURCE_EXHAUSTED, which
// counts as a failure: ejecting on it must be chosen for the task).
func DefaultDispatch() TaskDispatch {
	return TaskDispatch{RetryOn: slices.Clone(RetryableCodes), NumRetries: 2,
		BackoffBase: 25 * time.Millisecond, BackoffMax: 250 * time.Millisecond}
}

// defaultEjection is ejection turned on without details: the clients' own
// defaults (gRFC A50, Envoy), written out so that every client applies the
// same numbers.
func defaultEjection() Ejection {
	return Ejection{FailurePercentage: 85, MinimumHosts: 5, RequestVolume: 50,
		Interval: 10 * time.Second, BaseEjectionTime: 30 * time.Second, MaxEjectionPercent: 10}
}

// Key names everything the policy emits, for content-version memos: equal
// policies have equal keys.
func (p TaskDispatch) Key() string {
	k := fmt.Sprintf("%s/%d/%d/%d/%d/%d", strings.Join(p.RetryOn, ","), p.NumRetries,
		p.BackoffBase, p.BackoffMax, p.MaxRequests, p.Deadline)
	if o := p.Outlier; o != nil {
		k += fmt.Sprintf("/%d/%d/%d/%d/%d/%d/%d", o.FailurePercentage, o.MinimumHosts,
			o.RequestVolume, o.ConsecutiveFailures, o.Interval, o.BaseEjectionTime,
			o.MaxEjectionPercent)
	}
	return k
}

// String is the policy as explain shows it.
func (p TaskDispatch) String() string {
	var parts []string
	if p.NumRetries == 0 {
		parts = append(parts, "no retries")
	} else {
		parts = append(parts, fmt.Sprintf("retry %s up to %d× (backoff %s..%s)",
			strings.Join(p.RetryOn, ","), p.NumRetries, p.BackoffBase, p.BackoffMax))
	}
	if p.MaxRequests > 0 {
		parts = append(parts, fmt.Sprintf("max_requests %d", p.MaxRequests))
	}
	if p.Deadline > 0 {
		parts = append(parts, "deadline "+p.Deadline.String())
	}
	if o := p.Outlier; o != nil {
		s := fmt.Sprintf("eject over %d%% failed of >=%d calls (>=%d executors) every %s for %s, "+
			"at most %d%%", o.FailurePercentage, o.RequestVolume, o.MinimumHosts, o.Interval,
			o.BaseEjectionTime, o.MaxEjectionPercent)
		if o.ConsecutiveFailures > 0 {
			s += fmt.Sprintf(", or after %d in a row (Envoy)", o.ConsecutiveFailures)
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, "; ")
}

// DispatchOf is the dispatch policy in force for task.
func (r *Rollout) DispatchOf(task string) TaskDispatch {
	if r == nil || r.Dispatch == nil {
		return DefaultDispatch()
	}
	res := r.dispatch
	if res == nil { // not parsed (built in code): resolved each time, the rules stay unwritten
		var err error
		if res, err = r.Dispatch.resolve(); err != nil {
			return DefaultDispatch()
		}
	}
	if p, ok := res.tasks[task]; ok {
		return p
	}
	return res.def
}

// resolvedDispatch is a dispatch section merged: the default's policy and
// each task's.
type resolvedDispatch struct {
	def   TaskDispatch
	tasks map[string]TaskDispatch
}

func (d *DispatchRules) validate() (*resolvedDispatch, error) {
	if d == nil {
		return nil, nil
	}
	return d.resolve()
}

// resolve validates each policy as written and merged; errors name the
// field as written (dispatch.tasks["work"].retry.on[1]).
func (d *DispatchRules) resolve() (*resolvedDispatch, error) {
	var errs []error
	res := &resolvedDispatch{def: DefaultDispatch(), tasks: map[string]TaskDispatch{}}
	if d.Default != nil {
		p, err := d.Default.mergeOver(DefaultDispatch(), "dispatch.default")
		if err != nil {
			errs = append(errs, err)
		}
		res.def = p
	}
	for _, t := range slices.Sorted(maps.Keys(d.Tasks)) {
		field := fmt.Sprintf("dispatch.tasks[%q]", t)
		if fe := ValidateTask(t); fe != nil {
			errs = append(errs, fmt.Errorf("%s: %s", field, fe.Error()))
			continue
		}
		spec := d.Tasks[t]
		if spec == nil {
			errs = append(errs, fmt.Errorf("%s: null: want a policy object", field))
			continue
		}
		p, err := spec.mergeOver(res.def, field)
		if err != nil {
			errs = append(errs, err)
		}
		res.tasks[t] = p
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return res, nil
}

// mergeOver is p merged over base, validated; at is p's field path.
func (p *DispatchPolicy) mergeOver(base TaskDispatch, at string) (TaskDispatch, error) {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s.%s: %s", at, field, fmt.Sprintf(format, args...)))
	}
	out := base
	out.RetryOn = slices.Clone(base.RetryOn)
	if base.Outlier != nil {
		o := *base.Outlier
		out.Outlier = &o
	}
	if r := p.Retry; r != nil {
		if r.On != nil {
			out.RetryOn = nil
			if len(r.On) == 0 {
				bad("retry.on", "empty: want at least one code (retry.num_retries 0 turns "+
					"retries off)")
			}
			seen := map[string]int{}
			for i, c := range r.On {
				f := fmt.Sprintf("retry.on[%d]", i)
				if j, dup := seen[c]; dup {
					bad(f, "%q repeats retry.on[%d]", c, j)
					continue
				}
				seen[c] = i
				if err := retryable(c); err != nil {
					bad(f, "%v", err)
					continue
				}
				out.RetryOn = append(out.RetryOn, c)
			}
			slices.SortFunc(out.RetryOn, func(a, b string) int {
				return slices.Index(RetryableCodes, a) - slices.Index(RetryableCodes, b)
			})
		}
		if n := r.NumRetries; n != nil {
			switch {
			case *n < 0:
				bad("retry.num_retries", "%d: want 0..%d", *n, MaxNumRetries)
			case *n > MaxNumRetries:
				bad("retry.num_retries", "%d: want 0..%d: gRPC clients make at most 5 attempts "+
					"(gRFC A44) while Envoy makes as many as asked, so more would mean different "+
					"things to different dispatchers", *n, MaxNumRetries)
			default:
				out.NumRetries = *n
			}
		}
		if b := r.Backoff; b != nil {
			baseSet := false
			if b.Base != "" {
				if d, err := parseDur(b.Base, MaxBackoff); err != nil {
					bad("retry.backoff.base", "%v", err)
				} else {
					out.BackoffBase, baseSet = d, true
				}
			}
			if b.Max != "" {
				if d, err := parseDur(b.Max, MaxBackoff); err != nil {
					bad("retry.backoff.max", "%v", err)
				} else {
					out.BackoffMax = d
				}
			} else if baseSet {
				// The clients' own rule for a base without a max: ten times it.
				out.BackoffMax = min(10*out.BackoffBase, max(MaxBackoff, out.BackoffBase))
			}
			if out.BackoffMax < out.BackoffBase {
				field := "retry.backoff.max"
				if b.Max == "" {
					field = "retry.backoff.base"
				}
				bad(field, "backoff max %s is below base %s: clients refuse it", out.BackoffMax,
					out.BackoffBase)
			}
		}
	}
	if n := p.MaxRequests; n != nil {
		if *n < 1 || *n > MaxMaxRequests {
			bad("max_requests", "%d: want 1..%d", *n, MaxMaxRequests)
		} else {
			out.MaxRequests = *n
		}
	}
	if p.Deadline != "" {
		if d, err := parseDur(p.Deadline, MaxDeadline); err != nil {
			bad("deadline", "%v", err)
		} else {
			out.Deadline = d
		}
	}
	if o := p.Outlier; o != nil {
		if o.Enabled != nil && !*o.Enabled {
			// What else is written is still checked: a bad value is refused
			// now, not on the day ejection is turned on.
			e := defaultEjection()
			o.mergeInto(&e, bad)
			out.Outlier = nil
		} else {
			if out.Outlier == nil {
				e := defaultEjection()
				out.Outlier = &e
			}
			o.mergeInto(out.Outlier, bad)
		}
	}
	return out, errors.Join(errs...)
}

func (o *OutlierSpec) mergeInto(e *Ejection, bad func(field, format string, args ...any)) {
	count := func(field string, v *int, lo, hi int, dst *int) {
		if v == nil {
			return
		}
		if *v < lo || *v > hi {
			bad(field, "%d: want %d..%d", *v, lo, hi)
			return
		}
		*dst = *v
	}
	if fp := o.FailurePercentage; fp != nil {
		count("outlier.failure_percentage.threshold", fp.Threshold, 1, 100, &e.FailurePercentage)
		count("outlier.failure_percentage.minimum_hosts", fp.MinimumHosts, 1, maxHosts,
			&e.MinimumHosts)
		count("outlier.failure_percentage.request_volume", fp.RequestVolume, 1, maxVolume,
			&e.RequestVolume)
	}
	count("outlier.consecutive_failures", o.ConsecutiveFailures, 1, maxConsecutive,
		&e.ConsecutiveFailures)
	if v := o.MaxEjectionPercent; v != nil && *v == 0 {
		bad("outlier.max_ejection_percent", "0: want 1..100: gRPC clients would eject no "+
			"executor and Envoy one regardless (outlier.enabled false turns ejection off)")
	} else {
		count("outlier.max_ejection_percent", v, 1, 100, &e.MaxEjectionPercent)
	}
	if o.Interval != "" {
		if d, err := parseDur(o.Interval, maxOutlierTime); err != nil {
			bad("outlier.interval", "%v", err)
		} else {
			e.Interval = d
		}
	}
	if o.BaseEjectionTime != "" {
		if d, err := parseDur(o.BaseEjectionTime, maxBaseEjection); err != nil {
			why := ""
			if d, perr := time.ParseDuration(o.BaseEjectionTime); perr == nil && d > 0 {
				why = ": Envoy refuses a cluster whose base_ejection_time is above its " +
					"max_ejection_time (5m when unset)"
			}
			bad("outlier.base_ejection_time", "%v%s", err, why)
		} else {
			e.BaseEjectionTime = d
		}
	}
}

// retryable says why code may not be retried (nil: it may).
func retryable(code string) error {
	if slices.Contains(RetryableCodes, code) {
		return nil
	}
	up := strings.ToUpper(strings.ReplaceAll(code, "-", "_"))
	if up != code && (slices.Contains(RetryableCodes, up) || neverRetried[up] != "" ||
		slices.Contains(grpcCodes, up)) {
		return fmt.Errorf("%q: write the gRPC status name in upper case, %s", code, up)
	}
	if why, ok := neverRetried[code]; ok {
		return fmt.Errorf("%q is never retried: %s, and a retry would run it twice; only "+
			"codes that mean \"not executed\" may be retried: %s", code, why,
			strings.Join(RetryableCodes, ", "))
	}
	if slices.Contains(grpcCodes, code) {
		return fmt.Errorf("%q: no xDS client retries on it; want one of %s", code,
			strings.Join(RetryableCodes, ", "))
	}
	return fmt.Errorf("%q is not a gRPC status code; want one of %s", code,
		strings.Join(RetryableCodes, ", "))
}

// parseDur reads a Go duration in (0, limit].
func parseDur(v string, limit time.Duration) (time.Duration, error) {
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, fmt.Errorf("%s: want a Go duration (250ms, 30s, 5m)", strconv.Quote(v))
	}
	if d <= 0 || d > limit {
		return 0, fmt.Errorf("%s: want more than 0 and at most %s", strconv.Quote(v), limit)
	}
	return d, nil
}
