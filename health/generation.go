package health

import (
	"fmt"
	"strconv"
	"strings"
)

// The generation key (GenerationKeyPrefix + instance_id) is the authority on
// which session of an instance is newest. Consul's ACLs restrict service
// names, not service ids or meta, so any token that may register the task
// type may register any instance id with any generation; only the key can
// be restricted to the instance itself (a per-instance key rule). A session
// starts by taking the key with a check-and-set, then registers, so the
// key names the newest session before any registration of it exists.

// GenerationRecord is what an instance's generation key holds: the
// generation its newest session took and, in the current form
// "<generation>/<session_id>", that session's id. The bare form
// "<generation>" (written before the key named the session) leaves
// SessionID empty: it orders generations but cannot tell a forged session at
// its own generation from the real one. The zero value is "no key".
type GenerationRecord struct {
	Generation uint64
	SessionID  string // "" in the bare form
	// ModifyIndex is the Consul index at which the key was last written
	// (0 when not known): of two reads of one key, the higher is newer.
	ModifyIndex uint64
	// Datacenter is the datacenter whose KV holds the key ("" when not
	// known, or with one unnamed datacenter): a session registers where it
	// took its key (one agent does both), so the session the key names is
	// its registration there — indexes of two datacenters are unrelated and
	// order nothing between them.
	Datacenter string
}

// Present reports whether the record is a key (not "no key").
func (k GenerationRecord) Present() bool { return k.Generation > 0 }

// Value is the key's value in Consul KV.
func (k GenerationRecord) Value() string {
	if k.SessionID == "" {
		return strconv.FormatUint(k.Generation, 10)
	}
	return strconv.FormatUint(k.Generation, 10) + "/" + k.SessionID
}

// ParseGenerationRecord reads a generation key's value: "<generation>/<session_id>"
// or the bare "<generation>". The generation must be a positive integer below
// MaxGeneration (GenerationKeyValid) and the session a valid session id.
func ParseGenerationRecord(v string) (GenerationRecord, error) {
	gs, sess, named := strings.Cut(v, "/")
	g, err := strconv.ParseUint(gs, 10, 64)
	if err != nil || !GenerationKeyValid(g) {
		return GenerationRecord{}, fieldErr("generation key", v,
			"want <generation>/<session_id> (or a bare <generation>) with a positive integer "+
				"generation below 2^53")
	}
	if !named {
		return GenerationRecord{Generation: g}, nil
	}
	if errs := validateID(MetaSessionID, sess); errs != nil {
		return GenerationRecord{}, fieldErr("generation key", v,
			"the session after '/' is invalid: %s", errs[0].Reason)
	}
	return GenerationRecord{Generation: g, SessionID: sess}, nil
}

// Standing is how an instance's generation key judges one registration.
type Standing uint8

const (
	// KeyConfirms means the registration is the key's (generation, session), or
	// at the key's generation when the key does not name its session, or
	// the instance has no key (unprotected: ordered among registrations).
	KeyConfirms Standing = iota
	// KeyIsNewer means the registration's generation is below the key's: an
	// older session, fenced by the newer one the key names.
	KeyIsNewer
	// KeyDenies means the registration claims what the key does not hold: a
	// generation above the key's, the key's generation under another
	// session, or the key's session under another generation (a session has
	// one generation: a copy of its id, which anyone may read in the
	// catalog, is not the session, nor an older one of it). No session
	// start writes the key after registering, so such a registration is
	// unconfirmed: never routed, it fences nothing, its replaces are
	// ignored and its lease is not the session's.
	KeyDenies
)

// Judge is the key's standing on a registration of (generation, session).
func (k GenerationRecord) Judge(generation uint64, sessionID string) Standing {
	switch {
	case !k.Present():
		return KeyConfirms
	case k.SessionID != "" && k.SessionID == sessionID && generation != k.Generation:
		return KeyDenies
	case generation < k.Generation:
		return KeyIsNewer
	case generation > k.Generation:
		return KeyDenies
	case k.SessionID != "" && k.SessionID != sessionID:
		return KeyDenies
	}
	return KeyConfirms
}

// denial explains why the key of instance inst does not confirm a
// registration (Judge answered KeyDenies).
func (k GenerationRecord) denial(inst string, generation uint64, sessionID string) string {
	if sessionID == k.SessionID {
		return fmt.Sprintf("session %s has generation %d in its generation key (%s = %q), not "+
			"%d: a registration of its id under another generation is not the session",
			sessionID, k.Generation, GenerationKey(inst), k.Value(), generation)
	}
	if generation > k.Generation {
		return fmt.Sprintf("generation %d of session %s is above its generation key (%s = %q): "+
			"only a session that took the key is trusted, and a session start writes it before "+
			"registering",
			generation, sessionID, GenerationKey(inst), k.Value())
	}
	return fmt.Sprintf("generation %d belongs to session %s in its generation key (%s = %q), not "+
		"to session %s",
		generation, k.SessionID, GenerationKey(inst), k.Value(), sessionID)
}
