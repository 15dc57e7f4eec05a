package fleet

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/jonboulle/clockwork"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// The digests of a17SingleDCDigest at 336dbe1 (before several datacenters),
// computed there with this same function.
const (
	a17BytesAt336dbe1    = "ba7c5091848d0e0012902aaade1a1b0c383524008806790321fcbba85b69dcaf"
	a17VersionsAt336dbe1 = "fa06b0fb38c963844daa66c7207edacf44ac617ce5116456a960af90ff3e12d6"
)

// A fleet of one unnamed datacenter without zone labels is served the same
// bytes as before several datacenters: every load assignment (three
// constraint sets, incremental builds) and every resource of a syncer's
// snapshot, before and after a lapse. (Holds.)
func TestAttack17SingleDatacenterBytesAsBefore(t *testing.T) {
	if got, _ := a17SingleDCDigest(t); got != a17BytesAt336dbe1 {
		t.Fatalf("bytes digest %s, want %s as at 336dbe1", got, a17BytesAt336dbe1)
	}
}

// TestAttack17SingleDatacenterVersionsAsBefore (fixed; failed before, LOW): the same
// fleet's load assignments keep their bytes but not their content versions
// — locality.go means to keep them ("layout stays 0 for one locality
// without names: versions as before localities"), but every endpoint's
// digest now hashes its locality too (builder.go appends Datacenter, 0,
// zone — a 0 byte even with neither), so every EDS version of every
// single-datacenter deployment changes on upgrade: during a rolling upgrade
// replicas disagree on the version of identical content (one needless push
// of every assignment to every client that moves between them).
func TestAttack17SingleDatacenterVersionsAsBefore(t *testing.T) {
	if _, got := a17SingleDCDigest(t); got != a17VersionsAt336dbe1 {
		t.Fatalf("versions digest %s, want %s as at 336dbe1 (the bytes are the same)", got, a17VersionsAt336dbe1)
	}
}

