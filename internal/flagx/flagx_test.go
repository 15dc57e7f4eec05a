package flagx

import (
	"reflect"
	"strings"
	"testing"
)

func TestList(t *testing.T) {
	var l List
	for _, v := range []string{"a,b", " c ", ",,"} {
		if err := l.Set(v); err != nil {
			t.Fatal(err)
		}
	}
	if !reflect.DeepEqual([]string(l), []string{"a", "b", "c"}) {
		t.Fatalf("list = %v", l)
	}
}

func TestLabels(t *testing.T) {
	l := Labels{}
	if err := l.Set("zone=eu=1"); err != nil || l["zone"] != "eu=1" {
		t.Fatalf("set: %v %v", err, l)
	}
	if err := l.Set("empty="); err != nil || l["empty"] != "" {
		t.Fatalf("empty value: %v", err)
	}
	for _, bad := range []string{"zone=again", "novalue", "=x"} {
		if err := l.Set(bad); err == nil {
			t.Errorf("accepted %q", bad)
		}
	}
}

// Once takes its first value and refuses a second, naming both and saying
// what to do instead; its String is the default until it is set.
func TestOnceRefusesASecondValue(t *testing.T) {
	v := "default"
	o := &Once{V: &v, Hint: "use one"}
	if o.String() != "default" {
		t.Fatalf("String() = %q before Set", o.String())
	}
	if err := o.Set("a"); err != nil || v != "a" {
		t.Fatalf("first Set: %v, value %q", err, v)
	}
	err := o.Set("b")
	if err == nil || v != "a" || !strings.Contains(err.Error(), `"a", then "b"`) ||
		!strings.Contains(err.Error(), "use one") {
		t.Fatalf("second Set: %v, value %q", err, v)
	}
}
