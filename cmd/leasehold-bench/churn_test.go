package main

import (
	"flag"
	"strings"
	"testing"
)

// The churn serves its task types unsharded (their size crosses the shard
// size within a pass, and light streams subscribe once) unless --shard-size
// is given.
func TestChurnServesUnshardedUnlessAsked(t *testing.T) {
	saved := *shardSize
	t.Cleanup(func() { *shardSize = saved })
	unshardedChurn()
	if *shardSize != 0 {
		t.Fatalf("--shard-size not given: %d, want 0 (unsharded)", *shardSize)
	}
	if err := flag.Set("shard-size", "500"); err != nil {
		t.Fatal(err)
	}
	unshardedChurn()
	if *shardSize != 500 {
		t.Fatalf("--shard-size 500 given: %d", *shardSize)
	}
}

// TestEqualApartIgnoresOnlyTheIgnored: converge compares the streams with
// Consul's passing set apart from the canaries.
func TestEqualApartIgnoresOnlyTheIgnored(t *testing.T) {
	set := func(ks ...string) map[string]bool {
		m := map[string]bool{}
		for _, k := range ks {
			m[k] = true
		}
		return m
	}
	ignore := set("c")
	for _, tc := range []struct {
		a, b map[string]bool
		want bool
	}{
		{set("a", "b"), set("a", "b"), true},
		{set("a", "b", "c"), set("a", "b"), true},
		{set("a", "b"), set("a", "b", "c"), true},
		{set("a"), set("a", "b"), false},
		{set("a", "b"), set("a"), false},
		{set("a", "c"), set("b", "c"), false},
		{set("a", "d"), set("a", "c"), false},
		{set(), set("c"), true},
	} {
		if got := equalApart(tc.a, tc.b, ignore); got != tc.want {
			t.Errorf("equalApart(%v, %v) = %v, want %v", tc.a, tc.b, got, tc.want)
		}
	}
}

// The churn's reported command line names --consul-dev and
// --streams-per-conn when they were given: both change what Consul and
// leasehold pay, so a result without them could not be told from the
// default run's.
func TestChurnSummaryNamesTheConsulServerAndStreamsPerConn(t *testing.T) {
	savedDev, savedPer := *consulDev, *streamsPerConn
	t.Cleanup(func() { *consulDev, *streamsPerConn = savedDev, savedPer })
	if s := churnSummary(nil); strings.Contains(s, "--consul-dev") ||
		strings.Contains(s, "--streams-per-conn") {
		t.Fatalf("the defaults named: %q", s)
	}
	*consulDev, *streamsPerConn = true, 1
	s := churnSummary(nil)
	for _, want := range []string{" --consul-dev", " --streams-per-conn 1"} {
		if !strings.Contains(s, want) {
			t.Errorf("summary lacks %q: %q", want, s)
		}
	}
}
