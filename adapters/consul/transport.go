package consul

import (
	"bufio"
	"bytes"
	"cmp"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/hashicorp/consul/api"
)

// readSizes collects the bytes of the answers to the requests made with a
// context carrying it (withReadSizes): as they came over the wire
// (compressed) and decoded (the JSON Consul encoded and leasehold parses).
// The watcher charges its read budget and its metrics with them.
type readSizes struct {
	wire, decoded atomic.Int64
}

type readSizesKey struct{}

// withReadSizes returns ctx carrying a fresh readSizes.
func withReadSizes(ctx context.Context) (context.Context, *readSizes) {
	s := new(readSizes)
	return context.WithValue(ctx, readSizesKey{}, s), s
}

func readSizesOf(ctx context.Context) *readSizes {
	s, _ := ctx.Value(readSizesKey{}).(*readSizes)
	return s
}

// plus adds o's sizes to s (nil: none yet) and returns the sum.
func (s *readSizes) plus(o *readSizes) *readSizes {
	if s == nil || o == nil {
		return cmp.Or(s, o)
	}
	s.wire.Add(o.wire.Load())
	s.decoded.Add(o.decoded.Load())
	return s
}

// sizingTransport asks Consul for gzip-compressed answers and decompresses
// them itself (Go's transport would do it too, but hide the wire size),
// counting both sizes into the request's readSizes.
type sizingTransport struct{ next http.RoundTripper }

func (t sizingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	sizes := readSizesOf(req.Context())
	ownGzip := req.Header.Get("Accept-Encoding") == "" && req.Header.Get("Range") == ""
	if ownGzip {
		req = req.Clone(req.Context())
		req.Header.Set("Accept-Encoding", "gzip")
	}
	resp, err := t.next.RoundTrip(req)
	if err != nil || resp.Body == nil {
		return resp, err
	}
	wire := &countingReader{r: resp.Body, n: sizes.counter(false)}
	body := io.ReadCloser(wire)
	if ownGzip && strings.EqualFold(resp.Header.Get("Content-Encoding"), "gzip") {
		body = &gunzipBody{wire: wire}
		resp.Header.Del("Content-Encoding")
		resp.Header.Del("Content-Length")
		resp.ContentLength = -1
		resp.Uncompressed = true
	}
	resp.Body = &countingReader{r: body, n: sizes.counter(true)}
	if c := bodyCaptureOf(req.Context()); c != nil && resp.StatusCode == http.StatusOK {
		return c.take(resp)
	}
	return resp, nil
}

// bodyCapture takes the body of a successful answer to a request made with
// a context carrying it (withBodyCapture) and hands the api client a JSON
// null in its place: the listings leasehold decodes itself (listing.go)
// are then not decoded twice. The status, headers and query metadata stay
// the api client's to read; an answer that is not 200 is left alone, for
// the client's errors.
type bodyCapture struct {
	body  []byte
	taken bool
	hint  int // the bytes the answer is expected to hold (0: unknown)
}

type bodyCaptureKey struct{}

// withBodyCapture returns ctx carrying a fresh bodyCapture, expecting an
// answer of about hint bytes (0: unknown).
func withBodyCapture(ctx context.Context, hint int) (context.Context, *bodyCapture) {
	c := &bodyCapture{hint: hint}
	return context.WithValue(ctx, bodyCaptureKey{}, c), c
}

// listingSizes remembers the size of each listing's last answer, so that
// the next answer of the same listing is read into one buffer of about its
// size. Read into a buffer grown from nothing (io.ReadAll), a 2 MB listing
// allocated and copied ~2-3 times its size, the largest allocation of a
// fleet registering at 10,000 executors (BENCHMARKS.md, "The collector's
// target"). The zero value is ready; a nil one remembers nothing.
type listingSizes struct {
	mu sync.Mutex
	m  map[string]int
}

