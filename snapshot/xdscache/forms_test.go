package xdscache

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/fleettest"
	"github.com/leasehold/leasehold/snapshot/translator"
)

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
		if got, err := EndpointMetadataOf(fleettest.Node(t, c.meta)); err != nil || got != c.want {
			t.Errorf("%v: %q, %v; want %q", c.meta, got, err, c.want)
		}
	}
	for _, bad := range []any{"compact", "", "NONE", 1.0, true, map[string]any{"a": "b"}} {
		node := fleettest.Node(t, map[string]any{"endpoint_metadata": bad})
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
	cla := translator.Endpoints("transcode", fleettest.GoldenFleet(), d)
	snap := &cache.Snapshot{}
	snap.Resources[types.Endpoint] = cache.NewResources("v", []types.Resource{cla})
	versions := map[string]map[string]string{resource.EndpointType: {"transcode": "e1"}}
	for _, f := range []EndpointMetadata{MetadataSession, MetadataNone} {
		fs := &formState{form: f}
		ds, dv := fs.derive(snap, versions)
		res := ds.GetResources(resource.EndpointType)
		got := translator.Expand(res["transcode"].(*endpointv3.ClusterLoadAssignment))
		if err := got.ValidateAll(); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		fleettest.ProtoGolden(t, "endpoints-any-"+string(f)+".json", got)
		if v := dv[resource.EndpointType]["transcode"]; v != "e1-"+string(f) {
			t.Errorf("%s: version %q", f, v)
		}
		want := translator.Expand(cla)
		if len(want.Endpoints) < 2 {
			t.Fatal("the golden fleet has one locality: localities other than the first are not " +
				"exercised")
		}
		for _, loc := range want.Endpoints {
			for _, lb := range loc.LbEndpoints {
				switch f {
				case MetadataNone:
					lb.Metadata = nil
				case MetadataSession:
					delete(lb.Metadata.FilterMetadata[translator.MetadataNamespace].Fields,
						"instance_id")
					delete(lb.Metadata.FilterMetadata[translator.MetadataNamespace].Fields,
						"version")
				}
			}
		}
		if !proto.Equal(got, want) {
			t.Errorf("%s: derived %v\nwant %v", f, got, want)
		}
		if !proto.Equal(cla, translator.Endpoints("transcode", fleettest.GoldenFleet(), d)) {
			t.Fatalf("%s: deriving modified the snapshot's message", f)
		}
		size := func(m proto.Message) int { return proto.Size(m) }
		t.Logf("%s: %d of %d bytes (%d localities)", f, size(got), size(cla), len(cla.Endpoints))
	}
}

// A derivation derives again only the load assignments whose content
// version changed; what it keeps and what it derives anew are what a
// derivation from nothing gives.
func TestADerivationKeepsWhatDidNotChange(t *testing.T) {
	d, _ := health.NewDispatcher("", nil)
	fleet := fleettest.GoldenFleet()
	build := func(task string, es []health.Executor) *endpointv3.ClusterLoadAssignment {
		return translator.Endpoints(task, es, d)
	}
	snapOf := func(a, b *endpointv3.ClusterLoadAssignment, va, vb string) (*cache.Snapshot,
		map[string]map[string]string) {
		snap := &cache.Snapshot{}
		snap.Resources[types.Endpoint] = cache.NewResources("v", []types.Resource{a, b})
		return snap, map[string]map[string]string{resource.EndpointType: {"a": va, "b": vb}}
	}
	for _, f := range []EndpointMetadata{MetadataSession, MetadataNone} {
		fs := &formState{form: f}
		first, _ := fs.derive(snapOf(build("a", fleet), build("b", fleet), "a1", "b1"))
		next, _ := fs.derive(snapOf(build("a", fleet), build("b", fleet[1:]), "a1", "b2"))
		was, now := first.GetResources(resource.EndpointType),
			next.GetResources(resource.EndpointType)
		if was["a"] != now["a"] {
			t.Errorf("%s: a load assignment whose version did not change was derived again", f)
		}
		if was["b"] == now["b"] {
			t.Fatalf("%s: a load assignment whose version changed was kept", f)
		}
		fresh, _ := (&formState{form: f}).derive(snapOf(build("a", fleet), build("b", fleet[1:]),
			"a1", "b2"))
		for _, name := range []string{"a", "b"} {
			got := now[name].(*endpointv3.ClusterLoadAssignment)
			want := fresh.GetResources(resource.EndpointType)[name].(*endpointv3.ClusterLoadAssignment)
			if !proto.Equal(translator.Expand(got), translator.Expand(want)) {
				t.Errorf("%s: %s differs from a derivation from nothing", f, name)
			}
		}
	}
}

