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

// applyKeyReads takes a task watch's read-back keys in: only the instances
// read are merged again (a membership answer must not cost the whole
// fleet's keys).
func (s *Syncer) applyKeyReads(d *dcState, reads map[string]health.GenerationRecord) {
	for inst, k := range reads {
		if k.ModifyIndex <= d.genIndex || k.ModifyIndex <= d.key(inst).ModifyIndex {
			continue // the listing (or an earlier read) already holds it, or something newer
		}
		if d.keyReads == nil {
			d.keyReads = map[string]health.GenerationRecord{}
		}
		d.keyReads[inst] = k
		s.setKey(inst, s.mergedKey(inst))
	}
}

// forgetKeyReads drops a datacenter's read-back keys (its Consul lost or
// restored its state: their indexes say nothing any more).
func (s *Syncer) forgetKeyReads(d *dcState) {
	if len(d.keyReads) > 0 {
		d.keyReads = nil
		s.mergeKeys()
	}
}

// key is the datacenter's newest read of inst's key.
func (d *dcState) key(inst string) health.GenerationRecord {
	k := d.listed[inst]
	if r, ok := d.keyReads[inst]; ok && r.ModifyIndex > k.ModifyIndex {
		k = r
	}
	return k
}

// mergedKey is inst's key over every datacenter: the highest generation
// (an instance's key lives in its own datacenter; should one instance id
// have keys in two, the newer generation wins, and of equal ones the one
// naming its session, so every replica picks the same).
func (s *Syncer) mergedKey(inst string) health.GenerationRecord {
	var k health.GenerationRecord
	for name, d := range s.dcs {
		dk := d.key(inst)
		if dk.Present() {
			dk.Datacenter = name // where its session registers (Fence's keyHome)
		}
		k = newerKey(k, dk)
	}
	return k
}

// mergeKeys merges every datacenter's keys again (after a listing).
func (s *Syncer) mergeKeys() {
	seen := make(map[string]struct{}, len(s.keys))
	for _, d := range s.dcs {
		for inst := range d.listed {
			seen[inst] = struct{}{}
		}
		for inst := range d.keyReads {
			seen[inst] = struct{}{}
		}
	}
	for inst := range s.keys {
		seen[inst] = struct{}{}
	}
	for inst := range seen {
		s.setKey(inst, s.mergedKey(inst))
	}
}

// setKey records inst's merged key; a change is fenced again in the next
// batch (markKeyChanges).
func (s *Syncer) setKey(inst string, k health.GenerationRecord) {
	if s.keys[inst] == k {
		return
	}
	if k.Present() {
		s.keys[inst] = k
	} else {
		delete(s.keys, inst)
	}
	if s.keysChanged == nil {
		s.keysChanged = map[string]struct{}{}
	}
	s.keysChanged[inst] = struct{}{}
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
	for inst := range s.keysChanged {
		instances[inst] = struct{}{}
	}
	clear(s.keysChanged)
}
