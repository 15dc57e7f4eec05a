package snapshot

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/stream/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/leasehold/leasehold/health"
)

func formNode(t *testing.T, meta map[string]any) *corev3.Node {
	t.Helper()
	st, err := structpb.NewStruct(meta)
	if err != nil {
		t.Fatal(err)
	}
	return &corev3.Node{Id: "d", Metadata: st}
}

func TestEndpointMetadataOfNamesTheField(t *testing.T) {
	for _, c := range []struct {
		meta map[string]any
		want EndpointMetadata
	}{
		{map[string]any{}, MetadataFull},
		{map[string]any{"endpoint_metadata": "full"}, MetadataFull},
		{map[string]any{"endpoint_metadata": "session"}, MetadataSession},
		{map[string]any{"endpoint_metadata": "none"}, MetadataNone},
	} {
		if got, err := EndpointMetadataOf(formNode(t, c.meta)); err != nil || got != c.want {
			t.Errorf("%v: %q, %v; want %q", c.meta, got, err, c.want)
		}
	}
	for _, bad := range []any{"compact", "", "NONE", 1.0, true, map[string]any{"a": "b"}} {
		node := formNode(t, map[string]any{"endpoint_metadata": bad})
		_, err := EndpointMetadataOf(node)
		var fe *health.FieldError
		if !errors.As(err, &fe) || fe.Field != "node.metadata.endpoint_metadata" {
			t.Errorf("%v: error %v, want one naming node.metadata.endpoint_metadata", bad, err)
		}
		if _, err := DispatcherOf(node); err == nil {
			t.Errorf("%v: DispatcherOf accepted it", bad)
		}
	}
	if _, err := EndpointMetadataOf(nil); err != nil {
		t.Errorf("nil node: %v", err)
	}
}

// The forms of the golden fleet: golden files, and what each keeps of an
// endpoint (everything but the metadata it drops), valid for Envoy.
func TestFormsGolden(t *testing.T) {
	d, _ := health.NewDispatcher("", nil)
	cla := Endpoints("transcode", fleet(), d)
	snap := &cache.Snapshot{}
	snap.Resources[types.Endpoint] = cache.NewResources("v", []types.Resource{cla})
	versions := map[string]map[string]string{resource.EndpointType: {"transcode": "e1"}}
	for _, f := range []EndpointMetadata{MetadataSession, MetadataNone} {
		fs := &formState{form: f}
		ds, dv := fs.derive(snap, versions)
		got := ds.GetResources(resource.EndpointType)["transcode"].(*endpointv3.ClusterLoadAssignment)
		if err := got.ValidateAll(); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		protoGolden(t, "endpoints-any-"+string(f)+".json", got)
		if v := dv[resource.EndpointType]["transcode"]; v != "e1-"+string(f) {
			t.Errorf("%s: version %q", f, v)
		}
		want := proto.Clone(cla).(*endpointv3.ClusterLoadAssignment)
		if len(want.Endpoints) < 2 {
			t.Fatal("the golden fleet has one locality: localities other than the first are not exercised")
		}
		for _, loc := range want.Endpoints {
			for _, lb := range loc.LbEndpoints {
				switch f {
				case MetadataNone:
					lb.Metadata = nil
				case MetadataSession:
					delete(lb.Metadata.FilterMetadata[MetadataNamespace].Fields, "instance_id")
					delete(lb.Metadata.FilterMetadata[MetadataNamespace].Fields, "version")
				}
			}
		}
		if !proto.Equal(got, want) {
			t.Errorf("%s: derived %v\nwant %v", f, got, want)
		}
		if !proto.Equal(cla, Endpoints("transcode", fleet(), d)) {
			t.Fatalf("%s: deriving modified the snapshot's message", f)
		}
		size := func(m proto.Message) int { return proto.Size(m) }
		t.Logf("%s: %d of %d bytes (%d localities)", f, size(got), size(cla), len(cla.Endpoints))
	}
}

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
		members = append(members, testMember("work", fmt.Sprintf("e%02d", i), fmt.Sprintf("sess-%02d", i), 1, 9000+i, "1.0.0", health.StatusPassing, uint64(5+i)))
	}
	for _, h := range replicas {
		h.s.Subscribe(d)
		h.tasks("work")
		h.members("work", members...)
		h.nonPassing()
	}
	forms := []EndpointMetadata{MetadataFull, MetadataSession, MetadataNone}
	var firstSession *endpointv3.LbEndpoint
	for round := range 4 {
		type answer struct {
			version string
			bytes   []byte
		}
		got := make([]map[EndpointMetadata]answer, len(replicas))
		for r, h := range replicas {
			h.publish()
			got[r] = map[EndpointMetadata]answer{}
			for _, f := range forms {
				node := formNode(t, map[string]any{"endpoint_metadata": string(f)})
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
					fields := lb.GetMetadata().GetFilterMetadata()[MetadataNamespace].GetFields()
					wantFields := map[EndpointMetadata]int{MetadataFull: 3, MetadataSession: 1, MetadataNone: 0}[f]
					if len(fields) != wantFields || (f == MetadataSession && fields["session_id"].GetStringValue() != "sess-"+lb.GetEndpoint().GetHostname()[1:]) {
						t.Fatalf("round %d, %s: endpoint metadata %v", round, f, lb.GetMetadata())
					}
				}
				group := formGroup(d.Key(), f)
				snap, _ := h.s.cache.sotw.snapshot(group)
				want, _ := proto.MarshalOptions{Deterministic: true}.Marshal(snap.GetResources(resource.EndpointType)["work"])
				if !bytes.Equal(resp.Resources[0].Value, want) {
					t.Fatalf("round %d, %s: bytes differ from a marshal of the derived message", round, f)
				}
				got[r][f] = answer{resp.VersionInfo, resp.Resources[0].Value}
				if f == MetadataSession && r == 0 {
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
		if got[0][MetadataFull].version == got[0][MetadataNone].version || got[0][MetadataSession].version == got[0][MetadataNone].version {
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
	h.members("work", testMember("work", "e1", "s1", 1, 9001, "1.0.0", health.StatusPassing, 5))
	h.nonPassing()
	h.publish()
	node := formNode(t, map[string]any{"endpoint_metadata": "none"})
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
