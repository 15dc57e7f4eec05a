package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"log/slog"
	"math/big"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/internal/testcerts"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
)

const testPolicy = `
dispatchers:
  - identity: spiffe://test/dispatcher/work
    tasks: [work]
    fencing: [CheckSession]
  - identity: spiffe://test/dispatcher/other
    tasks: [other]
    fencing: ["*"]
  - identity: spiffe://test/dispatcher/all
    tasks: ["*"]
`

type secureFixture struct {
	*fixture
	ca, rogue *testcerts.CA
	dir       string
	tls       *ServerTLS
	policy    *PolicyStore
}

func startSecure(t *testing.T) *secureFixture {
	dir := t.TempDir()
	ca := testcerts.NewCA(t, "test CA")
	cert, key := ca.Issue(t, true, nil, "localhost")
	testcerts.WriteFile(t, filepath.Join(dir, "cert.pem"), cert)
	testcerts.WriteFile(t, filepath.Join(dir, "key.pem"), key)
	testcerts.WriteFile(t, filepath.Join(dir, "ca.pem"), ca.PEM)
	testcerts.WriteFile(t, filepath.Join(dir, "policy.yaml"), []byte(testPolicy))
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	st, err := NewServerTLS(TLSFiles{Cert: filepath.Join(dir, "cert.pem"), Key: filepath.Join(dir, "key.pem"), ClientCA: filepath.Join(dir, "ca.pem")}, log)
	if err != nil {
		t.Fatal(err)
	}
	policy, err := LoadPolicy(filepath.Join(dir, "policy.yaml"), log)
	if err != nil {
		t.Fatal(err)
	}
	f := startXDSWith(t, secureOpts{tls: st, policy: policy})
	return &secureFixture{fixture: f, ca: ca, rogue: testcerts.NewCA(t, "rogue CA"), dir: dir, tls: st, policy: policy}
}

// as returns a copy of the fixture whose connections present identity uri.
func (s *secureFixture) as(t *testing.T, uri string) *fixture {
	c := *s.fixture
	c.creds = s.ca.ClientCreds(t, s.ca, uri)
	return &c
}

func TestMTLSRefusesPlaintextAndUntrustedClients(t *testing.T) {
	s := startSecure(t)

	plain := *s.fixture // no credentials
	_, err := leaseholdv1.NewFencingClient(plain.dial()).CheckSession(context.Background(), &leaseholdv1.CheckSessionRequest{InstanceId: "a", SessionId: "s-a"})
	if status.Code(err) != codes.Unavailable {
		t.Errorf("plaintext client: want Unavailable (handshake refused), got %v", err)
	}

	rogue := *s.fixture
	rogue.creds = s.rogue.ClientCreds(t, s.ca, "spiffe://test/dispatcher/work")
	_, err = leaseholdv1.NewFencingClient(rogue.dial()).CheckSession(context.Background(), &leaseholdv1.CheckSessionRequest{InstanceId: "a", SessionId: "s-a"})
	if status.Code(err) != codes.Unavailable {
		t.Errorf("client with a certificate from an untrusted CA: want Unavailable, got %v", err)
	}

	stranger := s.as(t, "spiffe://test/dispatcher/stranger") // trusted CA, no grant
	a := stranger.ads(node("d-x", nil))
	a.Stream().Send(&discovery.DiscoveryRequest{Node: a.Node, TypeUrl: resource.ListenerType}) // may fail: the server ends the stream at once
	if _, err := a.Recv(); status.Code(err) != codes.PermissionDenied {
		t.Errorf("identity without a grant: want PermissionDenied, got %v", err)
	}
}

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
	if withOther.GetVersionInfo() != withNone.GetVersionInfo() || !proto.Equal(withOther.GetResources()[0], withNone.GetResources()[0]) {
		t.Errorf("a granted-out task type is distinguishable from a missing one: versions %s vs %s", withOther.GetVersionInfo(), withNone.GetVersionInfo())
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

func TestFencingGrants(t *testing.T) {
	s := startSecure(t)
	ctx := context.Background()
	// Wait until the fleet is read: a's session is CURRENT for a granted client.
	other := leaseholdv1.NewFencingClient(s.as(t, "spiffe://test/dispatcher/other").dial())
	deadline := time.Now().Add(5 * time.Second)
	for {
		r, err := other.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "o", SessionId: "s-o"})
		if err == nil && r.GetState() == leaseholdv1.SessionState_CURRENT {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("session o never CURRENT: %v %v", r, err)
		}
		time.Sleep(10 * time.Millisecond)
	}

	work := leaseholdv1.NewFencingClient(s.as(t, "spiffe://test/dispatcher/work").dial())
	if r, err := work.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "a", SessionId: "s-a"}); err != nil || r.GetState() != leaseholdv1.SessionState_CURRENT {
		t.Errorf("granted task's session: %v %v", r, err)
	}
	hidden, err := work.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "o", SessionId: "s-o"})
	if err != nil {
		t.Fatal(err)
	}
	never, err := work.CheckSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "o", SessionId: "never"})
	if err != nil {
		t.Fatal(err)
	}
	hidden.ViewAge, never.ViewAge, hidden.SessionId, never.SessionId = nil, nil, "", ""
	if hidden.GetState() != leaseholdv1.SessionState_UNKNOWN || !proto.Equal(hidden, never) {
		t.Errorf("a session of a task type outside the grant leaks: %v vs never seen %v", hidden, never)
	}
	// WatchSession is not granted to this identity.
	ws, err := work.WatchSession(ctx, &leaseholdv1.CheckSessionRequest{InstanceId: "a", SessionId: "s-a"})
	if err == nil {
		_, err = ws.Recv()
	}
	if status.Code(err) != codes.PermissionDenied {
		t.Errorf("WatchSession without the grant: want PermissionDenied, got %v", err)
	}
}

