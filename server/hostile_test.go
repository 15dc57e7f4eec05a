package server

import (
	"context"
	"net"
	"runtime"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/leasehold/leasehold/health"
)

// A client that never reads, one that NACKs everything, 1,000 streams opened
// and dropped, garbage bytes on the port and invalid node metadata — a
// well-behaved dispatcher still gets its updates promptly, and no goroutines
// are left behind.
func TestHostileClientsDoNotHurtOthers(t *testing.T) {
	// a big task, not sharded, so a response exceeds the stream's
	// flow-control window
	f := startXDSWith(t, fixtureOpts{shardSize: -1})
	var big []health.Member
	for i := range 600 {
		big = append(big,
			member("work", "w"+string(rune('a'+i%26))+string(rune('a'+i/26)), 10000+i, "1.0.0"))
	}
	f.members("work", big...)

	good := f.ads(node("good", nil))
	good.Subscribe(resource.EndpointType, "work")
	r := good.Next()
	good.ACK(r, "work")
	baseline := runtime.NumGoroutine()

	// never reads its responses
	stuck := f.ads(node("stuck", nil))
	stuck.Subscribe(resource.EndpointType, "work")
	// NACKs everything
	nacker := f.ads(node("nacker", nil))
	nacker.Subscribe(resource.EndpointType, "work")
	nr := nacker.Next()
	nacker.NACK(nr, "no", "work")
	// garbage on the port
	for range 5 {
		if c, err := net.Dial("tcp", f.addr); err == nil {
			c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n\x00\x01garbage"))
			c.Close()
		}
	}
	// invalid node metadata
	bad := f.ads(node("bad", map[string]any{"version_constraint": "nonsense >>"}))
	bad.Subscribe(resource.EndpointType, "work")
	if _, err := bad.Recv(); err == nil {
		t.Fatal("invalid metadata accepted")
	}
	// 1,000 streams opened and dropped
	conn := f.dial()
	for range 1000 {
		ctx, cancel := context.WithCancel(context.Background())
		s, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
		if err == nil {
			s.Send(
				&discovery.DiscoveryRequest{
					Node:          node("churn", nil),
					TypeUrl:       resource.EndpointType,
					ResourceNames: []string{"work"},
				},
			)
		}
		cancel()
	}

	// a change: the good client gets it promptly
	changed := time.Now()
	f.members("work", big[:599]...)
	r2 := good.Next()
	if got := hosts(t, r2, "work"); len(got) != 599 {
		t.Fatalf("good client got %d endpoints", len(got))
	}
	if took := time.Since(changed); took > 2*time.Second {
		t.Fatalf("update took %s with hostile clients around", took)
	}
	good.ACK(r2, "work")

	// dropped streams leave nothing behind (the stuck and NACKing ones stay)
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > baseline+40 {
		if time.Now().After(deadline) {
			t.Fatalf("goroutines %d, baseline %d: dropped streams leaked",
				runtime.NumGoroutine(), baseline)
		}
		<-time.After(50 * time.Millisecond) // goroutines have no event to wait on
	}
	_ = stuck
}
