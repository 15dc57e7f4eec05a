package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/snapshot/fleet"
)

// TestSystemdIsToldWhenServeIsReady: under a unit of Type=notify (systemd
// sets NOTIFY_SOCKET) serve says what it is doing, READY=1 only once it is
// ready (what /readyz says), and STOPPING=1 at the end.
func TestSystemdIsToldWhenServeIsReady(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "notify")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	t.Setenv("NOTIFY_SOCKET", sock)
	var ready atomic.Bool
	n := systemdNotify{log: slog.New(slog.NewTextHandler(io.Discard, nil)), readiness: func() fleet.Readiness {
		if ready.Load() {
			return fleet.Readiness{Ready: true}
		}
		return fleet.Readiness{Reason: fleet.ReasonFirstRead, Detail: "waiting for the task types"}
	}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- n.Run(ctx) }()
	next := func() string {
		t.Helper()
		conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		b := make([]byte, 4096)
		k, err := conn.Read(b)
		if err != nil {
			t.Fatalf("no notification: %v", err)
		}
		return string(b[:k])
	}
	for msg := next(); !strings.HasPrefix(msg, "STATUS=not ready: first_read_pending"); msg = next() {
		if strings.Contains(msg, "READY=1") {
			t.Fatalf("READY=1 before serve is ready: %q", msg)
		}
	}
	ready.Store(true)
	for msg := next(); msg != "READY=1"; msg = next() {
	}
	if msg := next(); msg != "STATUS=ready: serving" {
		t.Fatalf("after READY=1: %q", msg)
	}
	cancel()
	if msg := next(); msg != "STOPPING=1" {
		t.Fatalf("at the end: %q, want STOPPING=1", msg)
	}
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run = %v", err)
	}
}

// Outside systemd (no NOTIFY_SOCKET) nothing is sent and Run only waits for
// the end: serve's other parts are not ended by it.
func TestSystemdNotificationsWaitOutsideSystemd(t *testing.T) {
	t.Setenv("NOTIFY_SOCKET", "")
	n := systemdNotify{log: slog.New(slog.NewTextHandler(io.Discard, nil)), readiness: func() fleet.Readiness { return fleet.Readiness{Ready: true} }}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- n.Run(ctx) }()
	select {
	case err := <-done:
		t.Fatalf("Run ended by itself: %v", err)
	case <-time.After(50 * time.Millisecond): // a negative: it must not end on its own
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run = %v", err)
	}
}
