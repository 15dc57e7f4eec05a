package main

import (
	"testing"
	"time"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
)

// TestWrongLabelsNeverCalled: a dispatcher selecting zone=eu never reaches an
// executor labelled zone=us, also after that executor restarts (a new
// session) and while the eu one is replaced.
func TestWrongLabelsNeverCalled(t *testing.T) {
	a := consultest.Start(t)
	eu := startExecutor(t, a, "eu", "1.0.0", "zone=eu")
	us := startExecutor(t, a, "us", "1.0.0", "zone=us")
	addrs := startServe(t, a)
	d := startDispatcher(t, addrs.xds, "eu-dispatcher",
		map[string]any{"labels": map[string]any{"zone": "eu"}})
	start := time.Now()
	d.await(t, start, 20*time.Second, "calls to eu", func(cs []callResult) bool {
		return servedBy(cs)["eu"] > 10
	})
	// registration changes: us restarts under a new session, eu is replaced
	us.stop()
	<-us.reg.Done()
	startExecutor(t, a, "us", "1.0.0", "zone=us")
	eu.stop()
	<-eu.reg.Done()
	eu2 := startExecutor(t, a, "eu", "1.0.0", "zone=eu")
	d.await(t, time.Now(), 20*time.Second, "calls to the new eu session",
		func(cs []callResult) bool {
			for _, c := range cs {
				if c.Instance == "eu" && c.Session == eu2.reg.Session().ID {
					return true
				}
			}
			return false
		})
	if n := servedBy(d.since(start))["us"]; n > 0 {
		t.Fatalf("the eu dispatcher reached the us executor %d times", n)
	}
}
