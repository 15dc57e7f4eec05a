package server

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The same client refused for the same reason is one counted entry, and the
// list keeps the refusalsKept kinds seen last.
func TestRefusalsAreCountedPerKindAndBounded(t *testing.T) {
	var r refusals
	at := time.Unix(1000, 0)
	for i := range 3 {
		r.add(Refusal{NodeID: "looping", Reason: RefusedInvalidNode, Detail: "bad",
			Peer: fmt.Sprint("127.0.0.1:", 5000+i), Last: at.Add(time.Duration(i) * time.Second)})
	}
	if len(r.recent) != 1 || r.recent[0].Count != 3 || r.recent[0].Peer != "127.0.0.1:5002" ||
		!r.recent[0].First.Equal(at) || !r.recent[0].Last.Equal(at.Add(2*time.Second)) {
		t.Fatalf("one node refused three times: %+v", r.recent)
	}
	for i := range refusalsKept {
		r.add(Refusal{NodeID: fmt.Sprint("n", i), Reason: RefusedInvalidNode, Detail: "bad",
			Last: at.Add(time.Hour + time.Duration(i)*time.Second)})
	}
	if len(r.recent) != refusalsKept || r.total != 3+refusalsKept {
		t.Fatalf("%d kinds kept (total %d), want %d", len(r.recent), r.total, refusalsKept)
	}
	for _, f := range r.recent {
		if f.NodeID == "looping" {
			t.Fatal("the least recently seen kind was kept over newer ones")
		}
	}
	if got := clip(strings.Repeat("é", refusalTextMax)); len(got) > refusalTextMax+len("…") ||
		!strings.HasSuffix(got, "…") {
		t.Fatalf("clip: %d bytes", len(got))
	}
}

// Streams refused for invalid node metadata or for a node that changed are
// listed with the node id, the reason and the error they were ended with.
func TestRefusedStreamsAreListedWithWhy(t *testing.T) {
	f := startXDS(t)
	bad := f.ads(node("bad-meta", map[string]any{"version_constraint": ">= banana"}))
	bad.Subscribe(resource.ListenerType, "work")
	if _, err := bad.Recv(); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("invalid metadata: %v", err)
	}
	turncoat := f.ads(node("first-id", nil))
	turncoat.Subscribe(resource.EndpointType, "work")
	turncoat.ACK(turncoat.Next(), "work")
	if err := turncoat.Stream().Send(&discovery.DiscoveryRequest{TypeUrl: resource.EndpointType,
		Node: node("second-id", nil), ResourceNames: []string{"work"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := turncoat.Recv(); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("changed node: %v", err)
	}
	got, total := f.xds.Refusals()
	if total != 2 || len(got) != 2 {
		t.Fatalf("refusals %+v (total %d), want 2", got, total)
	}
	byReason := map[string]Refusal{}
	for _, r := range got {
		byReason[r.Reason] = r
	}
	inv := byReason[RefusedInvalidNode]
	if inv.NodeID != "bad-meta" || !strings.Contains(inv.Detail, "version_constraint") ||
		inv.Mode != "sotw" || !strings.HasPrefix(inv.Peer, "127.0.0.1:") || inv.Count != 1 {
		t.Errorf("invalid node metadata: %+v", inv)
	}
	if ch := byReason[RefusedNodeChanged]; ch.NodeID != "first-id" ||
		!strings.Contains(ch.Detail, "node.id") {
		t.Errorf("changed node: %+v", ch)
	}
}

// A client identity the policy grants nothing is listed with its identity.
func TestStreamWithoutGrantIsListedWithItsIdentity(t *testing.T) {
	s := startSecure(t)
	a := s.as(t, "spiffe://test/stranger").ads(node("d-stranger", nil))
	// The stream is refused as it opens, so the send may already find it
	// ended (io.EOF, one run in three): the refusal comes with Recv.
	if err := a.Stream().Send(&discovery.DiscoveryRequest{Node: a.Node,
		TypeUrl: resource.ListenerType}); err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	if _, err := a.Recv(); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("stranger: %v", err)
	}
	got, _ := s.xds.Refusals()
	if len(got) != 1 || got[0].Reason != RefusedNotGranted ||
		!strings.Contains(got[0].Identity, "spiffe://test/stranger") ||
		!strings.Contains(got[0].Detail, "no authorization grant") {
		t.Fatalf("refusals %+v", got)
	}
}
