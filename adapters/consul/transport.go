package consul

import (
	"cmp"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
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
	return resp, nil
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
// so an empty or failed body surfaces there, as the caller expects.
type gunzipBody struct {
	wire io.ReadCloser
	zr   *gzip.Reader
	err  error
}

func (g *gunzipBody) Read(p []byte) (int, error) {
	if g.zr == nil && g.err == nil {
		g.zr, g.err = gzip.NewReader(g.wire)
		if errors.Is(g.err, io.EOF) {
			g.err = io.ErrUnexpectedEOF
		}
	}
	if g.err != nil {
		return 0, g.err
	}
	return g.zr.Read(p)
}

func (g *gunzipBody) Close() error { return g.wire.Close() }
