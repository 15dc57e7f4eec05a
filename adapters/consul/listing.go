package consul

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"unicode/utf8"

	"github.com/hashicorp/consul/api"
)

// The task watch's two listings (a task type's catalog entries and its
// health entries) are decoded here rather than by encoding/json into the
// api package's types. Those carry some thirty fields per entry (tagged
// addresses, node metadata, proxy and Connect settings, weights, check
// definitions), each decoded through reflection and most into maps, while a
// member is built from a dozen; at 10,000 executors in one task type a
// listing is 8–14 MB of JSON and encoding/json spent ~100 ms and 22 MB on
// one. This decoder walks the JSON once, keeps only the fields a member
// needs (the rest is skipped without being decoded) and fills the same api
// types, so nothing downstream changes. Strings that repeat across a
// listing's entries (metadata keys, node names and addresses, check
// statuses) are kept once.
//
// On valid JSON whose objects hold each key once, spelled as Consul spells
// it, the result equals encoding/json's for the fields kept (strings with
// escapes or non-ASCII bytes are unquoted by encoding/json itself, so
// escapes and invalid UTF-8 come out alike; a JSON null leaves the field at
// its zero value, as encoding/json does). encoding/json also matches a key
// in another case, and merges a key given twice into what the first
// decoded; Consul writes neither. Malformed or truncated JSON is an error
// (FuzzLeanListings holds both promises).

// errListing is the error of a listing that is not the JSON expected.
var errListing = errors.New("consul listing")

// maxListingDepth bounds how deeply a listing may nest, as encoding/json
// bounds any document (Consul's entries nest five levels).
const maxListingDepth = 10000

// listingScan is a cursor over one JSON document. Its first error sticks:
// later calls do nothing and return zero values, and err reports it.
type listingScan struct {
	b     []byte
	i     int
	err   error
	depth int
	in    interner
}

func newListingScan(b []byte) *listingScan {
	return &listingScan{b: b, in: interner{}}
}

func (s *listingScan) fail(what string) {
	if s.err == nil {
		s.err = fmt.Errorf("%w: %s at byte %d", errListing, what, s.i)
	}
}

// ws skips white space and reports the byte after it (0 at the end).
func (s *listingScan) ws() byte {
	for s.i < len(s.b) {
		switch c := s.b[s.i]; c {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return c
		}
	}
	return 0
}

// end fails unless only white space is left.
func (s *listingScan) end() {
	if s.err == nil && s.ws() != 0 {
		s.fail("data after the listing")
	}
}

// null consumes a JSON null if one is next.
func (s *listingScan) null() bool {
	if s.err != nil || s.ws() != 'n' {
		return false
	}
	s.literal("null")
	return s.err == nil
}

func (s *listingScan) literal(lit string) {
	if len(s.b)-s.i < len(lit) || string(s.b[s.i:s.i+len(lit)]) != lit {
		s.fail("invalid literal")
		return
	}
	s.i += len(lit)
}

// array calls elem for each element of the array that is next (none for
// null); elem must consume exactly one value.
func (s *listingScan) array(elem func()) {
	if s.null() || s.err != nil {
		return
	}
	if s.ws() != '[' {
		s.fail("expected an array")
		return
	}
	if !s.deeper() {
		return
	}
	defer s.shallower()
	s.i++
	if s.ws() == ']' {
		s.i++
		return
	}
	for s.err == nil {
		elem()
		switch s.ws() {
		case ',':
			s.i++
		case ']':
			s.i++
			return
		default:
			s.fail("expected , or ] in an array")
		}
	}
}