func (l *listingSizes) get(key string) int {
	if l == nil {
		return 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.m[key]
}

// set remembers what c read for key (nothing when it read nothing).
func (l *listingSizes) set(key string, c *bodyCapture) {
	if l == nil || !c.taken {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m == nil {
		l.m = map[string]int{}
	}
	l.m[key] = len(c.body)
}

func bodyCaptureOf(ctx context.Context) *bodyCapture {
	c, _ := ctx.Value(bodyCaptureKey{}).(*bodyCapture)
	return c
}

func (c *bodyCapture) take(resp *http.Response) (*http.Response, error) {
	var buf bytes.Buffer
	if c.hint > 0 {
		// An eighth more: a listing grows a little between answers, and
		// one that outgrows the buffer is read on in a doubled one.
		buf.Grow(c.hint + c.hint/8 + bytes.MinRead)
	}
	_, err := buf.ReadFrom(resp.Body)
	resp.Body.Close()
	if err != nil {
		return nil, fmt.Errorf("reading the answer: %w", err)
	}
	c.body, c.taken = buf.Bytes(), true
	resp.Body = io.NopCloser(strings.NewReader("null"))
	resp.ContentLength = int64(len("null"))
	resp.Header.Del("Content-Length")
	return resp, nil
}

// catalog is the catalog listing the request answered: decoded from the
// captured body, or decoded (as given) by the api client when the client's
// transport captured nothing (a client not built by NewClient).
func (c *bodyCapture) catalog(decoded []*api.CatalogService) ([]*api.CatalogService, error) {
	if !c.taken {
		return decoded, nil
	}
	return decodeCatalogListing(c.body)
}

// health is catalog for a health listing.
func (c *bodyCapture) health(decoded []*api.ServiceEntry) ([]*api.ServiceEntry, error) {
	if !c.taken {
		return decoded, nil
	}
	return decodeHealthListing(c.body)
}

// checks is catalog for a listing of checks.
func (c *bodyCapture) checks(decoded api.HealthChecks) (api.HealthChecks, error) {
	if !c.taken {
		return decoded, nil
	}
	return decodeCheckListing(c.body)
}

func (s *readSizes) counter(decoded bool) *atomic.Int64 {
	switch {
	case s == nil:
		return nil
	case decoded:
		return &s.decoded
	default:
		return &s.wire
	}
}

type countingReader struct {
	r io.ReadCloser
	n *atomic.Int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	if c.n != nil {
		c.n.Add(int64(n))
	}
	return n, err
}

func (c *countingReader) Close() error { return c.r.Close() }

// gunzipBody decompresses lazily: the gzip header is read on the first Read,
// so an empty or failed body surfaces there, as the caller expects. Its
// decompressor comes from gunzips and goes back once the body is read to its
// end (the checksum verified); a body closed or failed before that drops it,
// so a Close racing a Read (a blocking call cut short) never frees one in
// use.
type gunzipBody struct {
	wire io.ReadCloser
	z    *gunzip
	err  error // sticky: the body's end (io.EOF) or its failure
}

// gunzip is one decompressor and the buffered reader it reads the wire
// through. A fresh one allocates its 32 KB window and 4 KB buffer: for
// every answer of every watch, that was ~60 KB of the ~1 MB serve allocated
// per lapse at 1,000 streams (BENCHMARKS.md, "Lapse marks after the pushes,
// and fewer allocations per lapse").
type gunzip struct {
	br *bufio.Reader
	zr gzip.Reader
}

// gunzips holds the decompressors of bodies read to their end.
var gunzips = sync.Pool{New: func() any { return &gunzip{br: bufio.NewReader(nil)} }}

func (g *gunzipBody) Read(p []byte) (int, error) {
	if g.z == nil && g.err == nil {
		z := gunzips.Get().(*gunzip)
		z.br.Reset(g.wire)
		if err := z.zr.Reset(z.br); err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			g.err = err
			return 0, err
		}
		g.z = z
	}
	if g.err != nil {
		return 0, g.err
	}
	n, err := g.z.zr.Read(p)
	if err != nil {
		g.err = err
		if err == io.EOF {
			z := g.z
			z.br.Reset(nil) // holds no connection's body while pooled
			gunzips.Put(z)
		}
		g.z = nil
	}
	return n, err
}

func (g *gunzipBody) Close() error { return g.wire.Close() }
