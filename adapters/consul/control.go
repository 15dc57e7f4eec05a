package consul

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// Consul KV layout of the operators' controls, shared by every replica.
const (
	ControlPrefix = "leasehold/control/"
	RulesKey      = ControlPrefix + "rules"    // the rollout configuration (JSON)
	CordonPrefix  = ControlPrefix + "cordons/" // one cordon (JSON) per key
	AuditPrefix   = "leasehold/audit/"         // operator actions, one JSON object per key
)

// ErrControl is returned for operator requests Consul state refuses (e.g.
// a concurrent change, an approval by the author).
var ErrControl = errors.New("control")

// WatchControl follows the control prefix with blocking queries and sends
// the rules and cordons whenever they change, until ctx ends. Errors back
// off and are retried; the last good state stays in force meanwhile. Whether
// it reads them goes out as ControlContact: a failure when it begins or its
// kind changes (a missing right: ACLError, key_prefix "leasehold/control/"
// read), OK after the first answer of each run.
//
// It runs the watches' loop (queryLoop) with cfg's back-off, clock and pace
// (as the other KV listings: MinInterval × 4); cfg.Logger logs.
func WatchControl(ctx context.Context, c *api.Client, out chan<- health.Observation, cfg WatchConfig) {
	cfg = cfg.withDefaults()
	var last sentControl
	answered := false // the current run of answers has been reported
	var failedAs health.Contact
	send := func(ctx context.Context, o health.Observation) error {
		o.At = time.Now()
		select {
		case out <- o:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	queryLoop{
		clock: cfg.Clock, maxBackoff: cfg.MaxBackoff, kvListing: true,
		interval: cfg.MinInterval * 4, freshInterval: cfg.MinInterval * 4,
		before: func(context.Context) (time.Duration, bool) { return 60 * time.Second, true },
		after: func(ctx context.Context, _, _ uint64, err error) bool {
			if err == nil || ctx.Err() != nil {
				return ctx.Err() == nil
			}
			cfg.Logger.Warn("watching operator controls in Consul KV failed; the last ones stay in force", "prefix", ControlPrefix, "err", err)
			prob, detail := classify(err)
			if answered || failedAs.Problem != prob || (prob != health.ProblemUnreachable && failedAs.Detail != detail) {
				failedAs = health.Contact{Err: err, Problem: prob, Detail: detail}
				if send(ctx, health.Observation{ControlContact: &failedAs}) != nil {
					return false
				}
			}
			answered = false
			return true
		},
	}.run(ctx, func(ctx context.Context, index uint64, wait time.Duration) (uint64, error) {
		pairs, meta, err := readControl(ctx, c, (&api.QueryOptions{WaitIndex: index, WaitTime: wait}).WithContext(ctx))
		if err != nil {
			return 0, err
		}
		for _, o := range last.changes(pairs, meta.LastIndex) {
			if err := send(ctx, o); err != nil {
				return 0, err
			}
		}
		if !answered {
			answered, failedAs = true, health.Contact{}
			if err := send(ctx, health.Observation{ControlContact: &health.Contact{OK: true}}); err != nil {
				return 0, err
			}
		}
		return meta.LastIndex, nil
	})
}

// sentControl is what the control watch last sent.
type sentControl struct {
	haveRules bool
	rules     []byte
	cordons   string // cordonPrint
}

// changes are the observations a listing of the control prefix makes: the
// rules and the cordons, each when it changed.
func (st *sentControl) changes(pairs api.KVPairs, index uint64) []health.Observation {
	var rules []byte
	cordons := map[string][]byte{}
	for _, p := range pairs {
		switch {
		case p.Key == RulesKey:
			rules = p.Value
			if rules == nil {
				rules = []byte{}
			}
		case strings.HasPrefix(p.Key, CordonPrefix):
			cordons[strings.TrimPrefix(p.Key, CordonPrefix)] = p.Value
		}
	}
	var out []health.Observation
	if !st.haveRules || string(rules) != string(st.rules) || (rules == nil) != (st.rules == nil) {
		st.haveRules, st.rules = true, rules
		out = append(out, health.Observation{Rules: &health.RulesSource{Source: "consul-kv:" + RulesKey, Raw: rules}})
	}
	if fp := cordonPrint(cordons); fp != st.cordons {
		st.cordons = fp
		out = append(out, health.Observation{Cordons: &health.CordonSet{Index: index, Raw: cordons}})
	}
	return out
}

// readControl lists the control prefix. leasehold must read every key
// under it: an answer Consul filtered is an *ACLError, and so is an answer
// without the rules key or without cordons when the token may not read
// them — Consul lists keys a token may not read as if they did not exist,
// so then a read of the rules key and of the cordons' prefix key asks (a
// key the token may not read is refused whether it exists or not).
func readControl(ctx context.Context, c *api.Client, q *api.QueryOptions) (api.KVPairs, *api.QueryMeta, error) {
	what, rights := "kv "+ControlPrefix, []string{RightKeyPrefix(ControlPrefix, "read")}
	pairs, meta, err := c.KV().List(ControlPrefix, q)
	if err := aclNeeds(what, rights, meta, err); err != nil {
		return nil, nil, err
	}
	rules, cordons := false, false
	for _, p := range pairs {
		rules = rules || p.Key == RulesKey
		cordons = cordons || strings.HasPrefix(p.Key, CordonPrefix)
	}
	for _, probe := range []struct {
		key  string
		seen bool
	}{{RulesKey, rules}, {CordonPrefix, cordons}} {
		if probe.seen {
			continue
		}
		_, pmeta, err := c.KV().Get(probe.key, (&api.QueryOptions{}).WithContext(ctx))
		if err := aclNeeds(what, rights, pmeta, err); err != nil {
			return nil, nil, err
		}
	}
	return pairs, meta, nil
}

func cordonPrint(m map[string][]byte) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		b.WriteString(k)
		b.WriteByte(0)
		b.Write(m[k])
		b.WriteByte(0)
	}
	return b.String()
}

