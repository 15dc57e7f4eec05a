package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"sync"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	protobuf "google.golang.org/protobuf/proto"
)

// The floor: the responses leasehold sent to light stream 0 during the
// lapses and the fan-out, byte for byte, pushed by a bare ADS server — no
// Consul, no decisions, no cache, each response marshalled once before the
// measurement — to the same number of light streams through the same client
// code (dispatcherSet: ACK on receipt, then the wire scan). What leasehold
// takes beyond the floor is leasehold's; the floor itself is grpc-go's
// transport, loopback and the harness's clients on this machine.
//
// The bare server is a child process (this binary again, like the grpc-go
// dispatchers), as `leasehold serve` is: its sends do not share a Go
// scheduler, GC or GOMAXPROCS with the clients measuring it, so the two
// measurements differ in the server only. It uses grpc-go's default
// transport settings (leasehold's own are part of what is compared). It
// runs while leasehold, its streams and the grpc-go children are still up
// and idle, so the machine's background is the one leasehold was measured
// in.

// floorChildEnv switches the harness binary into the bare ADS server; its
// value is the file holding the frames to serve.
const floorChildEnv = "LEASEHOLD_BENCH_FLOOR_CHILD"

// floorPlan is what the floor replays: frames[0] is the state every stream
// starts from; frames[k] (k ≥ 1) is pushed k-th, and removed[k-1], one host
// it no longer lists, tells when a stream has it.
type floorPlan struct {
	frames  [][]byte
	base    int // hosts frames[0] lists
	removed []string
	gone    int // endpoints the pushes remove in all
}

// planFloor keeps, of the responses received since base, those that removed
// an endpoint (what the lapses and fan-outs measured), marshalled as
// leasehold's codec writes them: a deterministic proto.Marshal. A response
// may carry only the load assignments that changed (one shard of a sharded
// task), so the endpoints are followed per resource, as the clients do.
func planFloor(
	base *discovery.DiscoveryResponse, since []*discovery.DiscoveryResponse,
) (floorPlan, error) {
	if base == nil {
		return floorPlan{}, errors.New("floor: no response captured before the lapses")
	}
	held := map[string]map[string]bool{}
	apply := func(resp *discovery.DiscoveryResponse) {
		for _, res := range resp.GetResources() {
			hosts := map[string]bool{}
			healthyHosts(res.GetValue(), hosts)
			held[resourceName(res.GetValue())] = hosts
		}
	}
	union := func() map[string]bool {
		set := map[string]bool{}
		for _, hosts := range held {
			for h := range hosts {
				set[h] = true
			}
		}
		return set
	}
	apply(base)
	prev := union()
	plan := floorPlan{base: len(prev)}
	if err := plan.add(base); err != nil {
		return floorPlan{}, err
	}
	for _, resp := range since {
		apply(resp)
		cur := union()
		var gone []string
		for h := range prev {
			if !cur[h] {
				gone = append(gone, h)
			}
		}
		prev = cur
		if len(gone) == 0 {
			continue
		}
		sort.Strings(gone)
		if err := plan.add(resp); err != nil {
			return floorPlan{}, err
		}
		plan.removed = append(plan.removed, gone[0])
		plan.gone += len(gone)
	}
	return plan, nil
}

func (p *floorPlan) add(resp *discovery.DiscoveryResponse) error {
	b, err := protobuf.MarshalOptions{Deterministic: true}.Marshal(resp)
	if err != nil {
		return fmt.Errorf("floor: %w", err)
	}
	p.frames = append(p.frames, b)
	return nil
}

