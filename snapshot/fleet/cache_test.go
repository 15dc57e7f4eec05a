package fleet

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/stream/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	"github.com/leasehold/leasehold/snapshot/translator"
	"github.com/leasehold/leasehold/snapshot/xdscache"
)

// Dispatchers of one constraint set in three forms: each gets its form's
// bytes (a deterministic marshal of the derived message) with its own
// versions, change after change; endpoint messages an unchanged executor
// kept are derived once; a second replica sends the same bytes and
// versions.
func TestFormsThroughTheCache(t *testing.T) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	replicas := []*syncHarness{startSyncer(t, quiet), startSyncer(t, quiet)}
	d := dispatcher(t, "")
	var members []health.Member
	for i := range 30 {
		members = append(members, fleettest.Member("work", fmt.Sprintf("e%02d", i), fmt.Sprintf("sess-%02d", i), 1, 9000+i, "1.0.0", health.StatusPassing, uint64(5+i)))
	}
	for _, h := range replicas {
		h.s.Subscribe(d)
		h.tasks("work")
		h.members("work", members...)
		h.nonPassing()
	}
	forms := []xdscache.EndpointMetadata{xdscache.MetadataFull, xdscache.MetadataSession, xdscache.MetadataNone}
	var firstSession *endpointv3.LbEndpoint
	for round := range 4 {
		type answer struct {
			version string
			bytes   []byte
		}
		got := make([]map[xdscache.EndpointMetadata]answer, len(replicas))
		for r, h := range replicas {
			h.publish()
			got[r] = map[xdscache.EndpointMetadata]answer{}
			for _, f := range forms {
				node := fleettest.Node(t, map[string]any{"endpoint_metadata": string(f)})
				out := make(chan cache.Response, 1)
				req := &cache.Request{TypeUrl: resource.EndpointType, ResourceNames: []string{"work"}, Node: node}
				cancel, err := h.s.Cache().CreateWatch(req, stream.NewSotwSubscription(req.ResourceNames, true), out)
				if err != nil {
					t.Fatal(err)
				}
				resp, err := (<-out).GetDiscoveryResponse()
				cancel()
				if err != nil || len(resp.Resources) != 1 {
					t.Fatalf("round %d, %s: %v, %d resources", round, f, err, len(resp.GetResources()))
				}
				cla := &endpointv3.ClusterLoadAssignment{}
				if err := resp.Resources[0].UnmarshalTo(cla); err != nil {
					t.Fatal(err)
				}
				if n := len(cla.Endpoints[0].LbEndpoints); n != len(members) {
					t.Fatalf("round %d, %s: %d endpoints, want %d", round, f, n, len(members))
				}
				for _, lb := range cla.Endpoints[0].LbEndpoints {
					fields := lb.GetMetadata().GetFilterMetadata()[translator.MetadataNamespace].GetFields()
					wantFields := map[xdscache.EndpointMetadata]int{xdscache.MetadataFull: 3, xdscache.MetadataSession: 1, xdscache.MetadataNone: 0}[f]
					if len(fields) != wantFields || (f == xdscache.MetadataSession && fields["session_id"].GetStringValue() != "sess-"+lb.GetEndpoint().GetHostname()[1:]) {
						t.Fatalf("round %d, %s: endpoint metadata %v", round, f, lb.GetMetadata())
					}
				}
				group := xdscache.GroupOf(node) // the form's group
				snap, _ := h.s.Snapshot(group)
				want, _ := proto.MarshalOptions{Deterministic: true}.Marshal(snap.GetResources(resource.EndpointType)["work"])
				if !bytes.Equal(resp.Resources[0].Value, want) {
					t.Fatalf("round %d, %s: bytes differ from a marshal of the derived message", round, f)
				}
				got[r][f] = answer{resp.VersionInfo, resp.Resources[0].Value}
				if f == xdscache.MetadataSession && r == 0 {
					lb := snap.GetResources(resource.EndpointType)["work"].(*endpointv3.ClusterLoadAssignment).Endpoints[0].LbEndpoints[0]
					if round == 0 {
						firstSession = lb
					} else if lb != firstSession {
						t.Fatalf("round %d: an unchanged endpoint was derived again", round)
					}
				}
			}
		}
		for _, f := range forms {
			a, b := got[0][f], got[1][f]
			if a.version != b.version || !bytes.Equal(a.bytes, b.bytes) {
				t.Fatalf("round %d, %s: replicas differ", round, f)
			}
		}
		if got[0][xdscache.MetadataFull].version == got[0][xdscache.MetadataNone].version || got[0][xdscache.MetadataSession].version == got[0][xdscache.MetadataNone].version {
			t.Fatalf("round %d: two forms share a version", round)
		}
		members = members[:len(members)-1] // a removal, published at once
		for _, h := range replicas {
			h.members("work", members...)
		}
	}
}

