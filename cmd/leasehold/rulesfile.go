package main

import (
	"context"
	"log/slog"
	"os"
	"time"

	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/health"
)

// rulesFile follows the --rules file: when it changes (checked every
// interval, a second by default, on clock) it hands the rules to the syncer,
// which validates them — an invalid version is refused there, and audited,
// and the previous one stays in force.
type rulesFile struct {
	path     string
	obs      chan<- health.Observation
	log      *slog.Logger
	clock    clockwork.Clock // default: the real clock
	interval time.Duration   // default: a second
}

// Run follows the file until ctx ends, and returns ctx's error.
func (r rulesFile) Run(ctx context.Context) error {
	if r.clock == nil {
		r.clock = clockwork.NewRealClock()
	}
	if r.interval <= 0 {
		r.interval = time.Second
	}
	stamp, _ := os.ReadFile(r.path)
	t := r.clock.NewTicker(r.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.Chan():
		}
		// The file is small, so it is compared whole at every tick.
		now, _ := os.ReadFile(r.path)
		if string(now) == string(stamp) {
			continue
		}
		stamp = now
		raw, err := rulesYAMLToJSON(r.path)
		if err != nil {
			r.log.Error("rules file changed but cannot be read: the previous rules stay in force",
				"path", r.path, "err", err)
			// The syncer refuses this, and audits the refusal.
			raw = []byte("not readable: " + err.Error())
		}
		select {
		case r.obs <- health.Observation{Data: &health.RulesSource{Source: "file:" + r.path, Raw: raw}}:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
