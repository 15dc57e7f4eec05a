package consul

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/iotest"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
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

// TestListingsAreDecodedOnceFromTheCapturedBody: a client built by
// NewClient hands the task watch's listings to the lean decoder (an entry's
// metadata with escapes comes out whole; the api client decoded only the
// null put in the body's place), their sizes are still counted, the tag is
// still asked for, and an answer that is not 200 keeps its body for the
// error. A client built otherwise decodes as the api does.
func TestListingsAreDecodedOnceFromTheCapturedBody(t *testing.T) {
	catDoc := mustRead(t, "testdata/consul-1.13-catalog-service.json")
	healthDoc := mustRead(t, "testdata/consul-1.13-health-service.json")
	var status atomic.Int64
	status.Store(200)
	var tags atomic.Value
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tags.Store(r.URL.Query().Get("tag"))
		w.Header().Set("X-Consul-Index", "42")
		if s := int(status.Load()); s != 200 {
			w.WriteHeader(s)
			w.Write([]byte("Permission denied: token lacks service:read"))
			return
		}
		body := []byte("[]")
		switch {
		case strings.HasPrefix(r.URL.Path, "/v1/catalog/service/"):
			body = catDoc
		case strings.HasPrefix(r.URL.Path, "/v1/health/service/"):
			body = healthDoc
		}
		if r.Header.Get("Accept-Encoding") == "gzip" {
			w.Header().Set("Content-Encoding", "gzip")
			body = gzipped(body)
		}
		w.Write(body)
	}))
	var conns atomic.Int64
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start() // after ConnState is set: the server reads it
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	own, plain := bothClients(t, addr)
	var want []*api.CatalogService
	json.Unmarshal(catDoc, &want)
	var wantHealth []*api.ServiceEntry
	json.Unmarshal(healthDoc, &wantHealth)
	for name, c := range map[string]*api.Client{"NewClient": own, "api.NewClient": plain} {
		cat := apiCatalog{c: c}
		ctx, sizes := withReadSizes(context.Background())
		nodes, idx, err := cat.ServiceNodes(ctx, "fixture", "leasehold", 0, 0)
		if err != nil || idx != 42 || len(nodes) != 2 || tags.Load() != "leasehold" {
			t.Fatalf("%s: catalog %d entries, index %d, tag %v: %v", name, len(nodes), idx,
				tags.Load(), err)
		}
		if !reflect.DeepEqual(nodes[0].ServiceMeta, want[0].ServiceMeta) ||
			nodes[1].ServicePort != want[1].ServicePort {
			t.Errorf("%s: catalog entry %s, want %s", name, dump(nodes[0]), dump(want[0]))
		}
		if name == "NewClient" {
			if n := sizes.decoded.Load(); n != int64(len(catDoc)) {
				t.Errorf("decoded size %d counted, the answer was %d", n, len(catDoc))
			}
			if n := sizes.wire.Load(); n != int64(len(gzipped(catDoc))) {
				t.Errorf("wire size %d counted, %d were sent", n, len(gzipped(catDoc)))
			}
			// Only the lean decoder keeps the node's address and nothing of
			// its tagged addresses: what came back was not the api's decoding.
			if nodes[0].TaggedAddresses != nil || want[0].TaggedAddresses == nil {
				t.Errorf("the listing was decoded by the api client: %s", dump(nodes[0]))
			}
		}
		entries, _, err := cat.HealthService(context.Background(), "fixture", "leasehold", nil)
		if err != nil || len(entries) != 2 ||
			entries[0].Checks[1].Output != wantHealth[0].Checks[1].Output ||
			!reflect.DeepEqual(entries[1].Service.Meta, wantHealth[1].Service.Meta) {
			t.Fatalf("%s: health %s: %v", name, dump(entries), err)
		}
		status.Store(403)
		_, _, err = cat.HealthService(context.Background(), "fixture", "leasehold", nil)
		var ae *ACLError
		if !errors.As(err, &ae) || !strings.Contains(err.Error(), "token lacks service:read") {
			t.Errorf("%s: a refused listing: %v", name, err)
		}
		status.Store(200)
	}
	if n := conns.Load(); n > 2 {
		t.Errorf("%d connections for two clients' sequential reads: captured bodies were "+
			"not read to the end", n)
	}
}

// bothClients are a client of addr built by NewClient (its transport
// captures listings) and one built by the api package alone.
func bothClients(t *testing.T, addr string) (own, plain *api.Client) {
	t.Helper()
	own, err := NewClient(addr, 4)
	if err != nil {
		t.Fatal(err)
	}
	if plain, err = api.NewClient(&api.Config{Address: addr}); err != nil {
		t.Fatal(err)
	}
	return own, plain
}

