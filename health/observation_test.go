package health

import "testing"

func member(checks ...CheckState) Member {
	e := exec(nil)
	return Member{Observed: Observed{Registration: e.Registration, ServiceID: e.ServiceID,
		Node: e.Node, CreateIndex: e.CreateIndex, Err: e.Err}, Checks: checks}
}

var leaseID = CheckID("exec-1", "s1", "transcode")

func lease(status CheckStatus, output string, idx uint64) CheckState {
	return CheckState{Node: "n1", CheckID: leaseID, ServiceID: "transcode:exec-1", Status: status,
		Output: output, ModifyIndex: idx}
}

func serf(status CheckStatus, idx uint64) CheckState {
	return CheckState{Node: "n1", CheckID: "serfHealth", Status: status, ModifyIndex: idx}
}

func TestJoin(t *testing.T) {
	tests := []struct {
		name  string
		m     Member
		np    *NonPassingSet
		lease CheckStatus
		node  CheckStatus
		other CheckStatus
		found bool
		load  int
	}{
		{"membership only", member(lease(StatusPassing, "load=1", 10), serf(StatusPassing, 5)), nil,
			StatusPassing, StatusPassing, "", true, 1},
		{"lapse seen by the fast path",
			member(lease(StatusPassing, "load=1", 10), serf(StatusPassing, 5)),
			NewNonPassingSet(NonPassing{Index: 20,
				Checks: []CheckState{lease(StatusCritical, "TTL expired", 20)}}), StatusCritical,
			StatusPassing, "", true, 1},
		{"recovery seen by the fast path",
			member(lease(StatusWarning, "load=4", 10), serf(StatusPassing, 5)),
			NewNonPassingSet(NonPassing{Index: 20}), StatusPassing, StatusPassing, "", true, 4},
		{"membership newer than fast path",
			member(lease(StatusWarning, "load=4", 30), serf(StatusPassing, 5)),
			NewNonPassingSet(NonPassing{Index: 20}), StatusWarning, StatusPassing, "", true, 4},
		{"stale fast-path entry", member(lease(StatusPassing, "load=0", 30)),
			NewNonPassingSet(NonPassing{Index: 20,
				Checks: []CheckState{lease(StatusCritical, "", 15)}}), StatusPassing, "", "", true,
			0},
		{"node failed", member(lease(StatusPassing, "", 10), serf(StatusPassing, 5)),
			NewNonPassingSet(NonPassing{Index: 20, Checks: []CheckState{serf(StatusCritical, 19)}}),
			StatusPassing, StatusCritical, "", true, 0},
		{"no lease check", member(serf(StatusPassing, 5)), nil, "", StatusPassing, "", false, 0},
		{"another node check critical is no node failure",
			member(lease(StatusPassing, "", 10), serf(StatusPassing, 5),
				CheckState{Node: "n1", CheckID: "disk", Status: StatusCritical, ModifyIndex: 6}),
			nil, StatusPassing, StatusCritical, "", true, 0},
		{"other check of another session is not the lease",
			member(CheckState{Node: "n1", CheckID: CheckID("exec-1", "old", "transcode"),
				ServiceID: "transcode:exec-1", Status: StatusPassing}),
			nil, "", "", StatusPassing, false, 0},
		{"unknown status is critical",
			member(lease(StatusPassing, "", 1),
				CheckState{Node: "n1", CheckID: "mine", ServiceID: "transcode:exec-1",
					Status: "maintenance"}),
			nil, StatusPassing, "", StatusCritical, true, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := Join(tt.m, tt.np)
			if e.LeaseStatus != tt.lease || e.NodeChecks != tt.node || e.Other != tt.other ||
				e.LeaseFound != tt.found || e.Load != tt.load {
				t.Fatalf("joined lease=%q node=%q other=%q found=%v load=%d", e.LeaseStatus,
					e.NodeChecks, e.Other, e.LeaseFound, e.Load)
			}
			if failed := tt.name == "node failed"; e.NodeFailed != failed {
				t.Fatalf("NodeFailed = %v, want %v", e.NodeFailed, failed)
			}
		})
	}
}

func TestJoinNodeFailedFromConsulsIndexes(t *testing.T) {
	leaseAt := func(created uint64) CheckState {
		c := lease(StatusPassing, "load=0", created)
		c.CreateIndex = created
		return c
	}
	serfAt := func(created, modified uint64) CheckState {
		c := serf(StatusPassing, modified)
		c.CreateIndex = created
		return c
	}
	for _, tt := range []struct {
		name   string
		checks []CheckState
		failed bool
	}{
		{"serf untouched since before the session", []CheckState{leaseAt(20), serfAt(5, 5)}, false},
		{"serf rewritten after the session registered: the node failed and came back",
			[]CheckState{leaseAt(20), serfAt(5, 30)}, true},
		{"serf created after the session: the leader caught up with a join",
			[]CheckState{leaseAt(20), serfAt(25, 25)}, false},
		{"serf created after the session, then changed: failed since",
			[]CheckState{leaseAt(20), serfAt(25, 31)}, true},
		{"no lease check", []CheckState{serfAt(5, 30)}, false},
	} {
		if e := Join(member(tt.checks...), nil); e.NodeFailed != tt.failed {
			t.Errorf("%s: NodeFailed = %v", tt.name, e.NodeFailed)
		}
	}
}

