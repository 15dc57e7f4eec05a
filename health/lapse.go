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
//	leasehold/lapsed/<instance_id>/<session_id> = {"generation": …, "at": …, "tasks": […]}
//
// Ids are validated ids (letters, digits, '.', '_', '-'; never '/'), so the
// key splits unambiguously.
const LapseMarkPrefix = "leasehold/lapsed/"

// LapseMark is one recorded lapse.
type LapseMark struct {
	InstanceID string    `json:"-"`
	SessionID  string    `json:"-"`
	Generation uint64    `json:"generation"`
	At         time.Time `json:"at"`
	Tasks      []string  `json:"tasks,omitempty"`
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
		return LapseMark{}, fmt.Errorf("lapse mark %q: want %s<instance_id>/<session_id>", key, LapseMarkPrefix)
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

// Value is the mark's KV value.
func (m LapseMark) Value() []byte {
	b, _ := json.Marshal(m)
	return b
}