// floor replays stream 0's responses from the bare server to fresh light
// streams and measures push → last stream has it.
func (b *bench) floor() error {
	plan, err := planFloor(b.ds.stopCapture())
	if err != nil {
		return err
	}
	p, err := startFloor(plan.frames)
	if err != nil {
		return err
	}
	defer p.stop()
	ctx, cancel := context.WithCancel(b.ctx)
	defer cancel()
	// The floor serves stream 0's task type's share of the streams, which is
	// what each of leasehold's pushes went to (all of them with one task
	// type).
	b.res.floorStreams = (*dispatchers + len(b.fleet.tasks) - 1) / len(b.fleet.tasks)
	// Each connection carries as many of those streams as it did in
	// leasehold's phase, where a connection's 100 streams were spread over
	// every task type: one task's push then went out over several
	// connections, not one.
	ds, err := startDispatchers(ctx, p.addr, b.res.floorStreams, b.fleet.tasks[:1],
		b.fleet.shards(), max(1, *streamsPerConn/len(b.fleet.tasks)))
	if err != nil {
		return err
	}
	if err := ds.awaitAll(func(_ string, set map[string]bool) bool {
		return len(set) == plan.base
	}, 60*time.Second); err != nil {
		return fmt.Errorf("floor: streams never had the starting state: %w", err)
	}
	stopTrace := traceSelf("floor")
	b.res.floor, err = plan.replay(p, ds)
	stopTrace()
	if err != nil {
		return err
	}
	logf("floor: %d of leasehold's responses (removing %d endpoints) replayed by a bare "+
		"ADS server to %d streams: %s", len(b.res.floor),
		plan.gone, b.res.floorStreams, dist(b.res.floor))
	return nil
}

// replay pushes each frame after the first and waits until every stream has
// it, lapseSpacing apart.
func (plan floorPlan) replay(p *floorProc, ds *dispatcherSet) ([]time.Duration, error) {
	var lat []time.Duration
	for k, host := range plan.removed {
		at, err := p.push()
		if err != nil {
			return nil, fmt.Errorf("floor push %d: %w", k, err)
		}
		if err := ds.awaitAll(func(_ string, set map[string]bool) bool {
			return !set[host]
		}, 30*time.Second); err != nil {
			return nil, fmt.Errorf("floor push %d: %w", k, err)
		}
		lat = append(lat, ds.goneFromAll(host).Sub(at))
		time.Sleep(*lapseSpacing) // the drill's spacing, not a wait for a result
	}
	return lat, nil
}

// floorProc is the running bare server, driven over its stdin: one line per
// push; it answers each with the push's instant (Unix nanoseconds).
type floorProc struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Scanner
	addr string
	file string
}

func startFloor(frames [][]byte) (*floorProc, error) {
	file, err := writeFrames(frames)
	if err != nil {
		return nil, err
	}
	p := &floorProc{file: file}
	if err := p.start(); err != nil {
		p.stop()
		return nil, fmt.Errorf("floor server: %w", err)
	}
	return p, nil
}

func (p *floorProc) start() error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	p.cmd = exec.Command(self)
	p.cmd.Env = append(os.Environ(), floorChildEnv+"="+p.file)
	p.cmd.Stderr = os.Stderr
	if p.in, err = p.cmd.StdinPipe(); err != nil {
		return err
	}
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := p.cmd.Start(); err != nil {
		return err
	}
	p.out = bufio.NewScanner(out)
	if !p.out.Scan() { // its first line is its address
		return errors.New("exited before listening")
	}
	p.addr = p.out.Text()
	return nil
}

// push has the server send its next frame to every stream and returns when
// it began.
func (p *floorProc) push() (time.Time, error) {
	if _, err := io.WriteString(p.in, "push\n"); err != nil {
		return time.Time{}, err
	}
	if !p.out.Scan() {
		return time.Time{}, errors.New("the floor server exited")
	}
	ns, err := strconv.ParseInt(p.out.Text(), 10, 64)
	if err != nil || ns == 0 {
		return time.Time{}, fmt.Errorf("the floor server answered %q", p.out.Text())
	}
	return time.Unix(0, ns), nil
}

func (p *floorProc) stop() {
	if p.cmd != nil && p.cmd.Process != nil {
		p.in.Close() // closing its input stops it
		done := make(chan struct{})
		go func() { p.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			p.cmd.Process.Kill()
			<-done
		}
	}
	os.Remove(p.file)
}

