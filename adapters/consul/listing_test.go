package consul

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
)

// keptCatalog is what the lean decoder keeps of a catalog entry, from one
// encoding/json decoded.
func keptCatalog(n *api.CatalogService) *api.CatalogService {
	if n == nil {
		return nil
	}
	return &api.CatalogService{
		Node: n.Node, Address: n.Address, ServiceID: n.ServiceID, ServiceName: n.ServiceName,
		ServiceAddress: n.ServiceAddress, ServicePort: n.ServicePort,
		ServiceTags: n.ServiceTags, ServiceMeta: n.ServiceMeta,
		CreateIndex: n.CreateIndex, ModifyIndex: n.ModifyIndex,
	}
}

// keptHealth is keptCatalog for a health entry.
func keptHealth(e *api.ServiceEntry) *api.ServiceEntry {
	if e == nil {
		return nil
	}
	out := &api.ServiceEntry{}
	if e.Node != nil {
		out.Node = &api.Node{Node: e.Node.Node, Address: e.Node.Address, Datacenter: e.Node.Datacenter}
	}
	if v := e.Service; v != nil {
		out.Service = &api.AgentService{
			ID: v.ID, Service: v.Service, Address: v.Address, Port: v.Port, Tags: v.Tags,
			Meta: v.Meta, CreateIndex: v.CreateIndex, ModifyIndex: v.ModifyIndex,
		}
	}
	if e.Checks != nil {
		out.Checks = api.HealthChecks{}
		for _, c := range e.Checks {
			out.Checks = append(out.Checks, keptCheck(c))
		}
	}
	return out
}

// keptCheck is keptCatalog for a check.
func keptCheck(c *api.HealthCheck) *api.HealthCheck {
	if c == nil {
		return nil
	}
	return &api.HealthCheck{
		Node: c.Node, CheckID: c.CheckID, Status: c.Status, Output: c.Output,
		ServiceID: c.ServiceID, ServiceName: c.ServiceName,
		CreateIndex: c.CreateIndex, ModifyIndex: c.ModifyIndex,
	}
}

// agree fails t unless the lean decoders decode doc as encoding/json does,
// for the fields they keep.
func agree(t *testing.T, what string, doc []byte) {
	t.Helper()
	var wantCat []*api.CatalogService
	if err := json.Unmarshal(doc, &wantCat); err == nil {
		got, err := decodeCatalogListing(doc)
		if err != nil {
			t.Fatalf("%s: catalog: %v", what, err)
		}
		want := []*api.CatalogService(nil)
		if wantCat != nil {
			want = []*api.CatalogService{}
		}
		for _, n := range wantCat {
			want = append(want, keptCatalog(n))
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%s: catalog:\n got %s\nwant %s", what, dump(got), dump(want))
		}
	}
	var wantHealth []*api.ServiceEntry
	if err := json.Unmarshal(doc, &wantHealth); err == nil {
		got, err := decodeHealthListing(doc)
		if err != nil {
			t.Fatalf("%s: health: %v", what, err)
		}
		want := []*api.ServiceEntry(nil)
		if wantHealth != nil {
			want = []*api.ServiceEntry{}
		}
		for _, e := range wantHealth {
			want = append(want, keptHealth(e))
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%s: health:\n got %s\nwant %s", what, dump(got), dump(want))
		}
	}
	var wantChecks api.HealthChecks
	if err := json.Unmarshal(doc, &wantChecks); err == nil {
		got, err := decodeCheckListing(doc)
		if err != nil {
			t.Fatalf("%s: checks: %v", what, err)
		}
		want := api.HealthChecks(nil)
		if wantChecks != nil {
			want = api.HealthChecks{}
		}
		for _, c := range wantChecks {
			want = append(want, keptCheck(c))
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%s: checks:\n got %s\nwant %s", what, dump(got), dump(want))
		}
	}
}

