package server

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// TLSFiles names the PEM files of the gRPC port's TLS. Cert and Key are
// required together; ClientCA, when set, makes client certificates required
// and verified against it (mTLS).
type TLSFiles struct {
	Cert, Key, ClientCA string
	// ClientCertOptional has a client certificate verified when given but
	// not required. The admin port uses it, so that probes stay open while
	// guarded paths check the certificate.
	ClientCertOptional bool
	// HTTP has the listener serve HTTP/1.1 (and h2) rather than gRPC's h2
	// only.
	HTTP bool
	// Flags is the flags' prefix for errors: "--tls" (the default) or
	// "--admin-tls", whose CA flag is --admin-client-ca.
	Flags string
}

func (f TLSFiles) flag(name string) string {
	p := f.Flags
	if p == "" {
		p = "--tls"
	}
	if name == "client-ca" && p != "--tls" {
		return strings.TrimSuffix(p, "-tls") + "-" + name // --admin-client-ca
	}
	return p + "-" + name
}

// Enabled reports whether any TLS file is set.
func (f TLSFiles) Enabled() bool { return f.Cert != "" || f.Key != "" || f.ClientCA != "" }

// ServerTLS serves certificates that are re-read from disk when their files
// change, so certificates rotate without a restart. Every handshake checks
// the files' stamps (fileStamp: inode, size, modification and change times),
// which is cheap, and a pair that fails to load (a rotation written half-way)
// keeps the previous one in force.
type ServerTLS struct {
	files TLSFiles
	log   *slog.Logger

	mu      sync.Mutex
	stamp   string // the fileStamp of each file last loaded
	cfg     *tls.Config
	loadErr error
}

// NewServerTLS loads the files once; an error names the flag at fault.
func NewServerTLS(files TLSFiles, log *slog.Logger) (*ServerTLS, error) {
	if files.Cert == "" || files.Key == "" {
		return nil, fmt.Errorf("%s and %s: both required for TLS (%s needs them too)",
			files.flag("cert"), files.flag("key"), files.flag("client-ca"))
	}
	s := &ServerTLS{files: files, log: log}
	cfg, stamp, err := s.load()
	if err != nil {
		return nil, err
	}
	s.cfg, s.stamp = cfg, stamp
	return s, nil
}

// Config is the tls.Config for a listener: each handshake gets the current
// certificates.
func (s *ServerTLS) Config() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: s.protos(),
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			return s.current(), nil
		},
	}
}

func (s *ServerTLS) protos() []string {
	if s.files.HTTP {
		return []string{"h2", "http/1.1"}
	}
	return []string{"h2"}
}

// Credentials are the gRPC server credentials.
func (s *ServerTLS) Credentials() credentials.TransportCredentials {
	return credentials.NewTLS(s.Config())
}

func (s *ServerTLS) current() *tls.Config {
	stamp := s.fileStamp()
	s.mu.Lock()
	defer s.mu.Unlock()
	if stamp == s.stamp {
		return s.cfg
	}
	cfg, loaded, err := s.load()
	if err != nil {
		if s.loadErr == nil || s.loadErr.Error() != err.Error() {
			s.log.Warn("TLS files changed but do not load: keeping the previous certificates",
				"err", err)
		}
		s.loadErr = err
		return s.cfg
	}
	s.cfg, s.stamp, s.loadErr = cfg, loaded, nil
	s.log.Info("TLS certificates reloaded", "cert", s.files.Cert,
		"not_after", cfg.Certificates[0].Leaf.NotAfter)
	return s.cfg
}

func (s *ServerTLS) fileStamp() string {
	var b bytes.Buffer
	for _, p := range []string{s.files.Cert, s.files.Key, s.files.ClientCA} {
		if p == "" {
			continue
		}
		fmt.Fprintf(&b, "%s:%s;", p, fileStamp(p))
	}
	return b.String()
}

func (s *ServerTLS) load() (*tls.Config, string, error) {
	stamp := s.fileStamp()
	pair, err := tls.LoadX509KeyPair(s.files.Cert, s.files.Key)
	if err != nil {
		return nil, "", fmt.Errorf("%s/%s: %w", s.files.flag("cert"), s.files.flag("key"), err)
	}
	if pair.Leaf == nil {
		if pair.Leaf, err = x509.ParseCertificate(pair.Certificate[0]); err != nil {
			return nil, "", fmt.Errorf("%s: %w", s.files.flag("cert"), err)
		}
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: s.protos(),
		Certificates: []tls.Certificate{pair}}
	if s.files.ClientCA != "" {
		pem, err := os.ReadFile(s.files.ClientCA)
		if err != nil {
			return nil, "", fmt.Errorf("%s: %w", s.files.flag("client-ca"), err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, "", fmt.Errorf("%s %s: no PEM certificate in it",
				s.files.flag("client-ca"), s.files.ClientCA)
		}
		cfg.ClientCAs, cfg.ClientAuth = pool, tls.RequireAndVerifyClientCert
		if s.files.ClientCertOptional {
			cfg.ClientAuth = tls.VerifyClientCertIfGiven
		}
	}
	return cfg, stamp, nil
}

// Identity is what a verified client certificate says of its holder: its
// URI SANs (e.g. SPIFFE ids) and DNS SANs. Empty without mTLS.
type Identity struct {
	URIs []string
	DNS  []string
}

// Names are every name of the identity, URIs first.
func (i Identity) Names() []string { return append(append([]string(nil), i.URIs...), i.DNS...) }

// IsZero reports whether no verified certificate was presented.
func (i Identity) IsZero() bool { return len(i.URIs) == 0 && len(i.DNS) == 0 }

// String is for logs.
func (i Identity) String() string {
	if i.IsZero() {
		return "(none)"
	}
	return fmt.Sprint(i.Names())
}

// PeerIdentity is the identity of the verified client certificate of the
// connection behind ctx.
func PeerIdentity(ctx context.Context) Identity {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return Identity{}
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.VerifiedChains) == 0 || len(ti.State.PeerCertificates) == 0 {
		return Identity{}
	}
	return certIdentity(ti.State.PeerCertificates[0])
}

func certIdentity(c *x509.Certificate) Identity {
	var id Identity
	for _, u := range c.URIs {
		id.URIs = append(id.URIs, u.String())
	}
	id.DNS = append(id.DNS, c.DNSNames...)
	return id
}
