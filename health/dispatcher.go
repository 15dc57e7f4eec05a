package health

import (
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/Masterminds/semver/v3"
)

// Node metadata keys a dispatcher (an xDS node) may set.
const (
	NodeMetaVersionConstraint = "version_constraint"
	NodeMetaLabels            = "labels"
)

// Dispatcher is the constraint set of one or more dispatchers: which
// executors they may send new work to. Dispatchers with equal constraint sets
// share one snapshot; Key identifies the set.
type Dispatcher struct {
	VersionConstraint string            // semver constraint, e.g. ">=1.4.0, <2.0.0"; empty: any
	Labels            map[string]string // selector: every pair must equal an executor label
	// Tasks, when not nil, are the only task types these dispatchers may
	// see: granted by leasehold's authorization policy (WithTasks), never
	// by a dispatcher's own metadata.
	Tasks []string

	constraint *semver.Constraints
	key        string
	labelKeys  []string // sorted keys of Labels
}

// NewDispatcher validates a constraint set; errors name the node metadata
// field (version_constraint, labels.<key>).
func NewDispatcher(versionConstraint string, labels map[string]string) (Dispatcher, error) {
	d := Dispatcher{VersionConstraint: strings.TrimSpace(versionConstraint)}
	var errs FieldErrors
	if d.VersionConstraint != "" {
		c, err := semver.NewConstraint(d.VersionConstraint)
		if err != nil {
			errs = append(errs, fieldErr(NodeMetaVersionConstraint, d.VersionConstraint, "not a semver constraint: %v", err))
		}
		d.constraint = c
	}
	if len(labels) > 0 {
		d.Labels = make(map[string]string, len(labels))
	}
	for _, k := range sortedKeys(labels) {
		if k == "" || !metaKeyRE.MatchString(k) || len(MetaLabelPrefix+k) > consulMetaKeyMaxLen {
			errs = append(errs, fieldErr(NodeMetaLabels+"."+k, k, "label key may contain only letters, digits, '-' and '_' (≤ %d bytes)", consulMetaKeyMaxLen-len(MetaLabelPrefix)))
			continue
		}
		if len(labels[k]) > consulMetaValueMaxLen {
			errs = append(errs, fieldErr(NodeMetaLabels+"."+k, labels[k], "value longer than %d bytes", consulMetaValueMaxLen))
			continue
		}
		d.Labels[k] = labels[k]
	}
	if err := errs.err(); err != nil {
		return Dispatcher{}, err
	}
	d.labelKeys = sortedKeys(d.Labels)
	d.key = d.computeKey()
	return d, nil
}

// Key identifies the constraint set: equal sets have equal keys.
func (d Dispatcher) Key() string {
	if d.key == "" {
		return d.computeKey() // a zero Dispatcher: the unconstrained set
	}
	return d.key
}

func (d Dispatcher) computeKey() string {
	var b strings.Builder
	b.WriteString("v=")
	if d.constraint != nil {
		b.WriteString(d.constraint.String()) // normalised spelling
	}
	for _, k := range sortedKeys(d.Labels) {
		b.WriteString(";")
		b.WriteString(k)
		b.WriteString("=")
		b.WriteString(d.Labels[k])
	}
	if d.Tasks != nil {
		b.WriteString("|tasks=") // '|' is in no label key
		b.WriteString(strings.Join(d.Tasks, ","))
	}
	return b.String()
}

// WithTasks is d restricted to the given task types (nil: all).
func (d Dispatcher) WithTasks(tasks []string) Dispatcher {
	if tasks == nil {
		d.Tasks = nil
	} else {
		d.Tasks = slices.Compact(slices.Sorted(slices.Values(tasks)))
		if d.Tasks == nil {
			d.Tasks = []string{}
		}
	}
	d.key = d.computeKey()
	return d
}

// AllowsTask reports whether these dispatchers may see task.
func (d Dispatcher) AllowsTask(task string) bool {
	if d.Tasks == nil {
		return true
	}
	_, found := slices.BinarySearch(d.Tasks, task)
	return found
}

// versionOK reports whether version satisfies the constraint.
func (d Dispatcher) versionOK(version string) bool {
	if d.constraint == nil {
		return true
	}
	v := parsedVersion(version)
	return v != nil && d.constraint.Check(v)
}

// parsedVersion parses a strict semantic version once per distinct string:
// a fleet has few versions, and every decision needs one. Invalid versions
// are not cached (they are excluded as bad metadata anyway), and the cache
// stops growing at maxCachedVersions.
func parsedVersion(s string) *semver.Version {
	if v, ok := versionCache.Load(s); ok {
		return v.(*semver.Version)
	}
	v, err := semver.StrictNewVersion(s)
	if err != nil {
		return nil
	}
	if versionCached.Add(1) <= maxCachedVersions {
		versionCache.Store(s, v)
	}
	return v
}

const maxCachedVersions = 10_000

var (
	versionCache  sync.Map // string → *semver.Version
	versionCached atomic.Int64
)

// labelsOK reports whether every selector pair is among labels.
func (d Dispatcher) labelsOK(labels map[string]string) (bool, string) {
	keys := d.labelKeys
	if keys == nil && len(d.Labels) > 0 { // a Dispatcher not built by NewDispatcher
		keys = sortedKeys(d.Labels)
	}
	for _, k := range keys {
		if v, ok := labels[k]; !ok || v != d.Labels[k] {
			return false, k
		}
	}
	return true, ""
}
