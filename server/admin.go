package server

import (
	"encoding/json"
	"net/http"
	"time"
)

// Readiness is what /readyz reports.
type Readiness interface {
	Ready() bool
}

// AdminHandler serves /healthz (the process is up) and /readyz (the fleet
// has been read and Consul answers; 503 otherwise — dispatchers keep the
// last snapshot meanwhile).
func AdminHandler(ready Readiness, lastContact func() time.Time) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		body := map[string]any{"ready": ready.Ready()}
		if t := lastContact(); !t.IsZero() {
			body["consul_last_contact"] = t.UTC().Format(time.RFC3339Nano)
			body["consul_contact_age_seconds"] = time.Since(t).Seconds()
		}
		w.Header().Set("Content-Type", "application/json")
		if !ready.Ready() {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		json.NewEncoder(w).Encode(body)
	})
	return mux
}
