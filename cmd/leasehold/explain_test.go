package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/adapters/loadreport"
	"github.com/leasehold/leasehold/server"
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
		{[]string{"--dispatcher", "nobody"}, 1, "--dispatcher \"nobody\": no such dispatcher"},
		{[]string{"--instance", "missing"}, 1, "--instance \"missing\": no such instance"},
		{[]string{"--task", "missing"}, 1, "--task \"missing\": no such task type"},
		{[]string{"--version-constraint", ">= banana"}, 2, "invalid --version-constraint"},
		{[]string{"--label", "bad key=a"}, 2, "invalid --label"},
		{[]string{"--datacenter", "no such dc!"}, 2, "invalid --datacenter"},
		{[]string{"--label", "zone=a", "--dispatcher", "d"}, 2, "invalid --dispatcher"},
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
		&out, &out); code != 1 || !strings.Contains(out.String(), "admin API") ||
		!strings.Contains(out.String(), "nothing listens there") {
		t.Errorf("unreachable admin: %d %q", code, out.String())
	}
}

// With colour on (a terminal), every column still starts where it does
// without: widths count what the terminal shows, not the escapes.
func TestExplainColumnsAlignWithColour(t *testing.T) {
	ex, ds := cannedAnswers(t)
	ansi := regexp.MustCompile("\x1b\\[[0-9;]*m")
	for name, print := range map[string]func(p printer){
		"overview":   func(p printer) { p.overview(ex, ds) },
		"dispatcher": func(p printer) { p.dispatcher(ex, ds, "eu-strict") },
	} {
		var plain, colour bytes.Buffer
		print(printer{w: &plain, loadMaxAge: time.Minute})
		print(printer{w: &colour, color: true, loadMaxAge: time.Minute})
		if !bytes.Contains(colour.Bytes(), []byte("\x1b[32m")) {
			t.Fatalf("%s: no colour written", name)
		}
		if got := ansi.ReplaceAllString(colour.String(), ""); got != plain.String() {
			t.Errorf("%s: coloured columns differ from plain ones:\n%s\nwant\n%s",
				name, got, plain.String())
		}
	}
}

// cannedAnswers are the recorded /debug answers, decoded.
func cannedAnswers(t *testing.T) (server.ExplainExecutors, []server.StreamInfo) {
	t.Helper()
	var ex server.ExplainExecutors
	var ds struct{ Dispatchers []server.StreamInfo }
	for file, v := range map[string]any{"explain-executors.json": &ex,
		"explain-dispatchers.json": &ds} {
		b, err := os.ReadFile(filepath.Join("testdata", file))
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatal(err)
		}
	}
	return ex, ds.Dispatchers
}

// explain --version-constraint/--label asks the replica about that
// constraint set and prints what a dispatcher with it would get, and why
// not each executor, saying that none with it is connected.
func TestExplainAnswersForADispatcherNotConnected(t *testing.T) {
	ex, ds := cannedAnswers(t)
	asked := server.ConstraintSet{Key: "v=<2.0.0;zone=us-1", VersionConstraint: "<2.0.0",
		Labels: map[string]string{"zone": "us-1"}, Hypothetical: true}
	ex.ConstraintSets = append(ex.ConstraintSets, asked)
	idx := len(ex.ConstraintSets) - 1
	ex.Asked = &idx
	for i := range ex.Executors {
		v := server.ExplainVerdict{ConstraintSet: asked.Key, Route: "NONE",
			Reason: "label-mismatch", Detail: "label zone, want \"us-1\""}
		if ex.Executors[i].InstanceID == "e3" {
			v = server.ExplainVerdict{ConstraintSet: asked.Key, Route: "HEALTHY"}
		}
		ex.Executors[i].Verdicts = append(ex.Executors[i].Verdicts, v)
	}
	var query url.Values
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/executors", func(w http.ResponseWriter, r *http.Request) {
		query = r.URL.Query()
		json.NewEncoder(w).Encode(ex)
	})
	mux.HandleFunc("/debug/dispatchers", func(w http.ResponseWriter, r *http.Request) {
		json.NewEncoder(w).Encode(map[string]any{"dispatchers": ds})
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	code, out, stderr := runCLI("explain", "--admin-addr", strings.TrimPrefix(srv.URL, "http://"),
		"--version-constraint", "<2.0.0", "--label", "zone=us-1")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if query.Get("version_constraint") != "<2.0.0" || query.Get("label") != "zone=us-1" {
		t.Errorf("asked %v", query)
	}
	for _, want := range []string{
		"a dispatcher with version <2.0.0, zone=us-1: no dispatcher with it is connected; " +
			"one would get",
		"HEALTHY ", "e3",
		"no: label-mismatch", `label zone, want "us-1"`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in:\n%s", want, out)
		}
	}
	if strings.Index(out, "e3") > strings.Index(out, "e1") {
		t.Errorf("the routed executor is not listed first:\n%s", out)
	}
}

