package main

import (
	"runtime"
	"runtime/debug"
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
