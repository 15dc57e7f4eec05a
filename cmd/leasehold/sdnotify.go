package main

import (
	"context"
	"log/slog"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/snapshot/fleet"
)

// systemdNotify tells systemd (a unit of Type=notify, which sets
// NOTIFY_SOCKET) what serve is doing: READY=1 once it has read the whole
// fleet and the operators' controls — what /readyz calls ready — so that
// `systemctl start` and `systemctl restart` return only once the replica
// serves; STATUS= each time readiness changes; STOPPING=1 when serve stops.
// Outside systemd it does nothing but wait for the end.
type systemdNotify struct {
	readiness func() fleet.Readiness
	log       *slog.Logger
	clock     clockwork.Clock // default: the real clock
}

// Run notifies until ctx ends, and returns ctx's error.
func (n systemdNotify) Run(ctx context.Context) error {
	if n.clock == nil {
		n.clock = clockwork.NewRealClock()
	}
	send := func(state string) bool {
		sent, err := daemon.SdNotify(false, state)
		if err != nil {
			n.log.Warn("systemd notification failed", "state", state, "err", err)
		}
		return sent
	}
	if !send("STATUS=" + "reading Consul") {
		<-ctx.Done() // not under systemd (no NOTIFY_SOCKET): nothing to tell
		return ctx.Err()
	}
	t := n.clock.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	var ready bool
	var last string
	for {
		r := n.readiness()
		status := "ready: serving"
		if !r.Ready {
			status = "not ready: " + r.Reason + ": " + r.Detail
		}
		if r.Ready && !ready {
			ready = true
			send(daemon.SdNotifyReady)
		}
		if status != last {
			last = status
			send("STATUS=" + status)
		}
		select {
		case <-ctx.Done():
			send(daemon.SdNotifyStopping)
			return ctx.Err()
		case <-t.Chan():
		}
	}
}
