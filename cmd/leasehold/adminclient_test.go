package main

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc"

	"github.com/leasehold/leasehold/server"
)

// adminCommands are the commands that read the admin port, each with the
// arguments it needs besides --admin-addr.
var adminCommands = [][]string{{"explain"}, {"dispatchers"}}

// Pointed at a gRPC port (leasehold's xDS port), every admin command says so
// instead of quoting the HTTP/2 frame net/http took for a malformed answer.
func TestAdminCommandsSayTheyReachedTheGRPCPort(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	for _, cmd := range adminCommands {
		code, stdout, stderr := runCLI(append(cmd, "--admin-addr", lis.Addr().String())...)
		if code != 1 || !strings.Contains(stderr, "leasehold's gRPC (xDS and fencing) port") ||
			strings.Contains(stderr, `\x00`) {
			t.Errorf("%v at the gRPC port: exit %d, stdout %q, stderr %q",
				cmd, code, stdout, stderr)
		}
	}
}

// The SETTINGS frame a gRPC server sends unasked tells it apart however the
// HTTP client happened to report it; an HTTP/1 server sends nothing first.
func TestGRPCPortIsRecognisedByItsFirstFrame(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	srv := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(srv.Close)
	ctx := context.Background()
	if !opensWithHTTP2Settings(ctx, lis.Addr().String()) {
		t.Error("a gRPC server not recognised")
	}
	if opensWithHTTP2Settings(ctx, strings.TrimPrefix(srv.URL, "http://")) {
		t.Error("an HTTP/1 server taken for a gRPC one")
	}
	err = adminDialError(ctx, lis.Addr().String(), true, errors.New("readLoopPeekFailLocked"))
	if !errors.Is(err, errGRPCPort) {
		t.Errorf("a bare read error from a gRPC port: %v", err)
	}
}

// A guarded admin port's 401 is a sentence naming the flag and the variable
// that carry the token, not the answer's JSON; a wrong token is told apart.
func TestAdminCommandsExplainAMissingOrWrongToken(t *testing.T) {
	dir := t.TempDir()
	good, bad := filepath.Join(dir, "good"), filepath.Join(dir, "bad")
	os.WriteFile(good, []byte("s3cret-s3cret-s3cret-s3cret-s3cret\n"), 0o600)
	os.WriteFile(bad, []byte("wrong-wrong-wrong-wrong-wrong-wrong\n"), 0o600)
	tok, err := server.NewAdminToken(good)
	if err != nil {
		t.Fatal(err)
	}
	h := server.GuardAdmin(http.NotFoundHandler(), tok, false)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	addr := strings.TrimPrefix(srv.URL, "http://")
	for _, cmd := range adminCommands {
		code, _, stderr := runCLI(append(cmd, "--admin-addr", addr)...)
		if code != 1 || !strings.Contains(stderr, "--admin-token-file") ||
			!strings.Contains(stderr, "LEASEHOLD_ADMIN_TOKEN_FILE") ||
			strings.Contains(stderr, `{"error"`) {
			t.Errorf("%v without a token: exit %d, stderr %q", cmd, code, stderr)
		}
		code, _, stderr = runCLI(append(cmd, "--admin-addr", addr, "--admin-token-file", bad)...)
		if code != 1 || !strings.Contains(stderr, "did not accept the token") ||
			strings.Contains(stderr, `{"error"`) {
			t.Errorf("%v with a wrong token: exit %d, stderr %q", cmd, code, stderr)
		}
	}
}

// Errors the admin port answers with (400 on a bad question) are its
// sentence, not its JSON.
func TestAdminErrorBodiesAreSentences(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusBadRequest)
		w.Write([]byte(`{"error":"task \"x y\": bad"}`))
	}))
	t.Cleanup(srv.Close)
	var out bytes.Buffer
	code := runExplain(context.Background(),
		[]string{"--admin-addr", strings.TrimPrefix(srv.URL, "http://")}, &out, &out)
	if code != 1 || !strings.Contains(out.String(), `task "x y": bad`) ||
		strings.Contains(out.String(), `{"error"`) {
		t.Errorf("exit %d, output %q", code, out.String())
	}
}

// cordon, uncordon and approve read the cordons' state through the same
// client: a replica refusing them for want of a token is not reported as
// one that did not answer.
func TestCordonViewOfARefusingReplicaNamesTheToken(t *testing.T) {
	f := explainFlags{admin: "127.0.0.1:19000"}
	err := adminStatusError(f, "/debug/config", http.StatusUnauthorized,
		[]byte(`{"error": "this endpoint needs Authorization: Bearer <token>"}`))
	got := cordonView{addr: f.admin, err: err}.unknown()
	if strings.Contains(got, "no replica answered") || !strings.Contains(got, "would not tell") ||
		!strings.Contains(got, "--admin-token-file") {
		t.Errorf("state of a cordon: %s", got)
	}
}
