package consul

import (
	"context"
	"io"
	"net/http/httptest"
	"strings"
	"testing"

	lhotel "github.com/leasehold/leasehold/adapters/otel"
)

// The sidecar's /metrics has every executor family before its first
// heartbeat, each lease-loss reason at 0: an alert on lost leases answers 0,
// not "no data".
func TestExecutorFamiliesAreExportedFromTheStart(t *testing.T) {
	tel, err := lhotel.Setup(context.Background(), lhotel.Config{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := baseConfig()
	cfg.Meter = tel.Meter
	if _, err := NewRegistrar(newFakeAgent(), cfg); err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	tel.MetricsHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body, _ := io.ReadAll(rec.Body)
	out := string(body)
	for _, want := range []string{
		"leasehold_executor_heartbeat_duration_seconds_count 0",
		"leasehold_executor_heartbeat_failures_total 0",
		"leasehold_executor_load ", "leasehold_executor_capacity 2",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	for _, reason := range LossReasons {
		if want := `reason="` + string(reason) + `"`; !strings.Contains(out, want) {
			t.Errorf("/metrics lacks leasehold_executor_lease_losses_total{%s}", want)
		}
	}
	if t.Failed() {
		t.Logf("/metrics:\n%s", out)
	}
}
