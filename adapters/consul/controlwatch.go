package consul

import (
	"context"
	"sort"
	"strings"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// ControlWatch follows the control prefix with blocking queries and sends
// the rules and cordons to WatchConfig.Out whenever they change. Errors back
// off and are retried; the last good state stays in force meanwhile. Whether
// it reads them goes out as ControlContact: a failure when it begins or its
// kind changes (a missing right: ACLError, key_prefix "leasehold/control/"
// read), OK after the first answer of each run.
//
// It runs the watches' loop (queryLoop) with the config's back-off, clock,
// blocking wait (WaitTime) and pace (as the other KV listings: MinInterval ×
// 4); the config's Logger logs.
type ControlWatch struct {
	c   *api.Client
	cfg WatchConfig
}

// NewControlWatch follows the operators' controls through c.
func NewControlWatch(c *api.Client, cfg WatchConfig) *ControlWatch {
	return &ControlWatch{c: c, cfg: cfg.withDefaults()}
}

// Run follows the controls until ctx ends, and returns ctx's error then. It
// fails at once, with an error naming the field, when WatchConfig.Out is
// nil.
func (cw *ControlWatch) Run(ctx context.Context) error {
	c, cfg, out := cw.c, cw.cfg, cw.cfg.Out
	if out == nil {
		return errNoOut
	}
	var last sentControl
	answered := false // the current run of answers has been reported
	var failedAs health.Contact
	send := func(ctx context.Context, o health.Observation) error {
		o.At = cfg.Clock.Now()
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
		before: func(context.Context) (time.Duration, bool) { return cfg.WaitTime, true },
		after: func(ctx context.Context, _, _ uint64, err error) bool {
			if err == nil || ctx.Err() != nil {
				return ctx.Err() == nil
			}
			cfg.Logger.Warn(
				"watching operator controls in Consul KV failed; the last ones stay in force",
				"prefix", ControlPrefix, "err", err)
			prob, detail := classify(err)
			if answered || failedAs.Problem != prob ||
				(prob != health.ProblemUnreachable && failedAs.Detail != detail) {
				failedAs = health.Contact{Err: err, Problem: prob, Detail: detail}
				if send(ctx, health.Observation{Data: (*health.ControlContact)(&failedAs)}) != nil {
					return false
				}
			}
			answered = false
			return true
		},
	}.run(ctx, func(ctx context.Context, index uint64, wait time.Duration) (uint64, error) {
		pairs, meta, err := readControl(
			ctx,
			c,
			(&api.QueryOptions{WaitIndex: index, WaitTime: wait}).WithContext(ctx),
		)
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
			ok := health.Observation{Data: &health.ControlContact{OK: true}}
			if err := send(ctx, ok); err != nil {
				return 0, err
			}
		}
		return meta.LastIndex, nil
	})
	return ctx.Err()
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
	cordons, removed := map[string][]byte{}, map[string][]byte{}
	for _, p := range pairs {
		switch {
		case p.Key == RulesKey:
			rules = p.Value
			if rules == nil {
				rules = []byte{}
			}
		case strings.HasPrefix(p.Key, CordonPrefix):
			cordons[strings.TrimPrefix(p.Key, CordonPrefix)] = p.Value
		case strings.HasPrefix(p.Key, RemovedPrefix):
			removed[strings.TrimPrefix(p.Key, RemovedPrefix)] = p.Value
		}
	}
	var out []health.Observation
	if !st.haveRules || string(rules) != string(st.rules) || (rules == nil) != (st.rules == nil) {
		st.haveRules, st.rules = true, rules
		out = append(
			out,
			health.Observation{
				Data: &health.RulesSource{Source: "consul-kv:" + RulesKey, Raw: rules},
			},
		)
	}
	if fp := cordonPrint(cordons); fp != st.cordons {
		st.cordons = fp
		out = append(
			out,
			health.Observation{
				Data: &health.CordonSet{Index: index, Raw: cordons, Removed: removed},
			},
		)
	}
	return out
}

// readControl lists the control prefix. leasehold must read every key
// under it: an answer Consul filtered is an *ACLError, and so is an answer
// without the rules key or without cordons when the token may not read
// them — Consul lists keys a token may not read as if they did not exist,
// so then a read of the rules key and of the cordons' prefix key asks (a
// key the token may not read is refused whether it exists or not).
func readControl(
	ctx context.Context,
	c *api.Client,
	q *api.QueryOptions,
) (api.KVPairs, *api.QueryMeta, error) {
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
