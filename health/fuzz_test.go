package health

import (
	"encoding/json"
	"maps"
	"net/url"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"
)

// FuzzParseRegistration: whatever Consul hands over, parsing never panics,
// and whatever it accepts is valid and survives a round trip through meta.
func FuzzParseRegistration(f *testing.F) {
	f.Add("transcode", "10.0.0.1", 9000, "exec-1", "s1", "3", "1.4.2", "4", "active", "zone",
		"eu-1")
	f.Add("t", "::1", 1, "a", "b", "1", "0.0.1-rc.1+build", "1", "draining", "", "")
	f.Add("bad task", "0.0.0.0", 0, "", "", "x", "latest", "-1", "gone", "a.b", "x")
	f.Fuzz(func(t *testing.T, task, address string, port int,
		inst, sess, gen, version, capacity, state, labelKey, labelValue string) {
		meta := map[string]string{
			MetaInstanceID: inst, MetaSessionID: sess, MetaGeneration: gen, MetaVersion: version,
			MetaCapacity: capacity, MetaState: state, MetaLabelPrefix + labelKey: labelValue,
			"owner": "x",
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
		if strconv.Itoa(r.Capacity) != capacity && capacity != "+"+strconv.Itoa(r.Capacity) &&
			capacity != "0"+strconv.Itoa(r.Capacity) {
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
		e := Executor{Registration: Registration{InstanceID: "a", SessionID: "s", Generation: 1,
			Task: "t", Address: "10.0.0.1", Port: 1, Version: version, Capacity: 1,
			State: StateActive, Labels: labels},
			LeaseStatus: StatusPassing, LeaseFound: true}
		v := Eligible(e, d)
		if v.Route == RouteHealthy && version != "" && d.constraint != nil && e.SemVer() == nil {
			t.Fatalf("unparseable version %q routed under %q", version, constraint)
		}
	})
}

// FuzzDispatcherKey: a key is unambiguous. It decodes back to the
// Dispatcher's normalised constraint, labels and grant, so two Dispatchers
// share a key exactly when those are equal; and a rollout mode scoped to a
// Dispatcher's own fields applies to it, with or without a grant, and to no
// set with other constraints.
func FuzzDispatcherKey(f *testing.F) {
	f.Add("", "zone", "a;zz=y", "", "", false, "", "", "zone", "a", "zz", "y", false, "")
	f.Add(">=1.0.0 || >=3.0.0", "pool", "gpu|cpu", "", "", true, "work\ntranscode", ">=1.0.0",
		"pool", "gpu", "", "", false, "")
	f.Add("", "zone", "a&tasks=work", "", "", false, "", "", "zone", "a", "", "", true, "work")
	f.Add("<2.0.0", "", "", "", "", true, "", "<2.0.0", "", "", "", "", true, "\n")
	f.Fuzz(func(t *testing.T, c1, k1, v1, k1b, v1b string, g1 bool, t1 string,
		c2, k2, v2, k2b, v2b string, g2 bool, t2 string) {
		d1, ok1 := fuzzDispatcher(c1, k1, v1, k1b, v1b, g1, t1)
		d2, ok2 := fuzzDispatcher(c2, k2, v2, k2b, v2b, g2, t2)
		for _, d := range []struct {
			d  Dispatcher
			ok bool
		}{{d1, ok1}, {d2, ok2}} {
			if d.ok {
				checkKeyDecodes(t, d.d)
				checkOwnScope(t, d.d)
			}
		}
		if !ok1 || !ok2 {
			return
		}
		sameSet := constraintOf(d1) == constraintOf(d2) && maps.Equal(d1.Labels, d2.Labels)
		same := sameSet && (d1.Tasks == nil) == (d2.Tasks == nil) &&
			slices.Equal(d1.Tasks, d2.Tasks)
		if (d1.Key() == d2.Key()) != same {
			t.Fatalf("keys %q and %q; same constraints and grant: %v", d1.Key(), d2.Key(), same)
		}
		if (d1.baseKey() == d2.baseKey()) != sameSet {
			t.Fatalf("base keys %q and %q; same constraints: %v", d1.baseKey(), d2.baseKey(),
				sameSet)
		}
		if r := scopedTo(t, d1); sameSet != (r.ModeOf(ReasonVersion, "work", d2) == ModeObserve) {
			t.Fatalf("a scope built from %q applies to %q: %v; same constraints: %v", d1.Key(),
				d2.Key(), !sameSet, sameSet)
		}
	})
}

// fuzzDispatcher builds a Dispatcher from fuzz input: up to two labels (an
// empty key: none) and, when granted, the tasks split at newlines.
func fuzzDispatcher(constraint, k1, v1, k2, v2 string, granted bool,
	tasks string) (Dispatcher, bool) {
	labels := map[string]string{}
	if k1 != "" {
		labels[k1] = v1
	}
	if k2 != "" {
		labels[k2] = v2
	}
	d, err := NewDispatcher(constraint, labels)
	if err != nil {
		return Dispatcher{}, false
	}
	if granted {
		ts := []string{}
		if tasks != "" {
			ts = strings.Split(tasks, "\n")
		}
		d = d.WithTasks(ts)
	}
	return d, true
}

func constraintOf(d Dispatcher) string {
	if d.constraint == nil {
		return ""
	}
	return d.constraint.String()
}

// checkKeyDecodes parses d's key by its grammar (the reference decoder) and
// compares with d's fields: a key that decodes to its own fields is
// injective.
func checkKeyDecodes(t *testing.T, d Dispatcher) {
	t.Helper()
	key := d.Key()
	if !strings.HasPrefix(key, d.baseKey()) || !utf8.ValidString(key) ||
		strings.ContainsFunc(key, func(r rune) bool { return !unicode.IsGraphic(r) }) {
		t.Fatalf("key %q: base %q is not its prefix, or it does not print", key, d.baseKey())
	}
	unescape := func(s string) string {
		out, err := url.PathUnescape(s) // %XX only; '+' stays
		if err != nil {
			t.Fatalf("key %q: field %q: %v", key, s, err)
		}
		return out
	}
	rest, ok := strings.CutPrefix(key, "v=")
	if !ok {
		t.Fatalf("key %q: no v= prefix", key)
	}
	base, grant, granted := strings.Cut(rest, "&")
	fields := strings.Split(base, ";")
	if got := unescape(fields[0]); got != constraintOf(d) {
		t.Fatalf("key %q: constraint decodes to %q, want %q", key, got, constraintOf(d))
	}
	labels := map[string]string{}
	for _, p := range fields[1:] {
		k, v, ok := strings.Cut(p, "=")
		if !ok {
			t.Fatalf("key %q: label %q has no '='", key, p)
		}
		labels[unescape(k)] = unescape(v)
	}
	if !maps.Equal(labels, d.Labels) || len(labels) != len(fields)-1 {
		t.Fatalf("key %q: labels decode to %q, want %q", key, labels, d.Labels)
	}
	if granted != (d.Tasks != nil) {
		t.Fatalf("key %q: granted %v, tasks %q", key, granted, d.Tasks)
	}
	if !granted {
		return
	}
	list, ok := strings.CutPrefix(grant, "tasks=")
	if !ok {
		t.Fatalf("key %q: grant %q", key, grant)
	}
	tasks := []string{}
	if list != "" {
		for _, s := range strings.Split(list, ",") {
			if s == `""` {
				s = ""
			} else if s == "" {
				t.Fatalf("key %q: an empty task not written \"\"", key)
			}
			tasks = append(tasks, unescape(s))
		}
	}
	if !slices.Equal(tasks, d.Tasks) {
		t.Fatalf("key %q: tasks decode to %q, want %q", key, tasks, d.Tasks)
	}
}

// scopedTo is a validated rollout observing the version rule for the set
// named by d's own fields, as an operator would write it.
func scopedTo(t *testing.T, d Dispatcher) *Rollout {
	t.Helper()
	r := &Rollout{Modes: []ScopedMode{{Rule: "version", Mode: ModeObserve,
		ConstraintSet: &SetSelector{VersionConstraint: d.VersionConstraint, Labels: d.Labels}}}}
	if err := r.validate(); err != nil {
		t.Fatalf("a scope from the fields of %q refused: %v", d.Key(), err)
	}
	return r
}

// checkOwnScope: a scope built from d's fields applies to d (and, through
// JSON, where the fields survive it).
func checkOwnScope(t *testing.T, d Dispatcher) {
	t.Helper()
	for _, task := range append([]string{"work"}, d.Tasks...) {
		if m := scopedTo(t, d).ModeOf(ReasonVersion, task, d); m != ModeObserve {
			t.Fatalf("a scope from its own fields does not apply to %q (task %q): %s", d.Key(),
				task, m)
		}
	}
	if !utf8.ValidString(d.VersionConstraint) ||
		slices.ContainsFunc(slices.Collect(maps.Values(d.Labels)),
			func(v string) bool { return !utf8.ValidString(v) }) {
		return // JSON would replace the invalid bytes
	}
	raw, err := json.Marshal(Rollout{Modes: []ScopedMode{{Rule: "version", Mode: ModeObserve,
		ConstraintSet: &SetSelector{VersionConstraint: d.VersionConstraint, Labels: d.Labels}}}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := ParseRollout(raw)
	if err != nil {
		t.Fatalf("%s refused: %v", raw, err)
	}
	if m := r.ModeOf(ReasonVersion, "work", d); m != ModeObserve {
		t.Fatalf("%s does not apply to %q: %s", raw, d.Key(), m)
	}
}
