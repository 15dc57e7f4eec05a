package consul

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// Agent is what the Registrar needs from the local Consul agent. APIAgent
// implements it over HTTP; unit tests use a fake.
type Agent interface {
	// Register registers (or replaces) a service with its checks; checks of
	// the same service missing from reg are removed.
	Register(ctx context.Context, reg *api.AgentServiceRegistration) error
	// Deregister removes a service and its checks from the agent.
	Deregister(ctx context.Context, serviceID string) error
	// UpdateTTL renews a TTL check. A check the agent does not know returns an
	// error matching ErrUnknownCheck.
	UpdateTTL(ctx context.Context, checkID string, status health.CheckStatus, output string) error
	// LocalService returns the agent's registration of serviceID, or nil.
	LocalService(ctx context.Context, serviceID string) (*api.AgentService, error)
	// Sessions lists every registration of instanceID for task in the catalog,
	// on any node, with the status of its lease check.
	Sessions(ctx context.Context, task, instanceID string) ([]RemoteSession, error)
	// NextGeneration takes the next session generation of instanceID for
	// session sessionID with a check-and-set in Consul KV (the key then
	// names the session: "<generation>/<session_id>"); the result is above
	// floor too, so a lost KV entry never hands out a generation an existing
	// session already has.
	NextGeneration(ctx context.Context, instanceID, sessionID string, floor uint64) (uint64, error)
	// Generation reads instanceID's generation key in Consul KV (the zero
	// record when there is none or it is garbage).
	Generation(ctx context.Context, instanceID string) (health.GenerationRecord, error)
	// NodeFailed reports whether Consul's servers hold the agent's own node
	// failed (its serfHealth check critical, or missing: not joined yet).
	NodeFailed(ctx context.Context) (bool, error)
}

// RemoteSession is one registration of an instance as the catalog shows it.
type RemoteSession struct {
	Node       string
	SessionID  string
	Generation uint64             // 0 when its meta has none
	Status     health.CheckStatus // of its lease check; critical when it has none
	// NodeFailed: its node's serfHealth check is critical, or was rewritten
	// after this session's lease check was created (the node failed and came
	// back).
	NodeFailed bool
	// LeaseCreateIndex is the catalog's CreateIndex of its lease check (0:
	// not in the catalog yet).
	LeaseCreateIndex uint64
	// Replaces: the sessions its registration names as replaced (none when
	// its replaces meta is absent or invalid).
	Replaces []string
}

// ErrUnknownCheck means the agent refused a heartbeat because it does not know
// the check: the session was replaced or the agent forgot it.
var ErrUnknownCheck = errors.New("agent does not know the lease check")

// ErrPermission: Consul's ACLs refuse the executor a write its registration
// needs (403). Waiting does not grant a right, so the Registrar stops after
// a few attempts (a token just created may take a moment to reach the agent)
// instead of retrying for ever. Errors of it are *PermissionError.
var ErrPermission = errors.New("permission denied by Consul's ACLs")

// PermissionError is ErrPermission for one write, with the right it needs.
type PermissionError struct {
	Op    string // what was refused, e.g. "register service work:exec-1"
	Right string // the Consul policy rule the token lacks
	Err   error  // Consul's answer
}

func (e *PermissionError) Error() string {
	return fmt.Sprintf("%s: %v: the executor's token (CONSUL_HTTP_TOKEN or "+
		"CONSUL_HTTP_TOKEN_FILE) needs %s (examples/consul/executor-policy.hcl): %v",
		e.Op, ErrPermission, e.Right, e.Err)
}

// Is makes errors.Is(err, ErrPermission) hold.
func (e *PermissionError) Is(target error) bool { return target == ErrPermission }

func (e *PermissionError) Unwrap() error { return e.Err }