// a17SingleDCDigest builds load assignments and a syncer's snapshots for a
// fleet of one unnamed datacenter without zone labels, and digests every
// byte and version of them.
func a17SingleDCDigest(t *testing.T) (bytesDigest, versionsDigest string) {
	t.Helper()
	fleet := func() []health.Executor {
		es := make([]health.Executor, 300)
		for i := range es {
			st := health.StateActive
			if i%7 == 0 {
				st = health.StateDraining
			}
			v := "1.4.2"
			if i%5 == 0 {
				v = "2.0.0"
			}
			es[i] = health.Executor{
				Registration: health.Registration{
					InstanceID: fmt.Sprintf("exec-%04d", i), SessionID: "s", Generation: 1, Task: "work",
					Address: fmt.Sprintf("10.0.%d.%d", i/200, (i%200)/1+1-(i%19)/18), Port: 9000 + i%3, Version: v, Capacity: 8,
					State: st, Labels: map[string]string{"rack": fmt.Sprintf("r%d", i%3)},
				},
				ServiceID: fmt.Sprintf("work:exec-%04d", i), Node: fmt.Sprintf("n%d", i%50), CreateIndex: uint64(100 + i),
				LeaseStatus: health.StatusPassing, LeaseFound: i%17 != 0, NodeChecks: health.StatusPassing, Load: i % 8,
			}
			if i%11 == 0 {
				es[i].LeaseStatus = health.StatusCritical
			}
			if i%13 == 0 {
				es[i].Load = 8
			}
		}
		return es
	}
	hb, hv := sha256.New(), sha256.New()
	out := func(parts ...any) { fmt.Fprintln(hb, parts...) }
	ver := func(parts ...any) { fmt.Fprintln(hv, parts...) }
	d0, _ := health.NewDispatcher("", nil)
	d1, _ := health.NewDispatcher(">=1.0.0, <2.0.0", map[string]string{"rack": "r1"})
	d2 := d0.WithTasks([]string{"work"})
	for _, d := range []health.Dispatcher{d0, d1, d2} {
		es := fleet()
		bl := &translator.Builder{}
		for step := range 4 {
			r := bl.BuildPrinted("work", es, nil, d)
			b, err := proto.MarshalOptions{Deterministic: true}.Marshal(r.CLA)
			if err != nil {
				t.Fatal(err)
			}
			out(d.Key(), step, hex.EncodeToString(b), r.RemovesOrDrains)
			ver(d.Key(), step, r.Version)
			es[step*7+1].Load = (es[step*7+1].Load + 3) % 9
			es[step*11+2].State = health.StateDraining
			es = es[:len(es)-step]
		}
	}

	// The syncer: one unnamed datacenter.
	obs := make(chan health.Observation, 16)
	pubs := make(chan *cache.Snapshot, 64)
	s := NewSyncer(SyncConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Clock: clockwork.NewFakeClock(),
		OnPublish: func(_ string, snap *cache.Snapshot) { pubs <- snap }})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx, obs); close(done) }()
	defer func() { cancel(); <-done }()
	var members []health.Member
	for i, e := range fleet()[:40] {
		e.LeaseStatus, e.LeaseFound, e.NodeChecks = "", false, ""
		members = append(members, health.Member{Executor: e, Checks: []health.CheckState{
			{Node: e.Node, CheckID: health.SerfHealthCheckID, Status: health.StatusPassing, CreateIndex: 1, ModifyIndex: 1},
			{Node: e.Node, CheckID: health.CheckID(e.InstanceID, e.SessionID, "work"), ServiceID: e.ServiceID, Status: health.StatusPassing, Output: fmt.Sprintf("load=%d", i%8), CreateIndex: e.CreateIndex, ModifyIndex: e.CreateIndex},
		}})
	}
	obs <- health.Observation{Tasks: &health.TaskList{Index: 1, Tasks: []string{"work"}}}
	obs <- health.Observation{NonPassing: &health.NonPassing{Index: 2}}
	obs <- health.Observation{Generations: &health.Generations{Index: 3, Keys: fleettest.Keys(map[string]uint64{"exec-0003": 2})}}
	obs <- health.Observation{Members: &health.TaskMembers{Task: "work", Index: 500, Members: members}}
	for !s.View().Synced {
		<-s.View().Changed()
	}
	s.Subscribe(d1)
	snapOut := func(step string) {
		snap, ok := s.Snapshot(d1.Key())
		if !ok {
			t.Fatalf("%s: no snapshot", step)
		}
		for _, url := range []string{resource.ClusterType, resource.EndpointType, resource.ListenerType, resource.RouteType} {
			ver(step, url, snap.GetVersion(url))
			res := snap.GetResources(url)
			names := make([]string, 0, len(res))
			for n := range res {
				names = append(names, n)
			}
			sort.Strings(names)
			for _, n := range names {
				b, err := proto.MarshalOptions{Deterministic: true}.Marshal(res[n])
				if err != nil {
					t.Fatal(err)
				}
				out(step, n, hex.EncodeToString(b))
			}
		}
	}
	snapOut("subscribed")
	lapse := members[4].Checks[1]
	lapse.Status, lapse.ModifyIndex = health.StatusCritical, 600
	before, _ := s.Snapshot(d1.Key())
	obs <- health.Observation{NonPassing: &health.NonPassing{Index: 600, Checks: []health.CheckState{lapse}}}
	for {
		snap, _ := s.Snapshot(d1.Key())
		if snap.GetVersion(resource.EndpointType) != before.GetVersion(resource.EndpointType) {
			break
		}
		select {
		case <-pubs:
		case <-time.After(5 * time.Second):
			t.Fatal("the lapse was not published")
		}
	}
	snapOut("lapsed")
	return hex.EncodeToString(hb.Sum(nil)), hex.EncodeToString(hv.Sum(nil))
}
