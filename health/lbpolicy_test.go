package health

import (
	"strings"
	"testing"
)

func TestRolloutLoadBalancing(t *testing.T) {
	r, err := ParseRollout([]byte(`{"modes":[],"load_balancing":{"default":"round_robin","tasks":{"batch":"least_request"}}}`))
	if err != nil {
		t.Fatal(err)
	}
	for task, want := range map[string]LBPolicy{"batch": LBLeastRequest, "work": LBRoundRobin} {
		if got := r.LBPolicyOf(task, LBWeightedRoundRobin); got != want {
			t.Errorf("%s: %s, want %s", task, got, want)
		}
	}
	var none *Rollout
	if got := none.LBPolicyOf("work", LBLeastRequest); got != LBLeastRequest {
		t.Errorf("no rollout: %s, want the server's default", got)
	}
	noDefault, err := ParseRollout([]byte(`{"load_balancing":{"tasks":{"batch":"round_robin"}}}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := noDefault.LBPolicyOf("work", LBWeightedRoundRobin); got != LBWeightedRoundRobin {
		t.Errorf("no default in the rollout: %s, want the server's", got)
	}

	for _, tt := range []struct{ json, field string }{
		{`{"load_balancing":{"default":"random"}}`, "load_balancing.default"},
		{`{"load_balancing":{"tasks":{"batch":"maglev"}}}`, `load_balancing.tasks["batch"]`},
		{`{"load_balancing":{"tasks":{"bad task":"round_robin"}}}`,
			`load_balancing.tasks["bad task"]`},
		{`{"load_balancing":{"policy":"round_robin"}}`, "policy"},
	} {
		_, err := ParseRollout([]byte(tt.json))
		if err == nil || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("%s: %v, want an error naming %s", tt.json, err, tt.field)
		}
	}
}

// TestHugeLoadBalancingMapIsRefusedNamingTheField: a huge load_balancing map
// of invalid task names is refused with an error of bounded size per entry
// (values are cut), every bad entry named.
func TestHugeLoadBalancingMapIsRefusedNamingTheField(t *testing.T) {
	var b strings.Builder
	b.WriteString(`{"load_balancing":{"tasks":{`)
	for i := range 2000 {
		if i > 0 {
			b.WriteString(",")
		}
		name := "bad_" + strings.Repeat("x",
			100) + string(rune('a'+i%26)) + "_" + strings.Repeat("y", i%7)
		b.WriteString(`"` + name + `":"round_robin"`)
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