// Control is the operators' side: cordons, approvals, rules and the audit
// trail, stored in Consul KV. Every change is one KV transaction with its
// audit record (and the check-and-set the change needs), so a change is
// never without its record nor a record without its change.
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
		return time.Time{}, fmt.Errorf("%q is not an audit record id (want e.g. 20250102T150405.000000000Z-1a2b3c)", id)
	}
	at, err := time.Parse(auditTimeLayout, ts)
	if err != nil {
		return time.Time{}, fmt.Errorf("%q is not an audit record id: %w", id, err)
	}
	return at, nil
}

// Identity is who acts: the Consul token's description or accessor id when
// ACLs are on (so it cannot be made up), else by (required then).
func (k *Control) Identity(ctx context.Context, by string) (string, error) {
	tok, _, err := k.c.ACL().TokenReadSelf((&api.QueryOptions{}).WithContext(ctx))
	if err == nil && tok != nil {
		name := tok.AccessorID
		if tok.Description != "" {
			name = tok.Description + " (" + tok.AccessorID + ")"
		}
		return "token:" + name, nil
	}
	// Only Consul saying ACLs are off lets --by say who acts: any other
	// failure (the anonymous token, which may not read itself; a token
	// Consul does not know; no answer) would let anyone be anyone, and
	// approve their own cordon as someone else.
	var se api.StatusError
	if err != nil && !errors.As(err, &se) {
		return "", fmt.Errorf("who acts: Consul did not answer the token's identity: %w", err)
	}
	if err == nil || se.Code != 401 || !strings.Contains(se.Body, "ACL support disabled") {
		if err == nil {
			err = errors.New("no token")
		}
		return "", &IdentityError{Err: err}
	}
	if strings.TrimSpace(by) == "" {
		return "", ErrByRequired
	}
	return strings.TrimSpace(by), nil
}

// ErrByRequired: Consul ACLs are off and no --by says who acts.
var ErrByRequired = errors.New("--by: required when Consul ACLs are off (who is acting, for the audit log)")

// IdentityError: with Consul ACLs on, the token that acts could not be
// read, so who acts is not known (--by never says it then).
type IdentityError struct{ Err error }

