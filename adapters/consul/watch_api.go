package consul

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
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
	Services(
		ctx context.Context,
		index uint64,
		wait time.Duration,
	) (map[string][]string, uint64, error)
	// ServiceNodes lists the registrations of task carrying tag (no checks).
	// A blocking call may answer errCatalogUnchanged (with the new index)
	// instead: the index moved (or the wait ended) but no registration did.
	ServiceNodes(
		ctx context.Context,
		task, tag string,
		index uint64,
		wait time.Duration,
	) ([]*api.CatalogService, uint64, error)
	// HealthService reads the registrations of task carrying tag with all
	// their checks, whatever their status (not blocking): those with one of
	// ids (plain ids: letters, digits, '-', '_', '.', ':'), or every one when
	// ids is nil.
	HealthService(
		ctx context.Context,
		task, tag string,
		ids []string,
	) ([]*api.ServiceEntry, uint64, error)
	// ChecksInState lists the checks in state (critical or warning) of
	// services carrying tag and of nodes. Consul wakes such a blocking query
	// only when a check enters, leaves or changes in that state, and scans
	// only those checks.
	ChecksInState(
		ctx context.Context,
		tag, state string,
		index uint64,
		wait time.Duration,
	) (api.HealthChecks, uint64, error)
	// SerfHealth lists every node's serfHealth check, whatever its status.
	SerfHealth(
		ctx context.Context,
		index uint64,
		wait time.Duration,
	) (api.HealthChecks, uint64, error)
	// NodeSerf reads one node's serfHealth check (nil if it has none).
	NodeSerf(ctx context.Context, node string) (*api.HealthCheck, error)
	// Generations lists the session generation keys (health.GenerationKeyPrefix).
	Generations(ctx context.Context, index uint64, wait time.Duration) (api.KVPairs, uint64, error)
	// GenerationKeys reads the generation keys of instances now (not
	// blocking): the pairs that exist, in any order.
	GenerationKeys(ctx context.Context, instances []string) (api.KVPairs, error)
}

type apiCatalog struct {
	c       *api.Client
	checked *atomic.Uint64 // services index at which read rights were last verified
	dc      string         // the datacenter read ("": the agent's own)
	// listed is, per task type and tag, the registration indexes as of the
	// last whole listing (nil: every blocking ServiceNodes call lists).
	listed *listedIndexes
	// sizes is each whole listing's last size, the next one's read buffer
	// (nil: read into a buffer grown as it reads).
	sizes *listingSizes
}

var _ catalog = apiCatalog{}

func (a apiCatalog) query(ctx context.Context, index uint64, wait time.Duration) *api.QueryOptions {
	return (&api.QueryOptions{Datacenter: a.dc, WaitIndex: index, WaitTime: wait}).WithContext(ctx)
}

// ErrACL: Consul's ACLs keep leasehold from reading what it must. Results
// silently filtered by ACLs (an anonymous or under-privileged token sees an
// empty catalog) are an error too: serving an empty fleet as if it were the
// truth would route nothing, and serving without the cordons as if there
// were none would route to executors operators took out. Errors of it are
// *ACLError, naming the rights missing.
var ErrACL = errors.New("consul ACL")

// ACLError is ErrACL for one read, with the rights it needs.
type ACLError struct {
	Read string // what was read, e.g. "kv leasehold/control/"
	How  string // "permission denied (…)" or "results filtered by ACLs"
	// Rights are the Consul policy rules the read needs and the token
	// lacks (or may lack: a filtered answer does not say which of several).
	Rights []string
	// Policy is the example policy file granting them ("": leasehold
	// serve's, leasehold-policy.hcl).
	Policy string
}

func (e *ACLError) Error() string {
	policy := e.Policy
	if policy == "" {
		policy = "leasehold-policy.hcl"
	}
	return fmt.Sprintf(
		"%s: %v: %s: the Consul token (CONSUL_HTTP_TOKEN or CONSUL_HTTP_TOKEN_FILE) needs %s "+
			"(examples/consul/%s)",
		e.Read,
		ErrACL,
		e.How,
		e.Right(),
		policy,
	)
}

// Is makes errors.Is(err, ErrACL) hold.
func (e *ACLError) Is(target error) bool { return target == ErrACL }

// Right is the missing rights as one line of Consul policy rules.
func (e *ACLError) Right() string { return strings.Join(e.Rights, " and ") }

