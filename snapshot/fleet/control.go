package fleet

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"sort"
	"time"

	"github.com/leasehold/leasehold/health"
)

// AuditEvent is one configuration change (or refused change) a replica
// applied, for the audit log.
type AuditEvent struct {
	At     time.Time `json:"at"`
	Actor  string    `json:"actor"` // "leasehold" for what a replica applied
	Action string    `json:"action"`
	Source string    `json:"source,omitempty"`
	Detail string    `json:"detail,omitempty"`
	Error  string    `json:"error,omitempty"`
}

// ControlState is the operators' configuration in force, for /debug/config.
type ControlState struct {
	Rollout       *health.Rollout `json:"rollout"`
	RolloutSource string          `json:"rollout_source"` // "" = defaults
	RolloutError  string          `json:"rollout_error,omitempty"`
	// RulesVersion is the content version of the rules in force
	// (health.Rollout.ContentVersion; the defaults' when none is).
	RulesVersion string                `json:"rules_version"`
	Cordons      []health.CordonStatus `json:"cordons"`
	CordonErrors map[string]string     `json:"cordon_errors,omitempty"`
	// RequireACLApprovals: this replica counts only approvals Consul
	// attributed (serve --require-acl-approvals).
	RequireACLApprovals bool `json:"require_acl_approvals"`
}

// control is the Syncer's operator state (owned by Run).
type control struct {
	sources     map[string]*health.RulesSource // by kind: "file", "kv"
	rollout     *health.Rollout
	rolloutRaw  []byte
	rolloutFrom string
	rolloutErr  string
	version     string // rollout.ContentVersion()
	// applied is the version a rules change applied since the last traced
	// batch ("": none), for the change's trace.
	applied      string
	cordons      []health.Cordon
	cordonErrs   map[string]string
	cordonStatus []health.CordonStatus
	held         int
	dirty        bool // decisions must be redone for every task type
	clusters     bool // every group's clusters must be published again (load-balancing policies)
}

func sourceKind(src string) string {
	if len(src) >= 5 && src[:5] == "file:" {
		return "file"
	}
	return "kv"
}

// applyRules takes a rules source; Consul KV wins over the file when both
// hold a configuration. An invalid configuration is refused: the previous
// one stays in force, and the refusal is logged and audited.
func (s *Syncer) applyRules(src *health.RulesSource) {
	c := &s.ctl
	if c.sources == nil {
		c.sources = map[string]*health.RulesSource{}
	}
	c.sources[sourceKind(src.Source)] = src
	eff := c.sources["kv"]
	if eff == nil || eff.Raw == nil {
		eff = c.sources["file"]
	}
	var raw []byte
	from := ""
	if eff != nil && eff.Raw != nil {
		raw, from = eff.Raw, eff.Source
	}
	if bytes.Equal(raw, c.rolloutRaw) && from == c.rolloutFrom {
		return
	}
	var r *health.Rollout
	if raw != nil {
		var err error
		if r, err = health.ParseRollout(raw); err != nil {
			msg := fmt.Sprintf("%s: %v", from, err)
			if msg != c.rolloutErr {
				c.rolloutErr = msg
				s.rulesRejected.Add(context.Background(), 1)
				s.log.Error("rollout configuration refused: the previous one stays in force",
					"source", from, "err", err)
				s.audit(AuditEvent{Action: "config-rejected", Source: from, Error: err.Error()})
			}
			return
		}
	}
	c.rollout, c.rolloutRaw, c.rolloutFrom, c.rolloutErr = r, raw, from, ""
	c.version = r.ContentVersion()
	c.applied = c.version
	c.dirty, c.clusters = true, true
	// The detail is read by people (serve's log, the audit trail): a scope
	// of <2.0.0 is written so, not as \u003c2.0.0.
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.Encode(r)
	detail := bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
	s.log.Info("rollout configuration applied", "source", from, "version", c.version,
		"config", string(detail))
	s.audit(AuditEvent{Action: "config-applied", Source: from, Detail: string(detail)})
}

// applyCordons takes every cordon in KV; an invalid one is skipped (logged
// once) and the others apply.
func (s *Syncer) applyCordons(set *health.CordonSet) {
	c := &s.ctl
	errs := map[string]string{}
	var cordons []health.Cordon
	keys := make([]string, 0, len(set.Raw))
	for k := range set.Raw {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		var cd health.Cordon
		err := json.Unmarshal(set.Raw[k], &cd)
		if err == nil {
			err = cd.Validate()
		}
		if err != nil {
			errs[k] = err.Error()
			if c.cordonErrs[k] != err.Error() {
				s.log.Error("invalid cordon in Consul KV: ignored", "key", k, "err", err)
			}
			continue
		}
		cordons = append(cordons, cd)
	}
	before, _ := json.Marshal(c.cordons)
	after, _ := json.Marshal(cordons)
	c.cordonErrs = errs
	if !bytes.Equal(before, after) {
		s.auditCordons(c.cordons, cordons, set.Removed)
		c.cordons, c.dirty = cordons, true
	}
}

