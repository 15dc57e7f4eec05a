package fleet

import "github.com/leasehold/leasehold/health"

// Lapse marks: every replica records the lapses it sees in each datacenter's
// KV (health.LapseMarkPrefix), so that a lapse stays final for every replica
// and across restarts. The Syncer merges every datacenter's marks, has the
// registrations of the sessions they name joined again (lapsed), and keeps the
// lapses it handed to OnLapse until it reads their marks back.

// lapseMarks is the Syncer's view of the lapse marks (owned by Run).
type lapseMarks struct {
	bySession  map[health.SessionKey]health.LapseMark // every datacenter's marks, merged
	byInstance map[string][]health.LapseMark          // the same, by instance
	// gen counts the replacements of a datacenter's marks (Observation.Lapses);
	// joinedGen is gen as the fleet state last took them in (markLapseMarks).
	gen, joinedGen uint64
	// awaited are the sessions handed to OnLapse whose mark has not been read
	// back yet (with AwaitLapses); awaitedView is the copy of it the latest
	// view shares (nil: to be made).
	awaited, awaitedView map[health.SessionKey]struct{}
}

// marked reports whether a lapse mark records session k.
func (m *lapseMarks) marked(k health.SessionKey) bool {
	_, ok := m.bySession[k]
	return ok
}

// markLapseMarks has the registrations of the sessions whose lapse marks
// (recorded by any replica, before any restart) changed joined again, now
// lapsed, and their instances fenced again.
func (s *Syncer) markLapseMarks(instances map[string]struct{}) {
	if s.marks.gen != s.marks.joinedGen {
		for inst := range s.mergeMarks() {
			instances[inst] = struct{}{}
			for _, ts := range s.fleet {
				for i := range ts.insts.of(inst) {
					ts.mark(i)
				}
			}
		}
		s.marks.joinedGen = s.marks.gen
	}
}

// mergeMarks takes every datacenter's lapse marks in and returns the
// instances whose marks changed.
func (s *Syncer) mergeMarks() map[string]struct{} {
	marked := map[health.SessionKey]health.LapseMark{}
	byInst := map[string][]health.LapseMark{}
	for _, d := range s.dcs {
		for _, m := range d.marks {
			k := health.SessionKey{Instance: m.InstanceID, Session: m.SessionID}
			if _, dup := marked[k]; !dup {
				marked[k] = m
				byInst[m.InstanceID] = append(byInst[m.InstanceID], m)
			}
		}
	}
	changed := map[string]struct{}{}
	for k := range marked {
		if _, ok := s.marks.bySession[k]; !ok {
			changed[k.Instance] = struct{}{}
		}
	}
	for k := range s.marks.bySession {
		if _, ok := marked[k]; !ok {
			changed[k.Instance] = struct{}{}
		}
	}
	s.marks.bySession, s.marks.byInstance = marked, byInst
	for k := range s.marks.awaited {
		if _, ok := marked[k]; ok {
			delete(s.marks.awaited, k)
			s.marks.awaitedView = nil
		}
	}
	return changed
}

// recordLapses hands every lapse of a batch that no lapse mark records yet
// to OnLapse, and awaits its mark.
func (s *Syncer) recordLapses(lapses []health.Executor) {
	if s.cfg.OnLapse == nil {
		return
	}
	for _, e := range lapses {
		k := health.SessionKey{Instance: e.InstanceID, Session: e.SessionID}
		if !s.marks.marked(k) {
			s.cfg.OnLapse(e)
			s.awaitMark(k)
		}
	}
}

// awaitMark notes that session k's lapse is being recorded (OnLapse): its
// answers wait for the mark to be read back (View.LapseUnrecorded), when the
// marks are read at all.
func (s *Syncer) awaitMark(k health.SessionKey) {
	if !s.cfg.AwaitLapses {
		return
	}
	if s.marks.awaited == nil {
		s.marks.awaited = map[health.SessionKey]struct{}{}
	}
	s.marks.awaited[k] = struct{}{}
	s.marks.awaitedView = nil
}