// permissionError is err as a *PermissionError when Consul answered 403,
// else nil; right is what the write needs.
func permissionError(err error, op, right string) error {
	if !isStatus(err, http.StatusForbidden) {
		return nil
	}
	if strings.Contains(err.Error(), "ACL not found") {
		right = unknownToken
	}
	return &PermissionError{Op: op, Right: right, Err: err}
}

// APIAgent is the Agent over Consul's HTTP API.
type APIAgent struct {
	c *api.Client
}

var _ Agent = (*APIAgent)(nil)

// NewAPIAgent wraps an API client configured for the local agent.
func NewAPIAgent(c *api.Client) *APIAgent { return &APIAgent{c: c} }

func (a *APIAgent) Register(ctx context.Context, reg *api.AgentServiceRegistration) error {
	opts := api.ServiceRegisterOpts{ReplaceExistingChecks: true}.WithContext(ctx)
	if err := a.c.Agent().ServiceRegisterOpts(reg, opts); err != nil {
		op := "register service " + reg.ID
		if perr := permissionError(err, op,
			fmt.Sprintf("service %q { policy = \"write\" }", reg.Name)); perr != nil {
			return perr
		}
		return fmt.Errorf("%s: %w", op, err)
	}
	return nil
}

func (a *APIAgent) Deregister(ctx context.Context, serviceID string) error {
	err := a.c.Agent().ServiceDeregisterOpts(serviceID, (&api.QueryOptions{}).WithContext(ctx))
	if err != nil && !isStatus(err, http.StatusNotFound) {
		return fmt.Errorf("deregister service %s: %w", serviceID, err)
	}
	return nil
}

func (a *APIAgent) UpdateTTL(
	ctx context.Context,
	checkID string,
	status health.CheckStatus,
	output string,
) error {
	err := a.c.Agent().
		UpdateTTLOpts(checkID, output, string(status), (&api.QueryOptions{}).WithContext(ctx))
	switch {
	case err == nil:
		return nil
	case isStatus(err, http.StatusNotFound):
		return fmt.Errorf("heartbeat %s: %w (%v)", checkID, ErrUnknownCheck, err)
	default:
		return fmt.Errorf("heartbeat %s: %w", checkID, err)
	}
}

func (a *APIAgent) LocalService(ctx context.Context, serviceID string) (*api.AgentService, error) {
	svc, _, err := a.c.Agent().Service(serviceID, (&api.QueryOptions{}).WithContext(ctx))
	switch {
	case err == nil:
		return svc, nil
	case isStatus(err, http.StatusNotFound):
		return nil, nil
	default:
		return nil, fmt.Errorf("read local service %s: %w", serviceID, err)
	}
}

func (a *APIAgent) Sessions(ctx context.Context, task, instanceID string) ([]RemoteSession, error) {
	q := (&api.QueryOptions{
		Filter: "Service.Meta." + health.MetaInstanceID + " == " + strconv.Quote(instanceID),
	}).WithContext(ctx)
	entries, _, err := a.c.Health().Service(task, "", false, q)
	if err != nil {
		return nil, fmt.Errorf("list sessions of %s/%s: %w", task, instanceID, err)
	}
	out := make([]RemoteSession, 0, len(entries))
	for _, e := range entries {
		rs := RemoteSession{
			Node:      e.Node.Node,
			SessionID: e.Service.Meta[health.MetaSessionID],
			Status:    health.StatusCritical,
		}
		if g, err := strconv.ParseUint(e.Service.Meta[health.MetaGeneration], 10, 64); err == nil &&
			g <= health.MaxGeneration {
			rs.Generation = g // garbage counts as none, as leasehold ignores it
		}
		if v, ok := e.Service.Meta[health.MetaReplaces]; ok {
			rs.Replaces, _ = health.ParseReplaces(rs.SessionID, v) // garbage counts as none
		}
		var leaseCreated, serfCreated, serfModified uint64
		for _, c := range e.Checks {
			if _, sess, _, ok := health.ParseCheckID(c.CheckID); ok && sess == rs.SessionID {
				rs.Status = health.CheckStatus(c.Status)
				leaseCreated = c.CreateIndex
			}
			if c.CheckID == health.SerfHealthCheckID && c.ServiceID == "" {
				serfCreated, serfModified = c.CreateIndex, c.ModifyIndex
				rs.NodeFailed = c.Status == api.HealthCritical
			}
		}
		// The same rule as leasehold's (health.Join): serfHealth changed
		// after our lease check was created means the node failed meanwhile.
		if health.NodeFailedSince(leaseCreated, serfCreated, serfModified) {
			rs.NodeFailed = true
		}
		rs.LeaseCreateIndex = leaseCreated
		if e.Checks.AggregatedStatus() == api.HealthCritical { // e.g. its node failed
			rs.Status = health.StatusCritical
		}
		out = append(out, rs)
	}
	return out, nil
}

