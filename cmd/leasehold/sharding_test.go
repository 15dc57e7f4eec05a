package main

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/snapshot/translator"
)

// A real grpc-go xds:/// dispatcher routes through a sharded task type
// (--shard-size 2, six executors: three shards behind one weighted route):
// calls reach every executor of every shard about evenly, since the shards
// weigh their capacity; a lapsed executor is never called after its lapse;
// a shard whose every executor lapsed takes no calls, and no call fails
// once the route has left it out; grpc-go NACKs nothing on the way.
func TestADispatcherRoutesThroughShards(t *testing.T) {
	a := consultest.Start(t)
	a.SettleSync()
	c := a.Client()
	const shards = 3
	names := make([]string, 6)
	for i := range names {
		names[i] = fmt.Sprintf("sh-%d", i)
	}
	byShard := map[int][]string{}
	for _, n := range names {
		s := translator.ShardOf(n, shards)
		byShard[s] = append(byShard[s], n)
	}
	execs := map[string]*e2eExecutor{}
	for _, n := range names {
		execs[n] = startExecutor(t, a, n, "1.0.0")
	}
	addrs := startServeTo(t, a, testWriter{t, "serve"},
		func(c *serveConfig) { c.shardSize = 2 })
	start := time.Now()
	d := startDispatcher(t, addrs.xds, "dispatcher-shards", map[string]any{})
	d.await(t, start, 30*time.Second, "calls to every executor of every shard",
		func(cs []callResult) bool {
			m := servedBy(cs)
			for _, n := range names {
				if m[n] == 0 {
					return false
				}
			}
			return true
		})
	t.Logf("shards: %v", byShard)

	// explain names the shard an executor is sent in.
	var out, errOut bytes.Buffer
	if code := runExplain(context.Background(),
		[]string{"--admin-addr", addrs.admin, "--instance", "sh-0"}, &out, &errOut); code != 0 {
		t.Fatalf("explain --instance sh-0: exit %d: %s", code, errOut.String())
	}
	if want := "in shard " + translator.ShardName("work", translator.ShardOf("sh-0", shards),
		shards); !strings.Contains(out.String(), want) {
		t.Fatalf("explain --instance sh-0 does not say %q:\n%s", want, out.String())
	}

	// Spread: over two seconds each executor gets within 1.6× of a sixth.
	// Shards weighed alike would give a lone executor's shard as much as one
	// of four (2× and ½× a sixth).
	from := time.Now()
	d.await(t, from, 10*time.Second, "two seconds of calls",
		func(cs []callResult) bool { return time.Since(from) > 2*time.Second })
	m := servedBy(d.since(from))
	total := 0
	for _, n := range names {
		total += m[n]
	}
	for _, n := range names {
		if fair := float64(total) / float64(len(names)); float64(m[n]) < fair/1.6 ||
			float64(m[n]) > 1.6*fair {
			t.Fatalf("calls per executor %v: %s far from a fair %.0f (shards %v)", m, n, fair,
				byShard)
		}
	}

	// One executor of the largest shard lapses: never called after it.
	largest := 0
	for s := range byShard {
		if len(byShard[s]) > len(byShard[largest]) {
			largest = s
		}
	}
	one := byShard[largest][0]
	execs[one].silent.Store(true)
	lapsed := awaitCheck(t, c, one, api.HealthCritical)
	margin := lapsed.Add(300 * time.Millisecond)
	d.await(t, time.Now().Add(time.Second), 10*time.Second, "calls after the lapse",
		func(cs []callResult) bool { return len(cs) > 50 })
	if n := servedBy(d.since(margin))[one]; n > 0 {
		t.Fatalf("%d calls reached %s more than 300ms after its lease lapsed", n, one)
	}

	// Every executor of another shard lapses: it takes no calls, and none
	// fails, once the route leaves it out.
	var emptied int
	for s := range shards {
		if s != largest && len(byShard[s]) > 0 {
			emptied = s
			break
		}
	}
	var last time.Time
	for _, n := range byShard[emptied] {
		execs[n].silent.Store(true)
	}
	for _, n := range byShard[emptied] {
		if at := awaitCheck(t, c, n, api.HealthCritical); at.After(last) {
			last = at
		}
	}
	margin = last.Add(300 * time.Millisecond)
	d.await(t, time.Now().Add(2*time.Second), 10*time.Second, "calls after the shard emptied",
		func(cs []callResult) bool { return len(cs) > 100 })
	after := d.since(margin)
	served := servedBy(after)
	for _, n := range byShard[emptied] {
		if served[n] > 0 {
			t.Fatalf("%d calls reached %s of the emptied shard %d", served[n], n, emptied)
		}
	}
	var failed []callResult
	for _, cr := range after {
		if cr.Err != "" {
			failed = append(failed, cr)
		}
	}
	if len(failed) > 0 {
		t.Fatalf("%d of %d calls failed after shard %d emptied: %v", len(failed), len(after),
			emptied, tail(failed, 3))
	}
	live := 0
	for _, n := range names {
		if served[n] > 0 {
			live++
			if n == one || slices.Contains(byShard[emptied], n) {
				t.Fatalf("lapsed %s called", n)
			}
		}
	}
	if live == 0 {
		t.Fatal("no executor called after the shard emptied")
	}
	if f := scrape(t, addrs.admin)["leasehold_xds_nacks_total"]; f != nil && sum(f) > 0 {
		t.Fatalf("grpc-go NACKed %v responses of the sharded task", sum(f))
	}
}
