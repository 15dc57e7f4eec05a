package main

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/hashicorp/consul/api"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protowire"
)

// The comparison: the same executors are also Connect services whose
// sidecar's health follows the executor's lease (an alias check), and a
// "dispatcher" proxy has every task type as an upstream. A delta ADS client on
// Consul's gRPC port — Consul 1.13's xDS server speaks only delta — plays
// that proxy and records when Consul's EDS stops offering a lapsed executor.
//
// It is a phase of its own, after leasehold's: the dispatcher proxy is
// registered only then (so Consul computes no xDS for it while leasehold is
// measured), and leasehold, its streams and the grpc-go children are stopped
// by then (so they do not react to Consul's lapses). Both phases run on the
// same fleet — every executor a Connect service throughout — with the same
// number of lapses, the same spacing; the victims are the next executors.

// consulLapses lets executors [n, 2n) lapse and measures lease expiry →
// the last of the Consul clients without it.
func (b *bench) consulLapses() error {
	if !*compare || b.n == 0 {
		return nil
	}
	c, err := b.followConsul()
	if err != nil {
		return err
	}
	if err := b.snapshotRaft(); err != nil {
		return err
	}
	victims := span(b.n, 2*b.n)
	expiries := b.fleet.lapseAll(victims)
	for k, i := range victims {
		port := uint32(sidecarPort(i))
		if err := c.await(func(p map[uint32]bool) bool {
			return !p[port]
		}, 4**lease+30*time.Second); err != nil {
			return fmt.Errorf("lapse %d through Consul's xDS: %w", k, err)
		}
		b.res.consulLapse = append(b.res.consulLapse, c.goneAt(port).Sub(expiries[k]))
	}
	b.res.consulLastBeat = b.fleet.heartbeatRTTs(victims)
	logf("%d lapses through Consul's own xDS (its own phase, %d clients): %s; the victims' "+
		"last heartbeat round trips: %s", len(victims), len(c.clients),
		dist(b.res.consulLapse), dist(b.res.consulLastBeat))
	return nil
}

// consulClientCount is how many delta clients follow Consul's xDS: as
// many as leasehold's streams unless --consul-xds-clients says otherwise, so
// that both paths push to the same number of clients.
func consulClientCount() int {
	if *consulClients > 0 {
		return *consulClients
	}
	return *dispatchers
}

