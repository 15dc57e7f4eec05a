package consul

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// call is one request the Registrar made of the fake agent.
type call struct {
	op      string // register, ttl, deregister
	service string
	session string
	state   string
	status  health.CheckStatus
	output  string
	err     error
}

// fakeAgent is an in-memory Consul agent with injectable failures.
type fakeAgent struct {
	mu          sync.Mutex
	services    map[string]*api.AgentServiceRegistration
	checks      map[string]health.CheckStatus
	outputs     map[string]string
	others      []RemoteSession // sessions on other nodes
	ttlErr      func(checkID string) error
	regErr      func() error
	deregErr    func(serviceID string) error
	gens        map[string]uint64 // KV generation per instance
	keySessions map[string]string // the session each generation key names
	calls       chan call
	// created is the catalog's CreateIndex of each local lease check (by
	// check id; 0: not synced yet), as Sessions reports it.
	created map[string]uint64
	// sessionsRead, if set, is sent to (without blocking) after every
	// Sessions answer.
	sessionsRead chan struct{}
}

var _ Agent = (*fakeAgent)(nil)

func newFakeAgent() *fakeAgent {
	return &fakeAgent{
		services:    map[string]*api.AgentServiceRegistration{},
		checks:      map[string]health.CheckStatus{},
		outputs:     map[string]string{},
		gens:        map[string]uint64{},
		keySessions: map[string]string{},
		calls:       make(chan call, 10000),
		created:     map[string]uint64{},
	}
}

func (f *fakeAgent) Register(_ context.Context, reg *api.AgentServiceRegistration) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	c := call{
		op:      "register",
		service: reg.ID,
		session: reg.Meta[health.MetaSessionID],
		state:   reg.Meta[health.MetaState],
	}
	if f.regErr != nil {
		if err := f.regErr(); err != nil {
			c.err = err
			f.calls <- c
			return err
		}
	}
	if old := f.services[reg.ID]; old != nil { // replace-existing-checks
		for _, ch := range old.Checks {
			delete(f.checks, ch.CheckID)
		}
	}
	f.services[reg.ID] = reg
	for _, ch := range reg.Checks {
		f.checks[ch.CheckID] = health.CheckStatus(ch.Status)
	}
	f.calls <- c
	return nil
}

func (f *fakeAgent) Deregister(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.deregErr != nil {
		if err := f.deregErr(id); err != nil {
			f.calls <- call{op: "deregister", service: id, err: err}
			return err
		}
	}
	if old := f.services[id]; old != nil {
		for _, ch := range old.Checks {
			delete(f.checks, ch.CheckID)
		}
		f.calls <- call{op: "deregister", service: id, session: old.Meta[health.MetaSessionID]}
	}
	delete(f.services, id)
	return nil
}

func (f *fakeAgent) UpdateTTL(
	_ context.Context,
	checkID string,
	status health.CheckStatus,
	output string,
) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, sess, _, _ := health.ParseCheckID(checkID)
	c := call{op: "ttl", service: checkID, session: sess, status: status, output: output}
	if f.ttlErr != nil {
		if err := f.ttlErr(checkID); err != nil {
			c.err = err
			f.calls <- c
			return err
		}
	}
	if _, ok := f.checks[checkID]; !ok {
		c.err = ErrUnknownCheck
		f.calls <- c
		return fmt.Errorf("fake: %w", ErrUnknownCheck)
	}
	f.checks[checkID] = status
	f.outputs[checkID] = output
	f.calls <- c
	return nil
}

func (f *fakeAgent) LocalService(_ context.Context, id string) (*api.AgentService, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	reg := f.services[id]
	if reg == nil {
		return nil, nil
	}
	return &api.AgentService{
		ID:      reg.ID,
		Service: reg.Name,
		Meta:    reg.Meta,
		Address: reg.Address,
		Port:    reg.Port,
	}, nil
}

func (f *fakeAgent) Sessions(_ context.Context, task, instanceID string) ([]RemoteSession, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []RemoteSession
	for _, reg := range f.services {
		if reg.Name == task && reg.Meta[health.MetaInstanceID] == instanceID {
			sess := reg.Meta[health.MetaSessionID]
			gen, _ := strconv.ParseUint(reg.Meta[health.MetaGeneration], 10, 64)
			replaces, _ := health.ParseReplaces(sess, reg.Meta[health.MetaReplaces])
			id := health.CheckID(instanceID, sess, task)
			out = append(
				out,
				RemoteSession{
					Node:             "local",
					SessionID:        sess,
					Generation:       gen,
					Status:           f.checks[id],
					Replaces:         replaces,
					LeaseCreateIndex: f.created[id],
				},
			)
		}
	}
	if f.sessionsRead != nil {
		select {
		case f.sessionsRead <- struct{}{}:
		default:
		}
	}
	return append(out, f.others...), nil
}

func (f *fakeAgent) NextGeneration(
	_ context.Context,
	instanceID, sessionID string,
	floor uint64,
) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.gens[instanceID] = max(f.gens[instanceID], floor) + 1
	f.keySessions[instanceID] = sessionID
	return f.gens[instanceID], nil
}

func (f *fakeAgent) NodeFailed(context.Context) (bool, error) { return false, nil }

func (f *fakeAgent) Generation(
	_ context.Context,
	instanceID string,
) (health.GenerationRecord, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return health.GenerationRecord{
		Generation: f.gens[instanceID],
		SessionID:  f.keySessions[instanceID],
	}, nil
}

// forget drops every registration, as a restarted agent without state does.
func (f *fakeAgent) forget() {
	f.mu.Lock()
	defer f.mu.Unlock()
	clear(f.services)
	clear(f.checks)
}

func (f *fakeAgent) output(checkID string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.outputs[checkID]
}

func (f *fakeAgent) service(id string) *api.AgentServiceRegistration {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.services[id]
}

// next returns the next call matching op, failing the test after a deadline.
func (f *fakeAgent) next(t *testing.T, op string) call {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		select {
		case c := <-f.calls:
			if c.op == op {
				return c
			}
		case <-deadline:
			t.Fatalf("no %s call within 5s", op)
		}
	}
}

// noCall fails if a call with op is already queued.
func (f *fakeAgent) noCall(t *testing.T, op string) {
	t.Helper()
	for {
		select {
		case c := <-f.calls:
			if c.op == op {
				t.Fatalf("unexpected %s call: %+v", op, c)
			}
		default:
			return
		}
	}
}

// takeKey writes instanceID's generation key as a session start does.
func (f *fakeAgent) takeKey(instanceID, sessionID string, gen uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.gens[instanceID], f.keySessions[instanceID] = gen, sessionID
}
