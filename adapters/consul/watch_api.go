package consul

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/hashicorp/go-cleanhttp"

	"github.com/leasehold/leasehold/health"
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
	// their checks, whatever their status (not blocking): those with one of
	// ids (plain ids: letters, digits, '-', '_', '.', ':'), or every one when
	// ids is nil.
	HealthService(ctx context.Context, task, tag string, ids []string) ([]*api.ServiceEntry, uint64, error)
	// ChecksInState lists the checks in state (critical or warning) of
	// services carrying tag and of nodes. Consul wakes such a blocking query
	// only when a check enters, leaves or changes in that state, and scans
	// only those checks.
	ChecksInState(ctx context.Context, tag, state string, index uint64, wait time.Duration) (api.HealthChecks, uint64, error)
	// SerfHealth lists every node's serfHealth check, whatever its status.
	SerfHealth(ctx context.Context, index uint64, wait time.Duration) (api.HealthChecks, uint64, error)
	// NodeSerf reads one node's serfHealth check (nil if it has none).
	NodeSerf(ctx context.Context, node string) (*api.HealthCheck, error)
	// Generations lists the session generation keys (health.GenerationKeyPrefix).
	Generations(ctx context.Context, index uint64, wait time.Duration) (api.KVPairs, uint64, error)
}

type apiCatalog struct {
	c       *api.Client
	checked *atomic.Uint64 // services index at which read rights were last verified
	dc      string         // the datacenter read ("": the agent's own)
}

var _ catalog = apiCatalog{}

func (a apiCatalog) query(ctx context.Context, index uint64, wait time.Duration) *api.QueryOptions {
	return (&api.QueryOptions{Datacenter: a.dc, WaitIndex: index, WaitTime: wait}).WithContext(ctx)
}

// ErrACL: Consul's ACLs keep leasehold from reading what it must. Results
// silently filtered by ACLs (an anonymous or under-privileged token sees an
// empty catalog) are an error too: serving an empty fleet as if it were the
// truth would route nothing.
var ErrACL = errors.New("consul ACL")

const aclRights = `the Consul token (CONSUL_HTTP_TOKEN or CONSUL_HTTP_TOKEN_FILE) needs read on every service and node: service_prefix "" { policy = "read" } and node_prefix "" { policy = "read" }, and on the generation keys: key_prefix "leasehold/generation/" { policy = "read" } (examples/consul/leasehold-policy.hcl)`

