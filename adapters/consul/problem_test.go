package consul

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"

	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/health"
)

func TestClassifyNamesWhatToFix(t *testing.T) {
	gen := RightKeyPrefix(health.GenerationKeyPrefix, "read")
	for _, tt := range []struct {
		name   string
		err    error
		want   health.ContactProblem
		detail string
	}{
		{"missing right",
			fmt.Errorf("x: %w", &ACLError{Read: "kv leasehold/generation/",
				How:    "results filtered by ACLs",
				Rights: []string{gen}}),
			health.ProblemACL, gen},
		{"unknown CA",
			&url.Error{Op: "Get", URL: "https://127.0.0.1:8501/v1/catalog/services",
				Err: &tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}},
			health.ProblemTLS, "x509: certificate signed by unknown authority"},
		{"plain HTTP port",
			&url.Error{Op: "Get", URL: "https://127.0.0.1:8500/",
				Err: errors.New("http: server gave HTTP response to HTTPS client")},
			health.ProblemTLS, "Consul answers plain HTTP"},
		{"refused",
			&url.Error{Op: "Get", URL: "http://127.0.0.1:1/",
				Err: errors.New("dial tcp 127.0.0.1:1: connect: connection refused")},
			health.ProblemUnreachable, "connection refused"},
	} {
		p, d := classify(tt.err)
		if p != tt.want || !strings.Contains(d, tt.detail) {
			t.Errorf("%s: %s %q, want %s with %q", tt.name, p, d, tt.want, tt.detail)
		}
	}
}

// A run of failures is reported once, and again when what it tells
// changes: a missing right (or a certificate problem) outranks an
// unreachable Consul in any watch, and another unreachable error text is no
// news.
func TestWatcherReportsAFailureAgainWhenItsKindChanges(t *testing.T) {
	out := make(chan health.Observation, 16)
	w := newWatcher(newFakeCatalog(), WatchConfig{Clock: clockwork.NewFakeClock(), Out: out})
	ctx := context.Background()
	next := func() *health.Contact {
		t.Helper()
		select {
		case o := <-out:
			return o.Contact()
		default:
			return nil
		}
	}
	refused := errors.New("connection refused")
	gen := &ACLError{
		Read:   "kv leasehold/generation/",
		How:    "results filtered by ACLs",
		Rights: []string{RightKeyPrefix(health.GenerationKeyPrefix, "read")},
	}

	w.contact(ctx, "non-passing", refused)
	if c := next(); c == nil || c.OK || c.Problem != health.ProblemUnreachable ||
		c.Detail != "connection refused" {
		t.Fatalf("first failure: %+v", c)
	}
	w.contact(ctx, "serf", errors.New("i/o timeout"))
	if c := next(); c != nil {
		t.Fatalf("another unreachable error reported again: %+v", c)
	}
	w.contact(ctx, "generations", gen)
	if c := next(); c == nil || c.Problem != health.ProblemACL || c.Detail != gen.Right() ||
		!errors.Is(c.Err, ErrACL) {
		t.Fatalf("a missing right while unreachable: %+v", c)
	}
	w.contact(ctx, "non-passing", refused)
	if c := next(); c != nil {
		t.Fatalf("the missing right still tells most, yet reported: %+v", c)
	}
	w.contact(ctx, "generations", nil) // the right granted; others still fail
	if c := next(); c == nil || c.OK || c.Problem != health.ProblemUnreachable {
		t.Fatalf("after the right came back: %+v, want unreachable again", c)
	}
	w.contact(ctx, "non-passing", nil)
	w.contact(ctx, "serf", nil)
	if c := next(); c == nil || !c.OK {
		t.Fatalf("recovery: %+v", c)
	}
	if c := next(); c != nil {
		t.Fatalf("more after recovery: %+v", c)
	}
}
