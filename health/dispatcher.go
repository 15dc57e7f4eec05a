package health

import (
	"errors"
	"regexp"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/Masterminds/semver/v3"
)

// Node metadata keys a dispatcher (an xDS node) may set.
const (
	NodeMetaVersionConstraint = "version_constraint"
	NodeMetaLabels            = "labels"
	// NodeMetaDatacenter is the Consul datacenter the dispatcher runs in:
	// its executors come first (priority 0), the other datacenters' after.
	NodeMetaDatacenter = "datacenter"
)

// datacenterRE is what Consul accepts as a datacenter name (it lowercases
// the name it is configured with; ?dc= with capitals is an error).
var datacenterRE = regexp.MustCompile(`^[a-z0-9_-]{1,64}$`)

// NormalizeDatacenter is a datacenter name as Consul spells it: trimmed,
// lowercase ("DC2" is dc2).
func NormalizeDatacenter(dc string) string { return strings.ToLower(strings.TrimSpace(dc)) }

// ValidateDatacenter checks a (normalized) datacenter name as Consul would:
// lowercase letters, digits, '-' and '_'; field names it in the error.
func ValidateDatacenter(field, dc string) error {
	if !datacenterRE.MatchString(dc) {
		return &FieldError{Field: field, Value: dc,
			Reason: "a Consul datacenter name: 1 to 64 lowercase letters, digits, '-' or '_'"}
	}
	return nil
}

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
	// Datacenter is where the dispatchers run ("": the datacenter of
	// leasehold's own agent). Part of the key: dispatchers of different
	// datacenters get different priorities, so they never share a snapshot.
	Datacenter string
	// SingleCluster says the dispatchers cannot take a route over weighted
	// clusters (their bootstrap metadata says weighted_clusters: false): a
	// task type is sent to them as one cluster however large it is. Part of
	// the key, as they get other resources.
	SingleCluster bool

	constraint *semver.Constraints
	base       string   // key of the constraints alone: what rollout scopes name
	key        string   // base plus the datacenter and the grant
	labelKeys  []string // sorted keys of Labels
}

// ParseConstraint reads a semver constraint (a dispatcher's or a cordon's).
// Its error says what to write: the library's own ("improper constraint:
// foo") only repeats the value the caller shows already.
func ParseConstraint(s string) (*semver.Constraints, error) {
	c, err := semver.NewConstraint(s)
	if err != nil {
		return nil, errors.New(`not a version constraint: write comparisons with a semver ` +
			`version, such as "<2.0.0", ">=1.4.0, <1.5.0" or "=1.4.2"`)
	}
	return c, nil
}

// NewDispatcher validates a constraint set; errors name the node metadata
// field (version_constraint, labels.<key>).
func NewDispatcher(versionConstraint string, labels map[string]string) (Dispatcher, error) {
	d := Dispatcher{VersionConstraint: strings.TrimSpace(versionConstraint)}
	var errs FieldErrors
	if d.VersionConstraint != "" {
		c, err := ParseConstraint(d.VersionConstraint)
		if err != nil {
			errs = append(errs, fieldErr(NodeMetaVersionConstraint, d.VersionConstraint,
				"%v", err))
		}
		d.constraint = c
	}
	if len(labels) > 0 {
		d.Labels = make(map[string]string, len(labels))
	}
	for _, k := range sortedKeys(labels) {
		if k == "" || !metaKeyRE.MatchString(k) || len(MetaLabelPrefix+k) > consulMetaKeyMaxLen {
			errs = append(errs,
				fieldErr(NodeMetaLabels+"."+k, k,
					"label key may contain only letters, digits, '-' and '_' (≤ %d bytes)",
					consulMetaKeyMaxLen-len(MetaLabelPrefix)))
			continue
		}
		if len(labels[k]) > consulMetaValueMaxLen {
			errs = append(errs,
				fieldErr(NodeMetaLabels+"."+k, labels[k], "value longer than %d bytes",
					consulMetaValueMaxLen))
			continue
		}
		d.Labels[k] = labels[k]
	}
	if err := errs.err(); err != nil {
		return Dispatcher{}, err
	}
	d.labelKeys = sortedKeys(d.Labels)
	d.base = d.computeBase()
	d.key = d.base + d.dcKey() + d.grantKey() + d.clustersKey()
	return d, nil
}

