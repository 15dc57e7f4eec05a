package health

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"
)

func validReg() Registration {
	return Registration{
		InstanceID: "exec-1", SessionID: "s1", Generation: 3, Task: "transcode",
		Address: "127.0.0.1", Port: 9000, Version: "1.4.2", Capacity: 4,
		State: StateActive, Labels: map[string]string{"zone": "eu-1", "gpu": "true"},
	}
}

func TestValidateNamesTheField(t *testing.T) {
	long := strings.Repeat("x", 600)
	many := map[string]string{}
	for i := range 59 {
		many["k"+strings.Repeat("a", i)] = "v"
	}
	tests := []struct {
		name   string
		mutate func(*Registration)
		fields []string
	}{
		{"valid", func(*Registration) {}, nil},
		{"hostname address", func(r *Registration) { r.Address = "exec-1.internal" }, nil},
		{"ipv6 address", func(r *Registration) { r.Address = "::1" }, nil},
		{"prerelease version", func(r *Registration) { r.Version = "2.0.0-rc.1" }, nil},
		{"empty instance", func(r *Registration) { r.InstanceID = "" }, []string{"instance_id"}},
		{"instance with slash", func(r *Registration) { r.InstanceID = "a/b" },
			[]string{"instance_id"}},
		{"instance with colon", func(r *Registration) { r.InstanceID = "a:b" },
			[]string{"instance_id"}},
		{"instance too long", func(r *Registration) { r.InstanceID = strings.Repeat("a", 129) },
			[]string{"instance_id"}},
		{"empty session", func(r *Registration) { r.SessionID = "" }, []string{"session_id"}},
		{"no generation", func(r *Registration) { r.Generation = 0 }, []string{"generation"}},
		{"empty task", func(r *Registration) { r.Task = "" }, []string{"task"}},
		{"task with underscore", func(r *Registration) { r.Task = "trans_code" }, []string{"task"}},
		{"task too long", func(r *Registration) { r.Task = strings.Repeat("t", 64) },
			[]string{"task"}},
		{"empty address", func(r *Registration) { r.Address = "" }, []string{"address"}},
		{"unspecified address", func(r *Registration) { r.Address = "0.0.0.0" },
			[]string{"address"}},
		{"garbage address", func(r *Registration) { r.Address = "not a host!" },
			[]string{"address"}},
		{"port zero", func(r *Registration) { r.Port = 0 }, []string{"port"}},
		{"port too big", func(r *Registration) { r.Port = 70000 }, []string{"port"}},
		{"bad semver", func(r *Registration) { r.Version = "1.2" }, []string{"version"}},
		{"v prefix", func(r *Registration) { r.Version = "v1.2.3" }, []string{"version"}},
		{"empty version", func(r *Registration) { r.Version = "" }, []string{"version"}},
		{"zero capacity", func(r *Registration) { r.Capacity = 0 }, []string{"capacity"}},
		{"negative capacity", func(r *Registration) { r.Capacity = -3 }, []string{"capacity"}},
		{"bad state", func(r *Registration) { r.State = "gone" }, []string{"state"}},
		{"label key with dot", func(r *Registration) { r.Labels = map[string]string{"a.b": "x"} },
			[]string{"label_a.b"}},
		{"label key empty", func(r *Registration) { r.Labels = map[string]string{"": "x"} },
			[]string{"labels"}},
		{"label key too long",
			func(r *Registration) { r.Labels = map[string]string{strings.Repeat("k", 123): "x"} },
			[]string{"label_" + strings.Repeat("k", 123)}},
		{"label value too long",
			func(r *Registration) { r.Labels = map[string]string{"zone": long} },
			[]string{"label_zone"}},
		{"too many labels", func(r *Registration) { r.Labels = many }, []string{"labels"}},
		{"several at once", func(r *Registration) { r.InstanceID = ""; r.Capacity = 0 },
			[]string{"instance_id", "capacity"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := validReg()
			tt.mutate(&r)
			err := r.Validate()
			got := Fields(err)
			if !reflect.DeepEqual(got, tt.fields) {
				t.Fatalf("fields = %v, want %v (err: %v)", got, tt.fields, err)
			}
			for _, f := range tt.fields {
				if !strings.Contains(err.Error(), f) {
					t.Errorf("error %q does not name %q", err, f)
				}
			}
		})
	}
}

func TestMetaRoundTrip(t *testing.T) {
	r := validReg()
	meta := r.Meta()
	meta["owner"] = "team-a" // operators' own meta is ignored
	got, err := ParseRegistration(r.Task, r.Address, r.Port, meta)
	if err != nil {
		t.Fatal(err)
	}
	if got.semver == nil || got.semver.Original() != r.Version {
		t.Fatalf("the version was not kept parsed: %v", got.semver)
	}
	got.semver = nil // what a registration built by hand lacks
	if !reflect.DeepEqual(got, r) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got, r)
	}
	if meta["label_zone"] != "eu-1" || meta["capacity"] != "4" || meta["state"] != "active" ||
		meta["generation"] != "3" {
		t.Fatalf("meta encoding: %v", meta)
	}
}