// writeFrames stores frames, each preceded by its length (uvarint), in a
// temporary file.
func writeFrames(frames [][]byte) (string, error) {
	f, err := os.CreateTemp("", "leasehold-bench-floor-*")
	if err != nil {
		return "", err
	}
	w := bufio.NewWriter(f)
	for _, fr := range frames {
		w.Write(binary.AppendUvarint(nil, uint64(len(fr))))
		w.Write(fr)
	}
	if err := errors.Join(w.Flush(), f.Close()); err != nil {
		os.Remove(f.Name())
		return "", err
	}
	return f.Name(), nil
}

func readFrames(path string) ([][]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var frames [][]byte
	for len(b) > 0 {
		n, k := binary.Uvarint(b)
		if k <= 0 || uint64(len(b)-k) < n {
			return nil, fmt.Errorf("%s: truncated frame", path)
		}
		frames = append(frames, b[k:k+int(n)])
		b = b[k+int(n):]
	}
	if len(frames) == 0 {
		return nil, fmt.Errorf("%s: no frames", path)
	}
	return frames, nil
}

// runFloorChild is the bare server's process: it prints its address, then
// pushes the next frame for each line on stdin until stdin ends.
func runFloorChild(path string) int {
	frames, err := readFrames(path)
	if err != nil {
		fmt.Fprintln(os.Stderr, "floor:", err)
		return 2
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, "floor:", err)
		return 2
	}
	g := grpc.NewServer(grpc.ForceServerCodecV2(rawCodec{}))
	fs := newFloorServer(frames)
	fs.register(g)
	go g.Serve(lis)
	defer g.Stop()
	out := bufio.NewWriter(os.Stdout)
	fmt.Fprintln(out, lis.Addr())
	out.Flush()
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		fmt.Fprintln(out, unixNanos(fs.push()))
		out.Flush()
	}
	return 0
}

func unixNanos(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

// floorServer is a hand-rolled SotW ADS server: every stream gets the
// current frame when it opens and each pushed frame after; requests (ACKs)
// are read and dropped.
type floorServer struct {
	frames  [][]byte
	mu      sync.Mutex
	current int
	streams []chan []byte
}

func newFloorServer(frames [][]byte) *floorServer { return &floorServer{frames: frames} }

func (f *floorServer) register(g *grpc.Server) {
	g.RegisterService(&grpc.ServiceDesc{
		ServiceName: discovery.AggregatedDiscoveryService_ServiceDesc.ServiceName,
		HandlerType: (*any)(nil),
		Streams: []grpc.StreamDesc{{
			StreamName: "StreamAggregatedResources", Handler: f.stream,
			ServerStreams: true, ClientStreams: true,
		}},
	}, f)
}

// push hands the next frame to every stream and returns when it began (zero
// when none is left).
func (f *floorServer) push() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.current+1 >= len(f.frames) {
		return time.Time{}
	}
	f.current++
	at := time.Now()
	for _, ch := range f.streams {
		ch <- f.frames[f.current] // never blocks, as the channel has room for every frame
	}
	return at
}

func (f *floorServer) stream(_ any, ss grpc.ServerStream) error {
	ch := make(chan []byte, len(f.frames))
	f.mu.Lock()
	ch <- f.frames[f.current]
	f.streams = append(f.streams, ch)
	f.mu.Unlock()
	go func() { // ACKs are read and dropped
		for ss.RecvMsg(nil) == nil {
		}
	}()
	for {
		select {
		case b := <-ch:
			if err := ss.SendMsg(b); err != nil {
				return err
			}
		case <-ss.Context().Done():
			return nil
		}
	}
}

// rawCodec sends pre-marshalled frames as they are (no copy) and drops
// what it receives.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	b, ok := v.([]byte)
	if !ok {
		return nil, fmt.Errorf("floor codec: %T is not a frame", v)
	}
	return mem.BufferSlice{mem.SliceBuffer(b)}, nil
}

func (rawCodec) Unmarshal(mem.BufferSlice, any) error { return nil }

func (rawCodec) Name() string { return proto.Name }
