package server

import (
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/internal/testcerts"
)

func TestAdminTokenGuard(t *testing.T) {
	path := filepath.Join(t.TempDir(), "token")
	testcerts.WriteFile(t, path, []byte("first-token-0123456789\n"))
	tok, err := NewAdminToken(path)
	if err != nil {
		t.Fatal(err)
	}
	h := GuardAdmin(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("secret view")) }), tok, false)
	get := func(path, auth string) (int, string) {
		r := httptest.NewRequest("GET", path, nil)
		if auth != "" {
			r.Header.Set("Authorization", auth)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w.Code, w.Body.String()
	}
	for _, p := range []string{"/healthz", "/readyz", "/metrics"} {
		if code, _ := get(p, ""); code != 200 {
			t.Errorf("%s must stay open for probes: %d", p, code)
		}
	}
	for _, p := range []string{"/debug/executors", "/debug/dispatchers", "/debug/pprof/", "/v1/session"} {
		if code, body := get(p, ""); code != 401 || strings.Contains(body, "first-token") {
			t.Errorf("%s without a token: %d %q", p, code, body)
		}
		if code, _ := get(p, "Bearer wrong-token-0123456789"); code != 401 {
			t.Errorf("%s with a wrong token: %d", p, code)
		}
		if code, _ := get(p, "Bearer first-token-0123456789"); code != 200 {
			t.Errorf("%s with the token: %d", p, code)
		}
	}
	// Rotation: the new token works at once, the old one no longer.
	testcerts.WriteFile(t, path, []byte("second-token-0123456789"))
	if code, _ := get("/debug/executors", "Bearer second-token-0123456789"); code != 200 {
		t.Errorf("rotated token refused: %d", code)
	}
	if code, _ := get("/debug/executors", "Bearer first-token-0123456789"); code != 401 {
		t.Errorf("old token still accepted after rotation: %d", code)
	}
	// A token file emptied by a rotation in progress keeps the last token.
	testcerts.WriteFile(t, path, nil)
	if code, _ := get("/debug/executors", "Bearer second-token-0123456789"); code != 200 {
		t.Errorf("an empty token file dropped the last good token: %d", code)
	}

	short := filepath.Join(t.TempDir(), "short")
	testcerts.WriteFile(t, short, []byte("abc"))
	if _, err := NewAdminToken(short); err == nil || !strings.Contains(err.Error(), "--admin-token-file") {
		t.Errorf("a 3-character token was accepted: %v", err)
	}
}

func TestIsLoopback(t *testing.T) {
	for addr, want := range map[string]bool{"127.0.0.1:19000": true, "[::1]:1": true, "localhost:1": true, "0.0.0.0:19000": false, ":19000": false, "10.0.0.1:1": false} {
		if got := IsLoopback(addr); got != want {
			t.Errorf("IsLoopback(%q) = %v", addr, got)
		}
	}
}
