package server

import (
	"strings"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasehold/leasehold/health"
)

func withLabel(m health.Member, k, v string) health.Member {
	m.Labels = map[string]string{k: v}
	return m
}

// A later request whose node changes the stream's node id or constraint set
// ends the stream with InvalidArgument naming the field — it is never left
// waiting for a constraint set it did not subscribe. The same node sent
// again (as Envoy does on every request) changes nothing.
func TestNodeChangedOnALaterRequest(t *testing.T) {
	first := map[string]any{
		"version_constraint": "<2.0.0",
		"labels":             map[string]any{"zone": "eu-1"},
	}
	for _, tt := range []struct {
		name  string
		id    string
		meta  map[string]any
		field string // "": the stream goes on
	}{
		{"same node again", "d1", map[string]any{"version_constraint": "<2.0.0", "labels": map[string]any{"zone": "eu-1"}}, ""},
		{"same constraint set, other spelling and metadata", "d1", map[string]any{"version_constraint": " <2.0.0 ", "labels": map[string]any{"zone": "eu-1"}, "owner": "team-a"}, ""},
		{"version constraint", "d1", map[string]any{"version_constraint": ">=2.0.0", "labels": map[string]any{"zone": "eu-1"}}, "node.metadata.version_constraint"},
		{"labels", "d1", map[string]any{"version_constraint": "<2.0.0", "labels": map[string]any{"zone": "us-1"}}, "node.metadata.labels"},
		{"labels dropped", "d1", map[string]any{"version_constraint": "<2.0.0"}, "node.metadata.labels"},
		{"invalid metadata", "d1", map[string]any{"version_constraint": "<2.0.0", "labels": map[string]any{"a.b": "x"}}, "labels.a.b"},
		{"node id", "d2", first, "node.id"},
		{"endpoint metadata", "d1", map[string]any{"version_constraint": "<2.0.0", "labels": map[string]any{"zone": "eu-1"}, "endpoint_metadata": "none"}, "node.metadata.endpoint_metadata"},
		{"endpoint metadata spelled out as the default", "d1", map[string]any{"version_constraint": "<2.0.0", "labels": map[string]any{"zone": "eu-1"}, "endpoint_metadata": "full"}, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := startXDS(t)
			f.members("work", withLabel(member("work", "a", 9001, "1.0.0"), "zone", "eu-1"),
				member("work", "b", 9002, "2.0.0"))
			a := f.ads(node("d1", first))
			a.Subscribe(resource.EndpointType, "work")
			r := a.Next()
			if got := hosts(t, r, "work"); len(got) != 1 || got[0] != "a" {
				t.Fatalf("initial endpoints %v", got)
			}
			a.Node = node(tt.id, tt.meta)
			a.ACK(r, "work", "other") // ACK, and ask for more
			r2, err := a.Recv()
			if tt.field == "" {
				if err != nil {
					t.Fatalf("stream ended: %v", err)
				}
				if n := names(r2); len(n) != 1 || n[0] != "other" {
					t.Fatalf("not answered under its constraint set: %v", names(r2))
				}
				return
			}
			if status.Code(err) != codes.InvalidArgument ||
				!strings.Contains(err.Error(), tt.field) {
				t.Fatalf("err %v (response %v), want InvalidArgument naming %s",
					err, names(r2), tt.field)
			}
		})
	}
}

func TestDeltaNodeChangedOnALaterRequest(t *testing.T) {
	f := startXDS(t)
	s := f.delta(node("delta-1", nil))
	s.Subscribe(resource.EndpointType, "work")
	r := s.Next()
	// A node that changes on a later request is what the client never sends: raw.
	if err := s.Stream().Send(&discovery.DeltaDiscoveryRequest{Node: node("delta-1",
		map[string]any{"version_constraint": "<2.0.0"}), TypeUrl: resource.EndpointType,
		ResponseNonce: r.Nonce, ResourceNamesSubscribe: []string{"other"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); status.Code(err) != codes.InvalidArgument ||
		!strings.Contains(err.Error(), "node.metadata.version_constraint") {
		t.Fatalf("err %v, want InvalidArgument naming node.metadata.version_constraint", err)
	}
}
