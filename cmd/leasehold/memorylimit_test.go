package main

import (
	"io"
	"math"
	"runtime/debug"
	"strings"
	"testing"
	"testing/fstest"
)

// --memory-limit takes auto, off or a size; anything else, or a size the
// runtime alone would exceed, is refused naming what it wants.
func TestMemoryLimitFlagTakesAutoOffOrASize(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		off  bool
		err  string
	}{
		{"auto", 0, false, ""},
		{"off", 0, true, ""},
		{"96MiB", 96 << 20, false, ""},
		{"1GiB", 1 << 30, false, ""},
		{"800MB", 800e6, false, ""},
		{"1MiB", 0, false, "at least 16MiB"},
		{"lots", 0, false, "a positive size"},
		{"-5MiB", 0, false, "a positive size"},
		{"", 0, false, "a positive size"},
	} {
		n, off, err := parseMemoryLimit(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: %v, want an error saying %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil || n != tc.want || off != tc.off {
			t.Errorf("%q: %d, off %v, %v; want %d, off %v", tc.in, n, off, err, tc.want, tc.off)
		}
	}
}

// A bad --memory-limit stops serve before it starts, naming the flag.
func TestABadMemoryLimitNamesTheFlag(t *testing.T) {
	_, err := parseServeFlags([]string{"--memory-limit", "2KiB"}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "memory-limit") {
		t.Fatalf("--memory-limit 2KiB: %v, want an error naming the flag", err)
	}
}

// auto follows GOMEMLIMIT when set, else 90% of the cgroup's limit (v2, or
// v1), else none; a size or off wins over both.
func TestAutoMemoryLimitFollowsGOMEMLIMITThenTheCgroup(t *testing.T) {
	v2 := fstest.MapFS{
		"proc/self/cgroup":                           {Data: []byte("0::/leasehold.service\n")},
		"sys/fs/cgroup/leasehold.service/memory.max": {Data: []byte("200000000\n")},
	}
	v2max := fstest.MapFS{
		"proc/self/cgroup":                           {Data: []byte("0::/leasehold.service\n")},
		"sys/fs/cgroup/leasehold.service/memory.max": {Data: []byte("max\n")},
	}
	v1 := fstest.MapFS{
		"proc/self/cgroup": {Data: []byte("12:cpu,cpuacct:/x\n4:memory:/docker/abc\n")},
		"sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": {Data: []byte("100000000")},
	}
	v1none := fstest.MapFS{
		"proc/self/cgroup":                           {Data: []byte("4:memory:/\n")},
		"sys/fs/cgroup/memory/memory.limit_in_bytes": {Data: []byte("9223372036854771712")},
	}
	noEnv := func(string) string { return "" }
	for _, tc := range []struct {
		name   string
		flag   int64
		off    bool
		env    func(string) string
		root   fstest.MapFS
		want   int64
		source string
	}{
		{"cgroup v2", 0, false, noEnv, v2, 180000000, "/sys/fs/cgroup/leasehold.service/memory.max"},
		{"cgroup v2 without a limit", 0, false, noEnv, v2max, 0, "none"},
		{"cgroup v1", 0, false, noEnv, v1, 90000000, "memory.limit_in_bytes"},
		{"cgroup v1 without a limit", 0, false, noEnv, v1none, 0, "none"},
		{"no cgroup file", 0, false, noEnv, fstest.MapFS{}, 0, "none"},
		{"a size wins", 64 << 20, false, noEnv, v2, 64 << 20, "--memory-limit"},
		{"off wins", 0, true, noEnv, v2, 0, "off"},
	} {
		got := decideMemoryLimit(tc.flag, tc.off, tc.env, tc.root)
		if got.bytes != tc.want || !strings.Contains(got.source, tc.source) {
			t.Errorf("%s: %d from %q, want %d from %q", tc.name, got.bytes, got.source, tc.want,
				tc.source)
		}
	}
	off := func(k string) string {
		if k == "GOMEMLIMIT" {
			return "off"
		}
		return ""
	}
	if got := decideMemoryLimit(0, false, off, v2); got.bytes != 0 || got.source != "GOMEMLIMIT=off" {
		t.Fatalf("with GOMEMLIMIT=off: %d from %q, want none", got.bytes, got.source)
	}
	// GOMEMLIMIT: the runtime's limit as the variable set it, not the cgroup's.
	prev := debug.SetMemoryLimit(512 << 20)
	defer debug.SetMemoryLimit(prev)
	env := func(k string) string {
		if k == "GOMEMLIMIT" {
			return "512MiB"
		}
		return ""
	}
	if got := decideMemoryLimit(0, false, env, v2); got.bytes != 512<<20 || got.source != "GOMEMLIMIT" {
		t.Fatalf("with GOMEMLIMIT: %d from %q, want 512 MiB from GOMEMLIMIT", got.bytes, got.source)
	}
}

