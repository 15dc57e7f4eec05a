package health

import (
	"encoding/json"
	"testing"
	"time"
)

// Marks written before the unregistered time existed read as marks that
// have counted none yet; the time counted reads back as written.
func TestParseLapseMarkReadsTheUnregisteredTime(t *testing.T) {
	for _, tc := range []struct {
		name  string
		value string
		want  time.Duration
	}{
		{"an older version's mark", `{"generation":3,"at":"2024-01-02T03:04:05Z","tasks":["work"]}`,
			0},
		{"counted",
			`{"generation":3,"at":"2024-01-02T03:04:05Z","tasks":["work"],"unregistered_s":7200}`,
			2 * time.Hour},
		{"negative (edited by hand)", `{"generation":3,"unregistered_s":-5}`, 0},
		{"unreadable", `not json`, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := ParseLapseMark(LapseMarkKey("x", "s1"), []byte(tc.value))
			if err != nil {
				t.Fatal(err)
			}
			if m.InstanceID != "x" || m.SessionID != "s1" || m.Unregistered() != tc.want {
				t.Fatalf("%+v: unregistered %v, want x/s1 and %v", m, m.Unregistered(), tc.want)
			}
		})
	}
}

// WithUnregistered changes the unregistered time only: every other field
// stays, also one this version does not know (a newer replica's), so
// replicas of different versions can prune side by side.
func TestWithUnregisteredKeepsTheRestOfTheMark(t *testing.T) {
	old := `{"generation":3,"at":"2024-01-02T03:04:05Z","tasks":["work","batch"],"future":{"a":1}}`
	for _, tc := range []struct {
		name  string
		value string
		d     time.Duration
		want  string
	}{
		{"set", old, 90*time.Minute + 999*time.Millisecond,
			`{"at":"2024-01-02T03:04:05Z","future":{"a":1},"generation":3,"tasks":["work","batch"],"unregistered_s":5400}`},
		{"replaced", `{"generation":3,"unregistered_s":10}`, time.Hour,
			`{"generation":3,"unregistered_s":3600}`},
		{"zero removes it", `{"generation":3,"unregistered_s":10}`, 0, `{"generation":3}`},
		{"under a second removes it", `{"generation":3,"unregistered_s":10}`,
			999 * time.Millisecond, `{"generation":3}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := WithUnregistered([]byte(tc.value), tc.d)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tc.want {
				t.Fatalf("got %s, want %s", got, tc.want)
			}
			var m LapseMark
			if err := json.Unmarshal(got, &m); err != nil ||
				m.Unregistered() != tc.d.Truncate(time.Second) {
				t.Fatalf("reads back as %v (%v), want %v", m.Unregistered(), err,
					tc.d.Truncate(time.Second))
			}
		})
	}
}

// A value that is no JSON object is not rewritten (nothing is known of
// it) and is not readable.
func TestWithUnregisteredRefusesWhatIsNoObject(t *testing.T) {
	for _, v := range []string{``, `null`, `[1]`, `"x"`, `{`, `7`} {
		if LapseMarkReadable([]byte(v)) {
			t.Errorf("%q: readable", v)
		}
		if got, err := WithUnregistered([]byte(v), time.Hour); err == nil {
			t.Errorf("%q: rewritten as %s", v, got)
		}
	}
	if !LapseMarkReadable([]byte(`{}`)) || !LapseMarkReadable(LapseMark{Generation: 1}.Value()) {
		t.Error("a mark's value not readable")
	}
}
