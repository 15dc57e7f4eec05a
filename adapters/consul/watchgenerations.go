package consul

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// watchGenerations follows the generation keys in Consul KV: per instance
// the generation (and session) of its newest session, the same on every
// replica.
func (w *Watcher) watchGenerations(ctx context.Context) {
	var last map[string]health.GenerationRecord
	bad := map[string]string{} // key → value already warned about
	first := true
	handle := func(
		ctx context.Context, pairs api.KVPairs, idx, at uint64, err error,
	) (uint64, error) {
		if err != nil {
			first = true
			return 0, err
		}
		keys := make(map[string]health.GenerationRecord, len(pairs))
		for _, p := range pairs {
			inst, rec, err := generationPair(p)
			if err != nil {
				if bad[p.Key] != string(p.Value) {
					bad[p.Key] = string(p.Value)
					w.log.Warn("generation key ignored", "key", p.Key, "value", string(p.Value),
						"err", err)
				}
				continue
			}
			keys[inst] = rec
		}
		// The task watches compare new registrations with the listing only
		// once it went out (listedKeys after the send): a membership decided
		// before it must have read its keys back.
		if !first && maps.Equal(keys, last) {
			w.sendProgress(ctx, "generations", at, 0)
			w.listedKeys(keys, at)
			return idx, nil
		}
		first, last = false, keys
		w.send(ctx, health.Observation{Data: &health.Generations{Index: idx, Keys: keys}})
		// Current at at: it holds every key written before a registration up to at.
		w.listedKeys(keys, at)
		w.sendProgress(ctx, "generations", at, idx)
		return idx, nil
	}
	w.blockingLoop(
		ctx,
		watchSpec{
			name:        "generations",
			minInterval: w.cfg.MinInterval * 4,
			budget:      w.genBudget,
			kvListing:   true,
		},
		func(ctx context.Context, index uint64, wait time.Duration) (uint64, handleFunc) {
			pairs, idx, err := cutShort(
				w,
				ctx,
				wait,
				func(ctx context.Context, wait time.Duration) (api.KVPairs, uint64, error) {
					return w.cat.Generations(ctx, index, wait)
				},
			)
			at := w.receipt(idx) // the index space of the checks: see refresh.go
			return idx, func() (uint64, error) { return handle(ctx, pairs, idx, at, err) }
		},
	)
}

// generationPair reads one generation key: its instance and record.
func generationPair(p *api.KVPair) (string, health.GenerationRecord, error) {
	inst := strings.TrimPrefix(p.Key, health.GenerationKeyPrefix)
	if err := health.ValidateInstanceID(inst); err != nil {
		return "", health.GenerationRecord{}, fmt.Errorf(
			"want %s<instance_id>: %w",
			health.GenerationKeyPrefix,
			err,
		)
	}
	rec, err := health.ParseGenerationRecord(string(p.Value))
	if err != nil {
		return "", health.GenerationRecord{}, err
	}
	rec.ModifyIndex = p.ModifyIndex
	return inst, rec, nil
}

// listedKeys remembers the last generation listing (what the task watches
// compare new registrations with).
func (w *Watcher) listedKeys(keys map[string]health.GenerationRecord, index uint64) {
	w.keysMu.Lock()
	w.keys, w.keysIndex = keys, index
	w.keysMu.Unlock()
}

// maxKeyReads is the most generation keys a task watch reads back one by
// one; past it, one listing costs less time.
const maxKeyReads = 16

// readBackKeys reads the generation keys of the members just read that
// registered after the last generation listing and that it does not
// confirm as they are (their (generation, session) is not their key's): a
// session start writes its key before it registers, so this read, made
// after the membership, holds the key of every legitimate new session and
// the syncer confirms it at once instead of after the listing's next
// answer. A failed read only delays that confirmation: nil is returned.
func (w *Watcher) readBackKeys(
	ctx context.Context,
	entries []*api.ServiceEntry,
) map[string]health.GenerationRecord {
	w.keysMu.Lock()
	keys, index := w.keys, w.keysIndex
	w.keysMu.Unlock()
	var insts []string
	for _, e := range entries {
		if e.Service == nil || e.Service.ModifyIndex <= index {
			// The listing was read after this registration: it holds the key written before it.
			continue
		}
		inst, sess := e.Service.Meta[health.MetaInstanceID], e.Service.Meta[health.MetaSessionID]
		if health.ValidateSessionQuery(inst, sess) != nil {
			continue
		}
		k := keys[inst]
		if k.SessionID == sess &&
			strconv.FormatUint(k.Generation, 10) == e.Service.Meta[health.MetaGeneration] {
			continue
		}
		insts = append(insts, inst)
	}
	if len(insts) == 0 {
		return nil
	}
	slices.Sort(insts)
	insts = slices.Compact(insts)
	var pairs api.KVPairs
	var err error
	if len(insts) > maxKeyReads {
		pairs, _, err = w.cat.Generations(ctx, 0, 0)
	} else {
		pairs, err = w.cat.GenerationKeys(ctx, insts)
	}
	if err != nil {
		if ctx.Err() == nil {
			w.log.Warn(
				"reading back generation keys failed: new sessions are confirmed by the next "+
					"generation listing",
				"err", err)
		}
		return nil
	}
	out := make(map[string]health.GenerationRecord, len(pairs))
	for _, p := range pairs {
		if inst, rec, err := generationPair(p); err == nil {
			out[inst] = rec
		}
	}
	return out
}
