package consul

import (
	"testing"
)

// TestAttack20cOwnPreviousGenerationIsAFloor: the agent forgot this
// process's registrations (restarted without state) and the generation key
// is gone too (KV lost or deleted). The process knows its own previous
// session and its generation, yet took the next generation from the KV
// and the catalog only: the new session got a generation BELOW the one it
// replaced, and (being "not older") the previous session was left out of
// the replaces meta. A leasehold that remembers the old session then
// ranks it above the new one (answered UNKNOWN, not STALE), and should
// the old registration resurface (its agent re-syncs it) it would fence
// the live session. The process's own highest generation is a floor too.
func TestAttack20cOwnPreviousGenerationIsAFloor(t *testing.T) {
	agent := newFakeAgent()
	agent.gens["exec-1"] = 6 // earlier processes of the instance
	h := startOn(t, agent, nil)
	s1 := h.session(nil)
	if s1.Generation != 7 {
		t.Fatalf("premise: s1 generation %d", s1.Generation)
	}
	h.agent.forget() // agent restarted without state
	h.agent.mu.Lock()
	delete(h.agent.gens, "exec-1") // and the generation key is lost
	h.agent.mu.Unlock()
	h.advance(2, testHB)
	if l := h.loss(); l.Reason != LossRefused {
		t.Fatalf("loss %+v", l)
	}
	s2 := h.session(s1)
	if s2.Generation <= s1.Generation {
		t.Errorf("new session generation %d not above the replaced session's %d", s2.Generation, s1.Generation)
	}
	if len(s2.Replaces) == 0 || s2.Replaces[0] != s1.ID {
		t.Errorf("new session replaces %v, want %s first", s2.Replaces, s1.ID)
	}
}
