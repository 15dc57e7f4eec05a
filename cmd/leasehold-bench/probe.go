package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/health"
)

// taskProbe records when each lease first shows critical in a blocking query
// of the harness's own: when Consul could have told leasehold of a lapse.
// That splits lapse → stop into Consul's part and leasehold's.
//
// With --consul-probe it follows /v1/health/state/critical: one query whose
// answer holds only the critical checks. With --flapping it follows, per
// task type, the executors with a non-passing check through
// /v1/health/service/<task> with a filter — the watch design a busy
// datacenter calls for, whose index is the task's own (moved by that task's
// registrations, their checks and their nodes' checks only) — and counts how
// often that alternative would wake. leasehold uses neither. The per-task
// query is a poor instrument for a large task type: each of its wakes has
// Consul run the filter over every registration of the task (~5 ms a
// thousand), and at 10,000 executors in one task type every lapse woke it,
// on a 2-core box Consul shares with leasehold and the harness: Consul's
// part at p50 11.2 ms with it, 7.4–9.5 ms with the state query, the same
// build on the same day (BENCHMARKS.md, "The instrument's own load").
type taskProbe struct {
	wakes, answers, bytes atomic.Int64
	mu                    sync.Mutex
	critical              map[string]time.Time // instance → when its lease first showed critical
	stop                  context.CancelFunc
	wg                    sync.WaitGroup
}

const probeFilter = `Checks.Status != "passing"`

// probeEntry is what the probe reads of a /v1/health/service answer.
type probeEntry struct {
	Checks []probeCheck
}

// probeCheck is what the probe reads of a check.
type probeCheck struct{ CheckID, Status string }

// decodeServiceEntries reads a /v1/health/service answer.
func decodeServiceEntries(body []byte) ([]probeEntry, error) {
	var entries []probeEntry
	err := json.Unmarshal(body, &entries)
	return entries, err
}

// decodeChecks reads a /v1/health/state answer as one entry of its checks.
func decodeChecks(body []byte) ([]probeEntry, error) {
	var checks []probeCheck
	if err := json.Unmarshal(body, &checks); err != nil {
		return nil, err
	}
	return []probeEntry{{Checks: checks}}, nil
}

// startProbe starts the probe's blocking queries: with --flapping one per
// task type, else (--consul-probe) one of the critical checks.
func (b *bench) startProbe() error {
	if !*consulProbe && *flapping == 0 {
		return nil
	}
	ctx, cancel := context.WithCancel(b.ctx)
	p := &taskProbe{critical: map[string]time.Time{}, stop: cancel}
	if *flapping == 0 {
		base := "http://" + b.agent.HTTPAddr() + "/v1/health/state/critical?wait=10s"
		p.wg.Add(1)
		go func() { defer p.wg.Done(); p.follow(ctx, base, decodeChecks) }()
		b.probe = p
		return nil
	}
	for _, task := range b.fleet.tasks {
		base := "http://" + b.agent.HTTPAddr() + "/v1/health/service/" + task +
			"?wait=10s&filter=" + url.QueryEscape(probeFilter)
		if _, _, err := get(ctx, base); err != nil { // the filter is Consul's to accept
			cancel()
			return fmt.Errorf("per-task probe: %w", err)
		}
		p.wg.Add(1)
		go func() { defer p.wg.Done(); p.follow(ctx, base, decodeServiceEntries) }()
	}
	b.probe = p
	return nil
}

func (p *taskProbe) follow(ctx context.Context, base string,
	decode func([]byte) ([]probeEntry, error)) {
	var index uint64
	for ctx.Err() == nil {
		body, next, err := get(ctx, base+"&index="+strconv.FormatUint(index, 10))
		at := time.Now()
		if err != nil {
			if ctx.Err() == nil {
				logf("probe: %v", err)
				time.Sleep(time.Second) // back off; the probe is an aside
			}
			continue
		}
		p.answers.Add(1)
		p.bytes.Add(int64(len(body)))
		if next != index {
			p.wakes.Add(1)
		}
		index = next
		entries, err := decode(body)
		if err != nil {
			logf("probe: %v", err)
			continue
		}
		p.seen(entries, at)
	}
}

// seen records the leases critical in an answer received at.
func (p *taskProbe) seen(entries []probeEntry, at time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, e := range entries {
		for _, c := range e.Checks {
			inst, _, _, ok := health.ParseCheckID(c.CheckID)
			if !ok || c.Status != "critical" {
				continue
			}
			if _, known := p.critical[inst]; !known {
				p.critical[inst] = at
			}
		}
	}
}

// consulPart is, per victim the probe saw critical, lease expiry → seen.
func (p *taskProbe) consulPart(f *fleet, victims []int, expiries []time.Time) []time.Duration {
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []time.Duration
	for k, i := range victims {
		if at, ok := p.critical[f.ids[i]]; ok {
			out = append(out, at.Sub(expiries[k]))
		}
	}
	return out
}

// afterConsul is, per victim the probe saw critical and every dispatcher of w
// dropped, the probe seeing it → the last dispatcher without it: leasehold's
// part of a lapse on the harness's clock, as the floor's push → last stream
// is (leasehold's own histogram ends at the last ACK instead, a round trip
// later). It is negative when leasehold's watch answered before the probe's.
func (p *taskProbe) afterConsul(f *fleet, w hostWatcher, victims []int) []time.Duration {
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []time.Duration
	for _, i := range victims {
		at, ok := p.critical[f.ids[i]]
		if !ok {
			continue
		}
		if gone := w.goneFromAll(f.ids[i]); !gone.IsZero() {
			out = append(out, gone.Sub(at))
		}
	}
	return out
}

func (b *bench) stopProbe() {
	if b.probe != nil {
		b.probe.stop()
		b.probe.wg.Wait()
	}
}
