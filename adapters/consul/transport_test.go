package consul

import (
	"bytes"
	"compress/gzip"
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/hashicorp/consul/api"
)

// TestSizingTransportHandlesEveryKindOfBody: gzip answers decode and keep the
// connection reusable (the api drains bodies; the gunzip reader must read the
// wire to EOF), sizes are counted, an error body is decompressed into the
// error, a body flagged gzip but empty or corrupt is an error (no hang, no
// panic), and a plain answer passes through.
func TestSizingTransportHandlesEveryKindOfBody(t *testing.T) {
	const payload = `{"consul":[],"work":["leasehold"]}`
	gz := func(s string) []byte {
		var b bytes.Buffer
		zw := gzip.NewWriter(&b)
		zw.Write([]byte(s))
		zw.Close()
		return b.Bytes()
	}
	mode := atomic.Value{}
	mode.Store("gzip")
	var conns atomic.Int64
	srv := httptest.NewUnstartedServer(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("X-Consul-Index", "42")
			switch mode.Load().(string) {
			case "gzip":
				if r.Header.Get("Accept-Encoding") != "gzip" {
					t.Errorf("Accept-Encoding %q", r.Header.Get("Accept-Encoding"))
				}
				w.Header().Set("Content-Encoding", "gzip")
				w.Write(gz(payload))
			case "plain":
				w.Write([]byte(payload))
			case "empty-gzip":
				w.Header().Set("Content-Encoding", "gzip")
			case "corrupt-gzip":
				w.Header().Set("Content-Encoding", "gzip")
				w.Write(gz(payload)[:15])
			case "error-gzip":
				w.Header().Set("Content-Encoding", "gzip")
				w.WriteHeader(500)
				w.Write(gz("rpc error: no leader"))
			}
		}),
	)
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	defer srv.Close()
	c, err := NewClient(strings.TrimPrefix(srv.URL, "http://"), 4)
	if err != nil {
		t.Fatal(err)
	}
	get := func() (map[string][]string, *readSizes, *api.QueryMeta, error) {
		ctx, sizes := withReadSizes(context.Background())
		s, meta, err := c.Catalog().Services((&api.QueryOptions{}).WithContext(ctx))
		return s, sizes, meta, err
	}
	for i := 0; i < 20; i++ {
		s, sizes, meta, err := get()
		if err != nil || len(s) != 2 || meta.LastIndex != 42 {
			t.Fatalf("gzip answer: %v %v %+v", s, err, meta)
		}
		if sizes.decoded.Load() != int64(len(payload)) ||
			sizes.wire.Load() != int64(len(gz(payload))) {
			t.Fatalf("sizes wire %d decoded %d", sizes.wire.Load(), sizes.decoded.Load())
		}
	}
	if n := conns.Load(); n != 1 {
		t.Errorf(
			"%d connections for 20 sequential gzip answers: bodies not drained to EOF, "+
				"connections not reused",
			n,
		)
	}
	mode.Store("plain")
	if s, sizes, _, err := get(); err != nil || len(s) != 2 ||
		sizes.decoded.Load() != int64(len(payload)) {
		t.Fatalf("plain answer: %v %v", s, err)
	}
	for _, m := range []string{"empty-gzip", "corrupt-gzip"} {
		mode.Store(m)
		if _, _, _, err := get(); err == nil {
			t.Errorf("%s: no error", m)
		}
	}
	mode.Store("error-gzip")
	if _, _, _, err := get(); err == nil || !strings.Contains(err.Error(), "no leader") {
		t.Errorf("error body: %v", err)
	}
}
