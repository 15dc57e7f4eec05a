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
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

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
	st, err := NewServerTLS(
		TLSFiles{
			Cert:     filepath.Join(dir, "cert.pem"),
			Key:      filepath.Join(dir, "key.pem"),
			ClientCA: filepath.Join(dir, "ca.pem"),
		},
		log,
	)
	if err != nil {
		t.Fatal(err)
	}
	policy, err := LoadPolicy(filepath.Join(dir, "policy.yaml"), log)
	if err != nil {
		t.Fatal(err)
	}
	f := startXDSWith(t, fixtureOpts{tls: st, policy: policy})
	return &secureFixture{
		fixture: f,
		ca:      ca,
		rogue:   testcerts.NewCA(t, "rogue CA"),
		dir:     dir,
		tls:     st,
		policy:  policy,
	}
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
	_, err := leaseholdv1.NewFencingClient(plain.dial()).CheckSession(context.Background(),
		&leaseholdv1.CheckSessionRequest{InstanceId: "a", SessionId: "s-a"},
	)
	if status.Code(err) != codes.Unavailable {
		t.Errorf("plaintext client: want Unavailable (handshake refused), got %v", err)
	}

	rogue := *s.fixture
	rogue.creds = s.rogue.ClientCreds(t, s.ca, "spiffe://test/dispatcher/work")
	_, err = leaseholdv1.NewFencingClient(rogue.dial()).CheckSession(context.Background(),
		&leaseholdv1.CheckSessionRequest{InstanceId: "a", SessionId: "s-a"},
	)
	if status.Code(err) != codes.Unavailable {
		t.Errorf("client with a certificate from an untrusted CA: want Unavailable, got %v", err)
	}

	stranger := s.as(t, "spiffe://test/dispatcher/stranger") // trusted CA, no grant
	a := stranger.ads(node("d-x", nil))
	// The send may fail: the server ends the stream at once.
	a.Stream().Send(&discovery.DiscoveryRequest{Node: a.Node, TypeUrl: resource.ListenerType})
	if _, err := a.Recv(); status.Code(err) != codes.PermissionDenied {
		t.Errorf("identity without a grant: want PermissionDenied, got %v", err)
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
		conn, err := tls.Dial("tcp", s.addr,
			&tls.Config{
				RootCAs:      pool,
				Certificates: []tls.Certificate{pair},
				NextProtos:   []string{"h2"},
			},
		)
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
		t.Errorf("a half-written certificate replaced the good pair: serial %v, want %v",
			got, after)
	}
	// The stream opened before the rotation still works.
	a.ACK(first)
	a.Subscribe(resource.EndpointType, "work")
	if got := names(a.Next()); !slices.Equal(got, []string{"work"}) {
		t.Errorf("the stream opened before the rotation: %v", got)
	}
}
