package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

// TestAttack20LapseMarksUnreadableStillRoutes: another replica (or this one
// before a restart) recorded x/s1's lapse in Consul KV; x/s1's check is
// passing again. leasehold runs with a token that reads everything it
// needs except leasehold/lapsed/ (the pre-issue-20 policy plus the new
// leasehold/control/ rule). The lapse marks are the only memory of the
// lapse, so x/s1 must not be routed — leasehold may stay unready, but must
// not serve the session it cannot tell is lapsed.
//
// (fixed; failed before: serve sets SyncConfig.AwaitLapses.) It failed
// because Syncer.allRead did not wait for the lapse marks (tasks,
// members, non-passing checks, generations and the controls only), so the
// fleet is served with x/s1 in the load assignment and answered CURRENT,
// while /readyz says 503 acl (key_prefix "leasehold/lapsed/"). The same
// window opens on every restart with a healthy token until the lapses
// watch's first answer arrives (see
// fleet.TestAttack20RestartServesLapsedSessionBeforeMarksRead).
func TestAttack20LapseMarksUnreadableStillRoutes(t *testing.T) {
	consultest.RequireBinary(t)
	a := consultest.Start(t, consultest.Options{ACLManagementToken: "7c1b0c1e-0000-4000-8000-0000000000a2"})
	root := a.Client()
	rules := `
service_prefix "" { policy = "read" }
node_prefix "" { policy = "read" }
key_prefix "leasehold/generation/" { policy = "read" }
key_prefix "leasehold/control/" { policy = "read" }
`
	p, _, err := root.ACL().PolicyCreate(&api.ACLPolicy{Name: "no-lapsed", Rules: rules}, nil)
	if err != nil {
		t.Fatal(err)
	}
	tok, _, err := root.ACL().TokenCreate(&api.ACLToken{Policies: []*api.ACLTokenPolicyLink{{ID: p.ID}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	catalogSession(t, root, "node-x", "x", "s1", 1, 9301)
	catalogSession(t, root, "node-y", "y", "y1", 1, 9302)
	mark := health.LapseMark{InstanceID: "x", SessionID: "s1", Generation: 1, At: time.Now().UTC().Truncate(time.Second), Tasks: []string{"work"}}
	if _, err := root.KV().Put(&api.KVPair{Key: health.LapseMarkKey("x", "s1"), Value: mark.Value()}, nil); err != nil {
		t.Fatal(err)
	}

	t.Setenv("CONSUL_HTTP_TOKEN", tok.SecretID)
	t.Setenv("CONSUL_HTTP_TOKEN_FILE", "")
	var log syncBuffer
	l := startServeLogged(t, a, &log)
	fc := fencingClient(t, l.xds)
	consultest.WaitFor(t, 15*time.Second, "/readyz naming leasehold/lapsed/", func() bool {
		code, body := readyzBody(t, l.admin)
		detail, _ := body["detail"].(string)
		return code == 503 && strings.Contains(detail, "leasehold/lapsed/")
	})
	// Give the syncer time to serve whatever it will serve.
	time.Sleep(2 * time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if r, err := fc.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "x", SessionId: "s1"}); err == nil && r.State == leaseholdv1.SessionState_CURRENT {
		t.Errorf("x/s1 (lapse recorded in KV) answered CURRENT while its lapse marks cannot be read (%s)", r.Detail)
	}
	// Nothing is served while the marks cannot be read: no snapshot (an
	// xDS client would wait), and the fleet is never announced as read.
	if strings.Contains(log.String(), "fleet read: serving") {
		t.Errorf("the fleet was served although its lapse marks cannot be read:\n%s", log.String())
	}
}
