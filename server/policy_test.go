package server

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasehold/leasehold/internal/testcerts"
)

func TestPolicyValidationNamesTheField(t *testing.T) {
	for _, c := range []struct{ policy, want string }{
		{"dispatchers:\n  - tasks: [work]\n", "dispatchers[0].identity"},
		{"dispatchers:\n  - identity: a\n    tasks: [\"bad task\"]\n", "dispatchers[0].tasks[0]"},
		{"dispatchers:\n  - identity: a\n    fencing: [Delete]\n", "dispatchers[0].fencing[0]"},
		{"dispatchers:\n  - identity: a\n  - identity: a\n", "dispatchers[1].identity"},
		{"dispatchers:\n  - identity: a\n    task: [work]\n", "field task not found"},
		{`{"dispatchers": [{"identity": "a", "tasks": ["work"], "fencing": ["CheckSession"]}]}`, ""},
	} {
		_, err := ParsePolicy([]byte(c.policy))
		switch {
		case c.want == "" && err != nil:
			t.Errorf("valid policy %q refused: %v", c.policy, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("policy %q: want an error naming %s, got %v", c.policy, c.want, err)
		}
	}
}

// A policy change ends the streams whose grant changed at their next
// request (they reconnect under the new grant); an invalid change is
// refused and the previous policy stays in force.
func TestPolicyFollowed(t *testing.T) {
	s := startSecure(t)
	w := s.as(t, "spiffe://test/dispatcher/work")
	a := w.ads(node("d-follow", nil))
	a.Subscribe(resource.ListenerType)
	first := a.Next()

	ps := s.policy // what Follow runs each second, called directly here
	testcerts.WriteFile(t, filepath.Join(s.dir, "policy.yaml"),
		[]byte("dispatchers: [{identity: x, tasks: [\"bad task\"]}]\n"))
	ps.reload()
	if v := ps.Version(); v != 0 {
		t.Fatalf("an invalid policy was accepted (version %d)", v)
	}
	if g, ok := ps.Grant(Identity{URIs: []string{"spiffe://test/dispatcher/work"}}); !ok ||
		!g.AllowsTask("work") {
		t.Fatal("the previous policy is not in force after an invalid change")
	}
	testcerts.WriteFile(t, filepath.Join(s.dir, "policy.yaml"),
		[]byte(
			"dispatchers: [{identity: \"spiffe://test/dispatcher/work\", tasks: [work, other]}]\n"),
	)
	ps.reload()
	if ps.Version() != 1 {
		t.Fatal("a valid policy change was not taken")
	}
	a.ACK(first)
	if _, err := a.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("stream whose grant changed: want Unavailable (reconnect), got %v", err)
	}
	b := w.ads(node("d-follow", nil))
	b.Subscribe(resource.ListenerType)
	if got := listenerNames(b.Next()); !slices.Equal(got, []string{"other", "work"}) {
		t.Errorf("after reconnecting under the new grant: %v", got)
	}
}
