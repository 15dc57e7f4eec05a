// Package adstest is the ADS client leasehold's tests share. It drives a
// state-of-the-world or an incremental (delta) stream the way a dispatcher
// does: it subscribes, receives, and ACKs or NACKs each response by its
// nonce, and it fails the test when a response it waits for does not come.
// A test that sends what no dispatcher would (a request without its node, a
// node that changes on an incremental stream) takes the raw stream from
// Stream.
package adstest

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
)

// DefaultTimeout is how long Recv waits for a response unless the client's
// Timeout says otherwise.
const DefaultTimeout = 5 * time.Second

// Client is one state-of-the-world ADS stream. It sends its Node on every
// request, as Envoy and grpc-go do by default.
type Client struct {
	// Node is sent on every request. A test may replace it between requests
	// to see how the server takes a node that changes.
	Node *corev3.Node
	// Timeout bounds each Recv: a response (or the stream's end) not there
	// by then fails the test.
	Timeout time.Duration

	t      testing.TB
	stream discovery.AggregatedDiscoveryService_StreamAggregatedResourcesClient
	cancel context.CancelFunc
	acked  map[string]string // type URL → the version last ACKed
}

// Open opens a stream on conn that ends when the test does (or at Close).
func Open(t testing.TB, conn grpc.ClientConnInterface, node *corev3.Node) *Client {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	s, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatalf("opening an ADS stream: %v", err)
	}
	return &Client{
		Node:    node,
		Timeout: DefaultTimeout,
		t:       t,
		stream:  s,
		cancel:  cancel,
		acked:   map[string]string{},
	}
}

// Dial opens a plaintext connection to addr and a stream on it; both end
// when the test does.
func Dial(t testing.TB, addr string, node *corev3.Node) *Client {
	t.Helper()
	return Open(t, dial(t, addr), node)
}

func dial(t testing.TB, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("dialling %s: %v", addr, err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// Stream is the raw stream, for a test that sends what no dispatcher would.
func (c *Client) Stream() discovery.AggregatedDiscoveryService_StreamAggregatedResourcesClient {
	return c.stream
}

// Close ends the stream.
func (c *Client) Close() { c.cancel() }

// Request sends one request for typeURL naming names, with the version and
// the nonce given. A failed send fails the test.
func (c *Client) Request(typeURL, version, nonce string, names ...string) {
	c.t.Helper()
	c.send(&discovery.DiscoveryRequest{Node: c.Node, TypeUrl: typeURL, VersionInfo: version,
		ResponseNonce: nonce, ResourceNames: names})
}

// Subscribe sends the first request for typeURL: no version, no nonce.
func (c *Client) Subscribe(typeURL string, names ...string) {
	c.t.Helper()
	c.Request(typeURL, "", "", names...)
}

// ACK accepts r, naming the resources the client wants from now on.
func (c *Client) ACK(r *discovery.DiscoveryResponse, names ...string) {
	c.t.Helper()
	c.Request(r.GetTypeUrl(), r.GetVersionInfo(), r.GetNonce(), names...)
	c.acked[r.GetTypeUrl()] = r.GetVersionInfo()
}

// NACK rejects r with detail (code InvalidArgument), naming names. Its
// version is the one last ACKed of r's type, as the protocol asks.
func (c *Client) NACK(r *discovery.DiscoveryResponse, detail string, names ...string) {
	c.t.Helper()
	c.send(&discovery.DiscoveryRequest{Node: c.Node, TypeUrl: r.GetTypeUrl(),
		VersionInfo: c.acked[r.GetTypeUrl()], ResponseNonce: r.GetNonce(), ResourceNames: names,
		ErrorDetail: &rpcstatus.Status{Code: int32(codes.InvalidArgument), Message: detail}})
}

func (c *Client) send(req *discovery.DiscoveryRequest) {
	c.t.Helper()
	if err := c.stream.Send(req); err != nil {
		c.t.Fatalf("sending a %s request: %v", req.GetTypeUrl(), err)
	}
}

// Recv waits for the next response or the stream's error. Neither within
// Timeout fails the test.
func (c *Client) Recv() (*discovery.DiscoveryResponse, error) {
	c.t.Helper()
	return recvWithin(c.t, c.Timeout, c.stream.Recv)
}

// Next is Recv for a response that must come: the stream's end fails the
// test.
func (c *Client) Next() *discovery.DiscoveryResponse {
	c.t.Helper()
	r, err := c.Recv()
	if err != nil {
		c.t.Fatalf("the ADS stream ended: %v", err)
	}
	return r
}

// Follow subscribes to typeURL's names and, from a goroutine of its own,
// ACKs each response and then hands it to each, until the stream ends. The
// ACK goes first so that a test that waits on each never waits on the
// client. requested is when the request that r answers was sent (taken just
// before sending, so never later), received when r arrived (before its
// ACK). The returned channel gets the error that ended the stream, once each
// has returned for the last time. Follow is for a client that only watches:
// the test must not send or receive on the stream itself meanwhile.
func (c *Client) Follow(typeURL string, names []string,
	each func(r *discovery.DiscoveryResponse, requested, received time.Time)) <-chan error {
	ended := make(chan error, 1)
	req := &discovery.DiscoveryRequest{Node: c.Node, TypeUrl: typeURL, ResourceNames: names}
	go func() {
		requested := time.Now()
		if err := c.stream.Send(req); err != nil {
			ended <- c.sendError(err)
			return
		}
		for {
			r, err := c.stream.Recv()
			if err != nil {
				ended <- err
				return
			}
			received := time.Now()
			req.VersionInfo, req.ResponseNonce = r.GetVersionInfo(), r.GetNonce()
			err = c.stream.Send(req)
			each(r, requested, received)
			if err != nil {
				ended <- c.sendError(err)
				return
			}
			requested = received // the ACK is the next response's request
		}
	}()
	return ended
}

// sendError is the error a failed send stands for: io.EOF only says the
// stream ended, and its status comes from Recv, as grpc-go documents.
func (c *Client) sendError(err error) error {
	if !errors.Is(err, io.EOF) {
		return err
	}
	for {
		if _, rerr := c.stream.Recv(); rerr != nil {
			return rerr
		}
	}
}

// DeltaClient is one incremental ADS stream. It sends its Node on the first
// request only: an incremental stream's node is the first request's.
type DeltaClient struct {
	// Node is sent on the stream's first request.
	Node *corev3.Node
	// Timeout bounds each Recv, as Client's does.
	Timeout time.Duration

	t      testing.TB
	stream discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
	sent   bool
}

// OpenDelta opens an incremental stream on conn that ends when the test
// does.
func OpenDelta(t testing.TB, conn grpc.ClientConnInterface, node *corev3.Node) *DeltaClient {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	s, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
	if err != nil {
		t.Fatalf("opening an incremental ADS stream: %v", err)
	}
	return &DeltaClient{Node: node, Timeout: DefaultTimeout, t: t, stream: s}
}

// Stream is the raw stream, for a test that sends what no dispatcher would.
func (c *DeltaClient) Stream() discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient {
	return c.stream
}

// Subscribe asks for typeURL's names as well.
func (c *DeltaClient) Subscribe(typeURL string, names ...string) {
	c.t.Helper()
	c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResourceNamesSubscribe: names})
}