// apply sets the runtime's limit, and none sets the largest (as unset).
func TestAMemoryLimitIsApplied(t *testing.T) {
	prev := debug.SetMemoryLimit(-1)
	defer debug.SetMemoryLimit(prev)
	memoryLimit{bytes: 300 << 20}.apply()
	if got := debug.SetMemoryLimit(-1); got != 300<<20 {
		t.Fatalf("limit %d after applying 300 MiB", got)
	}
	memoryLimit{}.apply()
	if got := debug.SetMemoryLimit(-1); got != math.MaxInt64 {
		t.Fatalf("limit %d after applying none, want the largest", got)
	}
}

// In a cgroup v1 container (Docker, or a Kubernetes pod, without a cgroup
// namespace: v1's default) /proc/self/cgroup names the container's cgroup by
// its path on the host, while the container sees that cgroup mounted as the
// root of /sys/fs/cgroup/memory (mountinfo's root field says so): the limit
// is in /sys/fs/cgroup/memory/memory.limit_in_bytes, and auto must find it.
func TestAutoMemoryLimitFindsAV1ContainersLimitAtItsMountRoot(t *testing.T) {
	const id = "/docker/3f1e2fc46f19"
	root := fstest.MapFS{
		"proc/self/cgroup": {Data: []byte("12:cpu,cpuacct:" + id + "\n9:memory:" + id +
			"\n1:name=systemd:" + id + "\n")},
		"proc/self/mountinfo": {Data: []byte(
			"600 590 0:52 / / rw,relatime - overlay overlay rw\n" +
				"610 600 0:33 " + id + " /sys/fs/cgroup/memory ro,nosuid,nodev,noexec,relatime " +
				"master:15 - cgroup cgroup rw,memory\n")},
		"sys/fs/cgroup/memory/memory.limit_in_bytes": {Data: []byte("536870912\n")},
	}
	got := decideMemoryLimit(0, false, func(string) string { return "" }, root)
	if want := int64(536870912 * 9 / 10); got.bytes != want {
		t.Fatalf("v1 container limited to 512 MiB: %d from %q, want %d (90%% of its limit)",
			got.bytes, got.source, want)
	}
}

// A cgroup v2 limit binds every cgroup below it: serve run in a slice with a
// limit (systemd MemoryMax= on leasehold.slice), its own cgroup without one,
// is killed at the slice's limit, so auto follows the lowest limit on the
// way up, not only its own cgroup's.
func TestAutoMemoryLimitFollowsAV2AncestorsLimit(t *testing.T) {
	root := fstest.MapFS{
		"proc/self/cgroup": {Data: []byte("0::/leasehold.slice/leasehold.service\n")},
		"proc/self/mountinfo": {Data: []byte(
			"30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")},
		"sys/fs/cgroup/leasehold.slice/memory.max":                   {Data: []byte("200000000\n")},
		"sys/fs/cgroup/leasehold.slice/leasehold.service/memory.max": {Data: []byte("max\n")},
		"sys/fs/cgroup/memory.max":                                   {Data: []byte("max\n")},
	}
	got := decideMemoryLimit(0, false, func(string) string { return "" }, root)
	if got.bytes != 180000000 || !strings.Contains(got.source, "leasehold.slice/memory.max") {
		t.Fatalf("in a slice limited to 200 MB: %d from %q, want 180000000 (90%% of the slice's)",
			got.bytes, got.source)
	}
	// Its own lower limit wins over the slice's.
	root["sys/fs/cgroup/leasehold.slice/leasehold.service/memory.max"] =
		&fstest.MapFile{Data: []byte("100000000\n")}
	if got := decideMemoryLimit(0, false, func(string) string { return "" }, root); got.bytes != 90000000 {
		t.Fatalf("its own 100 MB under the slice's 200 MB: %d, want 90000000", got.bytes)
	}
}