func dump(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// TestLeanListingsDecodeConsulsAnswersAsEncodingJSONDoes: listings a
// Consul 1.13.9 server wrote (metadata with a NUL, quotes, backslashes,
// HTML characters and U+2028 escaped, non-ASCII, and a byte that was not
// UTF-8 when registered) decode to what encoding/json decodes of the fields
// kept.
func TestLeanListingsDecodeConsulsAnswersAsEncodingJSONDoes(t *testing.T) {
	for _, f := range []string{"consul-1.13-catalog-service.json", "consul-1.13-health-service.json"} {
		doc, err := os.ReadFile("testdata/" + f)
		if err != nil {
			t.Fatal(err)
		}
		agree(t, f, doc)
		var indented bytes.Buffer
		if err := json.Indent(&indented, doc, "", "  "); err != nil {
			t.Fatal(err)
		}
		agree(t, f+" indented (a dev agent's)", indented.Bytes())
	}
	cat, _ := decodeCatalogListing(mustRead(t, "testdata/consul-1.13-catalog-service.json"))
	if len(cat) != 2 || !strings.Contains(cat[0].ServiceMeta["label_note"], "nul\x00 quote\"") ||
		cat[1].ServicePort != 9002 || cat[1].CreateIndex == 0 {
		t.Fatalf("the fixture decoded to %s", dump(cat))
	}
	h, _ := decodeHealthListing(mustRead(t, "testdata/consul-1.13-health-service.json"))
	if len(h) != 2 || len(h[0].Checks) != 2 || h[0].Checks[1].Output != `load=3 "x" \ é` || h[0].Checks[1].Status != "warning" {
		t.Fatalf("the fixture decoded to %s", dump(h))
	}
	// A listing of checks (/v1/health/state/:state) is an array of the
	// checks a health listing holds, written alike: the fixture's, as Consul
	// wrote them.
	var entries []struct{ Checks []json.RawMessage }
	if err := json.Unmarshal(mustRead(t, "testdata/consul-1.13-health-service.json"), &entries); err != nil {
		t.Fatal(err)
	}
	var checks [][]byte
	for _, e := range entries {
		for _, c := range e.Checks {
			checks = append(checks, c)
		}
	}
	doc := append(append([]byte("["), bytes.Join(checks, []byte(","))...), ']')
	agree(t, "the fixture's checks", doc)
	k, _ := decodeCheckListing(doc)
	if len(k) != 4 || k[1].Output != `load=3 "x" \ é` || k[1].Status != "warning" || k[1].ModifyIndex == 0 {
		t.Fatalf("the fixture's checks decoded to %s", dump(k))
	}
}

func mustRead(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestLeanListingsAgreeWithEncodingJSONOnRandomEntries: random entries
// carrying every field Consul writes (the skipped ones with nested values
// and nulls), strings of any byte, written compact or indented.
func TestLeanListingsAgreeWithEncodingJSONOnRandomEntries(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 7))
	for round := range 300 {
		var cat []*api.CatalogService
		var hl []*api.ServiceEntry
		var cl api.HealthChecks
		for range r.IntN(6) {
			if r.IntN(12) == 0 {
				cat, hl, cl = append(cat, nil), append(hl, nil), append(cl, nil)
				continue
			}
			cat = append(cat, randomCatalogEntry(r))
			hl = append(hl, randomHealthEntry(r))
			cl = append(cl, randomCheck(r))
		}
		if r.IntN(10) == 0 {
			cat, hl, cl = nil, nil, nil
		}
		for _, v := range []any{cat, hl, cl} {
			doc, err := json.Marshal(v)
			if r.IntN(2) == 0 {
				doc, err = json.MarshalIndent(v, "", "\t")
			}
			if err != nil {
				t.Fatal(err)
			}
			agree(t, fmt.Sprintf("round %d", round), doc)
		}
	}
}