// object calls member with each key of the object that is next (none for
// null); member must consume exactly one value (skip, for a key it does not
// keep). A key's bytes are valid only during the call.
func (s *listingScan) object(member func(key []byte)) {
	if s.null() || s.err != nil {
		return
	}
	if s.ws() != '{' {
		s.fail("expected an object")
		return
	}
	if !s.deeper() {
		return
	}
	defer s.shallower()
	s.i++
	if s.ws() == '}' {
		s.i++
		return
	}
	for s.err == nil {
		if s.ws() != '"' {
			s.fail("expected a key")
			return
		}
		key := s.key()
		if s.ws() != ':' {
			s.fail("expected : after a key")
			return
		}
		s.i++
		if s.err != nil {
			return
		}
		member(key)
		switch s.ws() {
		case ',':
			s.i++
		case '}':
			s.i++
			return
		default:
			s.fail("expected , or } in an object")
		}
	}
}

// deeper enters an array or an object, failing past maxListingDepth.
func (s *listingScan) deeper() bool {
	if s.depth++; s.depth > maxListingDepth {
		s.fail("nested too deeply")
		return false
	}
	return true
}

func (s *listingScan) shallower() { s.depth-- }

// quoted scans the string that is next and returns where its bytes lie
// between the quotes (s.b[start:end]), and whether it must be unquoted by
// encoding/json (it holds an escape or bytes outside ASCII).
func (s *listingScan) quoted() (start, end int, slow bool) {
	if s.ws() != '"' {
		s.fail("expected a string")
		return 0, 0, false
	}
	start = s.i + 1
	for i := start; i < len(s.b); i++ {
		switch c := s.b[i]; {
		case c == '"':
			s.i = i + 1
			return start, i, slow
		case c == '\\':
			slow = true
			n := escapeLen(s.b[i:])
			if n == 0 {
				s.i = i
				s.fail("invalid escape in a string")
				return 0, 0, false
			}
			i += n - 1
		case c < 0x20:
			s.i = i
			s.fail("control character in a string")
			return 0, 0, false
		case c >= utf8.RuneSelf:
			slow = true
		}
	}
	s.i = len(s.b)
	s.fail("unterminated string")
	return 0, 0, false
}

// escapeLen is the length of the escape b starts with (b[0] is a
// backslash), 0 if JSON has no such escape.
func escapeLen(b []byte) int {
	if len(b) < 2 {
		return 0
	}
	switch b[1] {
	case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
		return 2
	case 'u':
		if len(b) < 6 {
			return 0
		}
		for _, c := range b[2:6] {
			if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F') {
				return 0
			}
		}
		return 6
	}
	return 0
}

// unquote decodes the string s.b[start:end] (between its quotes) as
// encoding/json does: escapes resolved, invalid UTF-8 replaced.
func (s *listingScan) unquote(start, end int) string {
	var out string
	if err := json.Unmarshal(s.b[start-1:end+1], &out); err != nil {
		s.fail("invalid string: " + err.Error())
		return ""
	}
	return out
}

// key returns the next key's bytes, unquoted.
func (s *listingScan) key() []byte {
	start, end, slow := s.quoted()
	if slow && s.err == nil {
		return []byte(s.unquote(start, end))
	}
	return s.b[start:end]
}

// str decodes the next value as a string ("" for null).
func (s *listingScan) str() string {
	if s.null() || s.err != nil {
		return ""
	}
	start, end, slow := s.quoted()
	switch {
	case s.err != nil:
		return ""
	case slow:
		return s.unquote(start, end)
	}
	return string(s.b[start:end])
}

// shared is str for strings that repeat across entries: each is kept once.
func (s *listingScan) shared() string {
	if s.null() || s.err != nil {
		return ""
	}
	start, end, slow := s.quoted()
	switch {
	case s.err != nil:
		return ""
	case slow:
		return s.in.of(s.unquote(start, end))
	}
	if v, ok := s.in[string(s.b[start:end])]; ok {
		return v
	}
	return s.in.of(string(s.b[start:end]))
}

