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
// off and are retried; the last good state stays in force meanwhile.
func WatchControl(ctx context.Context, c *api.Client, out chan<- health.Observation, log *slog.Logger) {
	var index uint64
	var lastRules []byte
	haveRules := false
	var lastCordons string
	bo := newBackoff(200*time.Millisecond, 10*time.Second)
	for ctx.Err() == nil {
		q := (&api.QueryOptions{WaitIndex: index, WaitTime: 60 * time.Second}).WithContext(ctx)
		pairs, meta, err := c.KV().List(ControlPrefix, q)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			log.Warn("watching operator controls in Consul KV failed; the last ones stay in force", "prefix", ControlPrefix, "err", err)
			index = 0
			select {
			case <-ctx.Done():
				return
			case <-time.After(bo.next()):
			}
			continue
		}
		bo.reset()
		if meta.LastIndex < index {
			index = 0
		} else {
			index = meta.LastIndex
		}
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
		if !haveRules || string(rules) != string(lastRules) || (rules == nil) != (lastRules == nil) {
			haveRules, lastRules = true, rules
			o := health.Observation{At: time.Now(), Rules: &health.RulesSource{Source: "consul-kv:" + RulesKey, Raw: rules}}
			select {
			case out <- o:
			case <-ctx.Done():
				return
			}
		}
		fp := cordonPrint(cordons)
		if fp != lastCordons {
			lastCordons = fp
			select {
			case out <- health.Observation{At: time.Now(), Cordons: &health.CordonSet{Index: meta.LastIndex, Raw: cordons}}:
			case <-ctx.Done():
				return
			}
		}
		// Blocking queries can return early with the same index; pace them.
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
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
// trail, stored in Consul KV with check-and-set so concurrent operators
// never overwrite each other silently.
type Control struct {
	c *api.Client
}

// NewControl uses c (token and TLS from the standard CONSUL_* environment).
func NewControl(c *api.Client) *Control { return &Control{c: c} }

// AuditEntry is one operator action.
type AuditEntry struct {
	At     time.Time `json:"at"`
	Actor  string    `json:"actor"`
	Action string    `json:"action"` // cordon, uncordon, approve, rules-set
	Target string    `json:"target,omitempty"`
	Detail string    `json:"detail,omitempty"`
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
	if strings.TrimSpace(by) == "" {
		return "", errors.New("--by: required when Consul ACLs are off (who is acting, for the audit log)")
	}
	return strings.TrimSpace(by), nil
}

// NewCordonID is a fresh short id.
func NewCordonID() string {
	var b [4]byte
	rand.Read(b[:])
	return "c-" + hex.EncodeToString(b[:])
}

// Cordon stores a new cordon (validated) and audits it.
func (k *Control) Cordon(ctx context.Context, c health.Cordon) error {
	if err := c.Validate(); err != nil {
		return err
	}
	b, _ := json.Marshal(c)
	ok, _, err := k.c.KV().CAS(&api.KVPair{Key: CordonPrefix + c.ID, Value: b, ModifyIndex: 0}, (&api.WriteOptions{}).WithContext(ctx))
	if err != nil {
		return fmt.Errorf("store cordon: %w", err)
	}
	if !ok {
		return fmt.Errorf("%w: cordon %s exists already", ErrControl, c.ID)
	}
	return k.Audit(ctx, AuditEntry{Actor: c.By, Action: "cordon", Target: c.ID, Detail: c.Selector() + ": " + c.Reason})
}

// Cordons lists the stored cordons (invalid ones are returned with their
// error in bad).
func (k *Control) Cordons(ctx context.Context) (cordons []health.Cordon, bad map[string]error, err error) {
	pairs, _, err := k.c.KV().List(CordonPrefix, (&api.QueryOptions{}).WithContext(ctx))
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

// Uncordon removes a cordon and audits it.
func (k *Control) Uncordon(ctx context.Context, id, by, why string) error {
	p, _, err := k.c.KV().Get(CordonPrefix+id, (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		return fmt.Errorf("read cordon: %w", err)
	}
	if p == nil {
		return fmt.Errorf("%w: no cordon %s (see leasehold cordon --list)", ErrControl, id)
	}
	ok, _, err := k.c.KV().DeleteCAS(&api.KVPair{Key: p.Key, ModifyIndex: p.ModifyIndex}, (&api.WriteOptions{}).WithContext(ctx))
	if err != nil {
		return fmt.Errorf("delete cordon: %w", err)
	}
	if !ok {
		return fmt.Errorf("%w: cordon %s changed meanwhile; try again", ErrControl, id)
	}
	return k.Audit(ctx, AuditEntry{Actor: by, Action: "uncordon", Target: id, Detail: why})
}

// Approve records a second person's approval of a pending cordon.
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
	c.ApprovedBy, c.ApprovedAt = by, time.Now().UTC()
	b, _ := json.Marshal(c)
	ok, _, err := k.c.KV().CAS(&api.KVPair{Key: p.Key, Value: b, ModifyIndex: p.ModifyIndex}, (&api.WriteOptions{}).WithContext(ctx))
	if err != nil {
		return fmt.Errorf("store approval: %w", err)
	}
	if !ok {
		return fmt.Errorf("%w: cordon %s changed meanwhile; try again", ErrControl, id)
	}
	return k.Audit(ctx, AuditEntry{Actor: by, Action: "approve", Target: id, Detail: c.Selector()})
}

// SetRules stores a validated rollout configuration (JSON) for every
// replica, and audits it.
func (k *Control) SetRules(ctx context.Context, raw []byte, by string) error {
	if _, err := health.ParseRollout(raw); err != nil {
		return err
	}
	if _, err := k.c.KV().Put(&api.KVPair{Key: RulesKey, Value: raw}, (&api.WriteOptions{}).WithContext(ctx)); err != nil {
		return fmt.Errorf("store rules: %w", err)
	}
	return k.Audit(ctx, AuditEntry{Actor: by, Action: "rules-set", Target: RulesKey, Detail: string(raw)})
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

// ClearRules removes the stored rollout configuration, and audits it.
func (k *Control) ClearRules(ctx context.Context, by string) error {
	if _, err := k.c.KV().Delete(RulesKey, (&api.WriteOptions{}).WithContext(ctx)); err != nil {
		return fmt.Errorf("delete rules: %w", err)
	}
	return k.Audit(ctx, AuditEntry{Actor: by, Action: "rules-cleared", Target: RulesKey})
}

// Audit appends an entry to the shared audit trail.
func (k *Control) Audit(ctx context.Context, e AuditEntry) error {
	if e.At.IsZero() {
		e.At = time.Now().UTC()
	}
	var r [3]byte
	rand.Read(r[:])
	key := AuditPrefix + e.At.Format("20060102T150405.000000000Z") + "-" + hex.EncodeToString(r[:])
	b, _ := json.Marshal(e)
	if _, err := k.c.KV().Put(&api.KVPair{Key: key, Value: b}, (&api.WriteOptions{}).WithContext(ctx)); err != nil {
		return fmt.Errorf("audit: %w", err)
	}
	return nil
}

// AuditLog lists the most recent entries, oldest first.
func (k *Control) AuditLog(ctx context.Context, limit int) ([]AuditEntry, error) {
	pairs, _, err := k.c.KV().List(AuditPrefix, (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		return nil, fmt.Errorf("read audit: %w", err)
	}
	sort.Slice(pairs, func(i, j int) bool { return pairs[i].Key < pairs[j].Key })
	if limit > 0 && len(pairs) > limit {
		pairs = pairs[len(pairs)-limit:]
	}
	out := make([]AuditEntry, 0, len(pairs))
	for _, p := range pairs {
		var e AuditEntry
		if json.Unmarshal(p.Value, &e) == nil {
			out = append(out, e)
		}
	}
	return out, nil
}
