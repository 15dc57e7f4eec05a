package main

import (
	"context"
	"flag"
	"fmt"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/anypb"
)

// deltaStreams makes leasehold's light streams speak incremental (delta)
// xDS, the kind of client Consul 1.13's xDS server serves (it speaks only
// delta), so that the two paths are compared with the same kind of client.
var deltaStreams = flag.Bool("delta", false,
	"leasehold's light streams speak delta xDS (DeltaAggregatedResources), as the clients of "+
		"Consul's own xDS do; the floor's stay state of the world")

// startStreams starts leasehold's light streams, of the kind --delta says.
func startStreams(
	ctx context.Context, addr string, m int, tasks []string, shards map[string]int,
) (*dispatcherSet, error) {
	if *deltaStreams {
		return startDeltaDispatchers(ctx, addr, m, tasks, shards, *streamsPerConn)
	}
	return startDispatchers(ctx, addr, m, tasks, shards, *streamsPerConn)
}

// startDeltaDispatchers is startDispatchers speaking delta xDS: each stream
// subscribes to its task's load assignments by name and ACKs every
// response by its nonce.
func startDeltaDispatchers(
	ctx context.Context, addr string, m int, tasks []string, shards map[string]int, perConn int,
) (*dispatcherSet, error) {
	ds := newDispatcherSet(m, tasks)
	var conn *grpc.ClientConn
	for i := range m {
		if i%perConn == 0 {
			var err error
			conn, err = grpc.NewClient(addr,
				grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				return nil, err
			}
		}
		s, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
		if err != nil {
			return nil, err
		}
		if err := s.Send(&discovery.DeltaDiscoveryRequest{
			Node:                   &corev3.Node{Id: fmt.Sprintf("bench-%d", i)},
			TypeUrl:                resource.EndpointType,
			ResourceNamesSubscribe: edsNames(ds.tasks[i], shards[ds.tasks[i]]),
		}); err != nil {
			return nil, err
		}
		go ds.deltaClient(i, s)
	}
	return ds, nil
}

func (ds *dispatcherSet) deltaClient(
	i int, s discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient,
) {
	for {
		r, err := s.Recv()
		if err != nil {
			return
		}
		received := time.Now()
		s.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: r.TypeUrl, ResponseNonce: r.Nonce})
		updates := make(map[string]map[string]bool, len(r.GetResources()))
		// What client 0 keeps for the floor: the same resources as a state
		// of the world response (the floor serves state of the world).
		sotw := &discovery.DiscoveryResponse{VersionInfo: r.SystemVersionInfo, Nonce: r.Nonce,
			TypeUrl: r.TypeUrl}
		for _, res := range r.GetResources() {
			hosts := map[string]bool{}
			healthyHosts(res.GetResource().GetValue(), hosts)
			updates[res.GetName()] = hosts
			sotw.Resources = append(sotw.Resources, &anypb.Any{
				TypeUrl: res.GetResource().GetTypeUrl(), Value: res.GetResource().GetValue()})
		}
		ds.apply(i, received, updates, r.GetRemovedResources(), sotw)
	}
}