// number returns the next number's bytes, held to JSON's grammar: an
// optional minus, an integer without leading zeros, an optional fraction
// and an optional exponent.
func (s *listingScan) number() []byte {
	s.ws()
	start := s.i
	if s.at('-') {
		s.i++
	}
	switch {
	case s.at('0'):
		s.i++
	case s.digits() == 0:
		s.fail("expected a number")
		return nil
	}
	if s.at('.') {
		s.i++
		if s.digits() == 0 {
			s.fail("expected digits after a decimal point")
			return nil
		}
	}
	if s.at('e') || s.at('E') {
		s.i++
		if s.at('+') || s.at('-') {
			s.i++
		}
		if s.digits() == 0 {
			s.fail("expected digits in an exponent")
			return nil
		}
	}
	return s.b[start:s.i]
}

func (s *listingScan) at(c byte) bool { return s.i < len(s.b) && s.b[s.i] == c }

// digits consumes a run of decimal digits and reports its length.
func (s *listingScan) digits() int {
	start := s.i
	for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
		s.i++
	}
	return s.i - start
}

// uint decodes the next value as an unsigned integer (0 for null).
func (s *listingScan) uint() uint64 {
	if s.null() || s.err != nil {
		return 0
	}
	n, err := strconv.ParseUint(string(s.number()), 10, 64)
	if err != nil && s.err == nil {
		s.fail("not an unsigned integer")
	}
	return n
}

// int decodes the next value as an integer (0 for null).
func (s *listingScan) int() int {
	if s.null() || s.err != nil {
		return 0
	}
	n, err := strconv.ParseInt(string(s.number()), 10, strconv.IntSize)
	if err != nil && s.err == nil {
		s.fail("not an integer")
	}
	return int(n)
}

// strings decodes the next value as an array of strings (nil for null).
func (s *listingScan) strings() []string {
	if s.null() {
		return nil
	}
	out := []string{}
	s.array(func() { out = append(out, s.shared()) })
	return out
}

// meta decodes the next value as an object of strings (nil for null): its
// keys are kept once per listing, its values not.
func (s *listingScan) meta() map[string]string {
	if s.null() {
		return nil
	}
	out := make(map[string]string, 8)
	s.object(func(key []byte) {
		k, ok := s.in[string(key)]
		if !ok {
			k = s.in.of(string(key))
		}
		out[k] = s.str()
	})
	return out
}

// skip consumes the next value whatever it is.
func (s *listingScan) skip() {
	switch s.ws() {
	case '"':
		s.quoted()
	case '{':
		s.object(func([]byte) { s.skip() })
	case '[':
		s.array(s.skip)
	case 't':
		s.literal("true")
	case 'f':
		s.literal("false")
	case 'n':
		s.literal("null")
	case 0:
		s.fail("unexpected end")
	default:
		s.number()
	}
}

// decodeCheckListing decodes the answer to /v1/health/state/:state: of each
// check its node, id, status, output, service id and name, and indexes.
// The fast path reads one on every lapse, before the set goes out: through
// encoding/json (its Decoder's buffer grown from nothing, reflection) it
// allocated ~100 KB of the ~1 MB serve allocated per lapse at 1,000 streams
// (BENCHMARKS.md, "Lapse marks after the pushes, and fewer allocations per
// lapse").
func decodeCheckListing(b []byte) (api.HealthChecks, error) {
	s := newListingScan(b)
	out := s.healthChecks()
	if s.end(); s.err != nil {
		return nil, fmt.Errorf("checks: %w", s.err)
	}
	return out, nil
}

