package health

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"
)

// A lapse is final: once a session's lease was seen lapsed (or its node
// failed), the session is never routed again, even if its check turns
// passing. Consul keeps no history of a check, so leasehold records each
// lapse it sees in Consul KV, and every replica — also one started later,
// or the same one after a restart — reads them back:
//
//	leasehold/lapsed/<instance_id>/<session_id> =
//		{"generation": …, "at": …, "tasks": […], "unregistered_s": …}
//
// Ids are validated ids (letters, digits, '.', '_', '-'; never '/'), so the
// key splits unambiguously. A mark is removed only once its session has had
// no registration in the catalog for the retention: "unregistered_s" is how
// long the pruners have seen it without one so far (absent: not yet, as in
// marks written before it existed).
const LapseMarkPrefix = "leasehold/lapsed/"

// LapseMark is one recorded lapse.
type LapseMark struct {
	InstanceID string    `json:"-"`
	SessionID  string    `json:"-"`
	Generation uint64    `json:"generation"`
	At         time.Time `json:"at"`
	Tasks      []string  `json:"tasks,omitempty"`
	// UnregisteredSeconds is how long, in whole seconds, the session has
	// been seen with no registration in the catalog since it last had one:
	// durations the pruners measured themselves, so it does not depend on
	// their wall clocks agreeing (nor with the one that stamped At).
	UnregisteredSeconds int64 `json:"unregistered_s,omitempty"`
}

// LapseMarks is every lapse recorded in one datacenter's KV at Index.
type LapseMarks struct {
	Index uint64
	Marks []LapseMark
}

// LapseMarkKey is the KV key of a session's lapse mark.
func LapseMarkKey(instanceID, sessionID string) string {
	return LapseMarkPrefix + instanceID + "/" + sessionID
}

// ParseLapseMark reads a lapse mark from its key and value: the key is what
// counts (an unreadable value is ignored); a key that is not a mark's is an
// error naming what is wrong, and its readers ignore it.
func ParseLapseMark(key string, value []byte) (LapseMark, error) {
	rest, ok := strings.CutPrefix(key, LapseMarkPrefix)
	inst, sess, ok2 := strings.Cut(rest, "/")
	if !ok || !ok2 {
		return LapseMark{}, fmt.Errorf("lapse mark %q: want %s<instance_id>/<session_id>", key,
			LapseMarkPrefix)
	}
	if err := ValidateSessionQuery(inst, sess); err != nil {
		return LapseMark{}, fmt.Errorf("lapse mark %q: %w", key, err)
	}
	var m LapseMark
	if json.Unmarshal(value, &m) != nil {
		m = LapseMark{} // the key says it lapsed; the value only says more
	}
	m.InstanceID, m.SessionID = inst, sess
	return m, nil
}

// Unregistered is UnregisteredSeconds as a duration (zero when negative:
// nothing is known then).
func (m LapseMark) Unregistered() time.Duration {
	return time.Duration(max(m.UnregisteredSeconds, 0)) * time.Second
}

// LapseMarkReadable reports whether value is a lapse mark's value leasehold
// can read and rewrite: a JSON object. Other values still mark the lapse
// (ParseLapseMark), but nothing is known of them, so they are kept as they
// are.
func LapseMarkReadable(value []byte) bool {
	var obj map[string]json.RawMessage
	return json.Unmarshal(value, &obj) == nil && obj != nil
}

// WithUnregistered is a mark's value with its unregistered time set to d
// (whole seconds, rounded down; zero or less removes it) and everything
// else as it was, fields this version does not know included (a newer
// replica's). It is an error when value is no JSON object
// (LapseMarkReadable).
func WithUnregistered(value []byte, d time.Duration) ([]byte, error) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(value, &obj); err != nil || obj == nil {
		return nil, fmt.Errorf("lapse mark value %q: not a JSON object", value)
	}
	if s := int64(d / time.Second); s > 0 {
		obj["unregistered_s"] = json.RawMessage(fmt.Sprint(s))
	} else {
		delete(obj, "unregistered_s")
	}
	return json.Marshal(obj)
}

// Value is the mark's KV value.
func (m LapseMark) Value() []byte {
	b, _ := json.Marshal(m)
	return b
}