func gzipped(b []byte) []byte {
	var out bytes.Buffer
	zw := gzip.NewWriter(&out)
	zw.Write(b)
	zw.Close()
	return out.Bytes()
}

// TestACapturedListingThatFailsIsAnError: a 200 listing whose body is cut
// short, empty, or still coming when the read is cancelled is an error (the
// cancellation's own), and one Consul filtered by ACLs is an ACLError
// naming the rights, read without the capture.
func TestACapturedListingThatFailsIsAnError(t *testing.T) {
	doc := mustRead(t, "testdata/consul-1.13-catalog-service.json")
	var mode atomic.Value
	mode.Store("")
	stall := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Consul-Index", "42")
		if r.URL.Path == "/v1/catalog/services" || r.URL.Path == "/v1/catalog/nodes" {
			w.Write([]byte(`{"consul":[]}`)) // what catalogRights asks
			return
		}
		switch mode.Load().(string) {
		case "cut-gzip":
			w.Header().Set("Content-Encoding", "gzip")
			w.Write(gzipped(doc)[:40])
		case "empty":
		case "stall":
			w.Write(doc[:100])
			w.(http.Flusher).Flush()
			<-stall
		case "filtered":
			// The api client stops reading the headers at a missing LastContact.
			w.Header().Set("X-Consul-LastContact", "0")
			w.Header().Set("X-Consul-Results-Filtered-By-ACLs", "true")
			w.Write(doc)
		}
	}))
	defer srv.Close()
	defer close(stall) // before the server closes: it waits for its handlers
	c, err := NewClient(strings.TrimPrefix(srv.URL, "http://"), 4)
	if err != nil {
		t.Fatal(err)
	}
	cat := apiCatalog{c: c}
	for _, m := range []string{"cut-gzip", "empty"} {
		mode.Store(m)
		if nodes, _, err := cat.ServiceNodes(context.Background(), "fixture", "leasehold", 0, 0); err == nil {
			t.Errorf("%s: %d entries, no error", m, len(nodes))
		}
	}
	mode.Store("stall")
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		time.Sleep(50 * time.Millisecond) // the server has sent the first bytes by then
		cancel()
	}()
	if _, _, err := cat.ServiceNodes(ctx, "fixture", "leasehold", 0, 0); !errors.Is(err, context.Canceled) {
		t.Errorf("a read cancelled mid-body: %v", err)
	}
	mode.Store("filtered")
	_, _, err = cat.ServiceNodes(context.Background(), "fixture", "leasehold", 0, 0)
	var ae *ACLError
	if !errors.As(err, &ae) || len(ae.Rights) == 0 || !strings.Contains(err.Error(), "filtered") {
		t.Errorf("a filtered listing: %v", err)
	}
}

// TestAClientOnAUnixSocketKeepsItsTransport: NewClient with a unix://
// address dials the socket through its own transport (the api client would
// replace it with one of its own, losing the sizes and the capture).
func TestAClientOnAUnixSocketKeepsItsTransport(t *testing.T) {
	doc := mustRead(t, "testdata/consul-1.13-catalog-service.json")
	sock := filepath.Join(t.TempDir(), "consul.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Consul-Index", "7")
		w.Write(doc)
	})}
	go srv.Serve(l)
	defer srv.Close()
	c, err := NewClient("unix://"+sock, 4)
	if err != nil {
		t.Fatal(err)
	}
	ctx, sizes := withReadSizes(context.Background())
	nodes, idx, err := apiCatalog{c: c}.ServiceNodes(ctx, "fixture", "leasehold", 0, 0)
	if err != nil || idx != 7 || len(nodes) != 2 {
		t.Fatalf("%d entries at %d: %v", len(nodes), idx, err)
	}
	if sizes.decoded.Load() != int64(len(doc)) || nodes[0].TaggedAddresses != nil {
		t.Errorf("sizes %d (want %d) and tagged addresses %v: the transport was replaced",
			sizes.decoded.Load(), len(doc), nodes[0].TaggedAddresses)
	}
}

// captured is what take keeps of an answer of body, expecting hint bytes.
func captured(t testing.TB, body []byte, hint int) []byte {
	c := &bodyCapture{hint: hint}
	resp := &http.Response{StatusCode: http.StatusOK, Header: http.Header{},
		Body: io.NopCloser(iotest.HalfReader(bytes.NewReader(body)))}
	if _, err := c.take(resp); err != nil {
		t.Fatal(err)
	}
	if !c.taken {
		t.Fatal("the answer was not taken")
	}
	return c.body
}

