package consul

import (
	"context"
	"reflect"
	"sync"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// The fast path: the non-passing checks of leasehold's services and of
// nodes, and every node's serfHealth (passing too: its indexes tell a node
// that failed and came back since a session registered).
//
// Two watches feed it. "non-passing" blocks on Consul's checks in state
// critical and warning, whose blocking queries wake only when a check enters,
// leaves or changes in that state — registrations of passing executors,
// however many, do not wake them — and each answer costs Consul the
// non-passing checks only. "serf" lists every node's serfHealth, a scan of
// every check in the datacenter that any check change wakes, so it is paced
// by SlowInterval; a serfHealth leaving the non-passing set (a node back) is
// read at once by node, so its new indexes never wait for that pace.
//
// (Before issue 19 one filtered blocking query over every check did both: it
// woke on every registration and scanned the whole datacenter each time,
// the largest share of Consul's CPU that leasehold caused under churn.)
type fastPath struct {
	mu       sync.Mutex // held while sending, so observations go out in order
	np       []health.CheckState
	npIndex  uint64
	npRead   bool
	serf     map[string]health.CheckState // node → its serfHealth
	serfRead bool
	last     []health.CheckState // the last set sent
	sent     bool                // last is current: the next identical set is progress only
}

// isSerf reports whether c is a node's serfHealth check.
func isSerf(c health.CheckState) bool {
	return c.CheckID == health.SerfHealthCheckID && c.ServiceID == ""
}

// combined is the non-passing set with every node's serfHealth; of two
// states of one check, the one Consul modified later wins.
func (f *fastPath) combined() []health.CheckState {
	type key struct{ node, id string }
	m := make(map[key]health.CheckState, len(f.np)+len(f.serf))
	for _, c := range f.serf {
		m[key{c.Node, c.CheckID}] = c
	}
	for _, c := range f.np {
		k := key{c.Node, c.CheckID}
		if old, ok := m[k]; !ok || c.ModifyIndex >= old.ModifyIndex {
			m[k] = c
		}
	}
	out := make([]health.CheckState, 0, len(m))
	for _, c := range m {
		out = append(out, c)
	}
	sortChecks(out)
	return out
}

// publish sends the combined set at the non-passing index once both watches
// have answered: the whole set when it changed, else progress to that index
// (fencing's min_consul_index counts on it).
func (w *Watcher) publish(ctx context.Context, out chan<- health.Observation) {
	f := &w.fast
	if !f.npRead || !f.serfRead {
		return
	}
	set := f.combined()
	if f.sent && reflect.DeepEqual(set, f.last) {
		w.send(ctx, out, health.Observation{Progress: &health.Progress{NonPassing: f.npIndex}})
		return
	}
	f.last, f.sent = set, true
	w.send(ctx, out, health.Observation{NonPassing: &health.NonPassing{Index: f.npIndex, Checks: set}})
}

// watchNonPassing follows the non-passing checks.
func (w *Watcher) watchNonPassing(ctx context.Context, out chan<- health.Observation) {
	f := &w.fast
	w.blockingLoop(ctx, out, watchSpec{name: "non-passing", minInterval: w.cfg.MinInterval}, func(ctx context.Context, index uint64, wait time.Duration) (uint64, error) {
		checks, idx, err := w.cat.NonPassing(ctx, w.cfg.Tag, index, wait)
		if err != nil {
			f.mu.Lock()
			f.sent = false // report the next answer whatever it is
			f.mu.Unlock()
			return 0, err
		}
		states := make([]health.CheckState, 0, len(checks))
		for _, c := range checks {
			states = append(states, checkState(c))
		}
		sortChecks(states)
		// A node's serfHealth that left the set came back: read it now, so
		// its new indexes (the node failed since any older session) are
		// there before the set says nothing of it.
		f.mu.Lock()
		var back []string
		for _, c := range f.np {
			if isSerf(c) && !containsCheck(states, c) {
				back = append(back, c.Node)
			}
		}
		f.mu.Unlock()
		fresh := map[string]health.CheckState{}
		for _, node := range back {
			c, err := w.cat.NodeSerf(ctx, node)
			if err != nil {
				f.mu.Lock()
				f.sent = false
				f.mu.Unlock()
				return 0, err
			}
			if c != nil {
				fresh[node] = checkState(c)
			}
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		for node, c := range fresh {
			if old, ok := f.serf[node]; !ok || c.ModifyIndex >= old.ModifyIndex {
				f.serf[node] = c
			}
		}
		f.np, f.npIndex, f.npRead = states, idx, true
		w.publish(ctx, out)
		return idx, nil
	})
}

// watchSerf follows every node's serfHealth, paced by SlowInterval.
func (w *Watcher) watchSerf(ctx context.Context, out chan<- health.Observation) {
	f := &w.fast
	w.blockingLoop(ctx, out, watchSpec{name: "serf", minInterval: max(w.cfg.MinInterval*4, w.cfg.SlowInterval)}, func(ctx context.Context, index uint64, wait time.Duration) (uint64, error) {
		checks, idx, err := w.cat.SerfHealth(ctx, index, wait)
		if err != nil {
			return 0, err
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		serf := make(map[string]health.CheckState, len(checks))
		for _, c := range checks {
			s := checkState(c)
			if !isSerf(s) {
				continue
			}
			// a node's point read may be newer than this listing
			if old, ok := f.serf[s.Node]; ok && old.ModifyIndex > s.ModifyIndex && old.CreateIndex == s.CreateIndex {
				s = old
			}
			serf[s.Node] = s
		}
		f.serf, f.serfRead = serf, true
		w.publish(ctx, out)
		return idx, nil
	})
}

func containsCheck(cs []health.CheckState, c health.CheckState) bool {
	for _, x := range cs {
		if x.Node == c.Node && x.CheckID == c.CheckID {
			return true
		}
	}
	return false
}

// serfOf is the serfHealth among a node's checks (nil if none).
func serfOf(checks api.HealthChecks) *api.HealthCheck {
	for _, c := range checks {
		if c.CheckID == health.SerfHealthCheckID && c.ServiceID == "" {
			return c
		}
	}
	return nil
}
