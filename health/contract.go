// Package health holds leasehold's domain: the executor registration contract
// (contract.go), what the watches observe and how a registration joins its
// checks (observation.go), the lease rules (lease.go), fencing by generation
// (generation.go, eligibility.go), eligibility for a dispatcher's constraint
// set (dispatcher.go, eligibility.go, address.go), the fencing API's answers
// (session.go), the operators' rollout rules and cordons (rollout.go,
// lbpolicy.go, cordon.go) and the lapse marks (lapse.go). It is pure: no I/O,
// and time is passed in.
package health

import (
	"fmt"
	"net"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/Masterminds/semver/v3"
)

// The registration contract: how an executor appears in Consul.
// docs/contract.md documents the same for executors written in any language.
const (
	// DefaultTag marks a Consul service as a leasehold task type.
	DefaultTag = "leasehold"

	MetaInstanceID = "instance_id"
	MetaSessionID  = "session_id"
	MetaVersion    = "version"
	MetaCapacity   = "capacity"
	MetaState      = "state"
	// MetaReplaces (optional) names the sessions of the same instance that
	// this one replaced, newest first, comma-separated: a leasehold that never
	// saw them (restarted, a new replica) still answers them STALE.
	MetaReplaces = "replaces"
	// MetaGeneration orders the sessions of one instance: strictly increasing,
	// taken with a check-and-set on GenerationKey at session start, so
	// "newest session" never depends on wall clocks or catalog indexes.
	MetaGeneration = "generation"
	// MetaLeaseTTL (optional) is the session's lease, a Go duration such as
	// "10s": Consul's catalog does not return a TTL check's TTL, and the
	// fencing API vouches for a session only while its view of Consul is
	// younger than the lease (a lapse may go unseen for longer).
	MetaLeaseTTL = "lease_ttl"
	// MetaLabelPrefix prefixes each label key: label "zone=eu" is meta "label_zone".
	MetaLabelPrefix = "label_"

	// CheckIDPrefix starts every lease check id: lease:<instance>:<session>:<task>.
	CheckIDPrefix = "lease"

	// GenerationKeyPrefix + instance_id is the Consul KV key holding the last
	// generation issued to the instance.
	GenerationKeyPrefix = "leasehold/generation/"
)

// Consul's own limits on service meta (agent/structs), so a registration that
// passes Validate is never refused by the agent.
const (
	consulMetaMaxPairs     = 64
	consulMetaKeyMaxLen    = 128
	consulMetaValueMaxLen  = 512
	consulMetaReservedPref = "consul-"

	maxIDLen    = 128
	maxTaskLen  = 63 // one DNS label, so the task resolves in Consul DNS too
	maxCapacity = 1_000_000
)

