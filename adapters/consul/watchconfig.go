package consul

import (
	"errors"
	"log/slog"
	"time"

	"github.com/jonboulle/clockwork"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"

	"github.com/leasehold/leasehold/health"
)

// WatchConfig configures a Watcher, the Watchers of several datacenters
// and the control watch. Zero values mean defaults, except Out's.
type WatchConfig struct {
	// Out receives the observations (required: Run fails without it). It
	// is the syncer's input; a full channel holds the watches back, never
	// the fencing API's Refresh or FreshAsOf.
	Out chan<- health.Observation
	Tag string // services with this tag are task types; default "leasehold"
	// Datacenter is the Consul datacenter watched through the agent (?dc=;
	// "": the agent's own, unnamed); its observations name it.
	Datacenter string
	// MaxConcurrent caps the per-task blocking queries in flight at once
	// (default 32). The Watcher adds two of its own (the service list and
	// the non-passing checks), so it never holds more than MaxConcurrent+2
	// connections, whatever the number of task types: Consul answers 429
	// past 200 per client IP.
	MaxConcurrent int
	// WaitTime is how long a per-task blocking query waits (default 60s);
	// when task watchers queue for a slot, holders wait only ContendedWait
	// (default 2s) so every task type gets its turn.
	WaitTime time.Duration
	// FastWait is how long the non-passing and service-list queries wait
	// (default 10s): their answers are small, and they keep the age of the
	// last Consul contact (readiness, the contact-age metric) under ~11s.
	FastWait time.Duration
	// Under shorter leases (a registration's lease_ttl) they wait at most a
	// third of the shortest one, so a view vouched for only within a lease
	// (the fencing API's bound) never reads as stale merely because Consul
	// had nothing new to say; until every task type has been read they wait
	// at most a second.
	ContendedWait time.Duration
	// MinInterval is the least time between two queries of one watch
	// (default 5ms for the non-passing checks, 4× that for memberships), so
	// index resets and bursts never turn into a tight loop.
	MinInterval time.Duration
	// SlowInterval is the least time between two queries of the watches
	// whose every answer costs Consul a scan of the whole datacenter: the
	// task types (every service) and every node's serfHealth (every check)
	// (default 1s). Both wake on any registration, so under churn they
	// would otherwise scan the datacenter once per registration.
	SlowInterval time.Duration
	// MaxBackoff caps the jittered back-off after errors (default 10s).
	MaxBackoff time.Duration
	// ReadRate paces the reads that grow with the fleet (task memberships,
	// generation keys): bytes of JSON per second, all watches together
	// (default 4 MiB/s; negative: unpaced). ReadBurst is what a quiet fleet
	// may read at once (default 2 s of ReadRate, and never less than two of
	// the largest reads made, up to 128 MiB), so a lone change is read
	// without waiting; under churn the changes of each wait coalesce.
	ReadRate, ReadBurst int64

	Clock  clockwork.Clock
	Logger *slog.Logger
	Meter  metric.MeterProvider // default: no metrics
}

// errNoOut is Run's error when WatchConfig.Out is nil.
var errNoOut = errors.New("consul watch config: Out: nil; the observations need a channel to go to")

func (c WatchConfig) withDefaults() WatchConfig {
	if c.Tag == "" {
		c.Tag = health.DefaultTag
	}
	if c.MaxConcurrent <= 0 {
		c.MaxConcurrent = 32
	}
	if c.WaitTime <= 0 {
		c.WaitTime = time.Minute
	}
	if c.FastWait <= 0 {
		c.FastWait = 10 * time.Second
	}
	if c.ContendedWait <= 0 {
		c.ContendedWait = 2 * time.Second
	}
	if c.MinInterval <= 0 {
		c.MinInterval = 5 * time.Millisecond
	}
	if c.SlowInterval <= 0 {
		c.SlowInterval = time.Second
	}
	if c.MaxBackoff <= 0 {
		c.MaxBackoff = 10 * time.Second
	}
	if c.ReadRate == 0 {
		c.ReadRate = 4 << 20
	}
	if c.ReadBurst <= 0 {
		c.ReadBurst = 2 * max(c.ReadRate, 0)
	}
	if c.Clock == nil {
		c.Clock = clockwork.NewRealClock()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Meter == nil {
		c.Meter = metricnoop.NewMeterProvider()
	}
	return c
}
