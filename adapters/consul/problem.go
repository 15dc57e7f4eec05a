package consul

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"strings"

	"github.com/leasehold/leasehold/health"
)

// classify says why a query failed, for readiness: a right missing (the
// rights), a TLS handshake that failed (the certificate problem), or Consul
// unreachable or answering with an error (the error).
func classify(err error) (health.ContactProblem, string) {
	var ae *ACLError
	if errors.As(err, &ae) {
		return health.ProblemACL, ae.Right()
	}
	if errors.Is(err, ErrACL) {
		return health.ProblemACL, err.Error()
	}
	if detail, ok := tlsProblem(err); ok {
		return health.ProblemTLS, detail
	}
	return health.ProblemUnreachable, err.Error()
}

// tlsProblem is the certificate problem behind a failed TLS handshake with
// Consul, if that is why err happened.
func tlsProblem(err error) (string, bool) {
	var (
		cve     *tls.CertificateVerificationError
		unknown x509.UnknownAuthorityError
		host    x509.HostnameError
		invalid x509.CertificateInvalidError
		record  tls.RecordHeaderError
		alert   tls.AlertError
	)
	switch {
	case errors.As(err, &cve):
		return cve.Err.Error(), true
	case errors.As(err, &unknown):
		return unknown.Error(), true
	case errors.As(err, &host):
		return host.Error(), true
	case errors.As(err, &invalid):
		return invalid.Error(), true
	case errors.As(err, &record):
		return "not TLS on the other side (an HTTP port, or CONSUL_HTTP_SSL/https:// where " +
			"Consul speaks plain HTTP): " + record.Msg, true
	case errors.As(err, &alert):
		return "Consul refused the handshake: " + alert.Error() + " (a client certificate: " +
			"CONSUL_CLIENT_CERT, CONSUL_CLIENT_KEY)", true
	case strings.Contains(err.Error(), "server gave HTTP response to HTTPS client"):
		return "Consul answers plain HTTP on this port: drop CONSUL_HTTP_SSL/https://, or use " +
			"its HTTPS port", true
	}
	return "", false
}
