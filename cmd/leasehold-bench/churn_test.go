package main

import (
	"flag"
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
