package health

import (
	"strings"
	"testing"
)

// A rules document is one JSON object: what follows it is not ignored (an
// operator who pasted two documents, or a truncated edit, gets an error, not
// the first half silently applied).
func TestAttack16RulesTrailingContentRefused(t *testing.T) {
	for _, doc := range []string{
		`{"load_balancing":{"default":"round_robin"}} {"load_balancing":{"default":"least_request"}}`,
		`{"load_balancing":{"default":"round_robin"}}]`,
		`{"load_balancing":{"default":"round_robin"}} garbage`,
	} {
		if _, err := ParseRollout([]byte(doc)); err == nil {
			t.Errorf("%s: accepted", doc)
		}
	}
	for _, doc := range []string{"{}\n", "  {\"load_balancing\":null}  \n\t"} {
		if _, err := ParseRollout([]byte(doc)); err != nil {
			t.Errorf("%q: %v", doc, err)
		}
	}
}

// A huge load_balancing map of invalid task names is refused with an error
// of bounded size per entry (values are cut), every bad entry named.
func TestAttack16HugeLoadBalancingMap(t *testing.T) {
	var b strings.Builder
	b.WriteString(`{"load_balancing":{"tasks":{`)
	for i := range 2000 {
		if i > 0 {
			b.WriteString(",")
		}
		b.WriteString(`"bad_` + strings.Repeat("x", 100) + string(rune('a'+i%26)) + `_` + strings.Repeat("y", i%7) + `":"round_robin"`)
	}
	b.WriteString(`}}}`)
	_, err := ParseRollout([]byte(b.String()))
	if err == nil {
		t.Fatal("accepted")
	}
	if !strings.Contains(err.Error(), "load_balancing.tasks[") {
		t.Fatalf("error does not name the field: %.200s", err)
	}
}
