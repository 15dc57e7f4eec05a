package consul

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// list reads the keys under prefix for an operator's read: what Consul
// left out because the token may not read it is an *ACLError naming the
// rule (examples/consul/operator-policy.hcl), never an empty answer.
func (k *Control) list(ctx context.Context, prefix string) (api.KVPairs, error) {
	pairs, _, err := listKV(ctx, k.c, (&api.QueryOptions{}).WithContext(ctx), prefix, "read", nil)
	var ae *ACLError
	if errors.As(err, &ae) {
		ae.Policy = "operator-policy.hcl"
	}
	return pairs, err
}

// Cordons lists the stored cordons (invalid ones are returned with their
// error in bad).
func (k *Control) Cordons(
	ctx context.Context,
) (cordons []health.Cordon, bad map[string]error, err error) {
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
			// Shown, not hidden: it still takes its place.
			e = AuditEntry{Action: "unreadable", Detail: err.Error()}
		}
		e.ID = strings.TrimPrefix(p.Key, AuditPrefix)
		page.Entries = append(page.Entries, e)
	}
	return page, nil
}