// followConsul registers the dispatcher proxy and follows its EDS with
// consulClientCount clients until each offers every executor still
// heartbeating.
func (b *bench) followConsul() (*consulSet, error) {
	if err := registerDispatcherProxy(b.clients[0], b.fleet.tasks); err != nil {
		return nil, fmt.Errorf("dispatcher proxy: %w", err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", b.agent.Ports.GRPC)
	c := &consulSet{}
	for range consulClientCount() {
		e, err := followConsulEDS(b.ctx, addr, b.fleet.tasks)
		if err != nil {
			return nil, err
		}
		c.clients = append(c.clients, e)
	}
	live := b.fleet.live()
	offersLive := func(p map[uint32]bool) bool {
		for _, i := range live {
			if !p[uint32(sidecarPort(i))] {
				return false
			}
		}
		return true
	}
	for _, e := range c.clients {
		if err := e.await(offersLive, 120*time.Second); err != nil {
			e.mu.Lock()
			got := len(e.ports)
			e.mu.Unlock()
			return nil, fmt.Errorf(
				"the EDS of Consul never offered the live fleet (%d offered, %d live): %w",
				got, len(live), err)
		}
	}
	logf("Consul's own xDS offers all %d live executors' sidecars to %d clients",
		len(live), len(c.clients))
	return c, nil
}

// consulSet is the delta clients following Consul's xDS, each on a stream
// (and connection) of its own, as the dispatcher proxy's sidecars would be.
type consulSet struct{ clients []*consulEDS }

// await waits until cond holds at every client.
func (c *consulSet) await(cond func(map[uint32]bool) bool, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for _, e := range c.clients {
		if err := e.await(cond, time.Until(deadline)); err != nil {
			return err
		}
	}
	return nil
}

// goneAt is when the last client stopped offering port.
func (c *consulSet) goneAt(port uint32) time.Time {
	var last time.Time
	for _, e := range c.clients {
		if t := e.goneAt(port); t.After(last) {
			last = t
		}
	}
	return last
}

const dispatcherService = "bench-dispatcher"

// sidecarPort is where executor i's sidecar would listen (nothing does; the
// endpoint is only an address in Consul's EDS).
func sidecarPort(i int) int { return 40000 + i }

// connectFor returns the Connect part of executor i's registration.
func connectFor(serviceID string, i int) *api.AgentServiceConnect {
	return &api.AgentServiceConnect{SidecarService: &api.AgentServiceRegistration{
		Port: sidecarPort(i),
		// Only an alias of the executor's own health: a TCP check of a proxy
		// that does not run would keep every sidecar critical.
		Checks: api.AgentServiceChecks{{Name: "alias", AliasService: serviceID}},
	}}
}

func registerDispatcherProxy(c *api.Client, tasks []string) error {
	var ups []api.Upstream
	for k, t := range tasks {
		ups = append(ups, api.Upstream{DestinationName: t, LocalBindPort: 39997 - k})
	}
	return c.Agent().ServiceRegister(&api.AgentServiceRegistration{
		ID: dispatcherService, Name: dispatcherService, Port: 39999, Address: "127.0.0.1",
		Connect: &api.AgentServiceConnect{SidecarService: &api.AgentServiceRegistration{
			Port:   39998,
			Checks: api.AgentServiceChecks{{Name: "alias", AliasService: dispatcherService}},
			Proxy: &api.AgentServiceConnectProxyConfig{
				Upstreams: ups,
			},
		}},
	})
}

// consulEDS follows Consul's own EDS for the upstreams, as the dispatcher's
// sidecar would, ACKing every response. It keeps the ports per load
// assignment because a delta response carries only the assignments that
// changed.
type consulEDS struct {
	mu     sync.Mutex
	ports  map[uint32]bool            // sidecar ports currently offered, over every upstream
	byRes  map[string]map[uint32]bool // the ports per load assignment
	gone   map[uint32]time.Time
	notify chan struct{}
}

func followConsulEDS(ctx context.Context, grpcAddr string, tasks []string) (*consulEDS, error) {
	conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	s, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
	if err != nil {
		return nil, err
	}
	node := &corev3.Node{Id: dispatcherService + "-sidecar-proxy", Cluster: dispatcherService}
	// Clusters first (wildcard), to learn the upstream cluster's name.
	if err := s.Send(&discovery.DeltaDiscoveryRequest{Node: node,
		TypeUrl: resource.ClusterType}); err != nil {
		return nil, err
	}
	c := &consulEDS{ports: map[uint32]bool{}, byRes: map[string]map[uint32]bool{},
		gone: map[uint32]time.Time{}, notify: make(chan struct{}, 1)}
	ready := make(chan error, 1)
	go func() {
		subscribed := map[string]bool{}
		for {
			r, err := s.Recv()
			if err != nil {
				select {
				case ready <- err:
				default:
				}
				return
			}
			at := time.Now()
			// ACK the response.
			s.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: r.TypeUrl, ResponseNonce: r.Nonce})
			switch r.TypeUrl {
			case resource.ClusterType:
				for _, res := range r.Resources {
					for _, t := range tasks {
						if strings.HasPrefix(res.Name, t+".") && !subscribed[res.Name] {
							subscribed[res.Name] = true
							s.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.EndpointType,
								ResourceNamesSubscribe: []string{res.Name}})
						}
					}
				}
			case resource.EndpointType:
				c.take(r, at)
				select {
				case ready <- nil:
				default:
				}
				select {
				case c.notify <- struct{}{}:
				default:
				}
			}
		}
	}()
	select {
	case err := <-ready:
		if err != nil {
			return nil, fmt.Errorf("consul xDS: %w", err)
		}
	case <-time.After(60 * time.Second):
		return nil, errors.New("consul xDS: no endpoints within 60s")
	}
	return c, nil
}

// take applies an endpoints response received at: the ports offered now,
// and when each one that left was last offered.
func (c *consulEDS) take(r *discovery.DeltaDiscoveryResponse, at time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, res := range r.Resources {
		p := map[uint32]bool{}
		sidecarPorts(res.GetResource().GetValue(), p)
		c.byRes[res.Name] = p
	}
	for _, name := range r.RemovedResources {
		delete(c.byRes, name)
	}
	ports := map[uint32]bool{}
	for _, p := range c.byRes {
		maps.Copy(ports, p)
	}
	for p := range c.ports {
		if !ports[p] {
			if _, ok := c.gone[p]; !ok {
				c.gone[p] = at
			}
		}
	}
	c.ports = ports
}

// await waits until cond holds for the offered ports.
func (c *consulEDS) await(cond func(map[uint32]bool) bool, timeout time.Duration) error {
	return awaitNotified(&c.mu, c.notify, timeout, func() bool { return cond(c.ports) })
}

func (c *consulEDS) goneAt(port uint32) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gone[port]
}

// sidecarPorts adds the ports of the HEALTHY (or unset-status) endpoints of a
// serialized ClusterLoadAssignment: endpoints(2) → lb_endpoints(2) →
// endpoint(1) → address(1) → socket_address(1) → port_value(3).
func sidecarPorts(b []byte, ports map[uint32]bool) {
	fields(b, func(num protowire.Number, v []byte) {
		if num != 2 {
			return
		}
		fields(v, func(num protowire.Number, v []byte) {
			if num != 2 {
				return
			}
			var port uint32
			healthy := true
			fields(v, func(num protowire.Number, v []byte) {
				if num != 1 {
					return
				}
				fields(v, func(num protowire.Number, v []byte) {
					if num != 1 {
						return
					}
					fields(v, func(num protowire.Number, v []byte) {
						if num != 1 {
							return
						}
						fields(v, func(protowire.Number, []byte) {},
							func(num protowire.Number, x uint64) {
								if num == 3 {
									port = uint32(x)
								}
							})
					})
				})
			}, func(num protowire.Number, x uint64) {
				if num == 2 {
					healthy = x == uint64(corev3.HealthStatus_HEALTHY) || x == 0
				}
			})
			if healthy && port != 0 {
				ports[port] = true
			}
		})
	})
}