// Key identifies the constraint set, its datacenter and its grant: equal
// sets have equal keys, different sets different ones. It is the snapshot
// group id and is shown in logs and explain, so it stays readable:
//
//	v=<constraint>;<label>=<value>...[&dc=<dc>][&tasks=<task>,...][&clusters=one]
//
// with the constraint's normalised spelling, labels sorted by key, and the
// bytes of a field that would delimit it percent-escaped (escapeKeyField):
// label values may hold any byte, yet each '&' starts the datacenter or the
// grant (named by what follows it), each ';' a label, the first '=' after it
// the value, each ',' a task.
func (d Dispatcher) Key() string {
	if d.key == "" {
		// A Dispatcher not built by NewDispatcher.
		return d.computeBase() + d.dcKey() + d.grantKey() + d.clustersKey()
	}
	return d.key
}

// dcKey is the key's datacenter part: "" for none, else "&dc=" and the name.
func (d Dispatcher) dcKey() string {
	if d.Datacenter == "" {
		return ""
	}
	var b strings.Builder
	b.WriteString("&dc=")
	escapeKeyField(&b, d.Datacenter, keyTaskEscapes)
	return b.String()
}

// InDatacenter is d run from datacenter dc ("": leasehold's own).
func (d Dispatcher) InDatacenter(dc string) Dispatcher {
	d.Datacenter = dc
	d.base = d.computeBase()
	d.key = d.base + d.dcKey() + d.grantKey() + d.clustersKey()
	return d
}

// baseKey is the key of the constraints without the grant: a grant narrows
// what a set may see but does not make it another set for rollout scopes.
func (d Dispatcher) baseKey() string {
	if d.key == "" {
		return d.computeBase()
	}
	return d.base
}

// Bytes escaped in each field of a key, besides '%', control bytes and
// invalid UTF-8. A constraint's own '=', '|' and ',' delimit nothing, so
// ">=1.0.0 || >=3.0.0" stays as written.
const (
	keyConstraintEscapes = ";&"
	keyLabelEscapes      = ";=&"
	keyTaskEscapes       = ",&\"" // '"': an empty task is written ""
)

func (d Dispatcher) computeBase() string {
	var b strings.Builder
	b.WriteString("v=")
	if d.constraint != nil {
		escapeKeyField(&b, d.constraint.String(), keyConstraintEscapes) // normalised spelling
	}
	for _, k := range sortedKeys(d.Labels) {
		b.WriteByte(';')
		escapeKeyField(&b, k, keyLabelEscapes)
		b.WriteByte('=')
		escapeKeyField(&b, d.Labels[k], keyLabelEscapes)
	}
	return b.String()
}

// grantKey is the key's grant part: "" for no grant (every task), else
// "&tasks=" and the sorted tasks; an empty task name is written "", so the
// grants {} and {""} differ.
func (d Dispatcher) grantKey() string {
	if d.Tasks == nil {
		return ""
	}
	var b strings.Builder
	b.WriteString("&tasks=")
	for i, t := range d.Tasks {
		if i > 0 {
			b.WriteByte(',')
		}
		if t == "" {
			b.WriteString(`""`)
		}
		escapeKeyField(&b, t, keyTaskEscapes)
	}
	return b.String()
}

// escapeKeyField writes s with '%', the bytes in delims, bytes that are not
// UTF-8 and characters that do not print (controls, line separators) as %XX
// per byte: injective, and the result holds none of delims and prints on one
// line. Other text (the common case) stays as is.
func escapeKeyField(b *strings.Builder, s, delims string) {
	const hex = "0123456789ABCDEF"
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if (r == utf8.RuneError && n == 1) || !unicode.IsGraphic(r) || r == '%' ||
			(r < utf8.RuneSelf && strings.IndexByte(delims, byte(r)) >= 0) {
			for _, c := range []byte(s[i : i+n]) {
				b.WriteByte('%')
				b.WriteByte(hex[c>>4])
				b.WriteByte(hex[c&0xf])
			}
		} else {
			b.WriteString(s[i : i+n])
		}
		i += n
	}
}

// InSingleCluster is d for dispatchers that cannot take weighted clusters.
func (d Dispatcher) InSingleCluster() Dispatcher {
	d.SingleCluster = true
	d.base = d.computeBase()
	d.key = d.base + d.dcKey() + d.grantKey() + d.clustersKey()
	return d
}

// clustersKey is the key's part for SingleCluster: "" or "&clusters=one".
func (d Dispatcher) clustersKey() string {
	if d.SingleCluster {
		return "&clusters=one"
	}
	return ""
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
	d.base = d.computeBase()
	d.key = d.base + d.dcKey() + d.grantKey() + d.clustersKey()
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

// versionOK reports whether r's version satisfies the constraint.
func (d Dispatcher) versionOK(r *Registration) bool {
	if d.constraint == nil {
		return true
	}
	v := r.SemVer()
	return v != nil && d.constraint.Check(v)
}

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
