package consultest

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
)

// dc2's only server frozen (Freeze: SIGSTOP) behind WAN federation, read
// through dc1's client agent with ?dc=dc2 — what a watcher of a remote
// datacenter sees when that datacenter is partitioned. It measures and logs;
// it asserts only that dc1 is unaffected, that dc2 reads fail while frozen,
// and that they work again soon after Thaw.
//
// Consul 1.13.9 as measured (dev servers; the cross-DC numbers come from
// Consul's defaults, not from dev mode):
//   - a non-blocking read hangs until the dc1 server's pooled yamux session
//     to dc2 fails its keepalive (a ping every 30 s, 10 s to answer), then
//     fails with 500 "rpc error making call: rpc error making call: EOF":
//     10–40 s depending on the session's age (limits.rpc_client_timeout,
//     60 s, would end it otherwise); every read after it opens a new
//     session and hangs as long again;
//   - a blocking read (WaitIndex, WaitTime 2s) fails after WaitTime +
//     WaitTime/16 + rpc_hold_timeout (7 s) = 9.1 s with 500 "rpc error
//     making call: i/o deadline reached" (the client agent's own deadline);
//   - WAN gossip marks the server failed within a second or two, but with
//     one server in dc2 that does not take the route away: only the router's
//     rebalance (every 2+ min, pinging the server) marks dc2 offline, after
//     which reads fail at once with "Remote DC has no server currently
//     reachable";
//   - dc1 reads are unaffected (about a millisecond);
//   - after Thaw, dc2 reads work again within milliseconds (about 0.1 s
//     once the router had marked dc2 offline).
//
// About 50 s, nearly all of it Consul's timeouts: a measurement, run with
// LEASEHOLD_MEASURE=1 (make bench); the partition drill in cmd/leasehold
// keeps what leasehold relies on in make test.
func TestFrozenRemoteDatacenter(t *testing.T) {
	if testing.Short() || os.Getenv("LEASEHOLD_MEASURE") == "" {
		t.Skip("waits out Consul's cross-datacenter RPC timeouts (~50 s): set LEASEHOLD_MEASURE=1")
	}
	dc1 := Start(t, Options{Datacenter: "dc1"})
	dc2 := Start(t, Options{Datacenter: "dc2", FederateWith: dc1})
	c1 := Start(t, Options{NodeName: "dc1-client", JoinClientOf: dc1})
	cl := c1.Client()

	// read lists the services of dc ("" is the client agent's own), blocking
	// when index > 0, and never for more than 90 s.
	read := func(dc string, index uint64, wait time.Duration) (uint64, time.Duration, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
		defer cancel()
		q := (&api.QueryOptions{Datacenter: dc, WaitIndex: index, WaitTime: wait}).WithContext(ctx)
		t0 := time.Now()
		_, meta, err := cl.Catalog().Services(q)
		if err != nil {
			return 0, time.Since(t0), err
		}
		return meta.LastIndex, time.Since(t0), nil
	}

	firstTry := time.Now() // dc1's server opens its connection to dc2 after this
	WaitFor(t, 30*time.Second, "dc2 readable through dc1's client agent", func() bool {
		_, _, err := read("dc2", 0, 0)
		return err == nil
	})
	index, d, err := read("dc2", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("before the freeze: dc2 read in %s (index %d)", d, index)

	frozen := time.Now()
	if err := dc2.Freeze(); err != nil {
		t.Fatal(err)
	}
	t.Logf(
		"dc2's server frozen %s after the first dc2 read began (dc1's server's connection to dc2 "+
			"is younger)",
		frozen.Sub(firstTry).Round(time.Millisecond),
	)

	// (c) dc1 reads, and dc1's view of dc2's server in WAN gossip, meanwhile.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var dc1Reads, dc1Errs int
	var dc1Max time.Duration
	var dc1Err error
	var wanFailed time.Duration
	wg.Add(1)
	go func() {
		defer wg.Done()
		wan := dc1.Client()
		for {
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Millisecond):
			}
			_, d, err := read("", 0, 0)
			dc1Reads++
			dc1Max = max(dc1Max, d)
			if err != nil {
				dc1Errs++
				dc1Err = err
			}
			if wanFailed == 0 {
				members, _ := wan.Agent().Members(true) // the agent's own view: answers at once
				for _, m := range members {
					if m.Name == dc2.Node+".dc2" && m.Status != 1 { // serf StatusAlive
						wanFailed = time.Since(frozen)
					}
				}
			}
		}
	}()

	// (a) a non-blocking read of dc2.
	_, d, errA := read("dc2", 0, 0)
	t.Logf("(a) non-blocking dc2 read while frozen: %s, error: %v", d.Round(time.Millisecond), errA)
	// (b) a blocking read of dc2 at its current index.
	_, d, errB := read("dc2", index, 2*time.Second)
	t.Logf(
		"(b) blocking dc2 read (WaitTime 2s) while frozen: %s, error: %v",
		d.Round(time.Millisecond),
		errB,
	)

	close(stop)
	wg.Wait()
	t.Logf("(c) dc1 reads while dc2 was frozen (%s): %d, %d failed, slowest %s (last error: %v)",
		time.Since(frozen).Round(time.Millisecond), dc1Reads, dc1Errs, dc1Max, dc1Err)
	if wanFailed > 0 {
		t.Logf(
			"dc1's WAN gossip saw dc2's server fail %s after the freeze",
			wanFailed.Round(time.Millisecond),
		)
	} else {
		t.Logf("dc1's WAN gossip still saw dc2's server alive")
	}

	// (d) after Thaw, until a dc2 read succeeds.
	thawed := time.Now()
	if err := dc2.Thaw(); err != nil {
		t.Fatal(err)
	}
	var failed int
	var lastErr error
	for {
		_, d, err := read("dc2", 0, 0)
		if err == nil {
			t.Logf(
				"(d) dc2 readable again %s after Thaw (that read %s; %d failed before it, last: "+
					"%v)",
				time.Since(thawed).Round(time.Millisecond),
				d,
				failed,
				lastErr,
			)
			break
		}
		failed, lastErr = failed+1, err
		if time.Since(thawed) > 30*time.Second {
			t.Errorf("(d) dc2 still unreadable 30 s after Thaw: %v", err)
			break
		}
		time.Sleep(50 * time.Millisecond)
	}

	if dc1Reads == 0 || dc1Errs > 0 || dc1Max > 5*time.Second {
		t.Errorf(
			"dc1 reads affected by dc2's freeze: %d reads, %d failed, slowest %s, %v",
			dc1Reads,
			dc1Errs,
			dc1Max,
			dc1Err,
		)
	}
	if errA == nil || errB == nil {
		t.Errorf(
			"a dc2 read succeeded while dc2's only server was frozen: non-blocking %v, blocking %v",
			errA,
			errB,
		)
	}

	// A frozen agent stops promptly (SIGTERM is held pending by a stopped
	// process unless it is continued), and a stopped one cannot be frozen.
	if err := dc2.Freeze(); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	dc2.Stop()
	if d := time.Since(t0); d > 5*time.Second {
		t.Errorf("a frozen agent took %s to stop", d)
	}
	if err := dc2.Freeze(); err == nil {
		t.Error("Freeze of a stopped agent: no error")
	}
}
