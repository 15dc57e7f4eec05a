package server

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// TestAttack20cExplainShowsReplaces: /debug/executors (and so `leasehold
// explain`) shows every contract field of a registration but not its
// replaces meta, the one that makes sessions leasehold never saw STALE: an
// operator asking why a session is answered STALE after a restart cannot
// see which registration names it.
func TestAttack20cExplainShowsReplaces(t *testing.T) {
	m := member("work", "a", 9001, "1.0.0")
	m.Replaces = []string{"s-old"}
	v := fleet.NewView([]health.Executor{health.Join(m, health.NewNonPassingSet(health.NonPassing{}))})
	b, err := json.Marshal(explainExecutors(v, "work"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), "s-old") {
		t.Fatalf("/debug/executors does not show the replaces meta: %s", b)
	}
}