func randomString(r *rand.Rand) string {
	pieces := []string{"a", "b", "\x00", "\"", "\\", "/", "<", ">", "&", "\u2028", "\u2029",
		"é", "😀", "\xff", "\xc3", "\n", "\t", "\x1f", " ", "\\u0041"}
	var b strings.Builder
	for range r.IntN(12) {
		b.WriteString(pieces[r.IntN(len(pieces))])
	}
	return b.String()
}

func randomMeta(r *rand.Rand) map[string]string {
	if r.IntN(8) == 0 {
		return nil
	}
	m := map[string]string{}
	for range r.IntN(6) {
		m[randomString(r)] = randomString(r)
	}
	return m
}

func randomTags(r *rand.Rand) []string {
	if r.IntN(8) == 0 {
		return nil
	}
	tags := []string{}
	for range r.IntN(4) {
		tags = append(tags, randomString(r))
	}
	return tags
}

func randomCatalogEntry(r *rand.Rand) *api.CatalogService {
	n := &api.CatalogService{
		ID: randomString(r), Node: randomString(r), Address: randomString(r),
		Datacenter: randomString(r), TaggedAddresses: randomMeta(r), NodeMeta: randomMeta(r),
		ServiceID: randomString(r), ServiceName: randomString(r),
		ServiceAddress: randomString(r), ServiceTags: randomTags(r), ServiceMeta: randomMeta(r),
		ServicePort: r.IntN(1 << 16), ServiceWeights: api.Weights{Passing: r.IntN(9)},
		ServiceEnableTagOverride: r.IntN(2) == 0,
		CreateIndex:              r.Uint64(), ModifyIndex: r.Uint64(),
	}
	if r.IntN(2) == 0 {
		n.ServiceProxy = &api.AgentServiceConnectProxyConfig{
			DestinationServiceName: randomString(r),
			Config:                 map[string]any{"a": []any{1.5, nil, true, map[string]any{}}},
			Upstreams: []api.Upstream{{DestinationName: randomString(r),
				LocalBindPort: r.IntN(100)}},
		}
	}
	return n
}

func randomHealthEntry(r *rand.Rand) *api.ServiceEntry {
	e := &api.ServiceEntry{}
	if r.IntN(10) > 0 {
		e.Node = &api.Node{ID: randomString(r), Node: randomString(r),
			Address: randomString(r), Datacenter: randomString(r),
			TaggedAddresses: randomMeta(r), Meta: randomMeta(r), CreateIndex: r.Uint64()}
	}
	if r.IntN(10) > 0 {
		e.Service = &api.AgentService{ID: randomString(r), Service: randomString(r),
			Tags: randomTags(r), Meta: randomMeta(r), Port: r.IntN(1 << 16),
			Address: randomString(r), CreateIndex: r.Uint64(), ModifyIndex: r.Uint64(),
			Weights: api.AgentWeights{Passing: 1, Warning: 1}}
	}
	if r.IntN(8) > 0 {
		e.Checks = api.HealthChecks{}
		for range r.IntN(4) {
			e.Checks = append(e.Checks, randomCheck(r))
		}
	}
	return e
}

func randomCheck(r *rand.Rand) *api.HealthCheck {
	return &api.HealthCheck{Node: randomString(r),
		CheckID: randomString(r), Name: randomString(r), Status: randomString(r),
		Output: randomString(r), ServiceID: randomString(r),
		ServiceName: randomString(r), ServiceTags: randomTags(r), Type: randomString(r),
		Namespace: randomString(r), ExposedPort: r.IntN(1 << 16),
		Definition: api.HealthCheckDefinition{HTTP: randomString(r),
			Header: map[string][]string{randomString(r): randomTags(r)}},
		CreateIndex: r.Uint64(), ModifyIndex: r.Uint64()}
}

