package consul

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jonboulle/clockwork"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/health"
)

// Registrar registers a Go executor through its local Consul agent under a
// fresh session, keeps the TTL lease alive with heartbeats, fences itself when
// the lease is lost and drains on request. One goroutine (Run) owns all state.
type Registrar struct {
	agent Agent
	cfg   Config
	log   *slog.Logger

	drainCh chan drainRequest
	loadCh  chan struct{} // LoadChanged: the load may have crossed the capacity
	exited  chan struct{} // closed when Run returns
	running atomic.Bool

	own        map[string]bool    // sessions this process created; owned by Run
	ownGen     uint64             // the highest generation this process took; owned by Run
	registered []priorSession     // this process's last session and those it replaced; owned by Run
	sentStatus health.CheckStatus // the status the last heartbeat sent; owned by Run
	registrarTelemetry

	mu      sync.Mutex
	session *Session
	changed chan struct{} // closed and replaced whenever session changes
}

type drainRequest struct {
	ctx  context.Context
	done chan error
}

// NewRegistrar validates cfg and returns a Registrar; nothing is registered
// until Run. Invalid configuration returns health.FieldErrors naming each field.
func NewRegistrar(agent Agent, cfg Config) (*Registrar, error) {
	if agent == nil {
		return nil, errors.New("registrar: nil Consul agent")
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("registrar config: %w", err)
	}
	cfg = cfg.withDefaults()
	r := &Registrar{
		agent:   agent,
		cfg:     cfg,
		log:     cfg.Logger.With("instance_id", cfg.InstanceID),
		drainCh: make(chan drainRequest),
		loadCh:  make(chan struct{}, 1),
		exited:  make(chan struct{}),
		changed: make(chan struct{}),
		own:     make(map[string]bool),
	}
	r.initTelemetry()
	return r, nil
}

// Session is the current session, or nil before the first registration.
func (r *Registrar) Session() *Session {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.session
}

