package main

import (
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
)

// What a binary says it is: the Makefile's -ldflags first (a build from a
// checkout knows its tag), then what the Go toolchain recorded — the module
// version of `go install …@v1.2.3`, the commit of a build in a checkout
// (with -dirty for local changes) — and "dev"/"unknown" when neither says.
func TestResolveBuild(t *testing.T) {
	vcs := func(rev, modified string) []debug.BuildSetting {
		return []debug.BuildSetting{{Key: "vcs", Value: "git"},
			{Key: "vcs.revision", Value: rev}, {Key: "vcs.modified", Value: modified}}
	}
	for _, c := range []struct {
		name       string
		bi         *debug.BuildInfo
		ldV, ldRev string
		want       buildInfo
	}{
		{"no build information", nil, "", "",
			buildInfo{"dev", "unknown", runtime.Version()}},
		{"go install at a version", &debug.BuildInfo{GoVersion: "go1.26.1",
			Main: debug.Module{Version: "v1.2.3"}}, "", "",
			buildInfo{"v1.2.3", "unknown", "go1.26.1"}},
		{"go build in a clean checkout", &debug.BuildInfo{GoVersion: "go1.26.1",
			Main: debug.Module{Version: "(devel)"}, Settings: vcs("0123abcd", "false")}, "", "",
			buildInfo{"dev", "0123abcd", "go1.26.1"}},
		{"go build with local changes", &debug.BuildInfo{GoVersion: "go1.26.1",
			Main: debug.Module{Version: "(devel)"}, Settings: vcs("0123abcd", "true")}, "", "",
			buildInfo{"dev", "0123abcd-dirty", "go1.26.1"}},
		{"make: -ldflags over the toolchain's", &debug.BuildInfo{GoVersion: "go1.26.1",
			Main: debug.Module{Version: "v1.2.3"}, Settings: vcs("0123abcd", "false")},
			"v1.3.0-2-g4567ef0", "4567ef0123",
			buildInfo{"v1.3.0-2-g4567ef0", "4567ef0123", "go1.26.1"}},
		{"make without a tag: the revision only", &debug.BuildInfo{GoVersion: "go1.26.1",
			Main: debug.Module{Version: "(devel)"}, Settings: vcs("0123abcd", "false")},
			"", "4567ef0123", buildInfo{"dev", "4567ef0123", "go1.26.1"}},
	} {
		if got := resolveBuild(c.bi, c.ldV, c.ldRev); got != c.want {
			t.Errorf("%s: %+v, want %+v", c.name, got, c.want)
		}
	}
}

// The binary `make` builds lets the linker drop the methods nothing calls.
// gRPC's golang.org/x/net/trace imports html/template, whose reflective
// method calls (text/template's exec) make the linker keep every exported
// method of every type it keeps: the Envoy API's generated Validate and
// ValidateAll methods alone are 860 functions, and the binary was 45 MB
// instead of 30, 7 MB more of it resident in an idle serve. The Makefile's
// TAGS (grpcnotrace) leave the trace package out, and every binary it builds
// is built with them; this builds as make does and looks for what only a
// binary without that elimination holds (the symbols of an ELF binary: on
// Linux).
func TestTheBinaryLinksOnlyTheMethodsItCalls(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	if runtime.GOOS != "linux" {
		t.Skip("reads the symbols of an ELF binary")
	}
	makefile, err := os.ReadFile("../../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^TAGS\s*:=\s*(.*)$`).FindSubmatch(makefile)
	if m == nil || !strings.Contains(string(m[1]), "grpcnotrace") {
		t.Fatalf("the Makefile's TAGS (%q) do not hold grpcnotrace", m)
	}
	builds := 0
	for _, line := range strings.Split(string(makefile), "\n") {
		if strings.Contains(line, "$(GO) build") && strings.Contains(line, "-o bin/") {
			builds++
			if !strings.Contains(line, "-tags '$(TAGS)'") {
				t.Errorf("a binary the Makefile builds without its TAGS: %s", strings.TrimSpace(line))
			}
		}
	}
	if builds < 6 { // bin/leasehold (make, demo, bench), the examples, the harness
		t.Errorf("found %d of the Makefile's builds of bin/: not the lines this test means to read",
			builds)
	}
	bin := filepath.Join(t.TempDir(), "leasehold")
	build := exec.Command("go", "build", "-tags", strings.TrimSpace(string(m[1])), "-o", bin, ".")
	// Symbols are read from the binary: a GOFLAGS of the caller's must not
	// strip them.
	build.Env = append(os.Environ(), "GOFLAGS=")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	syms, err := f.Symbols()
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	sawMain := false
	for _, s := range syms {
		switch {
		case s.Name == "main.main":
			sawMain = true
		case strings.HasPrefix(s.Name, "golang.org/x/net/trace."),
			strings.HasPrefix(s.Name, "text/template.(*state)."),
			strings.HasPrefix(s.Name, "github.com/envoyproxy/") && strings.HasSuffix(s.Name, ".ValidateAll"):
			if len(found) < 5 {
				found = append(found, s.Name)
			}
		}
	}
	if !sawMain {
		t.Fatal("no main.main among the binary's symbols: not the symbols this test means to read")
	}
	if len(found) > 0 {
		t.Errorf("the binary holds what only a link without dead method elimination keeps: %v", found)
	}
}
