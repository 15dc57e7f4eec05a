package fleet

import "github.com/leasehold/leasehold/health"

// Generation keys: each datacenter's listing of leasehold/generation/, and
// the keys its task watches read back for registrations newer than that
// listing (TaskMembers.Keys), merged into one record per instance that Fence
// judges registrations by.

// applyListing takes a datacenter's generation listing in: reads back
// written at or before its index are covered by it (a key absent from it
// was deleted since), newer ones are kept until a listing covers them.
func (s *Syncer) applyListing(d *dcState, g *health.Generations) {
	d.listed = g.Keys
	if d.listed == nil {
		d.listed = map[string]health.GenerationRecord{}
	}
	for inst, k := range d.keyReads {
		if k.ModifyIndex <= g.Index {
			delete(d.keyReads, inst)
		}
	}
	d.haveGen = true
	d.genIndex = g.Index
	s.mergeKeys()
}

// applyKeyReads takes a task watch's read-back keys in; it reports whether
// any is newer than what the datacenter's keys hold.
func (s *Syncer) applyKeyReads(d *dcState, reads map[string]health.GenerationRecord) bool {
	newer := false
	for inst, k := range reads {
		if k.ModifyIndex <= d.genIndex || k.ModifyIndex <= d.key(inst).ModifyIndex {
			continue // the listing (or an earlier read) already holds it, or something newer
		}
		if d.keyReads == nil {
			d.keyReads = map[string]health.GenerationRecord{}
		}
		d.keyReads[inst] = k
		newer = true
	}
	if newer {
		s.mergeKeys()
	}
	return newer
}

// key is the datacenter's newest read of inst's key.
func (d *dcState) key(inst string) health.GenerationRecord {
	k := d.listed[inst]
	if r, ok := d.keyReads[inst]; ok && r.ModifyIndex > k.ModifyIndex {
		k = r
	}
	return k
}

// mergeKeys is every datacenter's generation keys in one: per instance the
// highest generation (an instance's key lives in its own datacenter; should
// one instance id have keys in two, the newer generation wins, and of equal
// ones the one naming its session, so every replica picks the same).
func (s *Syncer) mergeKeys() {
	merged := map[string]health.GenerationRecord{}
	for name, d := range s.dcs {
		key := func(inst string) health.GenerationRecord {
			k := d.key(inst)
			k.Datacenter = name // where its session registers (Fence's keyHome)
			return k
		}
		for inst := range d.listed {
			merged[inst] = newerKey(merged[inst], key(inst))
		}
		for inst := range d.keyReads {
			merged[inst] = newerKey(merged[inst], key(inst))
		}
	}
	s.keys = merged
	s.keysGen++
}

func newerKey(a, b health.GenerationRecord) health.GenerationRecord {
	switch {
	case a.Generation != b.Generation:
		if b.Generation > a.Generation {
			return b
		}
		return a
	case a.SessionID != b.SessionID:
		if b.SessionID > a.SessionID {
			return b
		}
		return a
	case b.ModifyIndex > a.ModifyIndex:
		return b
	}
	return a
}

// markKeyChanges adds the instances whose generation key changed since the
// fleet state was last fenced: they are fenced again.
func (s *Syncer) markKeyChanges(instances map[string]struct{}) {
	if s.keysGen == s.keysJoinedGen {
		return
	}
	for inst, k := range s.keys {
		if s.keysJoined[inst] != k {
			instances[inst] = struct{}{}
		}
	}
	for inst := range s.keysJoined {
		if _, ok := s.keys[inst]; !ok {
			instances[inst] = struct{}{}
		}
	}
	s.keysJoined, s.keysJoinedGen = s.keys, s.keysGen
}