// Rotating the certificate files changes what new handshakes get, with no
// restart and without dropping open streams; a half-written rotation keeps
// the previous pair.
func TestCertificateRotation(t *testing.T) {
	s := startSecure(t)
	a := s.as(t, "spiffe://test/dispatcher/work").ads(node("d-rot", nil))
	a.Subscribe(resource.ListenerType)
	first := a.Next()

	served := func() *big.Int {
		t.Helper()
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(s.ca.PEM)
		c, k := s.ca.Issue(t, false, []string{"spiffe://test/dispatcher/work"})
		pair, _ := tls.X509KeyPair(c, k)
		conn, err := tls.Dial("tcp", s.addr, &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{pair}, NextProtos: []string{"h2"}})
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		return conn.ConnectionState().PeerCertificates[0].SerialNumber
	}
	before := served()
	cert, key := s.ca.Issue(t, true, nil, "localhost")
	testcerts.WriteFile(t, filepath.Join(s.dir, "key.pem"), key)
	testcerts.WriteFile(t, filepath.Join(s.dir, "cert.pem"), cert)
	after := served()
	if after.Cmp(before) == 0 {
		t.Fatal("the rotated certificate is not served")
	}
	testcerts.WriteFile(t, filepath.Join(s.dir, "cert.pem"), cert[:len(cert)/2]) // half-written
	if got := served(); got.Cmp(after) != 0 {
		t.Errorf("a half-written certificate replaced the good pair: serial %v, want %v", got, after)
	}
	// The stream opened before the rotation still works.
	a.ACK(first)
	a.Subscribe(resource.EndpointType, "work")
	if got := names(a.Next()); !slices.Equal(got, []string{"work"}) {
		t.Errorf("the stream opened before the rotation: %v", got)
	}
}

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
	testcerts.WriteFile(t, filepath.Join(s.dir, "policy.yaml"), []byte("dispatchers: [{identity: x, tasks: [\"bad task\"]}]\n"))
	ps.reload()
	if v := ps.Version(); v != 0 {
		t.Fatalf("an invalid policy was accepted (version %d)", v)
	}
	if g, ok := ps.Grant(Identity{URIs: []string{"spiffe://test/dispatcher/work"}}); !ok || !g.AllowsTask("work") {
		t.Fatal("the previous policy is not in force after an invalid change")
	}
	testcerts.WriteFile(t, filepath.Join(s.dir, "policy.yaml"), []byte("dispatchers: [{identity: \"spiffe://test/dispatcher/work\", tasks: [work, other]}]\n"))
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