// A form written on the wire is byte for byte the form written through the
// endpoints' messages, on the golden fleet and on random ones (addresses,
// ports, capacities, ids and versions of any length and script, localities,
// datacenters), and the wire is what a Builder's localities take.
func TestTheWireFormIsTheMessageForm(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 30))
	word := func() string {
		const alphabet = "abcXYZ019-_.:é日\u0001"
		rs := []rune(alphabet)
		n := r.IntN(40)
		if r.IntN(8) == 0 { // past 127 bytes: lengths of two bytes and more
			n = 100 + r.IntN(2000)
		}
		b := make([]rune, n)
		for i := range b {
			b[i] = rs[r.IntN(len(rs))]
		}
		return string(b)
	}
	fleets := [][]health.Executor{fleettest.GoldenFleet()}
	for range 30 {
		es := fleettest.Executors(1 + r.IntN(60))
		for i := range es {
			e := &es[i]
			e.InstanceID, e.SessionID, e.Version = word(), word(), word()
			e.Address = fmt.Sprintf("10.%d.%d.%d", r.IntN(256), r.IntN(256), r.IntN(256))
			e.Port, e.Capacity, e.Load = 1+r.IntN(65535), r.IntN(1000), r.IntN(10)
			e.Labels = map[string]string{"zone": []string{"a", "b", "c"}[r.IntN(3)]}
			e.Datacenter = []string{"", "dc1", "dc2"}[r.IntN(3)]
		}
		fleets = append(fleets, es)
	}
	d, _ := health.NewDispatcher("", nil)
	for n, es := range fleets {
		cla := translator.Endpoints("work", es, d)
		for _, f := range []EndpointMetadata{MetadataSession, MetadataNone} {
			fs := &formState{form: f}
			for i, loc := range cla.Endpoints {
				wire, ok := fs.wireForm(loc)
				if !ok {
					t.Fatalf("fleet %d, %s, locality %d: a Builder's endpoints did not scan", n, f, i)
				}
				want, ok := translator.EncodedLbEndpoints(fs.messageForm(loc))
				if !ok || len(want) != len(wire) {
					t.Fatalf("fleet %d, %s, locality %d: %d endpoints on the wire, %d as messages",
						n, f, i, len(wire), len(want))
				}
				for j := range wire {
					if !bytes.Equal(wire[j], want[j]) {
						t.Fatalf("fleet %d, %s, locality %d, endpoint %d:\nwire     %x\nmessages %x",
							n, f, i, j, wire[j], want[j])
					}
				}
			}
		}
	}
}