// WaitSession waits until a registered session other than prev is current.
func (r *Registrar) WaitSession(ctx context.Context, prev *Session) (*Session, error) {
	for {
		r.mu.Lock()
		s, changed := r.session, r.changed
		r.mu.Unlock()
		if s != nil && s != prev && s.Err() == nil {
			return s, nil
		}
		select {
		case <-changed:
		case <-r.exited:
			return nil, ErrStopped
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Done is closed when Run has returned.
func (r *Registrar) Done() <-chan struct{} { return r.exited }

// Run registers, heartbeats and re-registers after a lost lease until ctx ends
// (then it deregisters), Drain completes (returns nil), a newer session of
// this instance supersedes it (ErrSuperseded), Consul's ACLs refuse the
// registration permissionAttempts times in a row (*PermissionError) or, with
// NoReregister, the lease is lost (*LeaseLostError).
func (r *Registrar) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("registrar: Run called twice")
	}
	defer close(r.exited)
	reregister := false
	for {
		sess, cancel, renewedAt, err := r.registerSession(ctx, reregister)
		if err != nil {
			if !errors.Is(err, ErrSuperseded) {
				r.deregisterOwn("") // a lost session's registration may linger
			}
			if errors.Is(err, errDrainedIdle) {
				return nil
			}
			return err
		}
		sctx, span := r.sessionSpan(sess.key(), renewedAt)
		_, reg := r.tracer.Start(
			sctx,
			"leasehold.executor.register",
			trace.WithTimestamp(renewedAt),
		)
		reg.End()
		out := r.keepAlive(trace.ContextWithSpan(ctx, span), sess, renewedAt)
		switch {
		case out.drained:
			cancel(ErrDrained) // before Drain returns, so callers see the session ended
			out.drainDone <- out.drainErr
			span.End()
			return nil
		case out.loss == nil: // ctx ended
			r.deregisterOwn(sess.ID)
			cancel(ErrStopped)
			if out.drainDone != nil {
				out.drainDone <- out.drainErr
			}
			span.End()
			return ctx.Err()
		}
		loss := *out.loss
		loss.Superseded = loss.Reason == LossSuperseded || r.superseded(ctx)
		r.lossRecorded(span, loss)
		span.End()
		lostErr := &LeaseLostError{Loss: loss}
		cancel(lostErr)
		if out.drainDone != nil {
			out.drainDone <- out.drainErr
		}
		r.notifyLost(loss)
		r.log.Warn("lease lost", "session_id", sess.ID, "reason", loss.Reason,
			"since_ack", loss.SinceAck, "superseded", loss.Superseded, "err", loss.Err)
		switch {
		case loss.Superseded:
			r.deregisterOwn(sess.ID) // ours only: never a newer session's
			return fmt.Errorf("%w: %w", ErrSuperseded, lostErr)
		case r.cfg.NoReregister:
			return lostErr
		}
		reregister = true
	}
}

// LoadChanged tells the Registrar that Load may have changed (a task
// started or ended). When the load crosses the capacity — full (lease check
// warning: no new work) or free again — the status is sent at once instead
// of at the next heartbeat. Cheap and non-blocking: call it on every change.
func (r *Registrar) LoadChanged() {
	select {
	case r.loadCh <- struct{}{}:
	default:
	}
}

// Drain marks every registration draining (no new dispatch; in-flight work
// and heartbeats go on), waits until Load reports 0 or ctx ends, then
// deregisters. It returns an error wrapping ctx's error if work was still in
// flight when ctx ended (the registrations are removed all the same).
func (r *Registrar) Drain(ctx context.Context) error {
	req := drainRequest{ctx: ctx, done: make(chan error, 1)}
	select {
	case r.drainCh <- req:
	case <-r.exited:
		return ErrStopped
	case <-ctx.Done():
		return fmt.Errorf("drain: %w", ctx.Err())
	}
	select {
	case err := <-req.done:
		return err
	case <-r.exited:
		select {
		case err := <-req.done:
			return err
		default:
			return ErrStopped
		}
	}
}

var errDrainedIdle = errors.New("drained before registration")

// permissionAttempts bounds the registrations Consul's ACLs refuse in a row
// before Run gives up with the *PermissionError: a token just created may
// take a moment to reach the agent, but no amount of waiting grants a right.
const permissionAttempts = 3

// registerSession registers every task under a fresh session id, retrying
// with backoff (and only while the probe passes) until it succeeds. A
// re-registration first makes sure no newer session of this instance exists.
func (r *Registrar) registerSession(
	ctx context.Context,
	reregister bool,
) (*Session, context.CancelCauseFunc, time.Time, error) {
	key := sessionKey{id: newSessionID()}
	log := r.log.With("session_id", key.id)
	bo := newBackoff(100*time.Millisecond, r.cfg.retryCap())
	var sentAt time.Time
	failures, denied := 0, 0 // denied: consecutive refusals by Consul's ACLs
	for {
		var err error
		sentAt, err = r.tryRegister(ctx, &key, reregister)
		if err == nil {
			break
		}
		if errors.Is(err, ErrSuperseded) {
			return nil, nil, time.Time{}, err
		}
		if !errors.Is(err, ErrPermission) {
			denied = 0
		} else if denied++; denied >= permissionAttempts {
			log.Error("registration refused by Consul's ACLs: giving up", "err", err,
				"attempts", denied)
			return nil, nil, time.Time{}, err
		}
		if denied > 0 {
			log.Warn("registration refused by Consul's ACLs; retrying in case the token is "+
				"new", "err", err, "attempts", denied, "of", permissionAttempts)
		} else if failures++; failures == 1 || failures%20 == 0 {
			// The first failure and every twentieth: no flood of the log
			// while, say, a probe fails.
			log.Warn("registration failed; retrying", "err", err, "attempts", failures)
		} else {
			log.Debug("registration failed; retrying", "err", err, "attempts", failures)
		}
		wait := r.cfg.Clock.NewTimer(bo.next())
		select {
		case <-ctx.Done():
			wait.Stop()
			return nil, nil, time.Time{}, ctx.Err()
		case req := <-r.drainCh: // nothing registered: nothing to drain
			wait.Stop()
			req.done <- nil
			return nil, nil, time.Time{}, errDrainedIdle
		case <-wait.Chan():
		}
	}
	// And those it replaced, for the next session to name.
	r.registered = []priorSession{{key.id, key.generation}}
	for _, old := range key.replaces {
		r.registered = append(r.registered, priorSession{old, key.generation})
	}
	sctx, cancel := context.WithCancelCause(context.Background())
	sess := &Session{ID: key.id, Generation: key.generation, Replaces: key.replaces, ctx: sctx}
	r.mu.Lock()
	r.session = sess
	close(r.changed)
	r.changed = make(chan struct{})
	r.mu.Unlock()
	log.Info("registered", "generation", key.generation, "tasks", r.cfg.Tasks,
		"address", r.cfg.hostPort(), "version", r.cfg.Version, "capacity", r.cfg.Capacity,
		"reregister", reregister, "replaces", key.replaces)
	return sess, cancel, sentAt, nil
}

// tryRegister makes one attempt and returns when its requests started: the
// agent's TTL timers started no earlier.
func (r *Registrar) tryRegister(
	ctx context.Context,
	key *sessionKey,
	reregister bool,
) (time.Time, error) {
	if err := r.probe(ctx); err != nil {
		return time.Time{}, fmt.Errorf("probe: %w", err)
	}
	r.own[key.id] = true
	if reregister && r.superseded(ctx) {
		return time.Time{}, ErrSuperseded
	}
	if reregister {
		// A session registered while the servers hold our node failed is
		// lapsed from its first moment: wait until the node is back.
		if failed, err := r.agent.NodeFailed(ctx); err == nil && failed {
			return time.Time{}, errors.New(
				"this agent's node is failed (serfHealth critical): waiting for it to rejoin",
			)
		}
	}
	rctx, cancel := context.WithTimeout(ctx, r.cfg.Lease.TTL)
	defer cancel()
	if key.generation == 0 {
		prior := r.priorSessions(rctx)
		// This process's own sessions are older too, whatever KV and the catalog still show.
		highest := r.ownGen
		for _, p := range prior {
			highest = max(highest, p.generation)
		}
		gen, err := r.agent.NextGeneration(rctx, r.cfg.InstanceID, key.id, highest)
		if err != nil {
			return time.Time{}, fmt.Errorf("session generation: %w", err)
		}
		key.generation = gen
		key.replaces = replacedSessions(
			append(prior, r.registered...),
			r.cfg.InstanceID,
			key.id,
			gen,
		)
		r.ownGen = max(r.ownGen, gen)
	}
	sentAt := r.cfg.Clock.Now()
	for _, task := range r.cfg.Tasks {
		reg := r.serviceRegistration(*key, task, health.StateActive)
		if err := r.agent.Register(rctx, reg); err != nil {
			return time.Time{}, err
		}
	}
	// A check definition has no output: the first heartbeat sets the load.
	if err := r.renew(rctx, *key, sentAt, false); err != nil {
		return time.Time{}, err
	}
	return sentAt, nil
}

// priorSession is an older session of this instance a new one replaces.
type priorSession struct {
	id         string
	generation uint64 // for one only named by another registration: that one's
}

// priorSessions lists the sessions of this instance the catalog shows, each
// followed by those it names as replaced. Their highest generation is the
// floor of the next one.
func (r *Registrar) priorSessions(ctx context.Context) []priorSession {
	var prior []priorSession
	for _, task := range r.cfg.Tasks {
		others, err := r.agent.Sessions(ctx, task, r.cfg.InstanceID)
		if err != nil {
			continue // KV alone still orders sessions
		}
		for _, o := range others {
			prior = append(prior, priorSession{o.SessionID, o.Generation})
			for _, old := range o.Replaces {
				prior = append(prior, priorSession{old, o.Generation})
			}
		}
	}
	return prior
}

// replacedSessions is what a new session (id, generation gen) names in its
// replaces meta: the newest older sessions known, so that a leasehold which
// never saw them still answers them STALE. A session at gen or above (a
// concurrent start) or without a generation is not known to be older.
func replacedSessions(prior []priorSession, instanceID, id string, gen uint64) []string {
	prior = slices.Clone(prior)
	slices.SortStableFunc(
		prior,
		func(a, b priorSession) int { return cmp.Compare(b.generation, a.generation) },
	)
	var out []string
	for _, p := range prior {
		if len(out) == health.MaxReplaces {
			break
		}
		if p.generation == 0 || p.generation >= gen || p.id == id || slices.Contains(out, p.id) {
			continue
		}
		if health.ValidateSessionQuery(instanceID, p.id) != nil {
			continue // not a session id (a registration breaking the contract)
		}
		out = append(out, p.id)
	}
	return out
}

func (r *Registrar) serviceRegistration(
	sess sessionKey,
	task string,
	state health.State,
) *api.AgentServiceRegistration {
	reg := r.cfg.registration(sess, task, state)
	sessionID := sess.id
	load := r.cfg.Load()
	return &api.AgentServiceRegistration{
		ID:      health.ServiceID(r.cfg.InstanceID, task),
		Name:    task,
		Tags:    []string{r.cfg.Tag},
		Address: r.cfg.Address,
		Port:    r.cfg.Port,
		Meta:    reg.Meta(),
		Checks: api.AgentServiceChecks{{
			CheckID:                        health.CheckID(r.cfg.InstanceID, sessionID, task),
			Name:                           "leasehold lease " + sessionID,
			TTL:                            r.cfg.Lease.TTL.String(),
			Status:                         string(health.HeartbeatStatus(load, r.cfg.Capacity)),
			Notes:                          "leasehold executor lease; output carries the load",
			DeregisterCriticalServiceAfter: r.cfg.Lease.DeregisterAfter.String(),
		}},
	}
}

func (r *Registrar) probe(ctx context.Context) error {
	if r.cfg.Probe == nil {
		return nil
	}
	pctx, cancel := context.WithTimeout(ctx, r.cfg.Lease.Heartbeat)
	defer cancel()
	return r.cfg.Probe(pctx)
}

type keepAliveResult struct {
	drained   bool
	drainDone chan error // answered by Run once the session is ended
	drainErr  error
	loss      *LeaseLoss // nil with drained false: ctx ended
}

// keepAlive heartbeats one session until its lease is lost, it is drained or
// ctx ends. The lease deadline is measured from the instant the last
// acknowledged heartbeat was sent, on the monotonic clock, and checked before
// every heartbeat: a lapsed session is never renewed back to passing.
func (r *Registrar) keepAlive(
	ctx context.Context,
	sess *Session,
	renewedAt time.Time,
) keepAliveResult {
	clock, lease := r.cfg.Clock, r.cfg.Lease
	k := &keeper{
		r:         r,
		ctx:       ctx,
		sess:      sess,
		renewedAt: renewedAt,
		log:       r.log.With("session_id", sess.ID),
		bo:        newBackoff(100*time.Millisecond, r.cfg.retryCap()),
	}
	k.next = clock.NewTimer(lease.Heartbeat - clock.Since(renewedAt))
	defer k.next.Stop()
	k.deadline = clock.NewTimer(lease.TTL - clock.Since(renewedAt))
	defer k.deadline.Stop()
	var fenceC <-chan time.Time
	if r.cfg.FenceCheck > 0 {
		t := clock.NewTicker(r.cfg.FenceCheck)
		defer t.Stop()
		fenceC = t.Chan()
	}
	defer k.stopDrainPoll()
	for {
		select {
		case <-ctx.Done():
			if k.drain != nil {
				return keepAliveResult{drainDone: k.drain.done, drainErr: ErrStopped}
			}
			return keepAliveResult{}
		case <-k.deadline.Chan():
			return k.lose(LossExpired, k.lastErr)
		case req := <-r.drainCh:
			k.startDrain(req)
		case <-k.drainPollC:
			if r.cfg.Load() <= 0 || k.drain.ctx.Err() != nil {
				return k.finishDrain()
			}
		case <-r.loadCh:
			if health.HeartbeatStatus(r.cfg.Load(), r.cfg.Capacity) != r.sentStatus &&
				k.lastErr == nil {
				// Full or free again: the status goes out now, not at the next
				// heartbeat (at most every 100 ms, so that a load flapping at the
				// capacity is not a write per task).
				k.next.Reset(max(0, 100*time.Millisecond-clock.Since(k.renewedAt)))
			}
		case <-fenceC:
			if reason, err := r.fenceCheck(ctx, sess, &k.fence); reason != "" {
				k.log.Warn("session ended by the fence check", "reason", reason, "err", err)
				return k.lose(reason, err)
			}
		case <-k.next.Chan():
			if res, ended := k.heartbeat(); ended {
				return res
			}
			if fenceC != nil && k.fence.leaseCreated == 0 && k.fence.early < earlyFenceChecks &&
				k.lastErr == nil {
				// Until the fence check knows our lease check, it runs with
				// the first heartbeats rather than a lease later: leasehold
				// learns the check's CreateIndex when it is registered, and a
				// check the catalog re-creates soon after must end the
				// session here as it does there (health.LeaseCheckRecreated).
				k.fence.early++
				if reason, err := r.fenceCheck(ctx, sess, &k.fence); reason != "" {
					k.log.Warn("session ended by the fence check", "reason", reason, "err", err)
					return k.lose(reason, err)
				}
			}
		}
	}
}

// keeper is keepAlive's state: one session's timers, its last heartbeat and
// the drain in progress.
type keeper struct {
	r         *Registrar
	ctx       context.Context
	sess      *Session
	log       *slog.Logger
	renewedAt time.Time // when the last acknowledged heartbeat was sent
	lastErr   error     // of the heartbeats failing since
	bo        *backoff
	next      clockwork.Timer // the next heartbeat
	deadline  clockwork.Timer // the lease's end
	fence     fenceState

	drain       *drainRequest
	drainMarked bool // registrations carry state=draining
	drainPollC  <-chan time.Time
	drainPoll   clockwork.Ticker
	drainSpan   trace.Span
}

// lose ends the session; a drain in progress ends with it.
func (k *keeper) lose(reason LossReason, err error) keepAliveResult {
	now := k.r.cfg.Clock.Now()
	res := keepAliveResult{loss: &LeaseLoss{
		InstanceID: k.r.cfg.InstanceID, SessionID: k.sess.ID, Reason: reason,
		At: now, SinceAck: now.Sub(k.renewedAt), Err: err,
	}}
	if k.drain != nil {
		res.drainDone, res.drainErr = k.drain.done, fmt.Errorf("drain: %w", ErrLeaseLost)
		k.drainSpan.SetStatus(codes.Error, "lease lost while draining")
		k.drainSpan.End()
	}
	return res
}

// startDrain marks the session draining at once (through the fenced
// renewal) and polls the load until the tasks in flight are done.
func (k *keeper) startDrain(req drainRequest) {
	if k.drain != nil {
		req.done <- errors.New("drain already in progress")
		return
	}
	k.drain = &req
	_, k.drainSpan = k.r.tracer.Start(
		k.ctx,
		"leasehold.executor.drain",
		trace.WithAttributes(attribute.Int("leasehold.in_flight", k.r.cfg.Load())),
	)
	k.log.Info("draining", "in_flight", k.r.cfg.Load())
	k.drainPoll = k.r.cfg.Clock.NewTicker(min(100*time.Millisecond, k.r.cfg.Lease.Heartbeat))
	k.drainPollC = k.drainPoll.Chan()
	k.next.Reset(0)
}

func (k *keeper) stopDrainPoll() {
	if k.drainPoll != nil {
		k.drainPoll.Stop()
	}
}

// finishDrain deregisters: the tasks in flight are done, or the drain's
// deadline passed (an error then).
func (k *keeper) finishDrain() keepAliveResult {
	defer k.drainSpan.End()
	var err error
	if load := k.r.cfg.Load(); load > 0 {
		err = fmt.Errorf(
			"drain: %d tasks still in flight when the deadline passed: %w",
			load,
			context.Cause(k.drain.ctx),
		)
	}
	_, dereg := k.r.tracer.Start(k.ctx, "leasehold.executor.deregister")
	derr := k.r.deregisterOwn(k.sess.ID)
	if derr != nil {
		dereg.SetStatus(codes.Error, derr.Error())
	}
	dereg.End()
	switch {
	case err == nil && derr == nil:
		k.log.Info("drained and deregistered")
	case derr == nil:
		k.log.Warn("deregistered with tasks still in flight", "err", err)
	default:
		// Said as it is: a registration the agent kept stays, draining (no
		// new work), until its lease lapses.
		derr = fmt.Errorf("drain: deregister: %w", derr)
		k.log.Warn("not deregistered: the registration lapses with its lease instead",
			"drained", err == nil, "err", errors.Join(err, derr))
	}
	return keepAliveResult{drained: true, drainDone: k.drain.done,
		drainErr: errors.Join(err, derr)}
}

// heartbeat renews the session unless its lease is over (a paused process)
// or the probe fails; ended reports a loss.
func (k *keeper) heartbeat() (res keepAliveResult, ended bool) {
	clock, lease := k.r.cfg.Clock, k.r.cfg.Lease
	now := clock.Now()
	if lease.Expired(k.renewedAt, now) { // e.g. the process was paused
		return k.lose(LossExpired, k.lastErr), true
	}
	if err := k.r.probe(k.ctx); err != nil {
		k.lastErr = fmt.Errorf("probe: %w", err)
		k.log.Warn("probe failed; heartbeat withheld", "err", err,
			"lease_left", lease.TTL-now.Sub(k.renewedAt))
		k.next.Reset(min(lease.Heartbeat, lease.TTL-clock.Since(k.renewedAt)))
		return res, false
	}
	hbStart := time.Now()
	err := k.r.renew(k.ctx, k.sess.key(), k.renewedAt, k.drain != nil && !k.drainMarked)
	k.r.heartbeatDone(k.ctx, trace.SpanFromContext(k.ctx), time.Since(hbStart), err)
	switch {
	case err == nil:
		k.renewedAt, k.lastErr = now, nil
		k.bo.reset()
		if k.drain != nil && !k.drainMarked {
			k.drainMarked = true
			k.log.Info("marked draining")
		}
		k.deadline.Reset(lease.TTL - clock.Since(k.renewedAt))
		k.next.Reset(lease.Heartbeat - clock.Since(k.renewedAt))
	case errors.Is(err, ErrUnknownCheck):
		return k.lose(LossRefused, err), true
	case k.ctx.Err() != nil:
		k.next.Reset(0) // keepAlive's ctx case ends it
	default: // transient: retry inside the lease; only the deadline ends it
		k.lastErr = err
		wait := k.bo.next()
		k.log.Warn("heartbeat failed; retrying", "err", err, "retry_in", wait,
			"lease_left", lease.TTL-clock.Since(k.renewedAt))
		k.next.Reset(wait)
	}
	return res, false
}

// renew sends one heartbeat for every task. With markDrain it then
// re-registers with state=draining; the heartbeat first proves the session is
// still the agent's, so a replaced session is never registered back.
func (r *Registrar) renew(
	ctx context.Context,
	sess sessionKey,
	renewedAt time.Time,
	markDrain bool,
) error {
	sessionID := sess.id
	left := r.cfg.Lease.TTL - r.cfg.Clock.Since(renewedAt)
	rctx, cancel := context.WithTimeout(ctx, left)
	defer cancel()
	load := r.cfg.Load()
	status, output := health.HeartbeatStatus(load, r.cfg.Capacity), health.LoadOutput(load)
	for _, task := range r.cfg.Tasks {
		checkID := health.CheckID(r.cfg.InstanceID, sessionID, task)
		if err := r.agent.UpdateTTL(rctx, checkID, status, output); err != nil {
			return err
		}
	}
	r.sentStatus = status // what LoadChanged compares with
	if !markDrain {
		return nil
	}
	for _, task := range r.cfg.Tasks {
		reg := r.serviceRegistration(sess, task, health.StateDraining)
		if err := r.agent.Register(rctx, reg); err != nil {
			return err
		}
	}
	return nil
}

// superseded reports whether a session of this instance that this process
// did not create, with a higher generation than any this process took, is
// alive: on this agent under our service id, or (not critical) anywhere in
// the catalog — and is the one the instance's generation key names (a
// registration the key does not confirm may be forged by another instance,
// and leasehold does not route it: it supersedes nothing). Two processes
// must never take turns replacing each other; an older session (a crashed
// predecessor whose registration lingers on another agent) supersedes
// nothing. Errors count as "no": the caller then retries registering.
func (r *Registrar) superseded(ctx context.Context) bool {
	qctx, cancel := context.WithTimeout(ctx, min(r.cfg.Lease.TTL, 5*time.Second))
	defer cancel()
	key, err := r.agent.Generation(qctx, r.cfg.InstanceID)
	if err != nil {
		return false
	}
	newer := func(sessionID string, gen uint64) bool {
		return !r.own[sessionID] && gen > r.ownGen &&
			key.Judge(gen, sessionID) == health.KeyConfirms
	}
	for _, task := range r.cfg.Tasks {
		svc, err := r.agent.LocalService(qctx, health.ServiceID(r.cfg.InstanceID, task))
		if err == nil && svc != nil {
			if gen, err := strconv.ParseUint(svc.Meta[health.MetaGeneration], 10, 64); err == nil &&
				newer(svc.Meta[health.MetaSessionID], gen) {
				return true
			}
		}
		others, err := r.agent.Sessions(qctx, task, r.cfg.InstanceID)
		if err != nil {
			continue
		}
		for _, o := range others {
			if newer(o.SessionID, o.Generation) && o.Status != health.StatusCritical {
				return true
			}
		}
	}
	return false
}

// fenceState is what the fence checks of one session remember.
type fenceState struct {
	// Since when a generation above ours is taken (KV, or a dead registration).
	aheadSince   time.Time
	leaseCreated uint64 // the catalog's CreateIndex of our lease check, as first seen
	early        int    // fence checks run with heartbeats while leaseCreated is not known
	// node is where this session's registration is (the node of its lease
	// check created first, as first seen): a registration of its id on
	// another node is a copy — anyone may read the id in the catalog — and
	// neither its lease check nor its node's failure is this session's.
	node string
}

// earlyFenceChecks is how many heartbeats of a session at most run a fence
// check while it does not know the session's lease check yet (the catalog
// has it once the agent synced the registration, at once as a rule); then
// the periodic checks learn it.
const earlyFenceChecks = 3

// fenceCheck looks in the catalog and KV for what ends this session although
// its heartbeats are accepted: a newer session registered through another
// agent (this process is then superseded), a failure of our node (leasehold
// saw the session LAPSED, for ever), or a generation taken above ours that
// stayed unregistered for a whole lease (a process that crashed between
// taking it and registering: leasehold calls our session STALE until we take
// a newer one).
func (r *Registrar) fenceCheck(
	ctx context.Context,
	sess *Session,
	st *fenceState,
) (LossReason, error) {
	qctx, cancel := context.WithTimeout(ctx, min(r.cfg.Lease.Heartbeat, 5*time.Second))
	defer cancel()
	others, err := r.agent.Sessions(qctx, r.cfg.Tasks[0], r.cfg.InstanceID)
	if err != nil {
		return "", nil // cannot tell: the next check will
	}
	key, err := r.agent.Generation(qctx, r.cfg.InstanceID)
	if err != nil {
		return "", nil
	}
	// Only a registration the instance's generation key confirms is a
	// session at all (leasehold's rule, health.FenceInstance): one above the
	// key, or at its generation under another session, may be forged by
	// another instance and neither supersedes nor overtakes this one.
	confirmed := func(o RemoteSession) bool {
		return !r.own[o.SessionID] && o.Generation > sess.Generation &&
			key.Judge(o.Generation, o.SessionID) == health.KeyConfirms
	}
	for _, o := range others {
		if confirmed(o) && o.Status != health.StatusCritical {
			return LossSuperseded, fmt.Errorf(
				"session %s (generation %d) on node %s is newer",
				o.SessionID,
				o.Generation,
				o.Node,
			)
		}
	}
	home := sessionHome(others, sess.ID, st)
	var ahead uint64 // the highest generation above ours, registered (dead) or taken in KV
	for _, o := range others {
		mine := o.SessionID == sess.ID && (home == "" || o.Node == home)
		switch {
		case mine && o.NodeFailed:
			return LossNodeFailed, fmt.Errorf(
				"node %s failed (serfHealth critical) after this session registered: the session "+
					"counts as lapsed",
				o.Node,
			)
		case mine && o.LeaseCreateIndex != 0:
			if health.LeaseCheckRecreated(st.leaseCreated, o.LeaseCreateIndex) {
				// It is leasehold's rule too: it answers the session LAPSED.
				return LossNodeFailed, fmt.Errorf(
					"the catalog lost this session's lease check and re-created it (created at "+
						"%d, now at %d: its agent left and came back, or its node was reaped): "+
						"the session counts as lapsed",
					st.leaseCreated,
					o.LeaseCreateIndex,
				)
			}
			if st.leaseCreated == 0 {
				st.leaseCreated = o.LeaseCreateIndex // the first seen, as leasehold keeps it
			}
		case confirmed(o):
			ahead = max(ahead, o.Generation) // dead (live ones supersede above): it still fences us
		}
	}
	if key.Judge(sess.Generation, sess.ID) == health.KeyDenies {
		// Below our generation, or ours under another session: Consul's KV
		// was restored or rewritten. leasehold no longer routes this session
		// (unconfirmed); a new one takes a generation above every known one.
		return LossOvertaken, fmt.Errorf(
			"the generation key %s holds %q, which does not name this session (generation %d): "+
				"leasehold calls it unconfirmed",
			health.GenerationKey(r.cfg.InstanceID),
			key.Value(),
			sess.Generation,
		)
	}
	ahead = max(ahead, key.Generation)
	gen := ahead
	if ahead <= sess.Generation {
		st.aheadSince = time.Time{}
		return "", nil
	}
	now := r.cfg.Clock.Now()
	if st.aheadSince.IsZero() {
		st.aheadSince = now
	}
	if now.Sub(st.aheadSince) >= r.cfg.Lease.TTL {
		return LossOvertaken, fmt.Errorf(
			"generation %d is above ours (%d) in Consul KV %s or a dead registration, and no "+
				"live session has it after a lease: leasehold calls ours STALE",
			gen,
			sess.Generation,
			health.GenerationKey(r.cfg.InstanceID),
		)
	}
	return "", nil
}

// sessionHome is the node of session id's registration (st.node once
// known): the node of its lease check created first among those listed —
// every registration of the session comes from this process through one
// agent, and a copy elsewhere can only be made once the id is in the
// catalog, after ours (leasehold's rule: the first registration is the
// session, health.FenceInstance). "" while no lease check of it is listed.
func sessionHome(others []RemoteSession, id string, st *fenceState) string {
	if st.node != "" {
		return st.node
	}
	var first *RemoteSession
	for i := range others {
		o := &others[i]
		if o.SessionID != id || o.LeaseCreateIndex == 0 {
			continue
		}
		if first == nil || o.LeaseCreateIndex < first.LeaseCreateIndex ||
			(o.LeaseCreateIndex == first.LeaseCreateIndex && o.Node < first.Node) {
			first = o
		}
	}
	if first != nil {
		st.node = first.Node
	}
	return st.node
}

// deregisterOwn removes this session's registrations, but never one that a
// newer session of the same instance has already put in its place; the
// error is of those the agent did not remove.
func (r *Registrar) deregisterOwn(sessionID string) error {
	var errs []error
	ctx, cancel := context.WithTimeout(context.Background(), min(r.cfg.Lease.TTL, 5*time.Second))
	defer cancel()
	for _, task := range r.cfg.Tasks {
		id := health.ServiceID(r.cfg.InstanceID, task)
		if svc, err := r.agent.LocalService(ctx, id); err == nil && svc != nil &&
			!r.own[svc.Meta[health.MetaSessionID]] {
			continue
		}
		if err := r.agent.Deregister(ctx, id); err != nil {
			r.log.Warn("deregister failed; the lease will lapse instead", "session_id", sessionID,
				"service_id", id, "err", err)
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (r *Registrar) notifyLost(loss LeaseLoss) {
	if r.cfg.OnLeaseLost != nil {
		r.cfg.OnLeaseLost(loss)
	}
}