// TestLeanListingsRefuseMalformedJSON: a listing cut short anywhere, or
// not of the shape expected, is an error (and no panic), never a shorter
// listing.
func TestLeanListingsRefuseMalformedJSON(t *testing.T) {
	for _, f := range []string{"consul-1.13-catalog-service.json", "consul-1.13-health-service.json"} {
		doc := bytes.TrimSpace(mustRead(t, "testdata/"+f))
		for i := range len(doc) {
			if _, err := decodeCatalogListing(doc[:i]); err == nil {
				t.Fatalf("%s cut at %d of %d: the catalog decoder took it", f, i, len(doc))
			}
			if _, err := decodeHealthListing(doc[:i]); err == nil {
				t.Fatalf("%s cut at %d of %d: the health decoder took it", f, i, len(doc))
			}
			if _, err := decodeCheckListing(doc[:i]); err == nil {
				t.Fatalf("%s cut at %d of %d: the checks decoder took it", f, i, len(doc))
			}
		}
	}
	wrong := []string{
		``, ` `, `{}`, `"x"`, `[1,]`, `[,1]`, `[{"Node":1}]`, `[{"ServicePort":"80"}]`,
		`[{"ServicePort":1.5}]`, `[{"CreateIndex":-1}]`, `[{"ServiceMeta":{"a":1}}]`,
		`[{"ServiceTags":"x"}]`, `[{"a":1,}]`, `[{"a" 1}]`, `[{a:1}]`, `[] []`, `[]x`,
		`[{"x":tru}]`, `[{"x":nul}]`, "[{\"Node\":\"a\x01\"}]", `[{"Node":"a\q"}]`,
		`[{"Node":"\ud800\u"}]`,
		`[[]]`, `[{"x":` + strings.Repeat(`[`, 10001) + strings.Repeat(`]`, 10001) + `}]`,
		`[{"x":` + strings.Repeat(`{"a":`, 10001) + `1` + strings.Repeat(`}`, 10001) + `}]`,
		`[{"Service":{"Port":"x"}}]`, `[{"Checks":[{"ModifyIndex":true}]}]`, `[{"Node":[]}]`,
		`[{"CheckID":1}]`, `[{"Status":true}]`, `[{"Output":{}}]`,
	}
	notJSON := []string{ // inside values the decoders skip or keep
		`[{"x":-}]`, `[{"x":e}]`, `[{"x":+}]`, `[{"Weights":1..2}]`, `[{"x":01}]`, `[{"x":1e}]`,
		`[{"x":1.}]`, `[{"x":.5}]`, `[{"x":1e+}]`, `[{"x":-01}]`,
		`[{"Service":{"Port":+1},"Checks":[{"x":--}]}]`, `[{"ServicePort":+80}]`,
		`[{"ServicePort":080}]`, `[{"CreateIndex":007}]`, `[{"x":"\q"}]`, `[{"x":"\u12"}]`,
		`[{"x":"\uZZZZ"}]`, `[{"x":"\"}]`,
		strings.Repeat(`[`, 10001) + strings.Repeat(`]`, 10001),
		`[{"Service":{"Proxy":` + strings.Repeat(`[`, 9998) + strings.Repeat(`]`, 9998) + `}}]`,
	}
	for _, doc := range notJSON {
		if json.Valid([]byte(doc)) {
			t.Errorf("%q: the case is JSON", doc)
		}
		if _, err := decodeCatalogListing([]byte(doc)); err == nil {
			t.Errorf("%q: the catalog decoder took it", doc)
		}
		if _, err := decodeHealthListing([]byte(doc)); err == nil {
			t.Errorf("%q: the health decoder took it", doc)
		}
		if _, err := decodeCheckListing([]byte(doc)); err == nil {
			t.Errorf("%q: the checks decoder took it", doc)
		}
	}
	for _, doc := range wrong {
		_, cerr := decodeCatalogListing([]byte(doc))
		_, herr := decodeHealthListing([]byte(doc))
		_, kerr := decodeCheckListing([]byte(doc))
		if cerr == nil && herr == nil && kerr == nil {
			t.Errorf("%q: every decoder took it", doc)
		}
	}
	for _, doc := range []string{`null`, `[]`, ` [ ] `, `[null]`, `[{}]`, `[{"Node":null}]`,
		`[{"x":-0.5e+10,"y":0,"z":1E-2,"w":"\u00e9\/\b"}]`,
		`[{"Service":{"Proxy":` + strings.Repeat(`[`, 9997) + strings.Repeat(`]`, 9997) + `}}]`,
	} {
		if !json.Valid([]byte(doc)) {
			t.Errorf("%q: the case is not JSON", doc)
		}
		if _, err := decodeCatalogListing([]byte(doc)); err != nil {
			t.Errorf("%q: %v", doc, err)
		}
		agree(t, doc, []byte(doc))
	}
}