// aclCheck turns a 403 or ACL-filtered results into ErrACL.
func aclCheck(what string, meta *api.QueryMeta, err error) error {
	var se api.StatusError
	if err != nil && errors.As(err, &se) && se.Code == 403 {
		return fmt.Errorf("%s: %w: permission denied (%s): %s", what, ErrACL, se.Body, aclRights)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	if meta != nil && meta.ResultsFilteredByACLs {
		return fmt.Errorf("%s: %w: results filtered by ACLs: %s", what, ErrACL, aclRights)
	}
	return nil
}

func (a apiCatalog) Services(ctx context.Context, index uint64, wait time.Duration) (map[string][]string, uint64, error) {
	s, meta, err := a.c.Catalog().Services(a.query(ctx, index, wait))
	if err := aclCheck("catalog services", meta, err); err != nil {
		return nil, 0, err
	}
	// Consul 1.13 filters by ACLs silently (no header on these endpoints).
	// The servers' own "consul" service is always in the catalog: when it
	// is missing, or its nodes are, the token cannot read services or nodes.
	if _, ok := s["consul"]; !ok {
		return nil, 0, fmt.Errorf("catalog services: %w: the catalog shows no \"consul\" service: %s", ErrACL, aclRights)
	}
	if a.checked != nil && a.checked.Load() != meta.LastIndex {
		servers, _, err := a.c.Catalog().Service("consul", "", a.query(ctx, 0, 0))
		if err := aclCheck("catalog service consul", nil, err); err != nil {
			return nil, 0, err
		}
		if len(servers) == 0 {
			return nil, 0, fmt.Errorf("catalog service consul: %w: the Consul servers' nodes are not visible: %s", ErrACL, aclRights)
		}
		a.checked.Store(meta.LastIndex)
	}
	return s, meta.LastIndex, nil
}

func (a apiCatalog) ServiceNodes(ctx context.Context, task, tag string, index uint64, wait time.Duration) ([]*api.CatalogService, uint64, error) {
	s, meta, err := a.c.Catalog().Service(task, tag, a.query(ctx, index, wait))
	if err := aclCheck("catalog service "+task, meta, err); err != nil {
		return nil, 0, err
	}
	return s, meta.LastIndex, nil
}

func (a apiCatalog) HealthService(ctx context.Context, task, tag string, ids []string) ([]*api.ServiceEntry, uint64, error) {
	q := a.query(ctx, 0, 0)
	if ids != nil {
		var f strings.Builder
		for i, id := range ids {
			if !plainID(id) {
				return nil, 0, fmt.Errorf("health service %s: service id %q cannot be filtered on", task, id)
			}
			if i > 0 {
				f.WriteString(" or ")
			}
			f.WriteString(`Service.ID == "` + id + `"`)
		}
		q.Filter = f.String()
	}
	s, meta, err := a.c.Health().Service(task, tag, false, q)
	if err := aclCheck("health service "+task, meta, err); err != nil {
		return nil, 0, err
	}
	return s, meta.LastIndex, nil
}

func (a apiCatalog) ChecksInState(ctx context.Context, tag, state string, index uint64, wait time.Duration) (api.HealthChecks, uint64, error) {
	q := a.query(ctx, index, wait)
	q.Filter = `ServiceTags contains ` + strconv.Quote(tag) + ` or ServiceID == ""`
	s, meta, err := a.c.Health().State(state, q)
	if err := aclCheck(state+" checks", meta, err); err != nil {
		return nil, 0, err
	}
	return s, meta.LastIndex, nil
}

func (a apiCatalog) SerfHealth(ctx context.Context, index uint64, wait time.Duration) (api.HealthChecks, uint64, error) {
	q := a.query(ctx, index, wait)
	q.Filter = `CheckID == "` + health.SerfHealthCheckID + `" and ServiceID == ""`
	s, meta, err := a.c.Health().State(api.HealthAny, q)
	if err := aclCheck("serfHealth checks", meta, err); err != nil {
		return nil, 0, err
	}
	return s, meta.LastIndex, nil
}

func (a apiCatalog) NodeSerf(ctx context.Context, node string) (*api.HealthCheck, error) {
	q := a.query(ctx, 0, 0)
	q.Filter = `CheckID == "` + health.SerfHealthCheckID + `" and ServiceID == ""`
	s, meta, err := a.c.Health().Node(node, q)
	if err := aclCheck("checks of node "+node, meta, err); err != nil {
		return nil, err
	}
	return serfOf(s), nil
}

func (a apiCatalog) Generations(ctx context.Context, index uint64, wait time.Duration) (api.KVPairs, uint64, error) {
	pairs, meta, err := a.c.KV().List(health.GenerationKeyPrefix, a.query(ctx, index, wait))
	if err := aclCheck("kv "+health.GenerationKeyPrefix, meta, err); err != nil {
		if errors.Is(err, ErrACL) {
			err = fmt.Errorf("%w (and key_prefix %q { policy = \"read\" })", err, health.GenerationKeyPrefix)
		}
		return nil, 0, err
	}
	return pairs, meta.LastIndex, nil
}

// NewClient builds a Consul API client from the standard CONSUL_* environment
// (address, token, TLS), with addr overriding the address when set, whose
// connections to the agent are capped at maxConns (Consul refuses more than
// 200 concurrent connections per client IP by default). Answers come
// gzip-compressed; a Watcher counts their sizes.
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
	hc, err := api.NewHttpClient(cfg.Transport, cfg.TLSConfig)
	if err != nil {
		return nil, fmt.Errorf("consul client: %w", err)
	}
	// Compressed answers, and their sizes for the watcher's read budget.
	hc.Transport = sizingTransport{next: hc.Transport}
	cfg.HttpClient = hc
	c, err := api.NewClient(cfg)
	if err != nil {
		return nil, fmt.Errorf("consul client: %w", err)
	}
	return c, nil
}
