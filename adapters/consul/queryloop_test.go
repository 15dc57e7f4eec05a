package consul

import "testing"

// TestQueryIndexRules: the index rules every blocking-query loop (queryLoop) follows.
func TestQueryIndexRules(t *testing.T) {
	type step struct {
		fail   bool
		next   uint64
		lost   bool   // want: Consul lost its state
		waitOn uint64 // want: the index of the next query
	}
	for _, tt := range []struct {
		name  string
		kv    bool
		steps []step
	}{
		{"grows", false, []step{{next: 5, waitOn: 5}, {next: 9, waitOn: 9}, {next: 9, waitOn: 9}}},
		{"a failure reads afresh", false, []step{{next: 5, waitOn: 5}, {fail: true, waitOn: 0},
			{next: 7, waitOn: 7}}},
		{"an index gone back is lost state, read afresh", false, []step{{next: 50, waitOn: 50},
			{next: 3, lost: true, waitOn: 0}, {next: 4, waitOn: 4}}},
		{"after a failure too", false, []step{{next: 50, waitOn: 50}, {fail: true, waitOn: 0},
			{next: 3, lost: true, waitOn: 3}}},
		{"a KV listing's index goes back with tombstones", true, []step{{next: 50, waitOn: 50},
			{next: 3, waitOn: 0}, {next: 4, waitOn: 4}, {next: 2, waitOn: 0}}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			q := queryIndex{kvListing: tt.kv}
			if !q.fresh() {
				t.Fatal("the first query is not fresh")
			}
			for i, s := range tt.steps {
				lost := false
				if s.fail {
					q.failed()
				} else {
					lost = q.answered(s.next)
				}
				if lost != s.lost || q.index != s.waitOn || q.fresh() != (s.waitOn == 0) {
					t.Fatalf("step %d (%+v): lost %v, next waits on %d", i, s, lost, q.index)
				}
			}
		})
	}
}