// Consul policy rules leasehold serve needs (examples/consul/leasehold-policy.hcl).
const (
	RightServices = `service_prefix "" { policy = "read" }`
	RightNodes    = `node_prefix "" { policy = "read" }`
	// unknownToken: a 403 "ACL not found" is no missing right.
	unknownToken = "a token Consul knows (this one is not found: deleted, expired or mistyped)"
)

// RightKeyPrefix is the rule that grants policy ("read", "write") on the
// keys under prefix.
func RightKeyPrefix(prefix, policy string) string {
	return fmt.Sprintf("key_prefix %q { policy = %q }", prefix, policy)
}

// rightsOf are the rights a read needs, by its name: a KV read ("kv
// PREFIX") its prefix, a catalog or health read every service and node.
func rightsOf(what string) []string {
	if prefix, ok := strings.CutPrefix(what, "kv "); ok {
		return []string{RightKeyPrefix(prefix, "read")}
	}
	return []string{RightServices, RightNodes}
}

// aclCheck turns a 403 or ACL-filtered results into an *ACLError naming
// the rights read what needs (rightsOf).
func aclCheck(what string, meta *api.QueryMeta, err error) error {
	return aclNeeds(what, rightsOf(what), meta, err)
}

// aclNeeds turns a 403 or ACL-filtered results of read what into an
// *ACLError naming rights.
func aclNeeds(what string, rights []string, meta *api.QueryMeta, err error) error {
	var se api.StatusError
	if err != nil && errors.As(err, &se) && se.Code == 403 {
		body := strings.TrimSpace(se.Body)
		if strings.Contains(body, "ACL not found") {
			rights = []string{unknownToken}
		}
		return &ACLError{Read: what, How: "permission denied (" + body + ")", Rights: rights}
	}
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	if meta != nil && meta.ResultsFilteredByACLs {
		return &ACLError{Read: what, How: "results filtered by ACLs", Rights: rights}
	}
	return nil
}

// listKV lists the keys under prefix (a blocking query from index), and
// fails with an *ACLError naming key_prefix PREFIX { policy = NEED } when
// the token may not read them: when Consul filtered keys out, and when
// the listing is empty — Consul answers an empty listing alike whether
// there are no keys or none the token may read, so then a read of the
// prefix key itself asks (a key the token may not read is refused with 403
// whether it exists or not). With sizes, the answer is read into a buffer
// of the last one's size and decoded whole (encoding/json's Decoder grows
// its own from nothing: ~2 MB read for a 1 MB listing of 10,000 generation
// keys); nil: as the api client reads it.
func listKV(
	ctx context.Context,
	c *api.Client,
	q *api.QueryOptions,
	prefix, need string,
	sizes *listingSizes,
) (api.KVPairs, *api.QueryMeta, error) {
	what, rights := "kv "+prefix, []string{RightKeyPrefix(prefix, need)}
	key := "kv\x00" + prefix
	var body *bodyCapture
	if sizes != nil {
		var qctx context.Context
		qctx, body = withBodyCapture(q.Context(), sizes.get(key))
		q = q.WithContext(qctx)
	}
	pairs, meta, err := c.KV().List(prefix, q)
	if err == nil && body != nil && body.taken {
		sizes.set(key, body)
		pairs = nil
		if err = json.Unmarshal(body.body, &pairs); err != nil {
			err = fmt.Errorf("decoding the listing: %w", err)
		}
	}
	if err := aclNeeds(what, rights, meta, err); err != nil {
		return nil, nil, err
	}
	if len(pairs) == 0 {
		probe := &api.QueryOptions{Datacenter: q.Datacenter}
		_, pmeta, err := c.KV().Get(prefix, probe.WithContext(ctx))
		if err := aclNeeds(what, rights, pmeta, err); err != nil {
			return nil, nil, err
		}
	}
	return pairs, meta, nil
}

// catalogRights are the catalog rights the token lacks, found with two
// small reads after a catalog or health read came back filtered: the
// service names (filtered without read on some service) and the Consul
// servers' own registrations (filtered without read on their nodes). Both
// when these do not tell.
func (a apiCatalog) catalogRights(ctx context.Context) []string {
	both := []string{RightServices, RightNodes}
	svcs, meta, err := a.c.Catalog().Services(a.query(ctx, 0, 0))
	if err != nil {
		return both
	}
	if _, ok := svcs["consul"]; !ok {
		return both // its nodes cannot be looked at either
	}
	var missing []string
	if meta.ResultsFilteredByACLs {
		missing = append(missing, RightServices)
	}
	servers, smeta, err := a.c.Catalog().Service("consul", "", a.query(ctx, 0, 0))
	if err != nil {
		return both
	}
	if len(servers) == 0 || smeta.ResultsFilteredByACLs {
		missing = append(missing, RightNodes)
	}
	if len(missing) == 0 {
		return both
	}
	return missing
}

