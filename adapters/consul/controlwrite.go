package consul

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sort"
	"strings"

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
			Actor:  c.By,
			Action: "cordon",
			Target: c.ID,
			Detail: c.Selector() + ": " + c.Reason,
		},
		func(int) error { return fmt.Errorf("%w: cordon %s exists already", ErrControl, c.ID) },
	)
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
	return k.commit(
		ctx,
		change,
		AuditEntry{Actor: by, Action: "uncordon", Target: id, Detail: why},
		func(int) error {
			return fmt.Errorf("%w: cordon %s changed meanwhile; try again", ErrControl, id)
		},
	)
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
		return fmt.Errorf(
			"%w: %s created cordon %s; a different identity must approve it",
			ErrControl,
			by,
			id,
		)
	}
	if c.ApprovedBy != "" {
		return fmt.Errorf("%w: cordon %s was approved by %s already", ErrControl, id, c.ApprovedBy)
	}
	c.ApprovedBy, c.ApprovedAt = by, k.now().UTC()
	b, err := json.Marshal(c)
	if err != nil {
		return fmt.Errorf("cordon %s: %w", id, err)
	}
	change := api.TxnOps{
		kvOp(api.KVTxnOp{Verb: api.KVCAS, Key: p.Key, Value: b, Index: p.ModifyIndex}),
	}
	return k.commit(
		ctx,
		change,
		AuditEntry{Actor: by, Action: "approve", Target: id, Detail: c.Selector()},
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