var (
	metaKeyRE = regexp.MustCompile(`^[a-zA-Z0-9_-]+$`)
	idRE      = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)
	taskRE    = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?$`)
)

// State is the executor's own view of whether it takes new work.
type State string

const (
	StateActive   State = "active"
	StateDraining State = "draining"
)

// Registration is one executor instance serving one task type, as registered in
// Consul: service name = Task, meta = everything else.
type Registration struct {
	InstanceID string
	SessionID  string
	Generation uint64 // order of the sessions of InstanceID: newest is highest
	Task       string
	Address    string
	Port       int
	Version    string
	Capacity   int
	State      State
	Labels     map[string]string
	// Replaces lists older sessions of InstanceID that this session
	// replaced, newest first (at most MaxReplaces; may be empty).
	Replaces []string
	// LeaseTTL is the session's lease (0: not given; MaxLeaseTTL at most).
	LeaseTTL time.Duration

	semver *semver.Version // Version, as ParseRegistration parsed it (nil: not parsed)
}

// SemVer is the parsed Version (nil when it is not a strict semantic
// version). A registration from ParseRegistration carries it, parsed once
// with the rest (copies share it: it must not be modified); others parse it
// here. Two equal registrations differ under reflect.DeepEqual when only
// one was parsed.
func (r *Registration) SemVer() *semver.Version {
	if r.semver != nil && r.semver.Original() == r.Version {
		return r.semver
	}
	v, err := semver.StrictNewVersion(r.Version)
	if err != nil {
		return nil
	}
	return v
}

// MaxReplaces bounds Registration.Replaces: three of the longest session ids
// fit in one meta value.
const MaxReplaces = 3

// ServiceID is the Consul service id of an (instance, task) registration. It
// does not contain the session, so a restarted process on the same agent
// replaces its predecessor's registration instead of adding a second one.
func ServiceID(instanceID, task string) string {
	return task + ":" + instanceID
}

// CheckID is the id of the TTL lease check of one session of one registration.
// It embeds the session, so a heartbeat from a replaced session names a check
// the agent no longer knows and is refused.
func CheckID(instanceID, sessionID, task string) string {
	return CheckIDPrefix + ":" + instanceID + ":" + sessionID + ":" + task
}

// ParseCheckID splits a lease check id; ok is false for any other check.
func ParseCheckID(id string) (instanceID, sessionID, task string, ok bool) {
	parts := strings.Split(id, ":")
	if len(parts) != 4 || parts[0] != CheckIDPrefix || parts[1] == "" || parts[2] == "" ||
		parts[3] == "" {
		return "", "", "", false
	}
	return parts[1], parts[2], parts[3], true
}

// Validate checks every field against the contract and Consul's limits and
// returns FieldErrors naming each invalid field, or nil.
func (r Registration) Validate() error { return r.validate(fixedMetaKeys) }

// validate is Validate with fixed meta keys besides the labels: what a
// registration read from Consul needs counts replaces and lease_ttl only
// when present (one of 58 labels without them fits Consul's 64 meta pairs
// and is valid).
func (r Registration) validate(fixed int) error {
	var errs FieldErrors
	errs = append(errs, validateID(MetaInstanceID, r.InstanceID)...)
	errs = append(errs, validateID(MetaSessionID, r.SessionID)...)
	if r.Generation == 0 {
		// Zero means no generation was given (a value read from Consul as 0
		// is reported by ParseRegistration as it was written): saying
		// `generation "0"` would send the operator looking for a 0 that is
		// nowhere.
		errs = append(errs,
			fieldErr(MetaGeneration, "",
				"missing: every registration carries its session's generation, a positive "+
					"integer taken from Consul KV %s<instance_id> at session start",
				GenerationKeyPrefix))
	}
	if e := ValidateTask(r.Task); e != nil {
		errs = append(errs, e)
	}
	if e := ValidateHost(r.Address); e != nil {
		errs = append(errs, e)
	}
	if r.Port < 1 || r.Port > 65535 {
		errs = append(errs, fieldErr("port", strconv.Itoa(r.Port), "must be 1..65535"))
	}
	if r.SemVer() == nil || len(r.Version) > consulMetaValueMaxLen {
		errs = append(errs, ValidateVersion(r.Version))
	}
	if r.Capacity < 1 || r.Capacity > maxCapacity {
		errs = append(errs,
			fieldErr(MetaCapacity, strconv.Itoa(r.Capacity), "must be a positive integer ≤ %d",
				maxCapacity))
	}
	if r.State != StateActive && r.State != StateDraining {
		errs = append(errs,
			fieldErr(MetaState, string(r.State), "must be %q or %q", StateActive, StateDraining))
	}
	errs = append(errs, validateLabels(r.Labels, fixed)...)
	errs = append(errs, r.validateReplaces()...)
	if r.LeaseTTL < 0 || r.LeaseTTL > MaxLeaseTTL {
		errs = append(errs,
			fieldErr(MetaLeaseTTL, r.LeaseTTL.String(), "must be a positive duration of at most %s",
				MaxLeaseTTL))
	}
	return errs.err()
}

// MaxLeaseTTL bounds a registration's lease_ttl: a lease longer than a day
// is a mistake (heartbeats would not be missed for a day).
const MaxLeaseTTL = 24 * time.Hour

// splitReplaces splits a replaces meta value; an empty value is one empty id
// (refused by Validate), not "none".
func splitReplaces(v string) []string { return strings.Split(v, ",") }

// ParseReplaces reads the replaces meta of a registration whose session is
// sessionID, for code that reads it outside ParseRegistration.
func ParseReplaces(sessionID, v string) ([]string, error) {
	r := Registration{SessionID: sessionID, Replaces: splitReplaces(v)}
	if errs := r.validateReplaces(); errs != nil {
		return nil, errs.err()
	}
	return r.Replaces, nil
}

func (r Registration) validateReplaces() FieldErrors {
	v := strings.Join(r.Replaces, ",")
	if len(r.Replaces) > MaxReplaces {
		return FieldErrors{fieldErr(MetaReplaces, v, "names %d sessions, at most %d",
			len(r.Replaces), MaxReplaces)}
	}
	for i, s := range r.Replaces {
		if errs := validateID(MetaReplaces, s); errs != nil {
			return errs
		}
		if s == r.SessionID {
			return FieldErrors{fieldErr(MetaReplaces, v, "names the registration's own session %s",
				s)}
		}
		if slices.Contains(r.Replaces[:i], s) {
			return FieldErrors{fieldErr(MetaReplaces, v, "names session %s twice", s)}
		}
	}
	return nil
}

func validateID(field, v string) FieldErrors {
	switch {
	case v == "":
		return FieldErrors{fieldErr(field, v, "must not be empty")}
	case len(v) > maxIDLen:
		return FieldErrors{fieldErr(field, v, "longer than %d bytes", maxIDLen)}
	case !idRE.MatchString(v):
		return FieldErrors{fieldErr(field, v,
			"may contain only letters, digits, '.', '_' and '-', starting with a letter or digit")}
	}
	return nil
}

// MaxGeneration bounds generations (2^53, exact in any JSON number): a larger
// value in a registration or a generation key is garbage, so a key written
// near the top of uint64 can neither overflow the next generation nor fence
// an instance for ever.
const MaxGeneration = 1 << 53

// GenerationKeyValid reports whether g, read from a generation key, counts.
// A key holds the generation its instance's newest session took, so it is
// below MaxGeneration for as long as that session can be newer than it: a
// key at MaxGeneration or above is garbage, and nothing written there can
// keep an instance from taking a generation above it.
func GenerationKeyValid(g uint64) bool { return g > 0 && g < MaxGeneration }

// GenerationKey is the KV key holding the last generation of an instance.
func GenerationKey(instanceID string) string { return GenerationKeyPrefix + instanceID }

// ValidateInstanceID checks an instance id alone (for configuration).
func ValidateInstanceID(v string) error { return validateID(MetaInstanceID, v).err() }

// ValidateTask checks a task type name: it is the Consul service name.
func ValidateTask(v string) *FieldError {
	switch {
	case v == "":
		return fieldErr("task", v, "must not be empty")
	case len(v) > maxTaskLen:
		return fieldErr("task", v, "longer than %d bytes (one DNS label)", maxTaskLen)
	case !taskRE.MatchString(v):
		return fieldErr("task", v, "may contain only letters, digits and '-', not at either end")
	}
	return nil
}

// ValidateHost checks the address dispatchers dial: an IP or a DNS name, not
// an unspecified address such as 0.0.0.0.
func ValidateHost(v string) *FieldError {
	if v == "" {
		return fieldErr("address", v, "must not be empty")
	}
	if ip := net.ParseIP(v); ip != nil {
		if ip.IsUnspecified() {
			return fieldErr("address", v,
				"unspecified address cannot be dialled; use the executor's reachable IP")
		}
		return nil
	}
	if len(v) > 253 {
		return fieldErr("address", v, "host name longer than 253 bytes")
	}
	for _, label := range strings.Split(v, ".") {
		if label == "" || len(label) > 63 || !taskRE.MatchString(label) {
			return fieldErr("address", v, "neither an IP address nor a valid host name")
		}
	}
	return nil
}

// ValidateVersion checks a strict semantic version such as 1.4.2 or 2.0.0-rc.1.
func ValidateVersion(v string) *FieldError {
	if v == "" {
		return fieldErr(MetaVersion, v, "must not be empty")
	}
	if len(v) > consulMetaValueMaxLen {
		return fieldErr(MetaVersion, v, "longer than %d bytes", consulMetaValueMaxLen)
	}
	if _, err := semver.StrictNewVersion(v); err != nil {
		return fieldErr(MetaVersion, v, "not a semantic version (MAJOR.MINOR.PATCH): %v", err)
	}
	return nil
}

// validateLabels checks that every label can be stored as Consul meta
// beside fixed other keys.
func validateLabels(labels map[string]string, fixed int) FieldErrors {
	var errs FieldErrors
	if n := len(labels) + fixed; n > consulMetaMaxPairs {
		errs = append(errs,
			fieldErr("labels", strconv.Itoa(len(labels)),
				"at most %d labels fit in Consul's %d meta pairs", consulMetaMaxPairs-fixed,
				consulMetaMaxPairs))
	}
	for _, k := range sortedKeys(labels) {
		key := MetaLabelPrefix + k
		switch {
		case k == "":
			errs = append(errs, fieldErr("labels", "", "label key must not be empty"))
		case !metaKeyRE.MatchString(k):
			errs = append(errs,
				fieldErr(key, k, "label key may contain only letters, digits, '-' and '_'"))
		case len(key) > consulMetaKeyMaxLen:
			errs = append(errs,
				fieldErr(key, k, "meta key longer than %d bytes", consulMetaKeyMaxLen))
		case len(labels[k]) > consulMetaValueMaxLen:
			errs = append(errs,
				fieldErr(key, labels[k], "value longer than %d bytes", consulMetaValueMaxLen))
		}
	}
	return errs
}

// fixedMetaKeys counts the contract's meta keys, the optional replaces and
// lease_ttl included: Validate (what the Registrar and leasehold register
// check) keeps room for them even when absent; a registration read from
// Consul counts them only when present. They are instance_id, session_id,
// generation, version, capacity, state, replaces and lease_ttl.
const fixedMetaKeys = 8

// optionalMetaKeys are the fixed keys a registration may leave out.
var optionalMetaKeys = []string{MetaReplaces, MetaLeaseTTL}

// Meta encodes the registration as Consul service meta.
func (r Registration) Meta() map[string]string {
	m := make(map[string]string, fixedMetaKeys+len(r.Labels))
	m[MetaInstanceID] = r.InstanceID
	m[MetaSessionID] = r.SessionID
	m[MetaGeneration] = strconv.FormatUint(r.Generation, 10)
	m[MetaVersion] = r.Version
	m[MetaCapacity] = strconv.Itoa(r.Capacity)
	m[MetaState] = string(r.State)
	if len(r.Replaces) > 0 {
		m[MetaReplaces] = strings.Join(r.Replaces, ",")
	}
	if r.LeaseTTL > 0 {
		m[MetaLeaseTTL] = r.LeaseTTL.String()
	}
	for k, v := range r.Labels {
		m[MetaLabelPrefix+k] = v
	}
	return m
}

// ParseRegistration decodes a Consul service (name, address, port, meta) into a
// Registration and validates it. Meta keys outside the contract are ignored, so
// operators may add their own.
func ParseRegistration(task, address string, port int,
	meta map[string]string) (Registration, error) {
	r := Registration{
		InstanceID: meta[MetaInstanceID],
		SessionID:  meta[MetaSessionID],
		Task:       task,
		Address:    address,
		Port:       port,
		Version:    meta[MetaVersion],
		State:      State(meta[MetaState]),
	}
	var errs FieldErrors
	if g, ok := meta[MetaGeneration]; ok {
		n, err := strconv.ParseUint(g, 10, 64)
		if err != nil || n == 0 || n > MaxGeneration {
			errs = append(errs, fieldErr(MetaGeneration, g, "not a positive integer ≤ 2^53"))
			n = 1 // reported once
		}
		r.Generation = n
	}
	if v, ok := meta[MetaReplaces]; ok {
		r.Replaces = splitReplaces(v)
	}
	if v, ok := meta[MetaLeaseTTL]; ok {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 || d > MaxLeaseTTL {
			errs = append(errs,
				fieldErr(MetaLeaseTTL, v, "not a positive Go duration of at most %s (e.g. 35s)",
					MaxLeaseTTL))
		} else {
			r.LeaseTTL = d
		}
	}
	if v, err := semver.StrictNewVersion(r.Version); err == nil {
		r.semver = v // parsed once: every decision needs it
	}
	if c, ok := meta[MetaCapacity]; ok {
		n, err := strconv.Atoi(c)
		if err != nil {
			errs = append(errs, fieldErr(MetaCapacity, c, "not an integer"))
			n = 1 // keep Validate from reporting the field twice
		}
		r.Capacity = n
	}
	for k, v := range meta {
		if lk, ok := strings.CutPrefix(k, MetaLabelPrefix); ok {
			if r.Labels == nil {
				r.Labels = make(map[string]string)
			}
			r.Labels[lk] = v
		}
	}
	fixed := fixedMetaKeys // the optional keys count only when present
	for _, k := range optionalMetaKeys {
		if _, ok := meta[k]; !ok {
			fixed--
		}
	}
	if err := r.validate(fixed); err != nil {
		var more FieldErrors
		if ok := asFieldErrors(err, &more); ok {
			errs = append(errs, more...)
		}
	}
	sort.SliceStable(errs, func(i, j int) bool { return errs[i].Field < errs[j].Field })
	return r, errs.err()
}

func asFieldErrors(err error, out *FieldErrors) bool {
	fe, ok := err.(FieldErrors)
	if ok {
		*out = fe
	}
	return ok
}

func sortedKeys(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// String is for logs.
func (r Registration) String() string {
	return fmt.Sprintf("%s/%s@%s:%d session=%s v%s", r.Task, r.InstanceID, r.Address, r.Port,
		r.SessionID, r.Version)
}

// ValidateTag checks the Consul tag that marks task types.
func ValidateTag(v string) *FieldError {
	if v == "" || len(v) > 255 || strings.ContainsAny(v, " \t\n/") {
		return fieldErr("tag", v, "must be a non-empty tag without spaces or '/'")
	}
	return nil
}
