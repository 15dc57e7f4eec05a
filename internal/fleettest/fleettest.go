// Package fleettest holds the fixtures the translator's, the cache's and
// the syncer's tests share: a golden fleet, members as a watch reports
// them, and golden files (go test -update rewrites them).
package fleettest

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/leasehold/leasehold/health"
)

// Update, set by -update, rewrites golden files instead of comparing.
var Update = flag.Bool("update", false, "rewrite golden files")

func Golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *Update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs from golden file (go test -update to accept):\n%s", name, got)
	}
}

func ProtoGolden(t *testing.T, name string, m proto.Message) {
	t.Helper()
	b, err := protojson.MarshalOptions{Multiline: true, Indent: "  "}.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	// protojson randomises whitespace between runs; normalise through encoding/json.
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatal(err)
	}
	out, _ := json.MarshalIndent(v, "", "  ")
	Golden(t, name, append(out, '\n'))
}

// GoldenFleet is the fleet of the golden files: every kind of executor
// the translator decides about, fenced.
func GoldenFleet() []health.Executor {
	mk := func(inst, sess string, gen uint64, port int,
		mut func(*health.Executor)) health.Executor {
		e := health.Executor{
			Registration: health.Registration{
				InstanceID: inst, SessionID: sess, Generation: gen, Task: "transcode",
				Address: "127.0.0.1", Port: port, Version: "1.4.2", Capacity: 4,
				State: health.StateActive, Labels: map[string]string{"zone": "eu-1"},
			},
			ServiceID: health.ServiceID(inst, "transcode"), Node: "node-a",
			LeaseStatus: health.StatusPassing, LeaseFound: true, NodeChecks: health.StatusPassing,
			Load: 1,
		}
		if mut != nil {
			mut(&e)
		}
		return e
	}
	es := []health.Executor{
		mk("exec-healthy", "s1", 1, 9001, nil),
		mk("exec-idle", "s1", 1, 9002, func(e *health.Executor) { e.Load = 0; e.Capacity = 500 }),
		mk("exec-full", "s1", 1, 9003,
			func(e *health.Executor) { e.LeaseStatus = health.StatusWarning; e.Load = 4 }),
		mk("exec-draining", "s1", 1, 9004,
			func(e *health.Executor) { e.State = health.StateDraining; e.Load = 3 }),
		mk("exec-lapsed", "s1", 1, 9005,
			func(e *health.Executor) { e.LeaseStatus = health.StatusCritical }),
		mk("exec-restarted", "old", 1, 9006, nil),
		mk("exec-restarted", "new", 2, 9007, func(e *health.Executor) { e.Node = "node-b" }),
		mk("exec-v2", "s1", 1, 9008, func(e *health.Executor) { e.Version = "2.0.0" }),
		mk("exec-us", "s1", 1, 9009,
			func(e *health.Executor) { e.Labels = map[string]string{"zone": "us-1"} }),
		mk("exec-bad", "s1", 1, 9010,
			func(e *health.Executor) { e.Err = errors.New("capacity \"abc\": not an integer") }),
		// A host name: Envoy would reject the whole assignment over it.
		mk("exec-dns", "s1", 1, 9011, func(e *health.Executor) { e.Address = "exec-dns.internal" }),
		// Two instances claiming one socket at once (equal CreateIndex): the
		// lowest instance id is sent.
		mk("exec-twin-b", "s1", 1, 9012, nil),
		mk("exec-twin-a", "s1", 1, 9012, nil),
	}
	health.Fence(es, nil)
	return es
}

// Executors is n routed executors of task work, one address, ports
// 10000 up (for benchmarks).
func Executors(n int) []health.Executor {
	es := make([]health.Executor, n)
	for i := range es {
		es[i] = health.Executor{
			Registration: health.Registration{
				InstanceID: fmt.Sprintf("exec-%06d", i), SessionID: "s", Generation: 1,
				Task: "work", Address: "10.0.0.1", Port: 10000 + i%50000, Version: "1.4.2",
				Capacity: 8, State: health.StateActive, Labels: map[string]string{"zone": "eu-1"},
			},
			ServiceID: fmt.Sprintf("work:exec-%06d", i), Node: fmt.Sprintf("n%d", i%100),
			LeaseStatus: health.StatusPassing, LeaseFound: true, NodeChecks: health.StatusPassing,
			Load: i % 8,
		}
		es[i].Registration = parsed(es[i].Registration)
	}
	return es
}

// parsed is r as a watch reads it from Consul (its version kept parsed);
// r itself when it breaks the contract.
func parsed(r health.Registration) health.Registration {
	if p, err := health.ParseRegistration(r.Task, r.Address, r.Port, r.Meta()); err == nil {
		return p
	}
	return r
}

// Member is one registration of task as a watch reports it: on node n1,
// its serfHealth passing, its lease check in state lease, its check's
// ModifyIndex and CreateIndex idx.
func Member(task, inst, sess string, gen uint64, port int, version string, lease health.CheckStatus,
	idx uint64) health.Member {
	reg := parsed(health.Registration{InstanceID: inst, SessionID: sess, Generation: gen,
		Task: task, Address: "127.0.0.1", Port: port, Version: version, Capacity: 4,
		State: health.StateActive})
	return health.Member{
		Observed: health.Observed{Registration: reg, ServiceID: health.ServiceID(inst, task),
			Node: "n1", CreateIndex: idx},
		Checks: []health.CheckState{
			{Node: "n1", CheckID: "serfHealth", Status: health.StatusPassing, ModifyIndex: 1},
			{Node: "n1", CheckID: health.CheckID(inst, sess, task),
				ServiceID: health.ServiceID(inst, task), Status: lease, Output: "load=1",
				ModifyIndex: idx},
		},
	}
}

// Node is a dispatcher's node (id "d") with metadata meta.
func Node(t testing.TB, meta map[string]any) *corev3.Node {
	t.Helper()
	st, err := structpb.NewStruct(meta)
	if err != nil {
		t.Fatal(err)
	}
	return &corev3.Node{Id: "d", Metadata: st}
}

// Keys are generation keys in the bare form ("<generation>", naming no
// session) for the instances of gens, as a generation listing reports them.
func Keys(gens map[string]uint64) map[string]health.GenerationRecord {
	out := make(map[string]health.GenerationRecord, len(gens))
	for inst, g := range gens {
		out[inst] = health.GenerationRecord{Generation: g}
	}
	return out
}

// HeapAfterGC is the live heap after a forced collection: what the memory
// benchmarks report per executor, member or endpoint.
func HeapAfterGC() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}
