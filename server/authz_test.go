package server

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// A granted dispatcher gets its task types; asking for another that exists
// is answered exactly as asking for one that does not — same resources, same
// versions — so it cannot learn that it exists.
func TestGrantsScopeTaskTypesWithoutLeaking(t *testing.T) {
	s := startSecure(t)
	w := s.as(t, "spiffe://test/dispatcher/work")

	a := w.ads(node("d-work", nil))
	a.Subscribe(resource.ListenerType)
	if got := listenerNames(a.Next()); !slices.Equal(got, []string{"work"}) {
		t.Fatalf("wildcard listeners of a dispatcher granted [work]: %v", got)
	}
	a.Subscribe(resource.EndpointType, "work", "other")
	withOther := a.Next()
	if got := names(withOther); !slices.Equal(got, []string{"work"}) {
		t.Fatalf("endpoints [work other] for a dispatcher granted [work]: %v", got)
	}
	b := w.ads(node("d-work-2", nil))
	b.Subscribe(resource.EndpointType, "work", "no-such-task")
	withNone := b.Next()
	if withOther.GetVersionInfo() != withNone.GetVersionInfo() ||
		!proto.Equal(withOther.GetResources()[0], withNone.GetResources()[0]) {
		t.Errorf("a granted-out task type is distinguishable from a missing one: versions %s vs %s",
			withOther.GetVersionInfo(), withNone.GetVersionInfo())
	}
	if got := hosts(t, withOther, "work"); !slices.Equal(got, []string{"a", "b"}) {
		t.Errorf("work endpoints: %v", got)
	}

	// A dispatcher cannot grant itself more through its own metadata.
	c := w.ads(node("d-sneaky", map[string]any{"leasehold.granted_tasks": []any{"work", "other"}}))
	c.Subscribe(resource.ListenerType)
	if got := listenerNames(c.Next()); !slices.Equal(got, []string{"work"}) {
		t.Errorf("self-granted metadata was honoured: %v", got)
	}

	// The identity granted "*" sees everything.
	all := s.as(t, "spiffe://test/dispatcher/all").ads(node("d-all", nil))
	all.Subscribe(resource.ListenerType)
	if got := listenerNames(all.Next()); !slices.Equal(got, []string{"other", "work"}) {
		t.Errorf("wildcard grant: %v", got)
	}
}

// A granted stream naming ever new task types outside its grant is answered
// as before, and leasehold remembers (counts, logs) at most maxDeniedNames of
// them: a hostile client cannot grow its memory or log without end.
func TestDeniedNamesAreRememberedBoundedly(t *testing.T) {
	s := startSecure(t)
	a := s.as(t, "spiffe://test/dispatcher/work").ads(node("d-work", nil))
	for round := range 3 {
		subs := []string{"work"}
		for i := range 300 {
			subs = append(subs, fmt.Sprintf("other-%d-%d", round, i))
		}
		a.Subscribe(resource.EndpointType, subs...)
		if round == 0 { // later rounds change nothing the stream is sent
			if got := names(a.Next()); !slices.Equal(got, []string{"work"}) {
				t.Fatalf("endpoints %v for a dispatcher granted [work]", got)
			}
		}
	}
	// The stream's requests are handled in order: once its first listeners
	// request is answered, every endpoints request before it was.
	a.Subscribe(resource.ListenerType)
	if got := listenerNames(a.Next()); !slices.Equal(got, []string{"work"}) {
		t.Fatalf("listeners %v for a dispatcher granted [work]", got)
	}
	s.xds.mu.Lock()
	defer s.xds.mu.Unlock()
	if len(s.xds.auth) != 1 {
		t.Fatalf("%d streams authorized, want 1", len(s.xds.auth))
	}
	for _, a := range s.xds.auth {
		if n := len(a.denied); n != maxDeniedNames {
			t.Fatalf("%d denied names remembered after 900, want the bound %d", n, maxDeniedNames)
		}
	}
}