func TestParseRegistrationRejectsBadMeta(t *testing.T) {
	tests := []struct {
		name   string
		meta   map[string]string
		fields []string
	}{
		{"capacity not a number", map[string]string{"capacity": "four"}, []string{"capacity"}},
		{"capacity missing", map[string]string{"capacity": ""}, []string{"capacity"}},
		{"state missing", map[string]string{"state": ""}, []string{"state"}},
		{"version garbage", map[string]string{"version": "latest"}, []string{"version"}},
		{"no instance", map[string]string{"instance_id": ""}, []string{"instance_id"}},
		{"generation missing", map[string]string{"generation": ""}, []string{"generation"}},
		{"generation garbage", map[string]string{"generation": "x"}, []string{"generation"}},
		{"generation zero", map[string]string{"generation": "0"}, []string{"generation"}},
		{"replaces own session", map[string]string{"replaces": "old,s1"}, []string{"replaces"}},
		{"replaces twice", map[string]string{"replaces": "a,b,a"}, []string{"replaces"}},
		{"replaces too many", map[string]string{"replaces": "a,b,c,d"}, []string{"replaces"}},
		{"replaces an empty id", map[string]string{"replaces": "a,,b"}, []string{"replaces"}},
		{"replaces a bad id", map[string]string{"replaces": "-a"}, []string{"replaces"}},
		{"replaces with a space", map[string]string{"replaces": "a, b"}, []string{"replaces"}},
		{"lease_ttl without a unit", map[string]string{"lease_ttl": "10"}, []string{"lease_ttl"}},
		{"lease_ttl negative", map[string]string{"lease_ttl": "-5s"}, []string{"lease_ttl"}},
		{"lease_ttl zero", map[string]string{"lease_ttl": "0s"}, []string{"lease_ttl"}},
		{"lease_ttl over a day", map[string]string{"lease_ttl": "25h"}, []string{"lease_ttl"}},
		{"lease_ttl garbage", map[string]string{"lease_ttl": "soon"}, []string{"lease_ttl"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			meta := validReg().Meta()
			for k, v := range tt.meta {
				if v == "" {
					delete(meta, k)
				} else {
					meta[k] = v
				}
			}
			_, err := ParseRegistration("transcode", "127.0.0.1", 9000, meta)
			if got := Fields(err); !reflect.DeepEqual(got, tt.fields) {
				t.Fatalf("fields = %v, want %v (err: %v)", got, tt.fields, err)
			}
		})
	}
}

// A registration without a generation is told so, not reported as an
// invalid "0" that appears nowhere; one written as 0 is reported as written.
func TestMissingGenerationIsToldMissing(t *testing.T) {
	meta := validReg().Meta()
	delete(meta, MetaGeneration)
	_, err := ParseRegistration("transcode", "127.0.0.1", 9000, meta)
	if err == nil || !strings.Contains(err.Error(), "generation: missing") ||
		strings.Contains(err.Error(), `"0"`) {
		t.Fatalf("no generation: %v", err)
	}
	meta[MetaGeneration] = "0"
	if _, err := ParseRegistration("transcode", "127.0.0.1", 9000, meta); err == nil ||
		!strings.Contains(err.Error(), `generation "0": not a positive integer`) {
		t.Fatalf("generation 0: %v", err)
	}
}

// TestReplacesMeta: the optional replaces meta round-trips, an empty value
// is refused (not read as "none"), and absent means none.
func TestReplacesMeta(t *testing.T) {
	r := validReg()
	r.Replaces = []string{"s-0b", "s-0a"}
	meta := r.Meta()
	if meta[MetaReplaces] != "s-0b,s-0a" {
		t.Fatalf("replaces meta %q", meta[MetaReplaces])
	}
	got, err := ParseRegistration(r.Task, r.Address, r.Port, meta)
	if err != nil || !reflect.DeepEqual(got.Replaces, r.Replaces) {
		t.Fatalf("round trip: %v, %v", got.Replaces, err)
	}
	meta[MetaReplaces] = ""
	if _, err := ParseRegistration(r.Task, r.Address, r.Port, meta); !reflect.DeepEqual(Fields(err),
		[]string{MetaReplaces}) {
		t.Fatalf("empty replaces: %v", err)
	}
	if _, ok := validReg().Meta()[MetaReplaces]; ok {
		t.Fatal("replaces written when there is none")
	}
	long := strings.Repeat("s", maxIDLen)
	r.Replaces = []string{long[:maxIDLen-1] + "1", long[:maxIDLen-1] + "2", long[:maxIDLen-1] + "3"}
	if v := r.Meta()[MetaReplaces]; len(v) > consulMetaValueMaxLen || r.Validate() != nil {
		t.Fatalf("%d of the longest ids take %d bytes (Consul allows %d): %v", MaxReplaces, len(v),
			consulMetaValueMaxLen, r.Validate())
	}
}