// ACK accepts r.
func (c *DeltaClient) ACK(r *discovery.DeltaDiscoveryResponse) {
	c.t.Helper()
	c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: r.GetTypeUrl(), ResponseNonce: r.GetNonce()})
}

// NACK rejects r with detail (code InvalidArgument).
func (c *DeltaClient) NACK(r *discovery.DeltaDiscoveryResponse, detail string) {
	c.t.Helper()
	c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: r.GetTypeUrl(), ResponseNonce: r.GetNonce(),
		ErrorDetail: &rpcstatus.Status{Code: int32(codes.InvalidArgument), Message: detail}})
}

func (c *DeltaClient) send(req *discovery.DeltaDiscoveryRequest) {
	c.t.Helper()
	if !c.sent {
		req.Node, c.sent = c.Node, true
	}
	if err := c.stream.Send(req); err != nil {
		c.t.Fatalf("sending an incremental %s request: %v", req.GetTypeUrl(), err)
	}
}

// Recv waits for the next response or the stream's error. Neither within
// Timeout fails the test.
func (c *DeltaClient) Recv() (*discovery.DeltaDiscoveryResponse, error) {
	c.t.Helper()
	return recvWithin(c.t, c.Timeout, c.stream.Recv)
}

// Next is Recv for a response that must come: the stream's end fails the
// test.
func (c *DeltaClient) Next() *discovery.DeltaDiscoveryResponse {
	c.t.Helper()
	r, err := c.Recv()
	if err != nil {
		c.t.Fatalf("the incremental ADS stream ended: %v", err)
	}
	return r
}

// recvWithin runs recv, failing the test when it has not returned within
// timeout. The receiving goroutine outlives a timeout, blocked until the
// stream ends with the test.
func recvWithin[R any](t testing.TB, timeout time.Duration, recv func() (R, error)) (R, error) {
	t.Helper()
	type result struct {
		r   R
		err error
	}
	ch := make(chan result, 1)
	go func() { r, err := recv(); ch <- result{r, err} }()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case got := <-ch:
		return got.r, got.err
	case <-timer.C:
		t.Fatalf("no ADS response within %s", timeout)
		var zero R
		return zero, nil
	}
}
