// Package server serves leasehold's xDS (state-of-the-world and delta, over
// ADS and the per-type services) from the syncer's cache, validates
// dispatchers' node metadata and serves the admin HTTP endpoints.
package server

import (
	"context"
	"log/slog"
	"sync"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	clusterservice "github.com/envoyproxy/go-control-plane/envoy/service/cluster/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	discoverygrpc "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	endpointservice "github.com/envoyproxy/go-control-plane/envoy/service/endpoint/v3"
	listenerservice "github.com/envoyproxy/go-control-plane/envoy/service/listener/v3"
	routeservice "github.com/envoyproxy/go-control-plane/envoy/service/route/v3"
	xdsserver "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot"
)

// Subscriber is what the xDS server needs from the syncer: streams announce
// and release their dispatcher constraint set.
type Subscriber interface {
	Subscribe(health.Dispatcher)
	Unsubscribe(health.Dispatcher)
}

// XDS is the xDS server.
type XDS struct {
	srv  xdsserver.Server
	subs Subscriber
	log  *slog.Logger

	mu      sync.Mutex
	streams map[int64]health.Dispatcher // streams that announced a constraint set
}

// NewXDS serves cache; subs learns which constraint sets are in use.
func NewXDS(ctx context.Context, syncer *snapshot.Syncer, log *slog.Logger) *XDS {
	x := &XDS{subs: syncer, log: log.With("component", "xds"), streams: map[int64]health.Dispatcher{}}
	x.srv = xdsserver.NewServer(ctx, syncer.Cache(), x.callbacks())
	return x
}

// Register adds the aggregated and per-type discovery services to g.
func (x *XDS) Register(g *grpc.Server) {
	discoverygrpc.RegisterAggregatedDiscoveryServiceServer(g, x.srv)
	endpointservice.RegisterEndpointDiscoveryServiceServer(g, x.srv)
	clusterservice.RegisterClusterDiscoveryServiceServer(g, x.srv)
	routeservice.RegisterRouteDiscoveryServiceServer(g, x.srv)
	listenerservice.RegisterListenerDiscoveryServiceServer(g, x.srv)
}

func (x *XDS) callbacks() xdsserver.CallbackFuncs {
	return xdsserver.CallbackFuncs{
		StreamRequestFunc: func(id int64, req *discovery.DiscoveryRequest) error {
			return x.onRequest(id, req.GetNode(), req.GetTypeUrl(), "sotw")
		},
		StreamDeltaRequestFunc: func(id int64, req *discovery.DeltaDiscoveryRequest) error {
			return x.onRequest(id, req.GetNode(), req.GetTypeUrl(), "delta")
		},
		StreamClosedFunc:      func(id int64, _ *corev3.Node) { x.onClosed(id) },
		DeltaStreamClosedFunc: func(id int64, _ *corev3.Node) { x.onClosed(id) },
		FetchRequestFunc: func(_ context.Context, req *discovery.DiscoveryRequest) error {
			if _, err := snapshot.DispatcherOf(req.GetNode()); err != nil {
				return status.Error(codes.InvalidArgument, err.Error())
			}
			return nil
		},
	}
}

// onRequest validates the node of a stream's first request, refusing the
// stream with InvalidArgument naming the bad field, and subscribes its
// constraint set before the cache sees the request.
func (x *XDS) onRequest(id int64, node *corev3.Node, typeURL, mode string) error {
	x.mu.Lock()
	_, known := x.streams[id]
	x.mu.Unlock()
	if known {
		return nil
	}
	d, err := snapshot.DispatcherOf(node)
	if err != nil {
		x.log.Warn("dispatcher refused: invalid node metadata", "node_id", node.GetId(), "err", err)
		return status.Error(codes.InvalidArgument, err.Error())
	}
	x.subs.Subscribe(d)
	x.mu.Lock()
	x.streams[id] = d
	n := len(x.streams)
	x.mu.Unlock()
	x.log.Info("dispatcher stream", "node_id", node.GetId(), "stream", id, "mode", mode, "type_url", typeURL, "group", d.Key(), "streams", n)
	return nil
}

func (x *XDS) onClosed(id int64) {
	x.mu.Lock()
	d, ok := x.streams[id]
	delete(x.streams, id)
	x.mu.Unlock()
	if ok {
		x.subs.Unsubscribe(d)
	}
}

// Streams is the number of open streams that announced a constraint set.
func (x *XDS) Streams() int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return len(x.streams)
}