// TestSemVerFollowsTheVersion: a registration keeps its version parsed,
// and a version changed since is parsed anew.
func TestSemVerFollowsTheVersion(t *testing.T) {
	r, err := ParseRegistration("transcode", "127.0.0.1", 9000, validReg().Meta())
	if err != nil || r.SemVer() == nil || r.SemVer().String() != "1.4.2" {
		t.Fatalf("parsed: %v, %v", r.SemVer(), err)
	}
	r.Version = "2.0.0"
	if v := r.SemVer(); v == nil || v.String() != "2.0.0" {
		t.Fatalf("after a change: %v", v)
	}
	r.Version = "two"
	if v := r.SemVer(); v != nil {
		t.Fatalf("an invalid version parsed as %v", v)
	}
}

func TestIDs(t *testing.T) {
	if got := ServiceID("exec-1", "transcode"); got != "transcode:exec-1" {
		t.Fatalf("ServiceID = %q", got)
	}
	id := CheckID("exec-1", "s1", "transcode")
	if id != "lease:exec-1:s1:transcode" {
		t.Fatalf("CheckID = %q", id)
	}
	inst, sess, task, ok := ParseCheckID(id)
	if !ok || inst != "exec-1" || sess != "s1" || task != "transcode" {
		t.Fatalf("ParseCheckID = %q %q %q %v", inst, sess, task, ok)
	}
	for _, bad := range []string{"serfHealth", "lease:a:b", "lease::s:t", "other:a:b:c",
		"lease:a:b:c:d"} {
		if _, _, _, ok := ParseCheckID(bad); ok {
			t.Errorf("ParseCheckID(%q) accepted", bad)
		}
	}
}

// TestLeaseTTLMeta: the optional lease_ttl meta round-trips as a Go
// duration, and absent means none.
func TestLeaseTTLMeta(t *testing.T) {
	r := validReg()
	r.LeaseTTL = 6 * time.Second
	meta := r.Meta()
	if meta[MetaLeaseTTL] != "6s" {
		t.Fatalf("meta lease_ttl %q", meta[MetaLeaseTTL])
	}
	got, err := ParseRegistration(r.Task, r.Address, r.Port, meta)
	if err != nil || got.LeaseTTL != 6*time.Second {
		t.Fatalf("parsed lease_ttl %s, %v", got.LeaseTTL, err)
	}
	delete(meta, MetaLeaseTTL)
	if got, err := ParseRegistration(r.Task, r.Address, r.Port, meta); err != nil ||
		got.LeaseTTL != 0 {
		t.Fatalf("absent lease_ttl read as %s, %v", got.LeaseTTL, err)
	}
	r.LeaseTTL = 48 * time.Hour
	if !reflect.DeepEqual(Fields(r.Validate()), []string{MetaLeaseTTL}) {
		t.Fatalf("Validate with a 48h lease_ttl: %v", r.Validate())
	}
}

// TestFiftyEightLabelsWithoutReplacesStillRead: a registration without the
// replaces key may carry 58 labels (6 contract keys + 58 fill Consul's 64 meta
// pairs). Such a registration is already in Consul (it fits, or Consul would
// have refused it), so reading it must not throw it out of routing as bad
// metadata: the pair reserved for replaces only counts when replaces is there.
// What an executor is told to write (Validate, the Registrar's configuration)
// keeps room for replaces and lease_ttl: 56 labels.
func TestFiftyEightLabelsWithoutReplacesStillRead(t *testing.T) {
	r := validReg()
	r.Labels = map[string]string{}
	for i := range consulMetaMaxPairs - 6 {
		r.Labels[fmt.Sprintf("k%02d", i)] = "v"
	}
	meta := r.Meta()
	if len(meta) != consulMetaMaxPairs {
		t.Fatalf("%d meta pairs", len(meta))
	}
	got, err := ParseRegistration(r.Task, r.Address, r.Port, meta)
	if err != nil {
		t.Fatalf("a registration of %d labels without replaces (%d meta pairs, what Consul "+
			"accepts) is refused: %v", len(r.Labels), len(meta), err)
	}
	if len(got.Labels) != len(r.Labels) {
		t.Fatalf("labels %d", len(got.Labels))
	}
	// With replaces it does not fit Consul: refused, naming the field.
	meta[MetaReplaces] = "old"
	_, err = ParseRegistration(r.Task, r.Address, r.Port, meta)
	if !reflect.DeepEqual(Fields(err), []string{"labels"}) {
		t.Fatalf("58 labels and replaces: %v", err)
	}
	// What executors are told to write keeps room for replaces and
	// lease_ttl: 56.
	if !reflect.DeepEqual(Fields(r.Validate()), []string{"labels"}) {
		t.Fatalf("Validate with 58 labels: %v", r.Validate())
	}
	if !reflect.DeepEqual(Fields(validateLabels(r.Labels, fixedMetaKeys).err()),
		[]string{"labels"}) {
		t.Fatal("validateLabels with 58 labels accepted")
	}
	delete(r.Labels, "k00")
	if !reflect.DeepEqual(Fields(r.Validate()), []string{"labels"}) {
		t.Fatalf("Validate with 57 labels: %v", r.Validate())
	}
	delete(r.Labels, "k01")
	if err := r.Validate(); err != nil {
		t.Fatalf("Validate with 56 labels: %v", err)
	}
}