// A body read to its end leaves its decompressor for the next answer: what
// reading an answer allocates is measured against a fresh gzip reader per
// answer (as before) in the same run, and is at most half of it (under the
// race detector the pool drops a quarter of what it is given).
func TestADecompressorServesTheNextAnswerOnceItsBodyEnds(t *testing.T) {
	payload := strings.Repeat(`{"Node":"n1","CheckID":"service:x","Status":"critical"},`, 100)
	wire := gzipped([]byte(payload))
	read := func(fresh bool) {
		var r io.Reader = &gunzipBody{wire: io.NopCloser(bytes.NewReader(wire))}
		if fresh {
			zr, err := gzip.NewReader(bytes.NewReader(wire))
			if err != nil {
				t.Fatal(err)
			}
			r = zr
		}
		if n, err := io.Copy(io.Discard, r); err != nil || n != int64(len(payload)) {
			t.Fatalf("read %d bytes (%v), want %d", n, err, len(payload))
		}
	}
	allocated := func(fresh bool) uint64 {
		read(fresh) // the pool holds one from here on
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		for range 50 {
			read(fresh)
		}
		runtime.ReadMemStats(&after)
		return (after.TotalAlloc - before.TotalAlloc) / 50
	}
	fresh, pooled := allocated(true), allocated(false)
	if pooled*2 > fresh {
		t.Fatalf("an answer allocated %d bytes with the pool, %d with a fresh reader each: "+
			"the decompressor is not reused", pooled, fresh)
	}
	t.Logf("an answer allocated %d bytes, %d with a fresh reader each", pooled, fresh)
}

// Bodies read at once each decode to their own answer, and one closed or
// failed before its end gives back no decompressor it may still be using:
// a Read after its Close fails, and a corrupt answer fails, and neither
// disturbs the answers read meanwhile (the race detector watches).
func TestBodiesReadAtOnceKeepTheirOwnDecompressors(t *testing.T) {
	const readers, answers = 8, 30
	var wants [readers][answers]string
	var wires [readers][answers][]byte
	for i := range readers {
		for j := range answers {
			wants[i][j] = strings.Repeat(fmt.Sprintf("answer %d.%d;", i, j), 50+i*j)
			wires[i][j] = gzipped([]byte(wants[i][j]))
		}
	}
	var wg sync.WaitGroup
	for i := range readers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range answers {
				want, wire := wants[i][j], wires[i][j]
				switch j % 3 {
				case 0: // closed halfway, then read again
					pr, pw := io.Pipe()
					go func() {
						pw.Write(wire[:len(wire)/2])
						pw.Write(wire[len(wire)/2:]) // blocks until the close below ends it
					}()
					body := &gunzipBody{wire: pr}
					buf := make([]byte, 10)
					if _, err := io.ReadFull(body, buf); err != nil {
						t.Errorf("the first bytes: %v", err)
						return
					}
					body.Close()
					if _, err := io.Copy(io.Discard, body); err == nil {
						t.Error("a body read after its Close: no error")
					}
				case 1: // corrupt
					body := &gunzipBody{wire: io.NopCloser(bytes.NewReader(wire[:len(wire)-6]))}
					if _, err := io.Copy(io.Discard, body); err == nil {
						t.Error("a truncated answer: no error")
					}
				default:
					body := &gunzipBody{wire: io.NopCloser(bytes.NewReader(wire))}
					got, err := io.ReadAll(body)
					if err != nil || string(got) != want {
						t.Errorf("answer %d.%d: %d bytes (%v), want %d", i, j, len(got), err,
							len(want))
					}
					if n, err := body.Read(make([]byte, 4)); n != 0 || err != io.EOF {
						t.Errorf("a Read past the end: %d, %v", n, err)
					}
				}
			}
		}()
	}
	wg.Wait()
}

// An answer expected at its size is read into one buffer of about it (the
// buffer it is kept in is at most 1.3 times it; grown from nothing by
// doubling, it was up to twice, after copies of every smaller one:
// BenchmarkTakeAListing has the bytes); one larger or smaller than
// expected is read whole all the same.
func TestAListingIsReadIntoABufferOfItsLastSize(t *testing.T) {
	body := bytes.Repeat([]byte(`{"Node":"n1","ServiceID":"work:x"},`), 60000) // ~2 MB
	if got := captured(t, body, 0); !bytes.Equal(got, body) {
		t.Fatal("read without a hint: not the body")
	}
	got := captured(t, body, len(body))
	if !bytes.Equal(got, body) {
		t.Fatal("read at its size: not the body")
	}
	if limit := len(body) * 13 / 10; cap(got) > limit {
		t.Fatalf("read at its size into %d bytes for %d, want at most %d", cap(got),
			len(body), limit)
	}
	for _, hint := range []int{1, len(body) / 3, len(body) - 1, len(body) + 1, 4 * len(body)} {
		if got := captured(t, body, hint); !bytes.Equal(got, body) {
			t.Fatalf("expecting %d bytes: read %d, not the body of %d", hint, len(got), len(body))
		}
	}
}