func TestFencingGrants(t *testing.T) {
	s := startSecure(t)
	ctx := context.Background()
	// Wait until the fleet is read: a's session is CURRENT for a granted client.
	other := leaseholdv1.NewFencingClient(s.as(t, "spiffe://test/dispatcher/other").dial())
	deadline := time.Now().Add(5 * time.Second)
	for {
		r, err := other.CheckSession(ctx,
			&leaseholdv1.CheckSessionRequest{InstanceId: "o", SessionId: "s-o"})
		if err == nil && r.GetState() == leaseholdv1.SessionState_CURRENT {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("session o never CURRENT: %v %v", r, err)
		}
		time.Sleep(10 * time.Millisecond)
	}

	work := leaseholdv1.NewFencingClient(s.as(t, "spiffe://test/dispatcher/work").dial())
	if r, err := work.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "a",
		SessionId: "s-a"}); err != nil ||
		r.GetState() != leaseholdv1.SessionState_CURRENT {
		t.Errorf("granted task's session: %v %v", r, err)
	}
	hidden, err := work.CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: "o", SessionId: "s-o"})
	if err != nil {
		t.Fatal(err)
	}
	never, err := work.CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: "o", SessionId: "never"})
	if err != nil {
		t.Fatal(err)
	}
	hidden.ViewAge, never.ViewAge, hidden.SessionId, never.SessionId = nil, nil, "", ""
	if hidden.GetState() != leaseholdv1.SessionState_UNKNOWN || !proto.Equal(hidden, never) {
		t.Errorf("a session of a task type outside the grant leaks: %v vs never seen %v",
			hidden, never)
	}
	// WatchSession is not granted to this identity.
	ws, err := work.WatchSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: "a", SessionId: "s-a"})
	if err == nil {
		_, err = ws.Recv()
	}
	if status.Code(err) != codes.PermissionDenied {
		t.Errorf("WatchSession without the grant: want PermissionDenied, got %v", err)
	}
}

// Under --authz-policy a session is answered only to callers granted one of
// its task types. A session known only from a replaces meta has the task
// types of the registrations naming it, so a caller granted those gets
// STALE, not the UNKNOWN ("never seen") it would get were the session
// without task types, and the replaces meta works for a secured leasehold
// too. A caller not granted them still learns nothing.
func TestSessionNamedByReplacesIsStaleToCallersGrantedItsNamer(t *testing.T) {
	s := startSecure(t)
	namer := member("other", "r", 9200, "1.0.0")
	namer.SessionID, namer.Generation, namer.Replaces = "s2", 2, []string{"s1"}
	namer.Checks[1].CheckID = health.CheckID("r", "s2", "other")
	s.members("other", member("other", "o", 9100, "1.0.0"), namer)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	other := leaseholdv1.NewFencingClient(s.as(t, "spiffe://test/dispatcher/other").dial())
	ws, err := other.WatchSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: "r", SessionId: "s2"})
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
	r, err := other.CheckSession(ctx,
		&leaseholdv1.CheckSessionRequest{InstanceId: "r", SessionId: "s1"})
	if err != nil {
		t.Fatal(err)
	}
	if r.GetState() != leaseholdv1.SessionState_STALE || r.GetNewerSessionId() != "s2" {
		t.Fatalf(
			"r/s1 (named by r/s2, task other, granted) = %s newer %q (%s), want STALE newer s2",
			r.GetState(), r.GetNewerSessionId(), r.GetDetail())
	}
	// A caller not granted task other still learns nothing.
	work := leaseholdv1.NewFencingClient(s.as(t, "spiffe://test/dispatcher/work").dial())
	if r, err := work.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "r",
		SessionId: "s1"}); err != nil ||
		r.GetState() != leaseholdv1.SessionState_UNKNOWN {
		t.Fatalf("r/s1 for a caller not granted task other: %v %v", r, err)
	}
}

func listenerNames(r *discovery.DiscoveryResponse) []string {
	var out []string
	for _, res := range r.GetResources() {
		l := &listenerv3.Listener{}
		res.UnmarshalTo(l)
		out = append(out, l.GetName())
	}
	slices.Sort(out)
	return out
}
