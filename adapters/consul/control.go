package consul

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/hashicorp/consul/api"
)

// Consul KV layout of the operators' controls, shared by every replica.
const (
	ControlPrefix = "leasehold/control/"
	RulesKey      = ControlPrefix + "rules"    // the rollout configuration (JSON)
	CordonPrefix  = ControlPrefix + "cordons/" // one cordon (JSON) per key
	// RemovedPrefix holds who removed each cordon (health.CordonRemoval,
	// JSON), written with the removal so every replica's audit log can say.
	RemovedPrefix = ControlPrefix + "removed/"
	AuditPrefix   = "leasehold/audit/" // operator actions, one JSON object per key
)

// ErrControl is returned for operator requests Consul state refuses (e.g.
// a concurrent change, an approval by the author).
var ErrControl = errors.New("control")

// Control is the operators' side: cordons, approvals, rules and the audit
// trail, stored in Consul KV. Every change is one KV transaction with its
// audit record (and the check-and-set the change needs), so a change is
// never without its record nor a record without its change.
//
// Its writes are in controlwrite.go and its reads in controlread.go; serve
// follows the same keys with the control watch (controlwatch.go).
type Control struct {
	c         *api.Client
	retention AuditRetention
	now       func() time.Time
	log       *slog.Logger
	// beforeCommit, when set (tests), sees each transaction just before
	// it is sent.
	beforeCommit func(api.TxnOps)
}

// Audit retention defaults: enough for a long incident review, bounded so
// listing the trail stays cheap.
const (
	DefaultAuditKeep   = 1000
	DefaultAuditMaxAge = 90 * 24 * time.Hour
)

// AuditRetention bounds the audit trail. The operator command that writes a
// record prunes, right after its change commits: leasehold serve never
// writes or deletes audit records.
type AuditRetention struct {
	Keep   int           // the most recent records kept
	MaxAge time.Duration // records older than this are deleted
}

// Validate names the bad field.
func (r AuditRetention) Validate() error {
	if r.Keep < 1 {
		return fmt.Errorf("keep: must be at least 1, got %d", r.Keep)
	}
	if r.MaxAge <= 0 {
		return fmt.Errorf("max age: must be positive, got %s", r.MaxAge)
	}
	return nil
}

// ControlOptions tune NewControl; zero values take the defaults.
type ControlOptions struct {
	Retention AuditRetention   // zero fields: DefaultAuditKeep, DefaultAuditMaxAge
	Now       func() time.Time // the clock of audit records and approvals; nil: time.Now
	Logger    *slog.Logger     // pruning failures; nil: slog.Default()
}

// NewControl uses c (token and TLS from the standard CONSUL_* environment).
func NewControl(c *api.Client, o ControlOptions) (*Control, error) {
	r := o.Retention
	if r.Keep == 0 {
		r.Keep = DefaultAuditKeep
	}
	if r.MaxAge == 0 {
		r.MaxAge = DefaultAuditMaxAge
	}
	if err := r.Validate(); err != nil {
		return nil, fmt.Errorf("audit retention: %w", err)
	}
	k := &Control{c: c, retention: r, now: o.Now, log: o.Logger}
	if k.now == nil {
		k.now = time.Now
	}
	if k.log == nil {
		k.log = slog.Default()
	}
	return k, nil
}

// AuditEntry is one operator action.
type AuditEntry struct {
	ID     string    `json:"id,omitempty"` // its key under AuditPrefix; set when read
	At     time.Time `json:"at"`
	Actor  string    `json:"actor"`
	Action string    `json:"action"` // cordon, uncordon, approve, rules-set, rules-cleared
	Target string    `json:"target,omitempty"`
	Detail string    `json:"detail,omitempty"`
	// Accessor is the acting ACL token's accessor id; "" when Consul could
	// not attribute the action (ACLs off: Actor is only what --by said).
	Accessor string `json:"accessor,omitempty"`
}

// auditTimeLayout makes record ids sort as their times do (fixed width, UTC).
const auditTimeLayout = "20060102T150405.000000000Z"