func (e *IdentityError) Error() string {
	return fmt.Sprintf("who acts: the Consul token cannot be read (%v); with ACLs on, each operator acts with a token of their own (CONSUL_HTTP_TOKEN or CONSUL_HTTP_TOKEN_FILE), whose description is recorded; --by is not taken for it", e.Err)
}

func (e *IdentityError) Unwrap() error { return e.Err }

// NewCordonID is a fresh short id.
func NewCordonID() string {
	var b [4]byte
	rand.Read(b[:])
	return "c-" + hex.EncodeToString(b[:])
}

// commit applies change and the audit record e of it in one KV transaction:
// both or neither. When an operation of change fails (a check-and-set lost
// to a concurrent operator), conflict says what that means. Pruning the
// trail follows a successful commit.
func (k *Control) commit(ctx context.Context, change api.TxnOps, e AuditEntry, conflict func(op int) error) error {
	if e.At.IsZero() {
		e.At = k.now().UTC()
	}
	key := AuditPrefix + newAuditID(e.At)
	b, err := json.Marshal(e)
	if err != nil {
		return fmt.Errorf("audit record: %w", err)
	}
	ops := append(append(api.TxnOps{}, change...),
		&api.TxnOp{KV: &api.KVTxnOp{Verb: api.KVCAS, Key: key, Value: b, Index: 0}}) // index 0: only if absent
	if k.beforeCommit != nil {
		k.beforeCommit(ops)
	}
	ok, resp, _, err := k.c.Txn().Txn(ops, (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		return fmt.Errorf("%s and its audit record: %w", e.Action, err)
	}
	if !ok {
		var whats []string
		for _, te := range resp.Errors {
			if te.OpIndex < len(change) {
				return conflict(te.OpIndex)
			}
			whats = append(whats, te.What)
		}
		return fmt.Errorf("%w: audit record %s not written, so neither was the %s: %s", ErrControl, key, e.Action, strings.Join(whats, "; "))
	}
	if n, err := k.PruneAudit(ctx); err != nil {
		// The change and its record are in; the next write prunes again.
		k.log.Warn("pruning the audit trail failed", "prefix", AuditPrefix, "err", err)
	} else if n > 0 {
		k.log.Debug("audit trail pruned", "deleted", n)
	}
	return nil
}

func kvOp(op api.KVTxnOp) *api.TxnOp { return &api.TxnOp{KV: &op} }

// maxTxnOps is Consul's limit of operations per transaction.
const maxTxnOps = 64

// PruneAudit deletes the records beyond the Keep most recent and those older
// than MaxAge, and returns how many. Record ids order as their times, so
// the key names are enough.
func (k *Control) PruneAudit(ctx context.Context) (int, error) {
	keys, _, err := k.c.KV().Keys(AuditPrefix, "", (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		return 0, fmt.Errorf("list audit records: %w", err)
	}
	sort.Strings(keys)
	cut := max(0, len(keys)-k.retention.Keep)
	doomed := keys[:cut:cut]
	oldest := k.now().Add(-k.retention.MaxAge)
	for _, key := range keys[cut:] {
		at, err := ParseAuditID(strings.TrimPrefix(key, AuditPrefix))
		if err != nil {
			continue // not a record of ours: only the count limit removes it
		}
		if !at.Before(oldest) {
			break // ids order as times: every later one is younger still
		}
		doomed = append(doomed, key)
	}
	deleted := 0
	for len(doomed) > 0 {
		n := min(len(doomed), maxTxnOps)
		ops := make(api.TxnOps, 0, n)
		for _, key := range doomed[:n] {
			ops = append(ops, kvOp(api.KVTxnOp{Verb: api.KVDelete, Key: key})) // deleting a gone key is fine: pruners may race
		}
		ok, resp, _, err := k.c.Txn().Txn(ops, (&api.QueryOptions{}).WithContext(ctx))
		if err != nil {
			return deleted, fmt.Errorf("delete audit records: %w", err)
		}
		if !ok {
			return deleted, fmt.Errorf("delete audit records: %s", txnErrors(resp))
		}
		deleted += n
		doomed = doomed[n:]
	}
	return deleted, nil
}

func txnErrors(resp *api.TxnResponse) string {
	var whats []string
	for _, te := range resp.Errors {
		whats = append(whats, fmt.Sprintf("op %d: %s", te.OpIndex, te.What))
	}
	return strings.Join(whats, "; ")
}

// Cordon stores a new cordon (validated) with its audit record.
func (k *Control) Cordon(ctx context.Context, c health.Cordon) error {
	if err := c.Validate(); err != nil {
		return err
	}
	b, err := json.Marshal(c)
	if err != nil {
		return fmt.Errorf("cordon %s: %w", c.ID, err)
	}
	change := api.TxnOps{kvOp(api.KVTxnOp{Verb: api.KVCAS, Key: CordonPrefix + c.ID, Value: b, Index: 0})}
	return k.commit(ctx, change, AuditEntry{Actor: c.By, Action: "cordon", Target: c.ID, Detail: c.Selector() + ": " + c.Reason},
		func(int) error { return fmt.Errorf("%w: cordon %s exists already", ErrControl, c.ID) })
}

// list reads the keys under prefix for an operator's read: what Consul
// left out because the token may not read it is an *ACLError naming the
// rule (examples/consul/operator-policy.hcl), never an empty answer.
func (k *Control) list(ctx context.Context, prefix string) (api.KVPairs, error) {
	pairs, _, err := listKV(ctx, k.c, (&api.QueryOptions{}).WithContext(ctx), prefix, "read")
	var ae *ACLError
	if errors.As(err, &ae) {
		ae.Policy = "operator-policy.hcl"
	}
	return pairs, err
}

// Cordons lists the stored cordons (invalid ones are returned with their
// error in bad).
func (k *Control) Cordons(ctx context.Context) (cordons []health.Cordon, bad map[string]error, err error) {
	pairs, err := k.list(ctx, CordonPrefix)
	if err != nil {
		return nil, nil, fmt.Errorf("list cordons: %w", err)
	}
	bad = map[string]error{}
	for _, p := range pairs {
		var c health.Cordon
		if err := json.Unmarshal(p.Value, &c); err != nil {
			bad[p.Key] = err
			continue
		}
		cordons = append(cordons, c)
	}
	return cordons, bad, nil
}

// Uncordon removes a cordon, unless it changed since it was read, with its
// audit record.
func (k *Control) Uncordon(ctx context.Context, id, by, why string) error {
	p, _, err := k.c.KV().Get(CordonPrefix+id, (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		return fmt.Errorf("read cordon: %w", err)
	}
	if p == nil {
		return fmt.Errorf("%w: no cordon %s (see leasehold cordon --list)", ErrControl, id)
	}
	change := api.TxnOps{kvOp(api.KVTxnOp{Verb: api.KVDeleteCAS, Key: p.Key, Index: p.ModifyIndex})}
	return k.commit(ctx, change, AuditEntry{Actor: by, Action: "uncordon", Target: id, Detail: why},
		func(int) error { return fmt.Errorf("%w: cordon %s changed meanwhile; try again", ErrControl, id) })
}

// Approve records a second person's approval of a pending cordon, unless it
// changed since it was read, with its audit record.
func (k *Control) Approve(ctx context.Context, id, by string) error {
	p, _, err := k.c.KV().Get(CordonPrefix+id, (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		return fmt.Errorf("read cordon: %w", err)
	}
	if p == nil {
		return fmt.Errorf("%w: no cordon %s", ErrControl, id)
	}
	var c health.Cordon
	if err := json.Unmarshal(p.Value, &c); err != nil {
		return fmt.Errorf("cordon %s: %w", id, err)
	}
	if c.By == by {
		return fmt.Errorf("%w: %s created cordon %s; a different identity must approve it", ErrControl, by, id)
	}
	if c.ApprovedBy != "" {
		return fmt.Errorf("%w: cordon %s was approved by %s already", ErrControl, id, c.ApprovedBy)
	}
	c.ApprovedBy, c.ApprovedAt = by, k.now().UTC()
	b, err := json.Marshal(c)
	if err != nil {
		return fmt.Errorf("cordon %s: %w", id, err)
	}
	change := api.TxnOps{kvOp(api.KVTxnOp{Verb: api.KVCAS, Key: p.Key, Value: b, Index: p.ModifyIndex})}
	return k.commit(ctx, change, AuditEntry{Actor: by, Action: "approve", Target: id, Detail: c.Selector()},
		func(int) error { return fmt.Errorf("%w: cordon %s changed meanwhile; try again", ErrControl, id) })
}

// SetRules stores a validated rollout configuration (JSON) for every
// replica, with its audit record.
func (k *Control) SetRules(ctx context.Context, raw []byte, by string) error {
	if _, err := health.ParseRollout(raw); err != nil {
		return err
	}
	change := api.TxnOps{kvOp(api.KVTxnOp{Verb: api.KVSet, Key: RulesKey, Value: raw})}
	return k.commit(ctx, change, AuditEntry{Actor: by, Action: "rules-set", Target: RulesKey, Detail: string(raw)},
		func(op int) error { return fmt.Errorf("%w: store rules: operation %d refused", ErrControl, op) })
}

// Rules is the stored rollout configuration (nil: none).
func (k *Control) Rules(ctx context.Context) ([]byte, error) {
	p, _, err := k.c.KV().Get(RulesKey, (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		return nil, fmt.Errorf("read rules: %w", err)
	}
	if p == nil {
		return nil, nil
	}
	return p.Value, nil
}

// ClearRules removes the stored rollout configuration, with its audit
// record.
func (k *Control) ClearRules(ctx context.Context, by string) error {
	change := api.TxnOps{kvOp(api.KVTxnOp{Verb: api.KVDelete, Key: RulesKey})}
	return k.commit(ctx, change, AuditEntry{Actor: by, Action: "rules-cleared", Target: RulesKey},
		func(op int) error { return fmt.Errorf("%w: delete rules: operation %d refused", ErrControl, op) })
}

// AuditPage is one page of the audit trail.
type AuditPage struct {
	Entries []AuditEntry // oldest first
	// Older is the cursor of the page before this one (pass it as before);
	// empty when no older record exists.
	Older string
}

// AuditLog returns the limit most recent records older than the record id
// before ("": the newest), oldest first. Records order by id, which is
// their time, so paging with Older returns every record exactly once even
// while new ones are written. The trail is bounded by retention, so one
// read of the prefix serves a page.
func (k *Control) AuditLog(ctx context.Context, limit int, before string) (AuditPage, error) {
	if limit < 1 {
		return AuditPage{}, fmt.Errorf("limit: must be at least 1, got %d", limit)
	}
	if before != "" {
		if _, err := ParseAuditID(before); err != nil {
			return AuditPage{}, fmt.Errorf("before: %w", err)
		}
	}
	pairs, err := k.list(ctx, AuditPrefix)
	if err != nil {
		return AuditPage{}, fmt.Errorf("read audit: %w", err)
	}
	sort.Slice(pairs, func(i, j int) bool { return pairs[i].Key < pairs[j].Key })
	if before != "" {
		n := sort.Search(len(pairs), func(i int) bool { return pairs[i].Key >= AuditPrefix+before })
		pairs = pairs[:n]
	}
	var page AuditPage
	if len(pairs) > limit {
		pairs = pairs[len(pairs)-limit:]
		page.Older = strings.TrimPrefix(pairs[0].Key, AuditPrefix)
	}
	page.Entries = make([]AuditEntry, 0, len(pairs))
	for _, p := range pairs {
		var e AuditEntry
		if err := json.Unmarshal(p.Value, &e); err != nil {
			e = AuditEntry{Action: "unreadable", Detail: err.Error()} // shown, not hidden: it still takes its place
		}
		e.ID = strings.TrimPrefix(p.Key, AuditPrefix)
		page.Entries = append(page.Entries, e)
	}
	return page, nil
}
