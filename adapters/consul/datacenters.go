package consul

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// Watchers watch one or several Consul datacenters through the local agent
// (?dc=), a Watcher each with the same blocking-query rules and bounds; the
// agent's servers forward each query to the datacenter's servers over WAN.
// A datacenter that does not answer fails only its own watches.
type Watchers struct {
	order []string // as configured; [""] for the agent's own, unnamed
	byDC  map[string]*Watcher
}

// NewWatchers watches datacenters (nil: the agent's own only, unnamed, as a
// single Watcher). The per-task query slots (cfg.MaxConcurrent) are shared
// out between the datacenters: every query goes through one agent, which
// answers 429 past 200 connections from one address.
func NewWatchers(client *api.Client, cfg WatchConfig, datacenters []string) (*Watchers, error) {
	ws := &Watchers{byDC: map[string]*Watcher{}}
	if len(datacenters) == 0 {
		datacenters = []string{""}
	}
	if n := len(datacenters); n > 1 {
		if cfg.MaxConcurrent <= 0 {
			cfg.MaxConcurrent = WatchConfig{}.withDefaults().MaxConcurrent
		}
		cfg.MaxConcurrent = max(cfg.MaxConcurrent/n, 2)
	}
	for _, dc := range datacenters {
		if dc != "" {
			if err := health.ValidateDatacenter("datacenters", dc); err != nil {
				return nil, err
			}
		}
		if _, dup := ws.byDC[dc]; dup {
			return nil, fmt.Errorf("datacenter %q listed twice", dc)
		}
		c := cfg
		c.Datacenter = dc
		if c.Logger != nil && dc != "" {
			c.Logger = c.Logger.With("datacenter", dc)
		}
		ws.byDC[dc] = NewWatcher(client, c)
		ws.order = append(ws.order, dc)
	}
	return ws, nil
}

// openQueries is how many queries a Watcher keeps open besides its
// per-task slots: the critical and warning checks, serfHealth, the task
// list, the generation keys and the lapse marks.
const openQueries = 6

// Connections is how many connections to the agent leasehold may hold at
// once watching datacenters (at least 1) with maxConcurrent per-task
// queries in all: each datacenter's open queries, its share of the slots
// and its refresh's fresh read (made beside the blocking queries, one at a
// time), plus the control watch and the lapse recorder. The HTTP client
// must allow that many, or a query waits for a connection — the lapse in it
// too — until a blocking query returns.
func Connections(maxConcurrent, datacenters int) int {
	datacenters = max(datacenters, 1)
	slots := maxConcurrent
	if datacenters > 1 {
		slots = datacenters * max(maxConcurrent/datacenters, 2)
	}
	return slots + datacenters*(openQueries+1) + 2
}

// Run watches every datacenter until ctx ends, and returns ctx's error
// then; a Watcher that fails (Watcher.Run) ends the others and Run returns
// its error, naming its datacenter.
func (ws *Watchers) Run(ctx context.Context) error {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg     sync.WaitGroup
		once   sync.Once
		failed error
	)
	for _, dc := range ws.order {
		wg.Add(1)
		go func(w *Watcher) {
			defer wg.Done()
			if err := w.Run(wctx); err != nil && wctx.Err() == nil {
				once.Do(func() { failed = fmt.Errorf("datacenter %q: %w", dc, err); cancel() })
			}
		}(ws.byDC[dc])
	}
	wg.Wait()
	if failed != nil {
		return failed
	}
	return ctx.Err()
}

// FreshAsOf is when the view of datacenter dc was last known current (zero:
// never, or a datacenter not watched).
func (ws *Watchers) FreshAsOf(dc string) time.Time {
	if w := ws.byDC[dc]; w != nil {
		return w.FreshAsOf()
	}
	return time.Time{}
}

// Refresh asks datacenter dc's watches that have not reached index least
// to read afresh (Watcher.Refresh).
func (ws *Watchers) Refresh(ctx context.Context, dc string, least uint64) (uint64, error) {
	w := ws.byDC[dc]
	if w == nil {
		return 0, fmt.Errorf("datacenter %q is not watched", dc)
	}
	return w.Refresh(ctx, least)
}

// LastContact is when Consul last answered any query (zero before the first).
func (ws *Watchers) LastContact() time.Time {
	var last time.Time
	for _, w := range ws.byDC {
		if t := w.LastContact(); t.After(last) {
			last = t
		}
	}
	return last
}