// catalogCheck is aclCheck for a catalog or health read, naming the rights
// missing as catalogRights finds them.
func (a apiCatalog) catalogCheck(
	ctx context.Context,
	what string,
	meta *api.QueryMeta,
	err error,
) error {
	err = aclCheck(what, meta, err)
	var ae *ACLError
	if errors.As(err, &ae) && ae.Rights[0] != unknownToken && ctx.Err() == nil {
		ae.Rights = a.catalogRights(ctx)
	}
	return err
}

func (a apiCatalog) Services(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (map[string][]string, uint64, error) {
	s, meta, err := a.c.Catalog().Services(a.query(ctx, index, wait))
	// Filtered: some service cannot be read (node rights play no part).
	if err := aclNeeds("catalog services", []string{RightServices}, meta, err); err != nil {
		return nil, 0, err
	}
	// The listing of services is not filtered when the token reads every
	// service but no node, and an empty catalog carries no sign either: the
	// servers' own "consul" service is always in the catalog, so when it is
	// missing, or its nodes are, the token cannot read services or nodes.
	if _, ok := s["consul"]; !ok {
		return nil, 0, &ACLError{
			Read:   "catalog services",
			How:    `the catalog shows no "consul" service (filtered by ACLs)`,
			Rights: a.catalogRights(ctx),
		}
	}
	if a.checked != nil && a.checked.Load() != meta.LastIndex {
		servers, smeta, err := a.c.Catalog().Service("consul", "", a.query(ctx, 0, 0))
		if err := aclNeeds("catalog service consul", []string{RightNodes}, smeta, err); err != nil {
			return nil, 0, err
		}
		if len(servers) == 0 {
			return nil, 0, &ACLError{
				Read:   "catalog service consul",
				How:    "the Consul servers' nodes are not visible (filtered by ACLs)",
				Rights: []string{RightNodes},
			}
		}
		a.checked.Store(meta.LastIndex)
	}
	return s, meta.LastIndex, nil
}

func (a apiCatalog) ServiceNodes(
	ctx context.Context,
	task, tag string,
	index uint64,
	wait time.Duration,
) ([]*api.CatalogService, uint64, error) {
	if a.listed == nil { // every wake lists
		s, meta, err := a.catalogListing(ctx, task, tag, index, wait)
		if err := a.catalogCheck(ctx, "catalog service "+task, meta, err); err != nil {
			return nil, 0, err
		}
		return s, meta.LastIndex, nil
	}
	key := task + "\x00" + tag
	var regs registrationIndexes
	var err error
	if index > 0 && wait > 0 {
		var idx uint64
		if idx, regs, err = a.awaitTaskIndex(ctx, task, tag, index, wait); err != nil {
			return nil, idx, err // errCatalogUnchanged when the wait ended
		}
		if was, ok := a.listed.get(key); ok && regs == was {
			return nil, idx, errCatalogUnchanged
		}
	} else if regs, err = a.registrationIndexes(ctx); err != nil {
		return nil, 0, err
	}
	// The indexes were read first: a change after them moves them again.
	s, meta, err := a.catalogListing(ctx, task, tag, 0, 0)
	if err := a.catalogCheck(ctx, "catalog service "+task, meta, err); err != nil {
		return nil, 0, err
	}
	a.listed.set(key, regs)
	return s, meta.LastIndex, nil
}

// catalogListing reads task's catalog entries carrying tag, decoded by
// listing.go's lean decoder.
func (a apiCatalog) catalogListing(
	ctx context.Context, task, tag string, index uint64, wait time.Duration,
) ([]*api.CatalogService, *api.QueryMeta, error) {
	key := "catalog\x00" + task + "\x00" + tag
	lctx, body := withBodyCapture(ctx, a.sizes.get(key))
	s, meta, err := a.c.Catalog().Service(task, tag, a.query(lctx, index, wait))
	if err != nil {
		return nil, meta, err
	}
	a.sizes.set(key, body)
	s, err = body.catalog(s)
	return s, meta, err
}

// errCatalogUnchanged: ServiceNodes woke at a new index of the task type,
// but no registration or node of the datacenter changed since its last
// listing (a check changed): the listing would be the same.
var errCatalogUnchanged = errors.New("catalog registrations unchanged")

// noSuchID is a service id leasehold filters on to have Consul answer a
// blocking query with its index and (almost always) an empty body; what the
// body holds is never read.
const noSuchID = "leasehold:index-only"

// awaitTaskIndex blocks on task's catalog entries without their bodies:
// Consul moves a service's index when a check of it changes status (a
// lapse, a flap) as well as when a registration does, and at 10,000
// executors in one task type each wake re-read ~12 MB of unchanged entries.
// Once woken, it reads the datacenter's registration indexes (services and
// nodes), which checks do not move.
func (a apiCatalog) awaitTaskIndex(
	ctx context.Context, task, tag string, index uint64, wait time.Duration,
) (uint64, registrationIndexes, error) {
	q := a.query(ctx, index, wait)
	q.Filter = `ServiceID == "` + noSuchID + `"`
	_, meta, err := a.c.Catalog().Service(task, tag, q)
	if err := a.catalogCheck(ctx, "catalog service "+task, meta, err); err != nil {
		return 0, registrationIndexes{}, err
	}
	if meta.LastIndex == index {
		return index, registrationIndexes{}, errCatalogUnchanged // the wait ended
	}
	regs, err := a.registrationIndexes(ctx)
	return meta.LastIndex, regs, err
}

var _ servicesIndexCatalog = apiCatalog{}

// ServicesIndex waits on the datacenter's catalog services; the answer (the
// service names and their tags: Consul 1.13 ignores a filter here) is not
// read.
func (a apiCatalog) ServicesIndex(ctx context.Context, index uint64, wait time.Duration) (uint64, error) {
	_, meta, err := a.c.Catalog().Services(a.query(ctx, index, wait))
	if err := aclNeeds("catalog services", []string{RightServices}, meta, err); err != nil {
		return 0, err
	}
	return meta.LastIndex, nil
}

// registrationIndexes are the indexes of the datacenter's service
// registrations and nodes: any registration, deregistration or change of a
// service or a node (its address) moves one of them; a check's status does
// not.
type registrationIndexes struct{ services, nodes uint64 }

func (a apiCatalog) registrationIndexes(ctx context.Context) (registrationIndexes, error) {
	_, smeta, err := a.c.Catalog().Services(a.query(ctx, 0, 0))
	if err := aclNeeds("catalog services", []string{RightServices}, smeta, err); err != nil {
		return registrationIndexes{}, err
	}
	q := a.query(ctx, 0, 0)
	q.Filter = `Node == "` + noSuchID + `"`
	_, nmeta, err := a.c.Catalog().Nodes(q)
	if err := aclNeeds("catalog nodes", []string{RightNodes}, nmeta, err); err != nil {
		return registrationIndexes{}, err
	}
	return registrationIndexes{services: smeta.LastIndex, nodes: nmeta.LastIndex}, nil
}

// listedIndexes holds registrationIndexes per task type and tag.
type listedIndexes struct {
	mu sync.Mutex
	m  map[string]registrationIndexes
}

func (l *listedIndexes) get(key string) (registrationIndexes, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	r, ok := l.m[key]
	return r, ok
}

func (l *listedIndexes) set(key string, r registrationIndexes) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m == nil {
		l.m = map[string]registrationIndexes{}
	}
	l.m[key] = r
}

