package health

import (
	"strconv"
	"strings"
	"time"
)

// Lease defaults from the design: a heartbeat every 10 s and a 35 s lease, so
// two lost heartbeats never remove an executor and 35 s of silence always does.
const (
	DefaultLeaseTTL        = 35 * time.Second
	DefaultHeartbeat       = 10 * time.Second
	DefaultDeregisterAfter = 10 * time.Minute

	// MinDeregisterAfter is Consul's floor for DeregisterCriticalServiceAfter.
	MinDeregisterAfter = time.Minute
)

// MinStaleBound is the shortest staleness bound leasehold keeps for what
// holds for a whole datacenter: --fencing-stale-after's floor, and how far a
// declared lease_ttl shortens a datacenter's readiness bound (/readyz
// consul_silent) and the silence after which it is Lost. Any token that may
// register the task type may declare any lease, and Consul's watches answer
// every fraction of a second at best; a session's own fencing answers are
// still bounded by its own lease, however short.
const MinStaleBound = 3 * time.Second

// DatacenterLeaseBound is the bound a datacenter's shortest declared lease
// (0: none) sets on what holds for the whole datacenter: that lease, but
// never under MinStaleBound (0: no bound).
func DatacenterLeaseBound(shortest time.Duration) time.Duration {
	if shortest <= 0 {
		return 0
	}
	return max(shortest, MinStaleBound)
}

// Lease is the timing of an executor's TTL lease. Zero fields mean defaults.
type Lease struct {
	TTL             time.Duration // lease: no acknowledged heartbeat for this long ends it
	Heartbeat       time.Duration // interval between heartbeats
	DeregisterAfter time.Duration // Consul removes a registration critical for this long
}

// WithDefaults fills zero fields.
func (l Lease) WithDefaults() Lease {
	if l.TTL == 0 {
		l.TTL = DefaultLeaseTTL
	}
	if l.Heartbeat == 0 {
		l.Heartbeat = DefaultHeartbeat
	}
	if l.DeregisterAfter == 0 {
		l.DeregisterAfter = DefaultDeregisterAfter
	}
	return l
}

// Validate checks a lease after defaults are applied: a lease must cover at
// least two heartbeats so one lost heartbeat never ends it.
func (l Lease) Validate() error {
	var errs FieldErrors
	if l.Heartbeat <= 0 {
		errs = append(errs, fieldErr("heartbeat", l.Heartbeat.String(), "must be positive"))
	}
	if l.TTL <= 0 {
		errs = append(errs, fieldErr("lease", l.TTL.String(), "must be positive"))
	} else if l.Heartbeat > 0 && l.TTL < 2*l.Heartbeat {
		errs = append(errs,
			fieldErr("lease", l.TTL.String(), "must be at least 2× the heartbeat interval (%s)",
				l.Heartbeat))
	}
	if l.DeregisterAfter < MinDeregisterAfter {
		errs = append(errs,
			fieldErr("deregister_after", l.DeregisterAfter.String(),
				"must be at least %s (Consul's minimum)", MinDeregisterAfter))
	}
	return errs.err()
}

// Expired reports whether a lease last renewed at renewedAt has run out at now.
// renewedAt must be the instant the acknowledged heartbeat was *sent*: the
// agent restarted its TTL timer no earlier than that, so the executor never
// believes in a lease the agent has already let lapse.
func (l Lease) Expired(renewedAt, now time.Time) bool {
	return now.Sub(renewedAt) >= l.TTL
}

// CheckStatus is a Consul check status.
type CheckStatus string

const (
	StatusPassing  CheckStatus = "passing"
	StatusWarning  CheckStatus = "warning"
	StatusCritical CheckStatus = "critical"
)

// HeartbeatStatus is the status a heartbeat reports: passing while the
// executor has spare capacity, warning while it is full. A status change is
// synced to the Consul servers at once, so "full" is seen without delay.
func HeartbeatStatus(load, capacity int) CheckStatus {
	if load >= capacity {
		return StatusWarning
	}
	return StatusPassing
}

// LoadOutput is the check output a heartbeat carries: "load=3".
func LoadOutput(load int) string { return "load=" + strconv.Itoa(load) }

// ParseLoad reads the load from a check output written by LoadOutput; other
// text after the first line is ignored.
func ParseLoad(output string) (int, bool) {
	line, _, _ := strings.Cut(output, "\n")
	v, ok := strings.CutPrefix(strings.TrimSpace(line), "load=")
	if !ok {
		return 0, false
	}
	v, _, _ = strings.Cut(v, " ")
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return 0, false
	}
	return n, true
}
