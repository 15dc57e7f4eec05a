package health

import "testing"

// TestAttack2NodeFailureMissedWhenSerfHealthCreatedAfterTheLease: the rule
// "serfHealth CreateIndex < lease CreateIndex < serfHealth ModifyIndex"
// (health.Join, and the same in APIAgent.Sessions) drops every case where
// serfHealth was created after the session's lease check. That is not only
// "the leader catching up with a join" with nothing after it: when a node
// joins, its agent's anti-entropy sync (node, services, checks) and the
// leader's handleAliveMember (which creates serfHealth) race — the agent
// syncs as soon as it learns a server, the leader registers serfHealth when
// the member-join reaches it through gossip and its reconcile queue — and
// the same after a node re-registration. Once serfHealth exists it is only
// rewritten when its status or output changes (Consul 1.13
// state.ensureCheckTxn keeps ModifyIndex for an identical check), so a
// ModifyIndex above its CreateIndex means the node failed after the check
// was created, which is after the lease was. Such a failure that has healed
// is invisible to both rules: a replica that saw serfHealth critical answers
// LAPSED for ever; a replica started later, and the Registrar's fence check,
// see nothing.
func TestAttack2NodeFailureMissedWhenSerfHealthCreatedAfterTheLease(t *testing.T) {
	l := lease(StatusPassing, "load=0", 20)
	l.CreateIndex = 20 // the executor's session, synced by its agent
	s := serf(StatusPassing, 60)
	s.CreateIndex = 25 // the leader registered the node's serfHealth just after (passing, "Agent alive and reachable")
	// ... critical at 50 (the node failed), passing again at 60 (it came back).
	if e := Join(member(l, s), nil); !e.NodeFailed {
		t.Fatalf("serfHealth created at 25 (passing), rewritten at 60, lease created at 20: the node failed after the session registered, but NodeFailed = false")
	}
}
