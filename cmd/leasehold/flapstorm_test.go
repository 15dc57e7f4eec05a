package main

import (
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

// TestFlapStorm: 500 registrations come and go and flip between passing,
// warning and critical for 10 s. Afterwards leasehold routes exactly the
// registrations Consul says are passing (those never seen critical), never a
// non-passing one, and no goroutines are left behind.
func TestFlapStorm(t *testing.T) {
	if testing.Short() {
		t.Skip("10 s storm")
	}
	const n = 500
	a := consultest.Start(t)
	c := a.Client()
	type reg struct {
		session  string
		critical bool // this session was ever set critical
		present  bool
	}
	var mu sync.Mutex
	regs := make([]reg, n)
	gen := 0
	register := func(i int) error {
		mu.Lock()
		gen++
		g := gen
		s := fmt.Sprintf("s%d", g)
		regs[i] = reg{session: s, present: true}
		mu.Unlock()
		r := health.Registration{InstanceID: fmt.Sprintf("f%03d", i), SessionID: s, Generation: uint64(g), Task: "work",
			Address: "127.0.0.1", Port: 30000 + i, Version: "1.0.0", Capacity: 4, State: health.StateActive}
		return c.Agent().ServiceRegisterOpts(&api.AgentServiceRegistration{
			ID: health.ServiceID(r.InstanceID, "work"), Name: "work", Tags: []string{"leasehold"}, Address: r.Address, Port: r.Port, Meta: r.Meta(),
			Checks: api.AgentServiceChecks{{CheckID: health.CheckID(r.InstanceID, s, "work"), TTL: "1h", Status: "passing"}},
		}, api.ServiceRegisterOpts{ReplaceExistingChecks: true})
	}
	for i := range n {
		if err := register(i); err != nil {
			t.Fatal(err)
		}
	}
	addrs := startServe(t, a)
	eds := openEDS(t, addrs.xds)
	for got := eds(); len(got) != n; got = eds() {
	}
	baseline := runtime.NumGoroutine()
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)

	// the storm: 4 workers for 10 s (LEASEHOLD_STORM sets another duration: make soak)
	storm := 10 * time.Second
	if v, err := time.ParseDuration(os.Getenv("LEASEHOLD_STORM")); err == nil {
		storm = v
	}
	stop := time.Now().Add(storm)
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for time.Now().Before(stop) {
				i := rng.IntN(n)
				id := fmt.Sprintf("f%03d", i)
				mu.Lock()
				r := regs[i]
				mu.Unlock()
				switch op := rng.IntN(10); {
				case !r.present || op == 0: // (re)register under a fresh session
					register(i)
				case op == 1:
					c.Agent().ServiceDeregister(health.ServiceID(id, "work"))
					mu.Lock()
					regs[i].present = false
					mu.Unlock()
				default:
					status := []string{"passing", "warning", "critical"}[rng.IntN(3)]
					if status == "critical" {
						mu.Lock()
						regs[i].critical = true
						mu.Unlock()
					}
					c.Agent().UpdateTTL(health.CheckID(id, r.session, "work"), "", status)
				}
			}
		}()
	}
	wg.Wait()

	// Consul's final state: what is passing
	passing := map[string]string{} // instance → session
	entries, _, err := c.Health().Service("work", "", false, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.Checks.AggregatedStatus() == api.HealthPassing {
			passing[e.Service.Meta[health.MetaInstanceID]] = e.Service.Meta[health.MetaSessionID]
		}
	}
	mu.Lock()
	mustRoute := map[string]string{}
	for inst, sess := range passing {
		var i int
		fmt.Sscanf(inst, "f%03d", &i)
		if regs[i].session == sess && !regs[i].critical {
			mustRoute[inst] = sess
		}
	}
	mu.Unlock()
	t.Logf("after the storm: %d registrations, %d passing, %d never critical", len(entries), len(passing), len(mustRoute))

	// leasehold converges: every never-critical passing one is routed, no
	// non-passing one is
	deadline := time.Now().Add(20 * time.Second)
	var got map[string]string
	for {
		got = eds()
		ok := true
		for inst, sess := range mustRoute {
			if got[inst] != sess {
				ok = false
			}
		}
		for inst, sess := range got {
			if passing[inst] != sess {
				ok = false
			}
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("leasehold routes %d endpoints; Consul has %d passing, %d must be routed", len(got), len(passing), len(mustRoute))
		}
	}
	// memory stays bounded: the heap after the storm is of the same order
	var after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&after)
	t.Logf("heap before %.1f MB, after %.1f MB", float64(before.HeapAlloc)/(1<<20), float64(after.HeapAlloc)/(1<<20))
	if after.HeapAlloc > 2*before.HeapAlloc+32<<20 {
		t.Fatalf("heap grew from %d to %d bytes over the storm", before.HeapAlloc, after.HeapAlloc)
	}
	// goroutines settle back
	settle := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > baseline+20 {
		if time.Now().After(settle) {
			t.Fatalf("goroutines %d after the storm, %d before", runtime.NumGoroutine(), baseline)
		}
		<-time.After(100 * time.Millisecond) // goroutines have no event to wait on
	}
}