// A delta client asking for a form gets that form.
func TestFormsForDeltaClients(t *testing.T) {
	h := startSyncer(t, slog.New(slog.NewTextHandler(io.Discard, nil)))
	d := dispatcher(t, "")
	h.s.Subscribe(d)
	h.tasks("work")
	h.members("work", fleettest.Member("work", "e1", "s1", 1, 9001, "1.0.0", health.StatusPassing, 5))
	h.nonPassing()
	h.publish()
	node := fleettest.Node(t, map[string]any{"endpoint_metadata": "none"})
	out := make(chan cache.DeltaResponse, 1)
	req := &cache.DeltaRequest{TypeUrl: resource.EndpointType, ResourceNamesSubscribe: []string{"work"}, Node: node}
	cancel, err := h.s.Cache().CreateDeltaWatch(req, stream.NewDeltaSubscription(req.ResourceNamesSubscribe, nil, nil, false), out)
	if err != nil {
		t.Fatal(err)
	}
	if cancel != nil { // nil when answered at once
		defer cancel()
	}
	resp, err := (<-out).GetDeltaDiscoveryResponse()
	if err != nil || len(resp.Resources) != 1 {
		t.Fatalf("%v, %d resources", err, len(resp.GetResources()))
	}
	cla := &endpointv3.ClusterLoadAssignment{}
	if err := resp.Resources[0].Resource.UnmarshalTo(cla); err != nil {
		t.Fatal(err)
	}
	if lb := cla.Endpoints[0].LbEndpoints[0]; lb.Metadata != nil || lb.GetEndpoint().GetHostname() != "e1" {
		t.Fatalf("delta client got %v", lb)
	}
}

// Through the cache: every state-of-the-world response carries, for each
// load assignment, exactly a deterministic proto.Marshal of the snapshot's
// message, change after change, for two constraint sets at once (each with
// its own encoder: their Builders hold different endpoint messages).
func TestSotwResponsesAreProtoMarshalBytes(t *testing.T) {
	h := startSyncer(t, slog.New(slog.NewTextHandler(io.Discard, nil)))
	sets := []health.Dispatcher{dispatcher(t, ""), dispatcher(t, ">=1.5.0")}
	for _, d := range sets {
		h.s.Subscribe(d)
	}
	h.tasks("work")
	var members []health.Member
	for i := range 40 {
		members = append(members, fleettest.Member("work", fmt.Sprintf("e%02d", i), "s1", 1, 9000+i, fmt.Sprintf("1.%d.0", i%10), health.StatusPassing, uint64(5+i)))
	}
	h.members("work", members...)
	h.nonPassing()
	for round := range 6 {
		for range sets {
			h.publish()
		}
		for _, d := range sets {
			snap, ok := h.s.Snapshot(d.Key())
			if !ok {
				t.Fatalf("round %d: no snapshot for %s", round, d.Key())
			}
			out := make(chan cache.Response, 1)
			req := &cache.Request{TypeUrl: resource.EndpointType, ResourceNames: []string{"work"}, Node: &corev3.Node{Id: "d", Metadata: nodeMeta(t, d)}}
			cancel, err := h.s.Cache().CreateWatch(req, stream.NewSotwSubscription(req.ResourceNames, true), out)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := (<-out).GetDiscoveryResponse()
			cancel()
			if err != nil || len(resp.Resources) != 1 {
				t.Fatalf("round %d: %v, %d resources", round, err, len(resp.GetResources()))
			}
			want, _ := proto.MarshalOptions{Deterministic: true}.Marshal(snap.GetResources(resource.EndpointType)["work"])
			if !bytes.Equal(resp.Resources[0].Value, want) {
				t.Fatalf("round %d, set %s: response bytes differ from proto.Marshal", round, d.Key())
			}
		}
		members = members[:len(members)-1] // 1.9.0, 1.8.0, …: removed from both sets at once
		h.members("work", members...)
	}
}

func nodeMeta(t *testing.T, d health.Dispatcher) *structpb.Struct {
	m := map[string]any{}
	if d.VersionConstraint != "" {
		m[health.NodeMetaVersionConstraint] = d.VersionConstraint
	}
	st, err := structpb.NewStruct(m)
	if err != nil {
		t.Fatal(err)
	}
	return st
}