// explain --orca shows the load an executor reports over ORCA now, marked
// as such, and for an executor that answers none the lease check's figure
// with how old it can be.
func TestExplainReadsTheCurrentLoadOverORCA(t *testing.T) {
	rep, err := loadreport.New(4, func() int { return 2 })
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	if err := rep.Register(g); err != nil {
		t.Fatal(err)
	}
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	closed, err := net.Listen("tcp", "127.0.0.1:0") // a port nothing answers on
	if err != nil {
		t.Fatal(err)
	}
	closedPort := closed.Addr().(*net.TCPAddr).Port
	closed.Close()

	ex, ds := cannedAnswers(t)
	for i := range ex.Executors {
		e := &ex.Executors[i]
		e.Address, e.Port = "127.0.0.1", closedPort
		if e.InstanceID == "e1" {
			e.Port = lis.Addr().(*net.TCPAddr).Port
		}
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/executors", func(w http.ResponseWriter, r *http.Request) {
		json.NewEncoder(w).Encode(ex)
	})
	mux.HandleFunc("/debug/dispatchers", func(w http.ResponseWriter, r *http.Request) {
		json.NewEncoder(w).Encode(map[string]any{"dispatchers": ds})
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	addr := strings.TrimPrefix(srv.URL, "http://")

	code, out, stderr := runCLI("explain", "--admin-addr", addr, "--orca")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if !regexp.MustCompile(`(?m)^work +e1 .* 2/4 orca `).MatchString(out) ||
		!regexp.MustCompile(`(?m)^work +e3 .* 2/2 +warning`).MatchString(out) ||
		!strings.Contains(out, "up to 7m30s old") {
		t.Errorf("overview with --orca:\n%s", out)
	}
	code, out, stderr = runCLI("explain", "--admin-addr", addr, "--orca", "--instance", "e1")
	if code != 0 || !strings.Contains(out, "2/4 (the executor's own ORCA report, read now)") {
		t.Errorf("--instance e1 --orca: exit %d %s\n%s", code, stderr, out)
	}
	code, out, _ = runCLI("explain", "--admin-addr", addr, "--instance", "e3")
	if code != 0 || !strings.Contains(out, "2/2 (the lease check's output: up to 7m30s old)") {
		t.Errorf("--instance e3: exit %d\n%s", code, out)
	}
}

// On a live replica: explain answers for a constraint set no dispatcher
// uses, says "no such" alike for a task type and an instance it does not
// know, recognises leasehold's own xDS port; leasehold dispatchers lists a
// NACKing dispatcher and a refused stream with why.
func TestExplainAndDispatchersOnALiveReplica(t *testing.T) {
	a := consultest.Start(t)
	startExecutor(t, a, "e1", "1.0.0", "zone=a")
	startExecutor(t, a, "e2", "2.0.0", "zone=a")
	startExecutor(t, a, "e3", "1.0.0", "zone=b")
	addrs := startServe(t, a)

	var out string
	for deadline := time.Now().Add(15 * time.Second); ; {
		var code int
		code, out, _ = runCLI("explain", "--admin-addr", addrs.admin,
			"--version-constraint", "<2.0.0", "--label", "zone=a")
		if code == 0 && strings.Contains(out, "e1") && strings.Contains(out, "e2") &&
			strings.Contains(out, "e3") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("explain never showed e1, e2 and e3 (exit %d):\n%s", code, out)
		}
		<-time.After(50 * time.Millisecond) // the admin port has no watch API
	}
	for _, re := range []string{
		`^a dispatcher with version <2\.0\.0, zone=a: no dispatcher with it is connected`,
		`(?m)^HEALTHY +work +e1 `,
		`(?m)^no: version-incompatible +work +e2 `,
		`(?m)^no: label-mismatch +work +e3 .*zone`,
	} {
		if !regexp.MustCompile(re).MatchString(out) {
			t.Errorf("no match for %s in:\n%s", re, out)
		}
	}

	codeT, _, taskErr := runCLI("explain", "--admin-addr", addrs.admin, "--task", "nosuch")
	codeI, _, instErr := runCLI("explain", "--admin-addr", addrs.admin, "--instance", "nosuch")
	if codeT != 1 || codeI != 1 || !strings.Contains(taskErr, `--task "nosuch": no such task`) ||
		!strings.Contains(instErr, `--instance "nosuch": no such instance`) {
		t.Errorf("--task nosuch: %d %q; --instance nosuch: %d %q", codeT, taskErr, codeI, instErr)
	}
	if code, _, stderr := runCLI("explain", "--admin-addr", addrs.xds); code != 1 ||
		!strings.Contains(stderr, "leasehold's gRPC (xDS and fencing) port") {
		t.Errorf("explain at the xDS port: %d %q", code, stderr)
	}

	nacker := nackingClient(t, addrs.xds)
	bad := dialADS(t, addrs.xds, &corev3.Node{Id: "bad-meta", Metadata: &structpb.Struct{
		Fields: map[string]*structpb.Value{
			"version_constraint": structpb.NewStringValue(">= banana")}}})
	bad.Subscribe(resource.EndpointType, "work")
	if _, err := bad.Recv(); err == nil {
		t.Fatal("a node with an invalid version_constraint was served")
	}
	wants := []*regexp.Regexp{
		regexp.MustCompile(`(?m)^  ` + nacker + ` +sotw +unconstrained `),
		regexp.MustCompile(`(?m)^  ` + nacker +
			` +ClusterLoadAssignment +work .*refused on purpose by the test`),
		regexp.MustCompile(`(?m)^1 streams refused since the start`),
		regexp.MustCompile(`(?m)^  \S+ +1 +bad-meta +- +127\.0\.0\.1:\d+ +sotw +invalid-node ` +
			`+.*version_constraint`),
	}
	// The NACK is handled apart from the client sending it: ask until it shows.
	for deadline := time.Now().Add(10 * time.Second); ; {
		code, out, stderr := runCLI("dispatchers", "--admin-addr", addrs.admin)
		if code != 0 {
			t.Fatalf("dispatchers: exit %d: %s", code, stderr)
		}
		missing := slices.IndexFunc(wants, func(re *regexp.Regexp) bool {
			return !re.MatchString(out)
		})
		if missing < 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no match for %s in:\n%s", wants[missing], out)
		}
		<-time.After(50 * time.Millisecond) // the admin port has no watch API
	}
}
