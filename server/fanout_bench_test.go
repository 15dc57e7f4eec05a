package server

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sort"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	protocodec "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/adstest"
	"github.com/leasehold/leasehold/internal/fleettest"
	"github.com/leasehold/leasehold/snapshot/fleet"
	"github.com/leasehold/leasehold/snapshot/xdscache"
)

// BenchmarkFanOut measures what happens after the cache: one removal at
// 500 endpoints (-fanout-endpoints; at 500 to 550, as removals run the
// fleet down and it is filled again), from the syncer's publication until
// the last of 100 ADS streams (-fanout-streams; one connection, like
// leasehold-bench's light clients) received the new response, against a
// floor: a bare ADS server pushing the bytes leasehold sent to as many
// streams of their own. The clients ACK and count
// responses only, so the figure is the servers' and the transport's, not
// client parsing. Both run in this process, their pushes alternating, so the
// pair shares the machine's background; compare the pair (ratio), not with
// leasehold-bench. Per endpoint metadata form.
//
//	go test ./server -run '^$' -bench FanOut -benchtime 40x
func BenchmarkFanOut(b *testing.B) {
	endpoints, streams, frames := *fanOutEndpoints, *fanOutStreams, 20
	for _, form := range []string{"full", "session", "none"} {
		b.Run(form, func(b *testing.B) {
			// Removals run the fleet down from endpoints+frames+slack to
			// endpoints, then it is filled again (unmeasured): b.Loop's
			// iterations are not known before it runs.
			lh := startFanOutServer(b, endpoints+frames+max(endpoints/10, 10))
			lc := dialStreams(b, lh.addr, streams, form, true)
			lc.await(b, 1)
			for i := 2; i <= frames; i++ { // stream 0's responses: the floor's frames
				lh.remove()
				lc.await(b, i)
			}
			f := startFloorServer(b, lc.frames)
			fc := dialStreams(b, f.addr, streams, form, false)
			fc.await(b, 1)
			ln, fn := len(lc.frames), 1
			var lat, floor []time.Duration
			for i := 0; b.Loop(); i++ {
				if len(lh.members) <= endpoints {
					lh.refill()
					ln++
					lc.await(b, ln)
				}
				at := lh.remove()
				ln++
				lat = append(lat, lc.await(b, ln).Sub(at))
				k := 1 + i%(len(f.frames)-1)
				at = f.push(k)
				fn++
				floor = append(floor, fc.await(b, fn).Sub(at))
				if k == len(f.frames)-1 { // start over, unmeasured
					f.push(0)
					fn++
					fc.await(b, fn)
				}
			}
			lp, fp := median(lat), median(floor)
			b.ReportMetric(float64(lp)/1e6, "ms-p50")
			b.ReportMetric(float64(fp)/1e6, "floor-ms-p50")
			b.ReportMetric(float64(lp)/float64(max(fp, 1)), "×floor")
			// The first removal's bytes; an op's wall time includes the waits,
			// so ns/op says nothing.
			b.ReportMetric(float64(len(lc.frames[1])), "B/push")
			b.ReportMetric(0, "ns/op")
		})
	}
}

var (
	fanOutEndpoints = flag.Int("fanout-endpoints",
		500, "BenchmarkFanOut: endpoints in the load assignment")
	fanOutStreams = flag.Int("fanout-streams", 100, "BenchmarkFanOut: ADS streams")
)

func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

// fanOutServer is leasehold's syncer and xDS server, fed members directly.
type fanOutServer struct {
	addr      string
	obs       chan health.Observation
	published chan time.Time
	members   []health.Member
	all       []health.Member // what it started with (refill)
	idx       uint64
}

func startFanOutServer(b *testing.B, n int) *fanOutServer {
	ctx, cancel := context.WithCancel(context.Background())
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	s := &fanOutServer{
		obs:       make(chan health.Observation, 16),
		published: make(chan time.Time, 16),
		idx:       10,
	}
	syncer := fleet.NewSyncer(fleet.SyncConfig{Logger: log})
	syncer.Notify(func(fleet.Publication) { s.published <- time.Now() })
	g := grpc.NewServer(ServerOption()) // serve's transport options
	NewXDS(ctx, syncer, log).Register(g)
	done := make(chan struct{})
	go func() { syncer.Run(ctx, s.obs); close(done) }()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go g.Serve(lis)
	b.Cleanup(func() { g.Stop(); cancel(); <-done })
	s.addr = lis.Addr().String()
	for i := range n {
		m := member("work", fmt.Sprintf("x%05d", i), 20000+i, "1.0.0")
		m.SessionID = fmt.Sprintf("%026d", i) // as long as the Registrar's
		m.Checks[1].CheckID = health.CheckID(m.InstanceID, m.SessionID, "work")
		s.members = append(s.members, m)
	}
	// Each instance's generation key confirms its registration: without
	// one nothing is routed, and a removal changes no response.
	gens := map[string]uint64{}
	for _, m := range s.members {
		gens[m.InstanceID] = m.Generation
	}
	s.all = s.members
	s.obs <- health.Observation{Data: &health.TaskList{Tasks: []string{"work"}}}
	s.obs <- health.Observation{Data: &health.NonPassing{Index: 2}}
	s.obs <- health.Observation{Data: &health.Generations{Index: 2, Keys: fleettest.Keys(gens)}}
	s.send()
	return s
}