// auditCordons writes what changed between two cordon sets to this
// replica's audit log, as the operators' actions it now applies; removed
// holds the removal records `leasehold uncordon` writes with each removal,
// which say who removed a cordon.
func (s *Syncer) auditCordons(old, cur []health.Cordon, removed map[string][]byte) {
	was := map[string]health.Cordon{}
	for _, cd := range old {
		was[cd.ID] = cd
	}
	for _, cd := range cur {
		prev, existed := was[cd.ID]
		delete(was, cd.ID)
		switch {
		case !existed:
			s.audit(AuditEvent{Actor: cd.By, Action: "cordon-applied", Source: "consul-kv",
				Detail: cd.ID + " " + cd.Selector() + ": " + cd.Reason})
		case prev.ApprovedBy == "" && cd.ApprovedBy != "":
			detail := cd.ID + " " + cd.Selector()
			if cd.ApprovedByAccessor == "" {
				detail += "; the approver is a name given with --by, which Consul cannot " +
					"attribute (ACLs off)"
			}
			s.audit(AuditEvent{Actor: cd.ApprovedBy, Action: "cordon-approved", Source: "consul-kv",
				Detail: detail})
		}
	}
	for _, id := range slices.Sorted(maps.Keys(was)) {
		cd := was[id]
		e := AuditEvent{Action: "cordon-removed", Source: "consul-kv",
			Detail: id + " " + cd.Selector()}
		var rm health.CordonRemoval
		if err := json.Unmarshal(removed[id], &rm); err == nil && rm.ID == id && rm.By != "" {
			e.Actor = rm.By
			if rm.Reason != "" {
				e.Detail += ": " + rm.Reason
			}
		} else {
			// Deleted from Consul KV directly (not by leasehold uncordon,
			// which records who), or the record is gone: who is not known.
			e.Actor = "unknown"
			e.Detail += " (removed without a removal record: not by leasehold uncordon; see " +
				"Consul's own logs)"
		}
		s.audit(e)
	}
}

// setsChanged redoes the cordons' decisions when a constraint set came or
// went while cordons are in force: the safety limit counts each set in use,
// so a new set may hold what a cordon took out, and a set gone may free
// room. It reports whether it did (and so rebuilt every group).
func (s *Syncer) setsChanged(ctx context.Context) bool {
	if len(s.ctl.cordons) == 0 {
		return false
	}
	s.ctl.dirty = true
	s.batchStart = s.cfg.Clock.Now()
	s.recompute(ctx)
	return true
}

// applyControl sets the operators' cordons on the joined, fenced
// executors (before fingerprints, so a cordon change rebuilds its tasks).
func (s *Syncer) applyControl() {
	c := &s.ctl
	if len(c.cordons) == 0 && c.held == 0 {
		// The executors were joined afresh when the last cordon went: no cordon fields set.
		c.cordonStatus = nil
		return
	}
	// Cordons count matches and live executors per task type and constraint
	// set in use across the fleet, so while any is in force every
	// registration is cordoned anew.
	tasks := sortedKeys(s.members)
	var all []health.Executor
	for _, task := range tasks {
		all = s.fleet[task].execs.appendTo(all)
	}
	sets := make([]health.Dispatcher, 0, len(s.groups))
	for _, key := range slices.Sorted(maps.Keys(s.groups)) {
		sets = append(sets, s.groups[key].d)
	}
	c.cordonStatus = health.ApplyCordons(all, c.cordons, c.rollout,
		health.CordonOptions{Sets: sets, AttributedApprovals: s.cfg.RequireACLApprovals})
	for _, task := range tasks {
		ts := s.fleet[task]
		ts.markAll()
		for i := range ts.execs.len() {
			*ts.mut(int32(i)) = all[i]
		}
		all = all[ts.execs.len():]
	}
	held := 0
	var pools []string
	for _, st := range c.cordonStatus {
		held += st.Held
		for _, p := range st.HeldBy {
			pools = append(pools, p.String())
		}
	}
	if held != c.held {
		if held > 0 {
			s.log.Warn("safety limit: cordons would take out more than the allowed fraction of "+
				"the executors a constraint set in use routes to; the rest stay routed",
				"held", held, "limit", c.rollout.Limit(), "pools", pools)
		} else {
			s.log.Info("safety limit: no cordon held any more")
		}
		c.held = held
	}
}

// observed is the rules in observe mode for a task under a group.
func (s *Syncer) observed(task string, d health.Dispatcher) []health.Reason {
	if s.ctl.rollout == nil {
		return nil
	}
	return s.ctl.rollout.Observed(task, d)
}

func (s *Syncer) audit(e AuditEvent) {
	if e.At.IsZero() {
		e.At = time.Now().UTC()
	}
	if e.Actor == "" {
		e.Actor = "leasehold"
	}
	if s.cfg.Audit != nil {
		s.cfg.Audit(e)
	}
}

func (s *Syncer) controlState() *ControlState {
	c := &s.ctl
	version := c.version
	if version == "" {
		version = defaultRulesVersion
	}
	return &ControlState{Rollout: c.rollout, RolloutSource: c.rolloutFrom,
		RolloutError: c.rolloutErr, RulesVersion: version, Cordons: c.cordonStatus,
		CordonErrors:        c.cordonErrs,
		RequireACLApprovals: s.cfg.RequireACLApprovals}
}
