package consul

import (
	"context"
	"log/slog"
	"net"
	"strconv"
	"time"

	"github.com/jonboulle/clockwork"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/health"
)

// Config configures a Registrar. Zero values mean defaults; required fields
// are InstanceID, Tasks, Address, Port, Version and Capacity.
type Config struct {
	InstanceID string            // stable across restarts, from configuration
	Tasks      []string          // task types served: one Consul service each
	Address    string            // host dispatchers dial (IP or DNS name)
	Port       int               // port dispatchers dial
	Version    string            // semantic version of the executor
	Capacity   int               // concurrent tasks the executor accepts
	Labels     map[string]string // stored as label_<key> meta
	Tag        string            // Consul tag marking task types; default "leasehold"

	Lease health.Lease // TTL, heartbeat interval, deregister-after; zero fields are defaults

	// Load reports the work in flight; nil means always 0. Heartbeats report
	// warning while Load() >= Capacity, and Drain waits for it to reach 0.
	Load func() int

	// Probe, when set, must pass before every heartbeat and registration: a
	// heartbeat then proves the executor itself is alive, not just this
	// library. While it fails no heartbeat is sent and the lease runs out.
	Probe func(ctx context.Context) error

	// NoReregister stops Run with the loss instead of registering a fresh
	// session after the lease is lost.
	NoReregister bool

	// FenceCheck is how often the Registrar looks in the catalog for a newer
	// session of its instance registered through another agent (default: once
	// per lease; negative: never). A newer session on the same agent is
	// noticed at once (its heartbeats are refused); on another agent only
	// this check notices it.
	FenceCheck time.Duration

	// OnLeaseLost is called (from the Registrar's goroutine; it must not
	// block) each time a session's lease is lost.
	OnLeaseLost func(LeaseLoss)

	Clock  clockwork.Clock      // default: the real clock (monotonic readings)
	Logger *slog.Logger         // default: slog.Default()
	Tracer trace.TracerProvider // default: no spans
	Meter  metric.MeterProvider // default: no metrics
}

func (c Config) withDefaults() Config {
	c.Lease = c.Lease.WithDefaults()
	if c.FenceCheck == 0 {
		c.FenceCheck = c.Lease.TTL
	}
	if c.Tag == "" {
		c.Tag = health.DefaultTag
	}
	if c.Load == nil {
		c.Load = func() int { return 0 }
	}
	if c.Clock == nil {
		c.Clock = clockwork.NewRealClock()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate reports every invalid field by name (health.FieldErrors).
func (c Config) Validate() error {
	c = c.withDefaults()
	var errs health.FieldErrors
	add := func(err error) {
		if err == nil {
			return
		}
		if fe, ok := err.(health.FieldErrors); ok {
			errs = append(errs, fe...)
		} else if fe, ok := err.(*health.FieldError); ok {
			errs = append(errs, fe)
		}
	}
	// Validate one registration per task with a placeholder session: the
	// contract's rules are the single source of truth.
	base := health.Registration{
		InstanceID: c.InstanceID, SessionID: "validate", Generation: 1,
		Address: c.Address, Port: c.Port, Version: c.Version, Capacity: c.Capacity,
		State: health.StateActive, Labels: c.Labels, LeaseTTL: c.Lease.TTL,
	}
	if len(c.Tasks) == 0 {
		add(&health.FieldError{Field: "task", Reason: "at least one task type is required"})
		base.Task = "placeholder"
		add(base.Validate())
	}
	seen := map[string]bool{}
	for i, task := range c.Tasks {
		r := base
		r.Task = task
		if err := r.Validate(); err != nil {
			if i == 0 {
				add(err) // every field error once
			} else if te := health.ValidateTask(task); te != nil {
				add(te)
			}
		}
		if seen[task] {
			add(&health.FieldError{Field: "task", Value: task, Reason: "listed twice"})
		}
		seen[task] = true
	}
	if fe := health.ValidateIP(c.Address); fe != nil {
		// Dispatchers never route a host name: refuse up front.
		add(fe)
	}
	if err := health.ValidateTag(c.Tag); err != nil {
		add(err)
	}
	add(c.Lease.Validate())
	if len(errs) == 0 {
		return nil
	}
	return errs
}

// hostPort is the executor's address for logs.
func (c Config) hostPort() string { return net.JoinHostPort(c.Address, strconv.Itoa(c.Port)) }

func (c Config) registration(sess sessionKey, task string, state health.State) health.Registration {
	return health.Registration{
		InstanceID: c.InstanceID, SessionID: sess.id, Generation: sess.generation, Task: task,
		Address: c.Address, Port: c.Port, Version: c.Version, Capacity: c.Capacity, State: state,
		Labels: c.Labels, Replaces: sess.replaces, LeaseTTL: c.Lease.TTL,
	}
}

// sleepCap bounds retry backoff so a recovered agent is used promptly.
func (c Config) retryCap() time.Duration {
	return min(c.Lease.Heartbeat, 5*time.Second)
}
