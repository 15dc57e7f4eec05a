package consul

import (
	"testing"

	"github.com/hashicorp/consul/api"
)

// TestSentControlSendsWhatChanged: the control watch sends the rules at
// the first listing (none: a nil Raw), the cordons once there are any, then
// each only when it changed; no rules key (nil) and an empty one are told
// apart.
func TestSentControlSendsWhatChanged(t *testing.T) {
	var st sentControl
	rules := &api.KVPair{Key: RulesKey, Value: []byte(`{"modes":[]}`)}
	cordon := &api.KVPair{Key: CordonPrefix + "c-1", Value: []byte(`{"id":"c-1"}`)}
	type want struct{ rules, cordons bool }
	for i, step := range []struct {
		pairs api.KVPairs
		want  want
	}{
		// The first listing: the rules (no cordon yet: nothing to send).
		{api.KVPairs{rules}, want{true, false}},
		{api.KVPairs{rules}, want{false, false}},                  // unchanged
		{api.KVPairs{rules, cordon}, want{false, true}},           // a cordon
		{api.KVPairs{cordon}, want{true, false}},                  // the rules key deleted
		{api.KVPairs{{Key: RulesKey}, cordon}, want{true, false}}, // an empty rules key: not "none"
		{api.KVPairs{{Key: RulesKey}}, want{false, true}},         // the cordon lifted
	} {
		var got want
		for _, o := range st.changes(step.pairs, uint64(10+i)) {
			switch {
			case o.Rules() != nil:
				got.rules = true
				if o.Rules().Source != "consul-kv:"+RulesKey {
					t.Errorf("step %d: rules source %q", i, o.Rules().Source)
				}
			case o.Cordons() != nil:
				got.cordons = true
				if o.Cordons().Index != uint64(10+i) {
					t.Errorf("step %d: cordons at index %d", i, o.Cordons().Index)
				}
			}
		}
		if got != step.want {
			t.Errorf(
				"step %d: sent rules %v, cordons %v; want %+v",
				i,
				got.rules,
				got.cordons,
				step.want,
			)
		}
	}
}
