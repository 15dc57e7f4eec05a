package server

import (
	"context"
	"testing"
	"time"

	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// TestAttack20cNamedSessionUnderAuthz: under --authz-policy a session is
// answered only to callers granted one of its task types. A session known
// only from a replaces meta had no task types, so every caller, however
// granted, got UNKNOWN ("never seen") instead of STALE: the replaces meta
// did nothing for a secured leasehold. (The fix is in health: such a
// session has the task types of the registrations naming it.)
func TestAttack20cNamedSessionUnderAuthz(t *testing.T) {
	s := startSecure(t)
	namer := member("other", "r", 9200, "1.0.0")
	namer.SessionID, namer.Generation, namer.Replaces = "s2", 2, []string{"s1"}
	namer.Checks[1].CheckID = health.CheckID("r", "s2", "other")
	s.members("other", member("other", "o", 9100, "1.0.0"), namer)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	other := leaseholdv1.NewFencingClient(s.as(t, "spiffe://test/dispatcher/other").dial())
	ws, err := other.WatchSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "r", SessionId: "s2"})
	if err != nil {
		t.Fatal(err)
	}
	for {
		r, err := ws.Recv()
		if err != nil {
			t.Fatalf("r/s2 never CURRENT: %v", err)
		}
		if r.GetState() == leaseholdv1.SessionState_CURRENT {
			break
		}
	}
	r, err := other.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "r", SessionId: "s1"})
	if err != nil {
		t.Fatal(err)
	}
	if r.GetState() != leaseholdv1.SessionState_STALE || r.GetNewerSessionId() != "s2" {
		t.Fatalf("r/s1 (named by r/s2, task other, granted) = %s newer %q (%s), want STALE newer s2", r.GetState(), r.GetNewerSessionId(), r.GetDetail())
	}
	// A caller not granted task other still learns nothing.
	work := leaseholdv1.NewFencingClient(s.as(t, "spiffe://test/dispatcher/work").dial())
	if r, err := work.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "r", SessionId: "s1"}); err != nil || r.GetState() != leaseholdv1.SessionState_UNKNOWN {
		t.Fatalf("r/s1 for a caller not granted task other: %v %v", r, err)
	}
}
