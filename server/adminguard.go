package server

import (
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
)

// AdminToken guards the admin port's sensitive endpoints (/debug/*, the
// fencing JSON API) with a bearer token read from a file. The file is
// re-read when it changes, so the token rotates without a restart; the token
// itself is never logged or echoed.
type AdminToken struct {
	path string

	mu    sync.Mutex
	token []byte
}

// NewAdminToken reads the token file; an empty file is an error.
func NewAdminToken(path string) (*AdminToken, error) {
	t := &AdminToken{path: path}
	if _, err := t.current(); err != nil {
		return nil, err
	}
	return t, nil
}

func (t *AdminToken) current() ([]byte, error) {
	// The file is read on every guarded request (those are rare and the file is
	// tiny), so a rotation applies at once, whatever the file system's
	// timestamp granularity.
	t.mu.Lock()
	defer t.mu.Unlock()
	b, err := os.ReadFile(t.path)
	if err != nil {
		if t.token != nil {
			return t.token, nil // a rotation may be in progress, so the old token stays
		}
		return nil, fmt.Errorf("--admin-token-file: %w", err)
	}
	tok := []byte(strings.TrimSpace(string(b)))
	if len(tok) < 16 {
		if t.token != nil {
			return t.token, nil
		}
		return nil, errors.New("--admin-token-file: the token must be at least 16 characters")
	}
	t.token = tok
	return tok, nil
}

func (t *AdminToken) valid(r *http.Request) bool {
	if t == nil {
		return false
	}
	want, err := t.current()
	got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	return err == nil && ok && subtle.ConstantTimeCompare([]byte(got), want) == 1
}

// GuardAdmin wraps h so that guarded paths need a valid bearer token (when
// token is set) or, with clientCerts, a client certificate that the admin
// port's TLS verified.
func GuardAdmin(h http.Handler, token *AdminToken, clientCerts bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !guardedPath(r.URL.Path) || token.valid(r) ||
			(clientCerts && r.TLS != nil && len(r.TLS.VerifiedChains) > 0) {
			h.ServeHTTP(w, r)
			return
		}
		var how []string
		if token != nil {
			how = append(how,
				"Authorization: Bearer <the token in leasehold serve's --admin-token-file>")
			w.Header().Set("WWW-Authenticate", `Bearer realm="leasehold admin"`)
		}
		if clientCerts {
			how = append(how, "a client certificate signed by --admin-client-ca")
		}
		writeJSON(w, http.StatusUnauthorized,
			map[string]string{"error": "this endpoint needs " + strings.Join(how, " or ")})
	})
}

// guardedPath reports whether p reveals executors, sessions or dispatchers.
// Health, readiness and metrics (no ids in any label) stay open for probes.
func guardedPath(p string) bool {
	return strings.HasPrefix(p, "/debug/") || strings.HasPrefix(p, "/v1/")
}

// IsLoopback reports whether a listen address binds only loopback.
func IsLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