// Endpoints not written as a Builder writes them (metadata twice, a key
// twice, an entry without its value, bytes that do not parse) go through the
// messages; those the wire takes (another namespace, typed metadata) come
// out as the messages give them.
func TestEndpointsTheWireDoesNotTakeGoThroughTheMessages(t *testing.T) {
	val := func(s string) []byte {
		b, _ := proto.Marshal(structpb.NewStringValue(s))
		return b
	}
	entry := func(key string, v []byte, withValue bool) []byte {
		b := protowire.AppendTag(nil, mapKeyField, protowire.BytesType)
		b = protowire.AppendString(b, key)
		if withValue {
			b = protowire.AppendTag(b, mapValueField, protowire.BytesType)
			b = protowire.AppendBytes(b, v)
		}
		return b
	}
	field := func(num protowire.Number, v []byte) []byte {
		return protowire.AppendBytes(protowire.AppendTag(nil, num, protowire.BytesType), v)
	}
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	st := func(entries ...[]byte) []byte { // a Struct of fields entries
		var b []byte
		for _, e := range entries {
			b = append(b, field(structFieldsField, e)...)
		}
		return b
	}
	md := func(entries ...[]byte) []byte { // a Metadata of filter_metadata entries
		var b []byte
		for _, e := range entries {
			b = append(b, field(filterMetadataField, e)...)
		}
		return b
	}
	ns := translator.MetadataNamespace
	sess := entry("session_id", val("s-1"), true)
	good := st(entry("instance_id", val("x"), true), sess)
	endpoint, _ := proto.Marshal(&endpointv3.LbEndpoint{
		HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{
			Hostname: "x"}}})
	lbOf := func(metadata ...[]byte) []byte { // in Go's order: a oneof (the endpoint) last
		var b []byte
		for _, m := range metadata {
			b = append(b, field(lbMetadataField, m)...)
		}
		return append(b, endpoint...)
	}
	typed := field(2, entry("other", nil, true))
	// Whether the wire takes it in the session form, and in the none form
	// (which drops the metadata without reading it).
	for _, c := range []struct {
		name          string
		lb            []byte
		session, none bool
	}{
		{"as a Builder writes it", lbOf(md(entry(ns, good, true))), true, true},
		{"another namespace only", lbOf(md(entry("other", good, true))), true, true},
		{"typed metadata beside", lbOf(cat(md(entry(ns, good, true)), typed)), true, true},
		{"no session_id", lbOf(md(entry(ns, st(entry("instance_id", val("x"), true)), true))),
			true, true},
		{"no metadata", lbOf(), true, true},
		{"metadata twice", lbOf(md(entry(ns, good, true)), md(entry(ns, good, true))), false,
			false},
		{"the namespace twice", lbOf(md(entry(ns, good, true), entry(ns, good, true))), false,
			true},
		{"session_id twice", lbOf(md(entry(ns, st(sess, sess), true))), false, true},
		{"session_id without its value",
			lbOf(md(entry(ns, st(entry("session_id", nil, false)), true))), false, true},
		{"bytes that do not parse", append(lbOf(), 0x1a, 0x05, 0x01), false, false},
	} {
		for _, f := range []EndpointMetadata{MetadataSession, MetadataNone} {
			loc := &endpointv3.LocalityLbEndpoints{}
			translator.SetEncoded(loc, [][]byte{c.lb})
			fs := &formState{form: f}
			taken := c.session
			if f == MetadataNone {
				taken = c.none
			}
			if _, ok := fs.wireForm(loc); ok != taken {
				t.Errorf("%s, %s: taken by the wire %v, want %v", c.name, f, ok, taken)
			}
			cla := &endpointv3.ClusterLoadAssignment{ClusterName: "work",
				Endpoints: []*endpointv3.LocalityLbEndpoints{loc}}
			got, _ := proto.Marshal(fs.cla(cla).Endpoints[0])
			want, _ := proto.Marshal(fs.messageForm(loc))
			if !bytes.Equal(got, want) {
				t.Errorf("%s, %s: %x, the messages give %x", c.name, f, got, want)
			}
		}
	}
}

// BenchmarkDeriveAForm derives one changed load assignment of 250 endpoints
// (a shard) in each form, on the wire and, for the floor it replaced, through
// the endpoints' messages.
func BenchmarkDeriveAForm(b *testing.B) {
	d, _ := health.NewDispatcher("", nil)
	cla := translator.Endpoints("work", fleettest.Executors(250), d)
	for _, f := range []EndpointMetadata{MetadataSession, MetadataNone} {
		fs := &formState{form: f}
		b.Run(string(f)+"/wire", func(b *testing.B) {
			for b.Loop() {
				fs.cla(cla)
			}
		})
		b.Run(string(f)+"/messages", func(b *testing.B) {
			for b.Loop() {
				for _, loc := range cla.Endpoints {
					fs.messageForm(loc)
				}
			}
		})
	}
}
