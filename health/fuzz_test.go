package health

import (
	"reflect"
	"strconv"
	"testing"
)

// FuzzParseRegistration: whatever Consul hands over, parsing never panics,
// and whatever it accepts is valid and survives a round trip through meta.
func FuzzParseRegistration(f *testing.F) {
	f.Add("transcode", "10.0.0.1", 9000, "exec-1", "s1", "3", "1.4.2", "4", "active", "zone", "eu-1")
	f.Add("t", "::1", 1, "a", "b", "1", "0.0.1-rc.1+build", "1", "draining", "", "")
	f.Add("bad task", "0.0.0.0", 0, "", "", "x", "latest", "-1", "gone", "a.b", "x")
	f.Fuzz(func(t *testing.T, task, address string, port int, inst, sess, gen, version, capacity, state, labelKey, labelValue string) {
		meta := map[string]string{
			MetaInstanceID: inst, MetaSessionID: sess, MetaGeneration: gen, MetaVersion: version,
			MetaCapacity: capacity, MetaState: state, MetaLabelPrefix + labelKey: labelValue, "owner": "x",
		}
		r, err := ParseRegistration(task, address, port, meta)
		if err != nil {
			if len(Fields(err)) == 0 {
				t.Fatalf("error names no field: %v", err)
			}
			return
		}
		if err := r.Validate(); err != nil {
			t.Fatalf("accepted but invalid: %v", err)
		}
		back, err := ParseRegistration(task, address, port, r.Meta())
		if err != nil || !reflect.DeepEqual(back, r) {
			t.Fatalf("round trip: %+v vs %+v (%v)", back, r, err)
		}
		if strconv.Itoa(r.Capacity) != capacity && capacity != "+"+strconv.Itoa(r.Capacity) && capacity != "0"+strconv.Itoa(r.Capacity) {
			// Atoi accepts a sign and leading zeros; anything else must match
			if n, _ := strconv.Atoi(capacity); n != r.Capacity {
				t.Fatalf("capacity %q parsed as %d", capacity, r.Capacity)
			}
		}
	})
}

// FuzzNewDispatcher: constraint sets from node metadata never panic; equal
// inputs give equal keys; an accepted set decides every version without
// panicking.
func FuzzNewDispatcher(f *testing.F) {
	f.Add(">=1.4.0, <2.0.0", "zone", "eu-1", "1.5.0")
	f.Add("~1.2 || ^3", "", "", "3.1.4")
	f.Add(">= banana", "a.b", "x", "not-semver")
	f.Fuzz(func(t *testing.T, constraint, key, value, version string) {
		labels := map[string]string{key: value}
		d, err := NewDispatcher(constraint, labels)
		if err != nil {
			if len(Fields(err)) == 0 {
				t.Fatalf("error names no field: %v", err)
			}
			return
		}
		d2, _ := NewDispatcher(constraint, labels)
		if d.Key() != d2.Key() {
			t.Fatal("key not stable")
		}
		e := Executor{Registration: Registration{InstanceID: "a", SessionID: "s", Generation: 1, Task: "t", Address: "10.0.0.1", Port: 1, Version: version, Capacity: 1, State: StateActive, Labels: labels},
			Lease: StatusPassing, LeaseFound: true}
		v := Eligible(e, d)
		if v.Route == RouteHealthy && version != "" && d.constraint != nil && parsedVersion(version) == nil {
			t.Fatalf("unparseable version %q routed under %q", version, constraint)
		}
	})
}