func (a apiCatalog) HealthService(
	ctx context.Context,
	task, tag string,
	ids []string,
) ([]*api.ServiceEntry, uint64, error) {
	// Only a whole listing has a size to expect: a read of some ids holds
	// what they are.
	key, hint := "health\x00"+task+"\x00"+tag, 0
	if ids == nil {
		hint = a.sizes.get(key)
	}
	lctx, body := withBodyCapture(ctx, hint)
	q := a.query(lctx, 0, 0)
	if ids != nil {
		var f strings.Builder
		for i, id := range ids {
			if !plainID(id) {
				return nil, 0, fmt.Errorf(
					"health service %s: service id %q cannot be filtered on",
					task,
					id,
				)
			}
			if i > 0 {
				f.WriteString(" or ")
			}
			f.WriteString(`Service.ID == "` + id + `"`)
		}
		q.Filter = f.String()
	}
	s, meta, err := a.c.Health().Service(task, tag, false, q)
	if err == nil {
		if ids == nil {
			a.sizes.set(key, body)
		}
		s, err = body.health(s)
	}
	if err := a.catalogCheck(ctx, "health service "+task, meta, err); err != nil {
		return nil, 0, err
	}
	return s, meta.LastIndex, nil
}

func (a apiCatalog) ChecksInState(
	ctx context.Context,
	tag, state string,
	index uint64,
	wait time.Duration,
) (api.HealthChecks, uint64, error) {
	q := a.query(ctx, index, wait)
	q.Filter = `ServiceTags contains ` + strconv.Quote(tag) + ` or ServiceID == ""`
	s, meta, err := a.checkListing(ctx, "state\x00"+state+"\x00"+tag, state, q)
	if err := a.catalogCheck(ctx, state+" checks", meta, err); err != nil {
		return nil, 0, err
	}
	return s, meta.LastIndex, nil
}

