package main

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
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

// A mistake in what serve is given that is found as it starts (a file
// missing, a token too short) is a usage error as a bad flag is: exit 2,
// nothing ran, and the error names the flag, and the variable when the value
// came from one. A port taken by another process is a failure (exit 1) that
// names the flag and its variable too.
func TestServeStartupMistakes(t *testing.T) {
	dir := t.TempDir()
	short := filepath.Join(dir, "token")
	if err := os.WriteFile(short, []byte("tooshort\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	t.Setenv("LEASEHOLD_CONSUL_ADDR", "127.0.0.1:1") // nothing listens: never asked
	for _, c := range []struct {
		args []string
		env  map[string]string
		code int
		want string
	}{
		{[]string{"--rules", filepath.Join(dir, "nosuch.yaml")}, nil, 2, "invalid --rules: "},
		{nil, map[string]string{"LEASEHOLD_RULES": filepath.Join(dir, "nosuch.yaml")}, 2,
			"invalid --rules (from $LEASEHOLD_RULES): "},
		{[]string{"--audit-log", filepath.Join(dir, "nosuch", "audit.jsonl")}, nil, 2,
			"invalid --audit-log: "},
		{[]string{"--admin-token-file", short}, nil, 2,
			"invalid --admin-token-file: the token must be at least 16 characters"},
		{nil, map[string]string{"LEASEHOLD_XDS_ADDR": busy.Addr().String()}, 1,
			"--xds-addr (from $LEASEHOLD_XDS_ADDR): cannot listen on " + busy.Addr().String() +
				": the address is in use"},
		{[]string{"--admin-addr", busy.Addr().String()}, nil, 1,
			"--admin-addr: cannot listen on " + busy.Addr().String() + ": the address is in use"},
	} {
		for k, v := range c.env {
			t.Setenv(k, v)
		}
		args := append([]string{"serve", "--xds-addr", "127.0.0.1:0",
			"--admin-addr", "127.0.0.1:0"}, c.args...)
		if c.env["LEASEHOLD_XDS_ADDR"] != "" {
			args = append([]string{"serve", "--admin-addr", "127.0.0.1:0"}, c.args...)
		}
		code, _, stderr := runCLI(args...)
		if code != c.code || !strings.Contains(stderr, c.want) ||
			(code == 2) != strings.Contains(stderr, "Run 'leasehold serve --help'") {
			t.Errorf("serve %v %v: exit %d, %q; want %d saying %q",
				c.args, c.env, code, stderr, c.code, c.want)
		}
		for k := range c.env {
			unsetenv(t, k)
		}
	}
}
