package consul

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strings"
	"time"
)

// LossReason says why a session's lease ended.
type LossReason string

const (
	// LossRefused: the agent refused a heartbeat (it does not know the check):
	// it restarted and forgot the session, or a newer session replaced it.
	LossRefused LossReason = "refused"
	// LossExpired: no heartbeat was acknowledged for a whole lease, measured on
	// the monotonic clock (GC pause, SIGSTOP, agent unreachable, failing probe).
	LossExpired LossReason = "expired"
	// LossSuperseded: a session of the same instance with a higher generation
	// is registered through another agent (its heartbeats there are accepted,
	// so only the catalog tells).
	LossSuperseded LossReason = "superseded"
	// LossNodeFailed: Consul declared this executor's node failed (its
	// serfHealth check went critical) after the session registered: leasehold
	// treats the session as lapsed for ever, whatever its check says now.
	LossNodeFailed LossReason = "node-failed"
	// LossOvertaken: a generation above this session's was taken in Consul KV
	// and stayed unregistered for a whole lease (its process died before
	// registering): leasehold calls this session STALE, so it takes a new one.
	LossOvertaken LossReason = "overtaken"
)

// LossReasons are every LossReason, the known values of the lease-loss
// metric's reason label.
var LossReasons = []LossReason{LossRefused, LossExpired, LossSuperseded, LossNodeFailed,
	LossOvertaken}

// LeaseLoss describes the end of one session's lease.
type LeaseLoss struct {
	InstanceID string
	SessionID  string
	Reason     LossReason
	// Superseded is true when a newer session of the same instance is alive:
	// this process must stop, it will not register again.
	Superseded bool
	At         time.Time     // when the loss was noticed
	SinceAck   time.Duration // since the last acknowledged heartbeat was sent
	Err        error         // the refusal or last heartbeat error, if any
}

// LeaseLostError is the cause of a lost session's context.
type LeaseLostError struct{ Loss LeaseLoss }

func (e *LeaseLostError) Error() string {
	msg := fmt.Sprintf(
		"lease of session %s lost (%s after %s without an acknowledged heartbeat)",
		e.Loss.SessionID,
		e.Loss.Reason,
		e.Loss.SinceAck.Round(time.Millisecond),
	)
	if e.Loss.Superseded {
		msg += "; superseded by a newer session of instance " + e.Loss.InstanceID
	}
	if e.Loss.Err != nil {
		msg += ": " + e.Loss.Err.Error()
	}
	return msg
}

// ErrLeaseLost matches every *LeaseLostError with errors.Is.
var ErrLeaseLost = errors.New("lease lost")

func (e *LeaseLostError) Is(target error) bool { return target == ErrLeaseLost }

var (
	// ErrDrained is the cause of a session ended by Drain.
	ErrDrained = errors.New("executor drained and deregistered")
	// ErrStopped is the cause of a session ended because Run's context ended.
	ErrStopped = errors.New("registrar stopped")
	// ErrSuperseded is returned by Run when a newer session of the same
	// instance took over: two processes must not fight over one instance id.
	ErrSuperseded = errors.New("superseded by a newer session of this instance")
)

// Session is one registration generation of this process. Work claimed under
// a session must stop (or at least not be confirmed) once Context is done.
type Session struct {
	ID         string
	Generation uint64 // orders the sessions of this instance: newest is highest
	// Replaces: the older sessions of this instance its registrations name
	// (so that a leasehold which never saw them answers them STALE).
	Replaces []string
	ctx      context.Context
}

func (s *Session) key() sessionKey { return sessionKey{s.ID, s.Generation, s.Replaces} }

// sessionKey identifies a session before it is published.
type sessionKey struct {
	id         string
	generation uint64
	replaces   []string // older sessions of the instance it replaces (health.Registration.Replaces)
}

// Context is cancelled when the session ends; context.Cause says why
// (*LeaseLostError, ErrDrained or ErrStopped).
func (s *Session) Context() context.Context { return s.ctx }

// Done is closed when the session ends.
func (s *Session) Done() <-chan struct{} { return s.ctx.Done() }

// Err is nil while the session is current, then why it ended.
func (s *Session) Err() error { return context.Cause(s.ctx) }

// newSessionID returns a fresh random id (128 bits, lower-case base32).
func newSessionID() string { return strings.ToLower(rand.Text()) }
