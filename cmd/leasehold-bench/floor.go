package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"os/exec"
	"slices"
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
// of the pushed task type starts from; frames[k] (k ≥ 1) is pushed k-th, and
// removed[k-1], one host it no longer lists, tells when a stream has it.
// others, when set, is the other task types' state: their streams get it
// once and nothing after, as leasehold's idle streams did.
type floorPlan struct {
	frames  [][]byte
	base    int             // hosts frames[0] lists
	start   map[string]bool // those hosts
	removed []string
	gone    int // endpoints the pushes remove in all
	others  [][]byte
	hosts   map[string]map[string]bool // per task type in others, the hosts its streams hold
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
	plan := floorPlan{base: len(prev), start: prev}
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
	b, err := marshalFrame(resp)
	if err != nil {
		return err
	}
	p.frames = append(p.frames, b)
	return nil
}

func marshalFrame(resp *discovery.DiscoveryResponse) ([]byte, error) {
	b, err := protobuf.MarshalOptions{Deterministic: true}.Marshal(resp)
	if err != nil {
		return nil, fmt.Errorf("floor: %w", err)
	}
	return b, nil
}

// withOthers is the plan that also serves, to the streams of every task type
// in tasks but the pushed one (tasks[0]), that task type's state in state.
func (p floorPlan) withOthers(
	tasks []string, state map[string]*discovery.DiscoveryResponse,
) (floorPlan, error) {
	p.others, p.hosts = nil, map[string]map[string]bool{}
	for _, task := range tasks[1:] {
		resp, ok := state[task]
		if !ok || len(resp.GetResources()) == 0 {
			// (Its streams would name no load assignment the floor serves
			// them, and be pushed the pushed task type's frames instead.)
			return floorPlan{}, fmt.Errorf("floor: no state captured for task type %s", task)
		}
		b, err := marshalFrame(resp)
		if err != nil {
			return floorPlan{}, err
		}
		hosts := map[string]bool{}
		for _, res := range resp.GetResources() {
			healthyHosts(res.GetValue(), hosts)
		}
		p.others, p.hosts[task] = append(p.others, b), hosts
	}
	return p, nil
}

// floor replays stream 0's responses from the bare server to fresh light
// streams and measures push → last stream has it: first to as many streams
// as leasehold served, in the same layout, those of the other task types
// holding their state and idle (the floor the ratio is taken against), then,
// with more than one task type, to the pushed task type's streams alone.
func (b *bench) floor() error {
	plan, err := planFloor(b.ds.stopCapture())
	if err != nil {
		return err
	}
	tasks := b.fleet.tasks
	if *dispatchers < len(tasks) {
		tasks = tasks[:*dispatchers]
	}
	whole, err := plan.withOthers(tasks, b.ds.otherState())
	if err != nil {
		return err
	}
	b.res.floorStreams = *dispatchers
	if b.res.floor, err = b.replayFloor(whole, tasks, *dispatchers, *streamsPerConn,
		"floor"); err != nil {
		return err
	}
	logf("floor: %d of leasehold's responses (removing %d endpoints) replayed by a bare "+
		"ADS server to %d streams over %d task types, as leasehold served them: %s",
		len(b.res.floor), plan.gone, b.res.floorStreams, len(tasks), dist(b.res.floor))
	if len(tasks) == 1 {
		return nil
	}
	// The pushed task type's share of the streams alone. Each connection
	// carries as many of them as it did in leasehold's phase, where a
	// connection's streams were spread over every task type: one task's push
	// then went out over several connections, not one.
	b.res.floorTaskStreams = (*dispatchers + len(tasks) - 1) / len(tasks)
	if b.res.floorTask, err = b.replayFloor(plan, tasks[:1], b.res.floorTaskStreams,
		max(1, *streamsPerConn/len(tasks)), "floor.task"); err != nil {
		return err
	}
	logf("floor: the same to the %d streams of the pushed task type alone: %s",
		b.res.floorTaskStreams, dist(b.res.floorTask))
	return nil
}

// replayFloor starts a bare server for plan, m light streams over tasks
// (client i following tasks[i % len(tasks)], perConn to a connection, the
// pushed task type first) and replays the plan to them (traced as traceName
// with --trace-harness).
func (b *bench) replayFloor(
	plan floorPlan, tasks []string, m, perConn int, traceName string,
) ([]time.Duration, error) {
	p, err := startFloor(plan.frames, plan.others)
	if err != nil {
		return nil, err
	}
	defer p.stop()
	ctx, cancel := context.WithCancel(b.ctx)
	defer cancel()
	ds, err := startDispatchers(ctx, p.addr, m, tasks, b.fleet.shards(), perConn)
	if err != nil {
		return nil, err
	}
	if err := ds.awaitAll(func(task string, set map[string]bool) bool {
		return maps.Equal(set, plan.startOf(task, tasks[0]))
	}, 60*time.Second); err != nil {
		return nil, fmt.Errorf("floor: streams never had the starting state: %w", err)
	}
	stopTrace := traceSelf(traceName)
	lat, err := plan.replay(p, ds)
	stopTrace()
	if err != nil {
		return nil, err
	}
	if err := ds.awaitAll(func(task string, set map[string]bool) bool {
		return task == tasks[0] || maps.Equal(set, plan.startOf(task, tasks[0]))
	}, time.Second); err != nil {
		return nil, errors.New("floor: a stream of a task type not pushed to no longer holds " +
			"its state: the floor pushed to it")
	}
	return lat, nil
}

