package main

import (
	"bytes"
	"context"
	"flag"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite golden files")

// cannedAdmin serves recorded /debug answers.
func cannedAdmin(t *testing.T) string {
	t.Helper()
	mux := http.NewServeMux()
	for path, file := range map[string]string{"/debug/executors": "explain-executors.json",
		"/debug/dispatchers": "explain-dispatchers.json"} {
		b, err := os.ReadFile(filepath.Join("testdata", file))
		if err != nil {
			t.Fatal(err)
		}
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) { w.Write(b) })
	}
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

func TestExplainGolden(t *testing.T) {
	addr := cannedAdmin(t)
	for _, tt := range []struct {
		name string
		args []string
	}{
		{"explain-overview.txt", nil},
		{"explain-dispatcher.txt", []string{"--dispatcher", "eu-strict"}},
		{"explain-instance.txt", []string{"--instance", "e3"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var out, errOut bytes.Buffer
			if code := runExplain(context.Background(),
				append([]string{"--admin-addr", addr}, tt.args...), &out, &errOut); code != 0 {
				t.Fatalf("exit %d: %s", code, errOut.String())
			}
			path := filepath.Join("testdata", tt.name)
			if *update {
				os.WriteFile(path, out.Bytes(), 0o644)
				return
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (go test ./cmd/leasehold -run Golden -update)", err)
			}
			if !bytes.Equal(out.Bytes(), want) {
				t.Errorf("output differs from %s:\n%s", path, out.String())
			}
			if bytes.Contains(out.Bytes(), []byte("\x1b[")) {
				t.Error("colour codes written to a non-terminal")
			}
		})
	}
}

func TestExplainErrors(t *testing.T) {
	addr := cannedAdmin(t)
	for _, tt := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"--dispatcher", "nobody"}, 1, "--dispatcher \"nobody\""},
		{[]string{"--instance", "missing"}, 1, "--instance \"missing\""},
		{[]string{"--instance", "a/b"}, 2, "invalid --instance"},
		{[]string{"--task", "bad task"}, 2, "invalid --task"},
	} {
		var out bytes.Buffer
		code := runExplain(context.Background(),
			append([]string{"--admin-addr", addr}, tt.args...), &out, &out)
		if code != tt.code || !strings.Contains(out.String(), tt.want) {
			t.Errorf("%v: exit %d, output %q; want %d and %q",
				tt.args, code, out.String(), tt.code, tt.want)
		}
	}
	var out bytes.Buffer
	if code := runExplain(context.Background(), []string{"--admin-addr", "127.0.0.1:1"},
		&out, &out); code != 1 || !strings.Contains(out.String(), "admin API") {
		t.Errorf("unreachable admin: %d %q", code, out.String())
	}
}