// decodeCatalogListing decodes the answer to /v1/catalog/service/:service:
// of each entry its node, node address, service id, address, port, tags,
// metadata and indexes.
func decodeCatalogListing(b []byte) ([]*api.CatalogService, error) {
	return decodeListing(b, "catalog", func(s *listingScan, n *api.CatalogService, key []byte) {
		switch string(key) {
		case "Node":
			n.Node = s.shared()
		case "Address":
			n.Address = s.shared()
		case "ServiceID":
			n.ServiceID = s.str()
		case "ServiceName":
			n.ServiceName = s.shared()
		case "ServiceAddress":
			n.ServiceAddress = s.shared()
		case "ServicePort":
			n.ServicePort = s.int()
		case "ServiceTags":
			n.ServiceTags = s.strings()
		case "ServiceMeta":
			n.ServiceMeta = s.meta()
		case "CreateIndex":
			n.CreateIndex = s.uint()
		case "ModifyIndex":
			n.ModifyIndex = s.uint()
		default:
			s.skip()
		}
	})
}

// decodeHealthListing decodes the answer to /v1/health/service/:service:
// of each entry its node's name and address, its service's id, address,
// port, tags, metadata and indexes, and its checks (node, id, service id
// and name, status, output, indexes).
func decodeHealthListing(b []byte) ([]*api.ServiceEntry, error) {
	return decodeListing(b, "health", func(s *listingScan, e *api.ServiceEntry, key []byte) {
		switch string(key) {
		case "Node":
			e.Node = s.healthNode()
		case "Service":
			e.Service = s.healthService()
		case "Checks":
			e.Checks = s.healthChecks()
		default:
			s.skip()
		}
	})
}

// decodeListing decodes b, an array of entries (each an object or null),
// with member reading each key of an entry into it (skip for the others).
func decodeListing[T any](
	b []byte, what string, member func(s *listingScan, v *T, key []byte),
) ([]*T, error) {
	s := newListingScan(b)
	out := list(s, func(v *T, key []byte) { member(s, v, key) })
	if s.end(); s.err != nil {
		return nil, fmt.Errorf("%s: %w", what, s.err)
	}
	return out, nil
}

// list decodes the next value as an array of objects or nulls (nil for
// null), member reading each key of an object into its entry.
func list[T any](s *listingScan, member func(v *T, key []byte)) []*T {
	if s.null() {
		return nil
	}
	out := []*T{}
	s.array(func() {
		if s.null() {
			out = append(out, nil)
			return
		}
		v := new(T)
		s.object(func(key []byte) { member(v, key) })
		out = append(out, v)
	})
	return out
}

func (s *listingScan) healthNode() *api.Node {
	if s.null() {
		return nil
	}
	n := &api.Node{}
	s.object(func(key []byte) {
		switch string(key) {
		case "Node":
			n.Node = s.shared()
		case "Address":
			n.Address = s.shared()
		case "Datacenter":
			n.Datacenter = s.shared()
		default:
			s.skip()
		}
	})
	return n
}

func (s *listingScan) healthService() *api.AgentService {
	if s.null() {
		return nil
	}
	v := &api.AgentService{}
	s.object(func(key []byte) {
		switch string(key) {
		case "ID":
			v.ID = s.str()
		case "Service":
			v.Service = s.shared()
		case "Address":
			v.Address = s.shared()
		case "Port":
			v.Port = s.int()
		case "Tags":
			v.Tags = s.strings()
		case "Meta":
			v.Meta = s.meta()
		case "CreateIndex":
			v.CreateIndex = s.uint()
		case "ModifyIndex":
			v.ModifyIndex = s.uint()
		default:
			s.skip()
		}
	})
	return v
}

func (s *listingScan) healthChecks() api.HealthChecks {
	return list(s, func(c *api.HealthCheck, key []byte) {
		switch string(key) {
		case "Node":
			c.Node = s.shared()
		case "CheckID":
			c.CheckID = s.str()
		case "Status":
			c.Status = s.shared()
		case "Output":
			c.Output = s.str()
		case "ServiceID":
			c.ServiceID = s.str()
		case "ServiceName":
			c.ServiceName = s.shared()
		case "CreateIndex":
			c.CreateIndex = s.uint()
		case "ModifyIndex":
			c.ModifyIndex = s.uint()
		default:
			s.skip()
		}
	})
}