// startOf is what a stream following task holds before the pushes, pushed
// being the task type the plan pushes to.
func (plan floorPlan) startOf(task, pushed string) map[string]bool {
	if task == pushed {
		return plan.start
	}
	return plan.hosts[task]
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

func startFloor(frames, others [][]byte) (*floorProc, error) {
	file, err := writeFrames(frames, others)
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

// writeFrames stores the pushed frames and the others, each preceded by its
// length (uvarint), after how many frames are pushed (uvarint), in a
// temporary file.
func writeFrames(frames, others [][]byte) (string, error) {
	f, err := os.CreateTemp("", "leasehold-bench-floor-*")
	if err != nil {
		return "", err
	}
	w := bufio.NewWriter(f)
	w.Write(binary.AppendUvarint(nil, uint64(len(frames))))
	for _, fr := range append(slices.Clip(frames), others...) {
		w.Write(binary.AppendUvarint(nil, uint64(len(fr))))
		w.Write(fr)
	}
	if err := errors.Join(w.Flush(), f.Close()); err != nil {
		os.Remove(f.Name())
		return "", err
	}
	return f.Name(), nil
}

func readFrames(path string) (frames, others [][]byte, err error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, err
	}
	pushed, k := binary.Uvarint(b)
	if k <= 0 {
		return nil, nil, fmt.Errorf("%s: no frame count", path)
	}
	b = b[k:]
	var all [][]byte
	for len(b) > 0 {
		n, k := binary.Uvarint(b)
		if k <= 0 || uint64(len(b)-k) < n {
			return nil, nil, fmt.Errorf("%s: truncated frame", path)
		}
		all = append(all, b[k:k+int(n)])
		b = b[k+int(n):]
	}
	if pushed == 0 || uint64(len(all)) < pushed {
		return nil, nil, fmt.Errorf("%s: %d frames, %d of them pushed", path, len(all), pushed)
	}
	return all[:pushed], all[pushed:], nil
}

// runFloorChild is the bare server's process: it prints its address, then
// pushes the next frame for each line on stdin until stdin ends.
func runFloorChild(path string) int {
	frames, others, err := readFrames(path)
	if err == nil {
		var fs *floorServer
		if fs, err = newFloorServer(frames, others); err == nil {
			return serveFloor(fs)
		}
	}
	fmt.Fprintln(os.Stderr, "floor:", err)
	return 2
}

func serveFloor(fs *floorServer) int {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, "floor:", err)
		return 2
	}
	g := grpc.NewServer(grpc.ForceServerCodecV2(rawCodec{}))
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

// floorServer is a hand-rolled SotW ADS server: a stream whose first request
// names one of the other task types' load assignments gets that task type's
// state once; every other stream gets the current frame when it opens and
// each pushed frame after. Requests after the first (ACKs) are read and
// dropped.
type floorServer struct {
	frames  [][]byte
	other   map[string][]byte // each of the others' load assignments → its frame
	mu      sync.Mutex
	current int
	streams []chan []byte
}

func newFloorServer(frames, others [][]byte) (*floorServer, error) {
	f := &floorServer{frames: frames, other: map[string][]byte{}}
	for _, fr := range others {
		var resp discovery.DiscoveryResponse
		if err := protobuf.Unmarshal(fr, &resp); err != nil {
			return nil, err
		}
		for _, res := range resp.GetResources() {
			f.other[resourceName(res.GetValue())] = fr
		}
	}
	return f, nil
}

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

// push hands the next frame to every stream of the pushed task type and
// returns when it began (zero when none is left).
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
	var req discovery.DiscoveryRequest
	if err := ss.RecvMsg(&req); err != nil {
		return err
	}
	go func() { // ACKs are read and dropped
		for ss.RecvMsg(nil) == nil {
		}
	}()
	if names := req.GetResourceNames(); len(names) > 0 && f.other[names[0]] != nil {
		if err := ss.SendMsg(f.other[names[0]]); err != nil {
			return err
		}
		<-ss.Context().Done()
		return nil
	}
	ch := make(chan []byte, len(f.frames))
	f.mu.Lock()
	ch <- f.frames[f.current]
	f.streams = append(f.streams, ch)
	f.mu.Unlock()
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

// rawCodec sends pre-marshalled frames as they are (no copy); it decodes
// what it receives into a message, and drops it given none.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	b, ok := v.([]byte)
	if !ok {
		return nil, fmt.Errorf("floor codec: %T is not a frame", v)
	}
	return mem.BufferSlice{mem.SliceBuffer(b)}, nil
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	if m, ok := v.(protobuf.Message); ok {
		return protobuf.Unmarshal(data.Materialize(), m)
	}
	return nil
}

func (rawCodec) Name() string { return proto.Name }
