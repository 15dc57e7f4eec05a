package otel

import (
	"context"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
)

// The build is exported as leasehold_build_info = 1, with its version,
// revision and Go version as labels, from the first scrape.
func TestBuildInfoMetric(t *testing.T) {
	tel, err := Setup(context.Background(), Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer tel.Shutdown(context.Background())
	if err := BuildInfo(tel.Meter, "v1.2.3", "0123abcd", ""); err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	tel.MetricsHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	want := `leasehold_build_info{go_version="` + runtime.Version() +
		`",revision="0123abcd",version="v1.2.3"} 1`
	if !strings.Contains(rec.Body.String(), want) {
		t.Fatalf("/metrics lacks %s:\n%s", want, rec.Body.String())
	}
}