// TestLeaseCheckRecreated: the rule the Registrar and leasehold share — a
// session's lease check created at another index than the one first seen
// was lost by the catalog and created anew, which ends the session.
func TestLeaseCheckRecreated(t *testing.T) {
	for _, tt := range []struct {
		name       string
		first, now uint64
		recreated  bool
	}{
		{"the same check", 40, 40, false},
		{"created anew (agent left and re-synced, node reaped and rejoined)", 40, 90, true},
		{"created anew at a lower index (Consul lost or restored its state)", 40, 7, true},
		{"first sight", 0, 40, false},
		{"missing now (not re-created yet)", 40, 0, false},
		{"never seen", 0, 0, false},
	} {
		if got := LeaseCheckRecreated(tt.first, tt.now); got != tt.recreated {
			t.Errorf("%s: LeaseCheckRecreated(%d, %d) = %v", tt.name, tt.first, tt.now, got)
		}
	}
}

// Join reports the CreateIndex of the session's own lease check, which
// LeaseCheckRecreated compares (0 without one).
func TestJoinReportsTheLeaseChecksCreateIndex(t *testing.T) {
	mine := lease(StatusPassing, "load=0", 50)
	mine.CreateIndex = 40
	other := CheckState{Node: "n1", CheckID: CheckID("exec-1", "old", "transcode"),
		ServiceID: "transcode:exec-1", Status: StatusPassing, CreateIndex: 30}
	if e := Join(member(other, mine, serf(StatusPassing, 5)), nil); e.LeaseCreateIndex != 40 {
		t.Fatalf("LeaseCreateIndex %d, want 40 (the session's own check)", e.LeaseCreateIndex)
	}
	// A member carries nothing a join decided: without its lease check, none.
	if e := Join(member(other, serf(StatusPassing, 5)), nil); e.LeaseCreateIndex != 0 {
		t.Fatalf("without its lease check: LeaseCreateIndex %d, want 0", e.LeaseCreateIndex)
	}
}

// A check the member's read lacks — added since, without a catalog change:
// a node put in maintenance, a new check of the service — counts from the
// non-passing set; one of another node or service does not.
func TestJoinCountsSetChecksTheReadLacks(t *testing.T) {
	reg := Registration{InstanceID: "a", SessionID: "s1", Generation: 1, Task: "work",
		Address: "127.0.0.1", Port: 9000, Version: "1.0.0", Capacity: 2, State: StateActive}
	m := Member{Observed: Observed{Registration: reg, ServiceID: ServiceID("a", "work"), Node: "n1",
		CreateIndex: 40},
		Checks: []CheckState{
			{Node: "n1", CheckID: SerfHealthCheckID, Status: StatusPassing, CreateIndex: 5,
				ModifyIndex: 5},
			{Node: "n1", CheckID: CheckID("a", "s1", "work"), ServiceID: ServiceID("a", "work"),
				Status: StatusPassing, CreateIndex: 40, ModifyIndex: 40},
		}}
	for _, c := range []struct {
		name      string
		set       []CheckState
		node, oth CheckStatus
	}{
		{"maintenance of its node",
			[]CheckState{{Node: "n1", CheckID: "_node_maintenance", Status: StatusCritical,
				ModifyIndex: 50}}, StatusCritical, ""},
		{"a new check of its service",
			[]CheckState{{Node: "n1", CheckID: "http", ServiceID: ServiceID("a", "work"),
				Status: StatusWarning, ModifyIndex: 50}}, StatusPassing, StatusWarning},
		{"another node's maintenance",
			[]CheckState{{Node: "n2", CheckID: "_node_maintenance", Status: StatusCritical,
				ModifyIndex: 50}}, StatusPassing, ""},
		{"another service's check",
			[]CheckState{{Node: "n1", CheckID: "http", ServiceID: ServiceID("b", "work"),
				Status: StatusCritical, ModifyIndex: 50}}, StatusPassing, ""},
	} {
		e := Join(m, NewNonPassingSet(NonPassing{Index: 50, Checks: c.set}))
		if e.NodeChecks != c.node || e.Other != c.oth || e.LeaseStatus != StatusPassing {
			t.Errorf("%s: node checks %q other %q lease %q, want %q %q passing", c.name,
				e.NodeChecks, e.Other, e.LeaseStatus, c.node, c.oth)
		}
	}
}

// TestNodeFailureSeenWhenSerfHealthWasCreatedAfterTheLease: serfHealth may be
// created after the session's lease check. When a node joins, its agent's
// anti-entropy sync (node, services, checks) races the leader's
// handleAliveMember, which creates serfHealth: the agent syncs as soon as it
// learns a server, the leader registers serfHealth when the member-join
// reaches it through gossip and its reconcile queue; the same after a node
// re-registration. Once serfHealth exists it is only rewritten when its status
// or output changes (Consul 1.13's state.ensureCheckTxn keeps ModifyIndex for
// an identical check), so a ModifyIndex above its CreateIndex means the node
// failed after the check was created, which is after the lease was. Join sees
// such a failure also once it has healed, as the Registrar's fence check and a
// replica started later must.
func TestNodeFailureSeenWhenSerfHealthWasCreatedAfterTheLease(t *testing.T) {
	l := lease(StatusPassing, "load=0", 20)
	l.CreateIndex = 20 // the executor's session, synced by its agent
	// The leader registered the node's serfHealth just after (passing, "Agent alive and
	// reachable"); it turned critical at 50 (the node failed), passing again at 60 (it came
	// back).
	s := serf(StatusPassing, 60)
	s.CreateIndex = 25
	if e := Join(member(l, s), nil); !e.NodeFailed {
		t.Fatalf("serfHealth created at 25 (passing), rewritten at 60, lease created at 20: " +
			"the node failed after the session registered, but NodeFailed = false")
	}
}