// listingSizes remembers what each listing last read, per key, only from
// answers taken; a nil one remembers nothing.
func TestListingSizesAreRememberedPerListing(t *testing.T) {
	var l listingSizes
	l.set("catalog\x00work\x00leasehold", &bodyCapture{body: make([]byte, 100), taken: true})
	l.set("health\x00work\x00leasehold", &bodyCapture{body: make([]byte, 7), taken: true})
	l.set("catalog\x00other\x00leasehold", &bodyCapture{body: make([]byte, 5)}) // not taken
	if got := l.get("catalog\x00work\x00leasehold"); got != 100 {
		t.Fatalf("catalog of work: %d, want 100", got)
	}
	if got := l.get("health\x00work\x00leasehold"); got != 7 {
		t.Fatalf("health of work: %d, want 7", got)
	}
	if got := l.get("catalog\x00other\x00leasehold"); got != 0 {
		t.Fatalf("an answer not taken was remembered: %d", got)
	}
	var none *listingSizes
	none.set("catalog\x00work\x00leasehold", &bodyCapture{body: make([]byte, 100), taken: true})
	if got := none.get("catalog\x00work\x00leasehold"); got != 0 {
		t.Fatalf("a nil listingSizes remembered %d", got)
	}
}

// BenchmarkTakeAListing reads a ~2 MB listing as the task watch captures
// it: into a buffer grown as it reads (the first answer), or one of the
// last answer's size.
func BenchmarkTakeAListing(b *testing.B) {
	body := bytes.Repeat([]byte(`{"Node":"n1","ServiceID":"work:x"},`), 60000)
	for _, tc := range []struct {
		name string
		hint int
	}{{"grown", 0}, {"sized", len(body)}} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for range b.N {
				c := &bodyCapture{hint: tc.hint}
				resp := &http.Response{StatusCode: http.StatusOK, Header: http.Header{},
					Body: io.NopCloser(bytes.NewReader(body))}
				if _, err := c.take(resp); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// The generation keys' listing, read into a buffer of the last one's size
// and decoded whole, is what the api client decodes; its size is
// remembered; an empty listing still asks whether the keys may be read; a
// body that is not a listing is an error.
func TestAGenerationListingIsDecodedFromItsCapturedBody(t *testing.T) {
	var pairs api.KVPairs
	for i := range 300 {
		pairs = append(pairs, &api.KVPair{Key: health.GenerationKey(fmt.Sprintf("x%03d", i)),
			Value:       []byte(fmt.Sprintf(`{"generation":%d,"session_id":"s%d"}`, i+1, i)),
			CreateIndex: uint64(10 + i), ModifyIndex: uint64(20 + i), Flags: uint64(i % 3)})
	}
	doc, err := json.Marshal(pairs)
	if err != nil {
		t.Fatal(err)
	}
	var answer atomic.Value // the listing's body
	answer.Store(doc)
	var probes atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Consul-Index", "42")
		if _, recurse := r.URL.Query()["recurse"]; !recurse {
			probes.Add(1) // the read of the prefix key an empty listing asks
			w.WriteHeader(http.StatusNotFound)
			return
		}
		body := answer.Load().([]byte)
		if r.Header.Get("Accept-Encoding") == "gzip" {
			w.Header().Set("Content-Encoding", "gzip")
			body = gzipped(body)
		}
		w.Write(body)
	}))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	own, plain := bothClients(t, addr)
	want, _, err := (apiCatalog{c: plain}).Generations(context.Background(), 0, 0)
	if err != nil || len(want) != len(pairs) {
		t.Fatalf("as the api client decodes: %d pairs, %v", len(want), err)
	}
	sized := apiCatalog{c: own, sizes: &listingSizes{}}
	for read := range 2 { // the first read has no size to expect, the second has
		got, idx, err := sized.Generations(context.Background(), 0, 0)
		if err != nil || idx != 42 || !reflect.DeepEqual(got, want) {
			t.Fatalf("read %d: %d pairs at %d, %v; want the api client's %d", read, len(got),
				idx, err, len(want))
		}
		if n := sized.sizes.get("kv\x00" + health.GenerationKeyPrefix); n != len(doc) {
			t.Fatalf("read %d: %d bytes remembered, the listing is %d", read, n, len(doc))
		}
	}
	answer.Store([]byte("[]"))
	if got, _, err := sized.Generations(context.Background(), 0, 0); err != nil || len(got) != 0 ||
		probes.Load() != 1 {
		t.Fatalf("an empty listing: %d pairs, %v, %d probes of the prefix", len(got), err,
			probes.Load())
	}
	answer.Store([]byte(`{"not":"a listing"}`))
	if _, _, err := sized.Generations(context.Background(), 0, 0); err == nil ||
		!strings.Contains(err.Error(), "decoding the listing") {
		t.Fatalf("a body that is no listing: %v", err)
	}
}
