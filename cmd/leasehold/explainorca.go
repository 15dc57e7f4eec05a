package main

import (
	"context"
	"net"
	"strconv"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/leasehold/leasehold/server"
)

// explain --orca reads each executor's current load from the executor itself:
// leasehold has only the lease check's output, which Consul syncs minutes
// late, while a gRPC executor reporting ORCA (adapters/loadreport) tells its
// tasks in flight to whoever opens its out-of-band load report stream — the
// same report `leasehold register` reads at each probe.
const (
	orcaTimeout  = 2 * time.Second // for all of them: explain stays quick
	orcaParallel = 16
)

// orcaKey names a registration in printer.orca.
func orcaKey(e server.ExplainExecutor) string { return e.Node + "/" + e.ServiceID }

// orcaLoads are the tasks in flight of the executors that answered with an
// ORCA report, by orcaKey; the others (no gRPC, TLS, no report, not
// reachable from here) are left out, so their LOAD stays the check's.
func orcaLoads(ctx context.Context, exs []server.ExplainExecutor) map[string]int {
	ctx, cancel := context.WithTimeout(ctx, orcaTimeout)
	defer cancel()
	var (
		mu  sync.Mutex
		out = map[string]int{}
		wg  sync.WaitGroup
		sem = make(chan struct{}, orcaParallel)
	)
	for _, e := range exs {
		if e.MetadataError != "" || net.ParseIP(e.Address) == nil || e.Port <= 0 {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case sem <- struct{}{}:
				defer func() { <-sem }()
			case <-ctx.Done():
				return
			}
			conn, err := grpc.NewClient(net.JoinHostPort(e.Address, strconv.Itoa(e.Port)),
				grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				return
			}
			defer conn.Close()
			n, err := (&grpcProber{conn: conn}).readORCA(ctx)
			if err != nil || n < 0 {
				return
			}
			mu.Lock()
			out[orcaKey(e)] = int(n)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return out
}
