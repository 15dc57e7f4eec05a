package consul

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/hashicorp/go-cleanhttp"
)

// catalog is what the Watcher needs from Consul; apiCatalog implements it
// over HTTP, unit tests use a fake. Every call is one request; blocking calls
// take the index to wait on and how long.
type catalog interface {
	// Services lists every service name with its tags.
	Services(ctx context.Context, index uint64, wait time.Duration) (map[string][]string, uint64, error)
	// ServiceNodes lists the registrations of task carrying tag (no checks).
	ServiceNodes(ctx context.Context, task, tag string, index uint64, wait time.Duration) ([]*api.CatalogService, uint64, error)
	// HealthService reads the registrations of task carrying tag with all
	// their checks, whatever their status (not blocking).
	HealthService(ctx context.Context, task, tag string) ([]*api.ServiceEntry, uint64, error)
	// NonPassing lists the non-passing checks of services carrying tag and
	// of nodes.
	NonPassing(ctx context.Context, tag string, index uint64, wait time.Duration) (api.HealthChecks, uint64, error)
}

type apiCatalog struct{ c *api.Client }

var _ catalog = apiCatalog{}

func query(ctx context.Context, index uint64, wait time.Duration) *api.QueryOptions {
	return (&api.QueryOptions{WaitIndex: index, WaitTime: wait}).WithContext(ctx)
}

func (a apiCatalog) Services(ctx context.Context, index uint64, wait time.Duration) (map[string][]string, uint64, error) {
	s, meta, err := a.c.Catalog().Services(query(ctx, index, wait))
	if err != nil {
		return nil, 0, fmt.Errorf("catalog services: %w", err)
	}
	return s, meta.LastIndex, nil
}

func (a apiCatalog) ServiceNodes(ctx context.Context, task, tag string, index uint64, wait time.Duration) ([]*api.CatalogService, uint64, error) {
	s, meta, err := a.c.Catalog().Service(task, tag, query(ctx, index, wait))
	if err != nil {
		return nil, 0, fmt.Errorf("catalog service %s: %w", task, err)
	}
	return s, meta.LastIndex, nil
}

func (a apiCatalog) HealthService(ctx context.Context, task, tag string) ([]*api.ServiceEntry, uint64, error) {
	s, meta, err := a.c.Health().Service(task, tag, false, query(ctx, 0, 0))
	if err != nil {
		return nil, 0, fmt.Errorf("health service %s: %w", task, err)
	}
	return s, meta.LastIndex, nil
}

func (a apiCatalog) NonPassing(ctx context.Context, tag string, index uint64, wait time.Duration) (api.HealthChecks, uint64, error) {
	q := query(ctx, index, wait)
	q.Filter = `Status != "passing" and (ServiceTags contains ` + strconv.Quote(tag) + ` or ServiceID == "")`
	s, meta, err := a.c.Health().State(api.HealthAny, q)
	if err != nil {
		return nil, 0, fmt.Errorf("non-passing checks: %w", err)
	}
	return s, meta.LastIndex, nil
}

// NewClient builds a Consul API client from the standard CONSUL_* environment
// (address, token, TLS), with addr overriding the address when set, whose
// connections to the agent are capped at maxConns (Consul refuses more than
// 200 concurrent connections per client IP by default).
func NewClient(addr string, maxConns int) (*api.Client, error) {
	cfg := api.DefaultConfig()
	if addr != "" {
		cfg.Address = addr
	}
	if cfg.Transport == nil {
		cfg.Transport = cleanhttp.DefaultPooledTransport()
	}
	cfg.Transport.MaxConnsPerHost = maxConns
	cfg.Transport.MaxIdleConnsPerHost = maxConns
	c, err := api.NewClient(cfg)
	if err != nil {
		return nil, fmt.Errorf("consul client: %w", err)
	}
	return c, nil
}