// checkListing reads the checks in state that q asks for, decoded by
// listing.go's lean decoder from a buffer of the size of key's last answer.
func (a apiCatalog) checkListing(
	ctx context.Context, key, state string, q *api.QueryOptions,
) (api.HealthChecks, *api.QueryMeta, error) {
	lctx, body := withBodyCapture(ctx, a.sizes.get(key))
	s, meta, err := a.c.Health().State(state, q.WithContext(lctx))
	if err != nil {
		return nil, meta, err
	}
	a.sizes.set(key, body)
	s, err = body.checks(s)
	return s, meta, err
}

func (a apiCatalog) SerfHealth(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (api.HealthChecks, uint64, error) {
	q := a.query(ctx, index, wait)
	q.Filter = `CheckID == "` + health.SerfHealthCheckID + `" and ServiceID == ""`
	s, meta, err := a.checkListing(ctx, "serf", api.HealthAny, q)
	if err := aclNeeds("serfHealth checks", []string{RightNodes}, meta, err); err != nil {
		// Node checks: node rights only.
		return nil, 0, err
	}
	return s, meta.LastIndex, nil
}

func (a apiCatalog) NodeSerf(ctx context.Context, node string) (*api.HealthCheck, error) {
	q := a.query(ctx, 0, 0)
	q.Filter = `CheckID == "` + health.SerfHealthCheckID + `" and ServiceID == ""`
	s, meta, err := a.c.Health().Node(node, q)
	if err := aclNeeds("checks of node "+node, []string{RightNodes}, meta, err); err != nil {
		return nil, err
	}
	return serfOf(s), nil
}

// kvIndexProbe is a key leasehold never writes: Consul answers a read of a
// key that does not exist with the index of the datacenter's latest KV
// write (any key; a delete too).
const kvIndexProbe = health.GenerationKeyPrefix + ".kv-index"

// KVIndex is the index of the datacenter's latest KV write, read with one
// request of no body (404); false when the probe key exists (its own index
// says nothing of the others').
func (a apiCatalog) KVIndex(ctx context.Context) (uint64, bool, error) {
	p, meta, err := a.c.KV().Get(kvIndexProbe, a.query(ctx, 0, 0))
	rights := []string{RightKeyPrefix(health.GenerationKeyPrefix, "read")}
	if err := aclNeeds("kv "+health.GenerationKeyPrefix, rights, meta, err); err != nil {
		return 0, false, err
	}
	if p != nil {
		return 0, false, nil
	}
	return meta.LastIndex, true, nil
}

func (a apiCatalog) Generations(
	ctx context.Context,
	index uint64,
	wait time.Duration,
) (api.KVPairs, uint64, error) {
	pairs, meta, err := listKV(
		ctx,
		a.c,
		a.query(ctx, index, wait),
		health.GenerationKeyPrefix,
		"read",
		a.sizes,
	)
	if err != nil {
		return nil, 0, err
	}
	return pairs, meta.LastIndex, nil
}

func (a apiCatalog) GenerationKeys(ctx context.Context, instances []string) (api.KVPairs, error) {
	// One read per key: Consul 1.13's transactions have no get-or-empty,
	// and a get of a missing key fails the whole transaction.
	what, rights := "kv "+health.GenerationKeyPrefix, []string{
		RightKeyPrefix(health.GenerationKeyPrefix, "read"),
	}
	var out api.KVPairs
	for _, inst := range instances {
		pair, meta, err := a.c.KV().Get(health.GenerationKey(inst), a.query(ctx, 0, 0))
		if err := aclNeeds(what, rights, meta, err); err != nil {
			return nil, err
		}
		if pair != nil {
			out = append(out, pair)
		}
	}
	return out, nil
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
	if sock, ok := strings.CutPrefix(cfg.Address, "unix://"); ok {
		// The api client would dial a unix:// address through a client of
		// its own, without the sizing transport: the socket is dialled here
		// instead (the address is then only the requests' host).
		cfg.Transport.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		}
		cfg.Address = sock
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