func (s *fanOutServer) send() {
	s.idx++
	s.obs <- health.Observation{Data: &health.TaskMembers{Task: "work", Index: s.idx,
		Members: append([]health.Member(nil), s.members...)}}
}

// remove drops the first member and returns when the syncer published the
// change (just before the cache has it).
func (s *fanOutServer) remove() time.Time {
	for len(s.published) > 0 {
		<-s.published
	}
	s.members = s.members[1:]
	s.send()
	return <-s.published
}

// refill puts every member back and returns when the syncer published it.
func (s *fanOutServer) refill() {
	for len(s.published) > 0 {
		<-s.published
	}
	s.members = s.all
	s.send()
	<-s.published
}

// benchStreams are light ADS clients on one connection: they ACK each
// response and count it.
type benchStreams struct {
	mu     sync.Mutex
	counts []int
	last   []time.Time
	frames [][]byte // stream 0's responses, marshalled, when capturing
	notify chan struct{}
}

func dialStreams(b *testing.B, addr string, n int, form string, capture bool) *benchStreams {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { conn.Close() })
	// One cluster of every endpoint, not shards of 250: a removal is pushed
	// whole, as the benchmark means to measure.
	meta, _ := structpb.NewStruct(map[string]any{xdscache.NodeMetaEndpointMetadata: form,
		xdscache.NodeMetaWeightedClusters: false})
	c := &benchStreams{
		counts: make([]int, n),
		last:   make([]time.Time, n),
		notify: make(chan struct{}, 1),
	}
	for i := range n {
		s := adstest.Open(b, conn, &corev3.Node{Id: fmt.Sprintf("bench-%d", i), Metadata: meta})
		s.Follow(resource.EndpointType, []string{"work"},
			func(r *discovery.DiscoveryResponse, _, at time.Time) {
				c.mu.Lock()
				c.counts[i]++
				c.last[i] = at
				if i == 0 && capture {
					r.Nonce = ""
					fr, _ := proto.MarshalOptions{Deterministic: true}.Marshal(r)
					c.frames = append(c.frames, fr)
				}
				c.mu.Unlock()
				select {
				case c.notify <- struct{}{}:
				default:
				}
			},
		)
	}
	return c
}

// await waits until every stream has n responses and returns when the last
// one arrived.
func (c *benchStreams) await(b *testing.B, n int) time.Time {
	deadline := time.After(30 * time.Second)
	for {
		c.mu.Lock()
		var last time.Time
		all := true
		for i, k := range c.counts {
			if k < n {
				all = false
				break
			}
			if c.last[i].After(last) {
				last = c.last[i]
			}
		}
		c.mu.Unlock()
		if all {
			return last
		}
		select {
		case <-c.notify:
		case <-deadline:
			b.Fatalf("streams never had %d responses", n)
		}
	}
}

// floorServer pushes pre-marshalled responses to every stream.
type floorServer struct {
	addr    string
	frames  [][]byte
	mu      sync.Mutex
	streams []chan []byte
}

func startFloorServer(b *testing.B, frames [][]byte) *floorServer {
	f := &floorServer{frames: frames}
	g := grpc.NewServer(grpc.ForceServerCodecV2(rawCodec{}))
	g.RegisterService(&grpc.ServiceDesc{
		ServiceName: discovery.AggregatedDiscoveryService_ServiceDesc.ServiceName,
		HandlerType: (*any)(nil),
		Streams: []grpc.StreamDesc{
			{
				StreamName:    "StreamAggregatedResources",
				Handler:       f.stream,
				ServerStreams: true,
				ClientStreams: true,
			},
		},
	}, f)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go g.Serve(lis)
	b.Cleanup(g.Stop)
	f.addr = lis.Addr().String()
	return f
}

func (f *floorServer) push(k int) time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	at := time.Now()
	for _, ch := range f.streams {
		ch <- f.frames[k]
	}
	return at
}

func (f *floorServer) stream(_ any, ss grpc.ServerStream) error {
	ch := make(chan []byte, 4)
	ch <- f.frames[0]
	f.mu.Lock()
	f.streams = append(f.streams, ch)
	f.mu.Unlock()
	go func() {
		for ss.RecvMsg(nil) == nil { // ACKs: read and dropped
		}
	}()
	for {
		select {
		case fr := <-ch:
			if err := ss.SendMsg(fr); err != nil {
				return err
			}
		case <-ss.Context().Done():
			return nil
		}
	}
}

// rawCodec sends frames as they are and drops what it receives.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	fr, ok := v.([]byte)
	if !ok {
		return nil, errors.New("floor codec: not a frame")
	}
	return mem.BufferSlice{mem.SliceBuffer(fr)}, nil
}

func (rawCodec) Unmarshal(mem.BufferSlice, any) error { return nil }

func (rawCodec) Name() string { return protocodec.Name }