func newAuditID(at time.Time) string {
	var r [3]byte
	rand.Read(r[:])
	return at.UTC().Format(auditTimeLayout) + "-" + hex.EncodeToString(r[:])
}

// ParseAuditID checks an audit record id (as `leasehold audit` prints it)
// and returns the time it encodes.
func ParseAuditID(id string) (time.Time, error) {
	ts, suffix, ok := strings.Cut(id, "-")
	if !ok || len(suffix) != 6 || strings.Trim(suffix, "0123456789abcdef") != "" {
		return time.Time{}, fmt.Errorf(
			"%q is not an audit record id (want e.g. 20250102T150405.000000000Z-1a2b3c)",
			id,
		)
	}
	at, err := time.Parse(auditTimeLayout, ts)
	if err != nil {
		return time.Time{}, fmt.Errorf("%q is not an audit record id: %w", id, err)
	}
	return at, nil
}

// Actor is who acts, as Consul can vouch for it or not.
type Actor struct {
	// Name is what the audit trail records: "token:" and the token's
	// description and accessor id with ACLs on, else the --by name.
	Name string
	// Accessor is the acting ACL token's accessor id; "" when ACLs are off,
	// and Name is then only a name anyone can type.
	Accessor string
}

// Attributed reports whether Consul said who acts (an ACL token).
func (a Actor) Attributed() bool { return a.Accessor != "" }

// Unattributed is what the audit trail and the CLI say of an action whose
// actor Consul could not attribute.
const Unattributed = "not attributed: Consul ACLs are off, so the name is only what --by " +
	"said, which anyone can type"

// Identity is who acts: the Consul token's description or accessor id when
// ACLs are on (so it cannot be made up), else by (required then).
func (k *Control) Identity(ctx context.Context, by string) (string, error) {
	a, err := k.Who(ctx, by)
	return a.Name, err
}

// Who is Identity with the token's accessor id, which says whether Consul
// attributed the action.
func (k *Control) Who(ctx context.Context, by string) (Actor, error) {
	tok, _, err := k.c.ACL().TokenReadSelf((&api.QueryOptions{}).WithContext(ctx))
	if err == nil && tok != nil {
		name := tok.AccessorID
		if tok.Description != "" {
			name = tok.Description + " (" + tok.AccessorID + ")"
		}
		return Actor{Name: "token:" + name, Accessor: tok.AccessorID}, nil
	}
	// Only Consul saying ACLs are off lets --by say who acts: any other
	// failure (the anonymous token, which may not read itself; a token
	// Consul does not know; no answer) would let anyone be anyone, and
	// approve their own cordon as someone else.
	var se api.StatusError
	if err != nil && !errors.As(err, &se) {
		return Actor{}, fmt.Errorf("who acts: Consul did not answer the token's identity: %w", err)
	}
	if err == nil || se.Code != 401 || !strings.Contains(se.Body, "ACL support disabled") {
		if err == nil {
			err = errors.New("no token")
		}
		return Actor{}, &IdentityError{Err: err}
	}
	if strings.TrimSpace(by) == "" {
		return Actor{}, ErrByRequired
	}
	return Actor{Name: strings.TrimSpace(by)}, nil
}

// ErrByRequired: Consul ACLs are off and no --by says who acts.
var ErrByRequired = errors.New(
	"--by: required when Consul ACLs are off (who is acting, for the audit log)",
)

// IdentityError: with Consul ACLs on, the token that acts could not be
// read, so who acts is not known (--by never says it then).
type IdentityError struct{ Err error }

func (e *IdentityError) Error() string {
	return fmt.Sprintf(
		"who acts: the Consul token cannot be read (%v); with ACLs on, each operator acts with a "+
			"token of their own (CONSUL_HTTP_TOKEN or CONSUL_HTTP_TOKEN_FILE), whose description "+
			"is recorded; --by is not taken for it",
		e.Err,
	)
}

func (e *IdentityError) Unwrap() error { return e.Err }
