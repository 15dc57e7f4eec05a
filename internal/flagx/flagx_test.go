package flagx

import (
	"reflect"
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