// BenchmarkListingDecode: a task type's two listings as Consul 1.13 writes
// them for 1,000 executors, decoded by encoding/json into the api types (the
// floor: what the watch did before) and by the lean decoder.
func BenchmarkListingDecode(b *testing.B) {
	catDoc, healthDoc := consulLikeListings(b, 1000)
	for _, c := range []struct {
		name string
		doc  []byte
		std  func([]byte) error
		lean func([]byte) error
	}{
		{"catalog", catDoc,
			func(d []byte) error { var v []*api.CatalogService; return json.Unmarshal(d, &v) },
			func(d []byte) error { _, err := decodeCatalogListing(d); return err }},
		{"health", healthDoc,
			func(d []byte) error { var v []*api.ServiceEntry; return json.Unmarshal(d, &v) },
			func(d []byte) error { _, err := decodeHealthListing(d); return err }},
	} {
		for _, way := range []struct {
			name string
			f    func([]byte) error
		}{{"encoding-json", c.std}, {"lean", c.lean}} {
			b.Run(c.name+"/"+way.name, func(b *testing.B) {
				b.SetBytes(int64(len(c.doc)))
				b.ReportAllocs()
				for b.Loop() {
					if err := way.f(c.doc); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/1000, "ms/listing")
			})
		}
	}
}

// consulLikeListings writes n executors' catalog and health listings in the
// shape of the fixtures (one node, a TTL check per service; keys sorted, as
// encoding/json writes a map, where Consul keeps its structs' order).
func consulLikeListings(tb testing.TB, n int) (catalog, healthDoc []byte) {
	var cat []map[string]any
	var hl []map[string]any
	if err := json.Unmarshal(mustRead(tb, "testdata/consul-1.13-catalog-service.json"), &cat); err != nil {
		tb.Fatal(err)
	}
	if err := json.Unmarshal(mustRead(tb, "testdata/consul-1.13-health-service.json"), &hl); err != nil {
		tb.Fatal(err)
	}
	var cs, hs []map[string]any
	for i := range n {
		inst := fmt.Sprintf("exec-%05d", i)
		meta := map[string]any{"instance_id": inst, "session_id": "s1", "generation": "1",
			"version": "1.0.0", "capacity": "8", "state": "active"}
		c := clone(cat[0])
		c["ServiceID"], c["ServiceMeta"], c["ServicePort"] = inst+"/work", meta, 20000+i
		c["ServiceTags"] = []string{"leasehold"}
		cs = append(cs, c)
		h := clone(hl[0])
		svc := h["Service"].(map[string]any)
		svc["ID"], svc["Meta"], svc["Port"] = inst+"/work", meta, 20000+i
		svc["Tags"] = []string{"leasehold"}
		checks := h["Checks"].([]any)
		lease := checks[1].(map[string]any)
		lease["CheckID"], lease["ServiceID"], lease["Output"] = "lease:"+inst+":s1:work", inst+"/work", ""
		hs = append(hs, h)
	}
	catalog, _ = json.Marshal(cs)
	healthDoc, _ = json.Marshal(hs)
	return catalog, healthDoc
}

func clone(m map[string]any) map[string]any {
	b, _ := json.Marshal(m)
	var out map[string]any
	json.Unmarshal(b, &out)
	return out
}

