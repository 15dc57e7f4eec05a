package main

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/server"
)

// TestServeRestartKeepsCallsFlowing is the leasehold-restart drill: the
// server is stopped and started again on the same address while a grpc-go
// dispatcher calls executors. Calls go on through the outage (the client
// keeps its last config), the client reconnects, and the restarted server
// serves the same versions for the same state.
func TestServeRestartKeepsCallsFlowing(t *testing.T) {
	a := consultest.Start(t)
	startExecutor(t, a, "e1", "1.0.0")
	startExecutor(t, a, "e2", "1.0.0")
	run := func(xdsAddr, adminAddr string) (listening, context.CancelFunc, chan error) {
		ctx, cancel := context.WithCancel(context.Background())
		bound := make(chan listening, 1)
		served := make(chan error, 1)
		cfg := &serveConfig{consulAddr: a.HTTPAddr(), xdsAddr: xdsAddr,
			adminAddr: adminAddr, tag: "leasehold", consulMaxConns: 8}
		go func() {
			served <- serve(ctx, cfg,
				slog.New(slog.NewTextHandler(testWriter{t, "serve"}, nil)), bound)
		}()
		select {
		case l := <-bound:
			return l, cancel, served
		case err := <-served:
			t.Fatalf("serve: %v", err)
		}
		return listening{}, cancel, served
	}
	first, stop, served := run("127.0.0.1:0", "127.0.0.1:0")
	before := edsVersions(t, first.xds)
	d := startDispatcher(t, first.xds, "dispatcher", map[string]any{})
	start := time.Now()
	d.await(t, start, 20*time.Second, "calls to e1 and e2", func(cs []callResult) bool {
		m := servedBy(cs)
		return m["e1"] > 0 && m["e2"] > 0
	})

	stop() // leasehold goes away
	if err := <-served; err != nil {
		t.Fatal(err)
	}
	down := time.Now()
	d.await(t, down.Add(time.Second), 10*time.Second, "calls while leasehold is down",
		func(cs []callResult) bool {
			m := servedBy(cs)
			return m["e1"] > 5 && m["e2"] > 5
		})
	for _, c := range d.since(down) {
		if c.Err != "" {
			t.Fatalf("call failed while leasehold was down: %s", c.Err)
		}
	}

	second, stop2, served2 := run(first.xds, first.admin) // same address: clients reconnect to it
	t.Cleanup(func() { stop2(); <-served2 })
	after := edsVersions(t, second.xds)
	if after != before {
		t.Fatalf("versions after restart %q differ from before %q for the same state",
			after, before)
	}
	// the dispatcher reconnects to the restarted server
	deadline := time.Now().Add(30 * time.Second)
	for {
		var ds struct {
			Dispatchers []server.StreamInfo `json:"dispatchers"`
		}
		getBody(t, "http://"+second.admin+"/debug/dispatchers", &ds)
		found := false
		for _, s := range ds.Dispatchers {
			found = found || s.NodeID == "dispatcher"
		}
		if found {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the dispatcher never reconnected")
		}
		<-time.After(100 * time.Millisecond) // /debug has no watch API
	}
	up := time.Now()
	d.await(t, up, 15*time.Second, "calls after the restart", func(cs []callResult) bool {
		m := servedBy(cs)
		return m["e1"] > 0 && m["e2"] > 0
	})
	for _, c := range d.since(down) {
		if c.Err != "" {
			t.Fatalf("call failed across the restart: %s", c.Err)
		}
	}
}