func (a *APIAgent) NextGeneration(
	ctx context.Context,
	instanceID, sessionID string,
	floor uint64,
) (uint64, error) {
	key := health.GenerationKey(instanceID)
	kv := a.c.KV()
	for attempt := 0; attempt < 16; attempt++ {
		// CAS loses only to a concurrent start of the same instance.
		pair, _, err := kv.Get(key, (&api.QueryOptions{RequireConsistent: true}).WithContext(ctx))
		if err != nil {
			return 0, fmt.Errorf("read %s: %w", key, err)
		}
		var cur, index uint64
		if pair != nil {
			index = pair.ModifyIndex
			if rec, err := health.ParseGenerationRecord(string(pair.Value)); err == nil {
				cur = rec.Generation
			} // garbage: overwrite it, floor still protects the order
		}
		next := max(cur, floor) + 1
		if next > health.MaxGeneration {
			return 0, fmt.Errorf("%s: generations exhausted (floor %d): reset the key", key, floor)
		}
		value := health.GenerationRecord{Generation: next, SessionID: sessionID}.Value()
		ok, _, err := kv.CAS(
			&api.KVPair{Key: key, Value: []byte(value), ModifyIndex: index},
			(&api.WriteOptions{}).WithContext(ctx),
		)
		if err != nil {
			if perr := permissionError(err, "check-and-set "+key,
				fmt.Sprintf("key %q { policy = \"write\" }", key)); perr != nil {
				return 0, perr
			}
			return 0, fmt.Errorf("check-and-set %s: %w", key, err)
		}
		if ok {
			return next, nil
		}
	}
	return 0, fmt.Errorf("check-and-set %s: too much contention", key)
}

func (a *APIAgent) Generation(
	ctx context.Context,
	instanceID string,
) (health.GenerationRecord, error) {
	key := health.GenerationKey(instanceID)
	pair, _, err := a.c.KV().Get(key, (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		return health.GenerationRecord{}, fmt.Errorf("read %s: %w", key, err)
	}
	if pair == nil {
		return health.GenerationRecord{}, nil
	}
	rec, err := health.ParseGenerationRecord(string(pair.Value))
	if err != nil {
		return health.GenerationRecord{}, nil // garbage: leasehold ignores it too
	}
	rec.ModifyIndex = pair.ModifyIndex
	return rec, nil
}

func (a *APIAgent) NodeFailed(ctx context.Context) (bool, error) {
	name, err := a.c.Agent().NodeName()
	if err != nil {
		return false, fmt.Errorf("agent node name: %w", err)
	}
	checks, _, err := a.c.Health().Node(name, (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		return false, fmt.Errorf("health of node %s: %w", name, err)
	}
	for _, c := range checks {
		if c.CheckID == health.SerfHealthCheckID {
			return c.Status == api.HealthCritical, nil
		}
	}
	return true, nil // not (yet) in the catalog: the leader has not caught up with our join
}

func isStatus(err error, code int) bool {
	var se api.StatusError
	return errors.As(err, &se) && se.Code == code
}