// FuzzLeanListings: any bytes decode without a panic, what is not JSON is
// an error, and a document encoding/json decodes into the api types the
// lean decoders decode alike,
// unless one of its objects holds a key twice or in two cases (see
// listing.go: Consul writes neither).
func FuzzLeanListings(f *testing.F) {
	for _, p := range []string{"consul-1.13-catalog-service.json", "consul-1.13-health-service.json"} {
		f.Add(mustRead(f, "testdata/"+p))
	}
	for _, s := range []string{`null`, `[]`, `[null]`, `[{"Node":null,"Checks":[null,{}]}]`,
		`[{"ServiceMeta":{"a":null},"ServiceTags":[null,"x"]}]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, doc []byte) {
		_, cerr := decodeCatalogListing(doc)
		_, herr := decodeHealthListing(doc)
		_, kerr := decodeCheckListing(doc)
		if !json.Valid(doc) {
			if cerr == nil || herr == nil || kerr == nil {
				t.Fatalf("%q is not JSON; catalog decoder: %v, health decoder: %v, checks "+
					"decoder: %v", doc, cerr, herr, kerr)
			}
			return
		}
		if repeatsAKey(doc) || respellsAKey(doc) {
			return
		}
		var c []*api.CatalogService
		if json.Unmarshal(doc, &c) == nil && cerr != nil {
			t.Fatalf("encoding/json took %q, the lean catalog decoder: %v", doc, cerr)
		}
		var h []*api.ServiceEntry
		if json.Unmarshal(doc, &h) == nil && herr != nil {
			t.Fatalf("encoding/json took %q, the lean health decoder: %v", doc, herr)
		}
		var k api.HealthChecks
		if json.Unmarshal(doc, &k) == nil && kerr != nil {
			t.Fatalf("encoding/json took %q, the lean checks decoder: %v", doc, kerr)
		}
		agree(t, string(doc), doc)
	})
}

// keptKeys are the keys the lean decoders read, in Consul's spelling.
var keptKeys = []string{"Node", "Address", "Datacenter", "ServiceID", "ServiceName",
	"ServiceAddress", "ServicePort", "ServiceTags", "ServiceMeta", "CreateIndex", "ModifyIndex",
	"Service", "Checks", "ID", "Port", "Tags", "Meta", "CheckID", "Status", "Output"}

// respellsAKey reports whether the valid JSON doc holds a kept key in
// another case (encoding/json reads it; the lean decoders do not).
func respellsAKey(doc []byte) bool {
	d := json.NewDecoder(bytes.NewReader(doc))
	for {
		tok, err := d.Token()
		if err != nil {
			return false
		}
		if k, ok := tok.(string); ok {
			for _, want := range keptKeys {
				if k != want && strings.EqualFold(k, want) {
					return true
				}
			}
		}
	}
}

// repeatsAKey reports whether an object of the valid JSON doc holds a key
// twice, in the same case or another.
func repeatsAKey(doc []byte) bool {
	d := json.NewDecoder(bytes.NewReader(doc))
	type frame struct {
		object bool
		keys   map[string]bool
		key    bool // the next token is a key
	}
	var stack []*frame
	for {
		tok, err := d.Token()
		if err != nil {
			return false
		}
		var top *frame
		if len(stack) > 0 {
			top = stack[len(stack)-1]
		}
		if k, ok := tok.(string); ok && top != nil && top.object && top.key {
			for seen := range top.keys {
				if strings.EqualFold(seen, k) {
					return true
				}
			}
			top.keys[k], top.key = true, false
			continue
		}
		switch tok {
		case json.Delim('{'):
			stack = append(stack, &frame{object: true, keys: map[string]bool{}, key: true})
			continue
		case json.Delim('['):
			stack = append(stack, &frame{})
			continue
		case json.Delim('}'), json.Delim(']'):
			stack = stack[:len(stack)-1]
		}
		if len(stack) > 0 && stack[len(stack)-1].object {
			stack[len(stack)-1].key = true // a value ended: a key or } is next
		}
	}
}
