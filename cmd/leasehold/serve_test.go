package main

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

// TestServePartsShareOneLifecycle: serve's long-running parts run in one
// group. The first part to fail, or to end on its own before serve stops
// them, ends the others and is named in serve's error; parts ending because
// serve stops them are no failure.
func TestServePartsShareOneLifecycle(t *testing.T) {
	boom := errors.New("boom")
	for _, tc := range []struct {
		name string
		// The part under test; the others wait for their context.
		first   func(context.Context) error
		stop    bool   // serve stops the parts (they do not end on their own)
		wantErr string // "" for none
	}{
		{"a failing part ends the others and is named", func(context.Context) error { return boom },
			false, "first part: boom"},
		{"a part ending on its own is a failure", func(context.Context) error { return nil }, false,
			"first part: ended before serve stopped"},
		{"parts stopped by serve end without failure",
			func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() }, true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runCtx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ps := newParts(runCtx)
			ended := make(chan string, 2)
			ps.run("first part", tc.first)
			ps.run("second part", func(ctx context.Context) error {
				<-ctx.Done()
				ended <- "second part"
				return ctx.Err()
			})
			// A server ignores the context: serve stops it after stopping().
			server := make(chan struct{})
			ps.run("server", func(context.Context) error {
				<-server
				ended <- "server"
				return errors.New("server closed")
			})
			if tc.stop {
				ps.stopping()
				close(server)
				cancel()
			} else {
				select {
				case <-ps.ctx.Done():
				case <-time.After(5 * time.Second):
					t.Fatal("a part ended but the others' context did not")
				}
				ps.stopping()
				close(server)
			}
			err := ps.wait()
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("wait: %v, want no failure", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("wait: %v, want an error naming %q", err, tc.wantErr)
			}
			if len(ended) != 2 {
				t.Fatalf("%d of the 2 other parts ended", len(ended))
			}
		})
	}
}
