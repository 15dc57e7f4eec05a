package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/spf13/pflag"

	"github.com/leasehold/leasehold/health"
)

// TestCordonStateNamesAnUnreadyReplica: a cordon the replica never sees
// because it cannot read the operators' controls is reported with the
// replica's /readyz reason, not as "not yet seen"; a ready replica that has
// not seen it yet keeps the old wording.
func TestCordonStateNamesAnUnreadyReplica(t *testing.T) {
	for _, tt := range []struct {
		name    string
		readyz  int
		body    string
		want    string
		notWant string
	}{
		{"unready: acl", http.StatusServiceUnavailable,
			`{"ready":false,"reason":"acl","detail":"key_prefix \"leasehold/control/\" { policy = \"read\" }","source":"operator controls"}`,
			`which is not ready: acl: key_prefix "leasehold/control/" { policy = "read" } (operator controls)`, "not yet seen"},
		{"ready", http.StatusOK, `{"ready":true}`, "not yet seen by the replica", "not ready"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(
				w http.ResponseWriter, r *http.Request,
			) {
				switch r.URL.Path {
				case "/debug/config":
					w.Write([]byte(`{}`))
				case "/readyz":
					w.WriteHeader(tt.readyz)
					w.Write([]byte(tt.body))
				default:
					http.NotFound(w, r)
				}
			}))
			defer srv.Close()
			var af adminFlags
			fs := pflag.NewFlagSet("cordon", pflag.ContinueOnError)
			af.register(fs, "test")
			if err := fs.Parse([]string{"--admin-addr",
				strings.TrimPrefix(srv.URL, "http://")}); err != nil {
				t.Fatal(err)
			}
			v := af.cordonView(context.Background(), fs, 0,
				func(map[string]health.CordonStatus) bool { return false })
			got := v.long("c-1a2b3c4d")
			if !strings.Contains(got, tt.want) || strings.Contains(got, tt.notWant) {
				t.Fatalf("state %q, want %q", got, tt.want)
			}
		})
	}
}
