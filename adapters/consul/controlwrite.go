package consul

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

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
func (k *Control) commit(
	ctx context.Context,
	change api.TxnOps,
	e AuditEntry,
	conflict func(op int) error,
) error {
	if e.At.IsZero() {
		e.At = k.now().UTC()
	}
	key := AuditPrefix + newAuditID(e.At)
	b, err := json.Marshal(e)
	if err != nil {
		return fmt.Errorf("audit record: %w", err)
	}
	ops := append(append(api.TxnOps{}, change...),
		// Index 0: only if absent.
		&api.TxnOp{KV: &api.KVTxnOp{Verb: api.KVCAS, Key: key, Value: b, Index: 0}})
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
		return fmt.Errorf(
			"%w: audit record %s not written, so neither was the %s: %s",
			ErrControl,
			key,
			e.Action,
			strings.Join(whats, "; "),
		)
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
			// Deleting a gone key is fine: pruners may race.
			ops = append(ops, kvOp(api.KVTxnOp{Verb: api.KVDelete, Key: key}))
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
	change := api.TxnOps{
		kvOp(api.KVTxnOp{Verb: api.KVCAS, Key: CordonPrefix + c.ID, Value: b, Index: 0}),
	}
	return k.commit(
		ctx,
		change,
		AuditEntry{
			Actor:    c.By,
			Action:   "cordon",
			Target:   c.ID,
			Detail:   c.Selector() + ": " + c.Reason,
			Accessor: c.ByAccessor,
		},
		func(int) error { return fmt.Errorf("%w: cordon %s exists already", ErrControl, c.ID) },
	)
}

// removalKeep is how long a removal record is kept: long enough for every
// replica to see the removal it explains (a replica that restarts later has
// no cordon to report removed), short enough that they do not pile up.
const removalKeep = 7 * 24 * time.Hour

// Uncordon removes a cordon as by, a name Consul did not attribute.
func (k *Control) Uncordon(ctx context.Context, id, by, why string) error {
	return k.UncordonAs(ctx, id, Actor{Name: by}, why)
}

// UncordonAs removes a cordon, unless it changed since it was read, with its
// audit record and a removal record (RemovedPrefix) saying who removed it,
// which the replicas' audit logs name. Removal records older than
// removalKeep go in the same transaction.
func (k *Control) UncordonAs(ctx context.Context, id string, by Actor, why string) error {
	p, _, err := k.c.KV().Get(CordonPrefix+id, (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		return fmt.Errorf("read cordon: %w", err)
	}
	if p == nil {
		return fmt.Errorf("%w: no cordon %s (see leasehold cordon --list)", ErrControl, id)
	}
	now := k.now().UTC()
	rm, err := json.Marshal(health.CordonRemoval{ID: id, By: by.Name, ByAccessor: by.Accessor,
		At: now, Reason: why})
	if err != nil {
		return fmt.Errorf("removal record of %s: %w", id, err)
	}
	change := api.TxnOps{
		kvOp(api.KVTxnOp{Verb: api.KVDeleteCAS, Key: p.Key, Index: p.ModifyIndex}),
		kvOp(api.KVTxnOp{Verb: api.KVSet, Key: RemovedPrefix + id, Value: rm}),
	}
	old, _, err := k.c.KV().List(RemovedPrefix, (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		return fmt.Errorf("read removal records: %w", err)
	}
	for _, o := range old {
		var r health.CordonRemoval
		if len(change) >= maxTxnOps-2 {
			break // the next removal prunes the rest
		}
		if o.Key != RemovedPrefix+id &&
			(json.Unmarshal(o.Value, &r) != nil || now.Sub(r.At) > removalKeep) {
			change = append(change, kvOp(api.KVTxnOp{Verb: api.KVDelete, Key: o.Key}))
		}
	}
	return k.commit(
		ctx,
		change,
		AuditEntry{Actor: by.Name, Action: "uncordon", Target: id, Detail: why,
			Accessor: by.Accessor, At: now},
		func(int) error {
			return fmt.Errorf("%w: cordon %s changed meanwhile; try again", ErrControl, id)
		},
	)
}

// Approve approves as by, a name Consul did not attribute.
func (k *Control) Approve(ctx context.Context, id, by string) error {
	return k.ApproveAs(ctx, id, Actor{Name: by})
}

// ApproveAs records a second person's approval of a pending cordon, unless
// it changed since it was read, with its audit record; an approval Consul
// cannot attribute (ACLs off) says so in the record.
func (k *Control) ApproveAs(ctx context.Context, id string, by Actor) error {
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
	if c.By == by.Name || (by.Accessor != "" && c.ByAccessor == by.Accessor) {
		return fmt.Errorf(
			"%w: %s created cordon %s; a different identity must approve it",
			ErrControl,
			by.Name,
			id,
		)
	}
	if c.ApprovedBy != "" {
		return fmt.Errorf("%w: cordon %s was approved by %s already", ErrControl, id, c.ApprovedBy)
	}
	c.ApprovedBy, c.ApprovedByAccessor, c.ApprovedAt = by.Name, by.Accessor, k.now().UTC()
	b, err := json.Marshal(c)
	if err != nil {
		return fmt.Errorf("cordon %s: %w", id, err)
	}
	change := api.TxnOps{
		kvOp(api.KVTxnOp{Verb: api.KVCAS, Key: p.Key, Value: b, Index: p.ModifyIndex}),
	}
	detail := c.Selector()
	if !by.Attributed() {
		detail += "; " + Unattributed
	}
	return k.commit(
		ctx,
		change,
		AuditEntry{Actor: by.Name, Action: "approve", Target: id, Detail: detail,
			Accessor: by.Accessor},
		func(int) error {
			return fmt.Errorf("%w: cordon %s changed meanwhile; try again", ErrControl, id)
		},
	)
}

// SetRules stores a validated rollout configuration (JSON) for every
// replica, with its audit record.
func (k *Control) SetRules(ctx context.Context, raw []byte, by string) error {
	if _, err := health.ParseRollout(raw); err != nil {
		return err
	}
	change := api.TxnOps{kvOp(api.KVTxnOp{Verb: api.KVSet, Key: RulesKey, Value: raw})}
	return k.commit(
		ctx,
		change,
		AuditEntry{Actor: by, Action: "rules-set", Target: RulesKey, Detail: string(raw)},
		func(op int) error {
			return fmt.Errorf("%w: store rules: operation %d refused", ErrControl, op)
		},
	)
}

// ClearRules removes the stored rollout configuration, with its audit
// record.
func (k *Control) ClearRules(ctx context.Context, by string) error {
	change := api.TxnOps{kvOp(api.KVTxnOp{Verb: api.KVDelete, Key: RulesKey})}
	return k.commit(
		ctx,
		change,
		AuditEntry{Actor: by, Action: "rules-cleared", Target: RulesKey},
		func(op int) error {
			return fmt.Errorf("%w: delete rules: operation %d refused", ErrControl, op)
		},
	)
}
