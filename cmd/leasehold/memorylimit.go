package main

import (
	"bufio"
	"bytes"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
)

// The Go runtime's soft memory limit (runtime/debug.SetMemoryLimit), which
// --memory-limit sets. Without one the collector lets the heap grow to
// twice what is live before collecting, and the runtime keeps what it
// freed for a while: at 10,000 executors and 1,000 streams serve's live
// heap was ~40 MB and its resident set ~126 MB after a run of lapses
// (BENCHMARKS.md, "A third cut of memory, and a memory limit"). A limit
// makes the collector run before the process outgrows it, at a cost in CPU
// that grows as the live heap nears it; past it the runtime gives the
// collector at most half the CPU rather than fail, so a limit set too low
// slows serve but does not stop it.

// memoryLimitAutoShare is the share of the cgroup's memory limit that
// --memory-limit's default (auto: GOMEMLIMIT when set, else this share of
// the lowest cgroup limit above serve, else none) takes; the rest is for
// what the Go runtime does not count: the binary's pages, which a cgroup
// charges too.
const memoryLimitAutoShare = 0.9

// memoryLimit is --memory-limit decided: the limit in bytes (0: none) and
// where it came from, for the log.
type memoryLimit struct {
	bytes  int64
	source string
}

// parseMemoryLimit reads --memory-limit: auto (0), off, or a size (512MiB,
// 1GB).
func parseMemoryLimit(s string) (limit int64, off bool, err error) {
	switch s {
	case "auto":
		return 0, false, nil
	case "off":
		return 0, true, nil
	}
	n, err := parseByteSize(s)
	if err != nil {
		return 0, false, fmt.Errorf("%w, auto or off", err)
	}
	if n < minMemoryLimit {
		return 0, false, fmt.Errorf("%q: want at least 16MiB (the runtime alone uses several), "+
			"auto or off", s)
	}
	return n, false, nil
}

const minMemoryLimit = 16 << 20

// decideMemoryLimit is the limit serve runs with: the flag's size, none when
// off, or (auto: 0) GOMEMLIMIT's when set (the runtime applied it already)
// and else memoryLimitAutoShare of the cgroup's limit read under root ("/"
// but in tests).
func decideMemoryLimit(flagLimit int64, off bool, getenv func(string) string,
	root fs.FS) memoryLimit {
	switch {
	case flagLimit > 0:
		return memoryLimit{bytes: flagLimit, source: "--memory-limit"}
	case off:
		return memoryLimit{source: "--memory-limit off"}
	case getenv("GOMEMLIMIT") == "off":
		return memoryLimit{source: "GOMEMLIMIT=off"}
	case getenv("GOMEMLIMIT") != "":
		return memoryLimit{bytes: debug.SetMemoryLimit(-1), source: "GOMEMLIMIT"}
	}
	if n, where, ok := cgroupMemoryLimit(root); ok {
		return memoryLimit{bytes: int64(float64(n) * memoryLimitAutoShare),
			source: fmt.Sprintf("%.0f%% of %s (%d bytes)", memoryLimitAutoShare*100, where, n)}
	}
	return memoryLimit{source: "none: no GOMEMLIMIT and no cgroup memory limit"}
}

// apply sets the runtime's limit (none: the largest, as when unset).
func (l memoryLimit) apply() {
	if l.bytes > 0 {
		debug.SetMemoryLimit(l.bytes)
	} else {
		debug.SetMemoryLimit(math.MaxInt64)
	}
}

// cgroupMemoryLimit is the memory limit binding the process's cgroup: the
// lowest of its own and its ancestors' (a slice's limit binds the services
// in it), read from cgroup v2's memory.max, else v1's
// memory.limit_in_bytes, in the cgroup /proc/self/cgroup names under the
// hierarchy's mount (/proc/self/mountinfo: a container sees its own cgroup
// mounted as the root, though /proc/self/cgroup names it by its path on the
// host). False when none sets one (v2's "max", v1's near-2^63 unlimited
// value) or nothing can be read.
func cgroupMemoryLimit(root fs.FS) (int64, string, bool) {
	self, err := fs.ReadFile(root, "proc/self/cgroup")
	if err != nil {
		return 0, "", false
	}
	mounts := cgroupMounts(root)
	sc := bufio.NewScanner(bytes.NewReader(self))
	for sc.Scan() {
		// hierarchy-ID:controllers:path; v2's is 0::/path.
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		var m cgroupMount
		var file string
		switch {
		case parts[0] == "0" && parts[1] == "":
			m, file = mounts.v2, "memory.max"
		case hasController(parts[1], "memory"):
			m, file = mounts.v1, "memory.limit_in_bytes"
		default:
			continue
		}
		if n, where, ok := lowestLimit(root, m, parts[2], file); ok {
			return n, where, true
		}
	}
	return 0, "", false
}

// cgroupMount is where a cgroup hierarchy is mounted (point, relative to
// "/") and which of its cgroups the mount shows as its root.
type cgroupMount struct{ point, root string }

// cgroupMounts finds the v2 hierarchy's mount and v1's memory controller's
// in /proc/self/mountinfo, else the usual places.
func cgroupMounts(root fs.FS) (ms struct{ v2, v1 cgroupMount }) {
	ms.v2 = cgroupMount{point: "sys/fs/cgroup", root: "/"}
	ms.v1 = cgroupMount{point: "sys/fs/cgroup/memory", root: "/"}
	info, err := fs.ReadFile(root, "proc/self/mountinfo")
	if err != nil {
		return ms
	}
	sc := bufio.NewScanner(bytes.NewReader(info))
	for sc.Scan() {
		// id parent major:minor root point options [optional...] - type source super
		f := strings.Fields(sc.Text())
		dash := slices.Index(f, "-")
		if dash < 5 || dash+1 >= len(f) {
			continue
		}
		m := cgroupMount{point: strings.TrimPrefix(f[4], "/"), root: f[3]}
		switch {
		case f[dash+1] == "cgroup2":
			ms.v2 = m
		case f[dash+1] == "cgroup" && dash+3 < len(f) && hasController(f[dash+3], "memory"):
			ms.v1 = m
		}
	}
	return ms
}

// lowestLimit reads file in the cgroup at path (as /proc/self/cgroup names
// it) and in each of its ancestors up to the mount's root, and returns the
// lowest limit set, with the file that sets it.
func lowestLimit(root fs.FS, m cgroupMount, cgroup, file string) (int64, string, bool) {
	rel := cgroup
	if m.root != "/" {
		if r, ok := strings.CutPrefix(cgroup, m.root); ok && (r == "" || r[0] == '/') {
			rel = r
		}
	}
	var best int64
	where := ""
	for dir := path.Join(m.point, rel); ; dir = path.Dir(dir) {
		if n, ok := readLimit(root, path.Join(dir, file)); ok && (best == 0 || n < best) {
			best, where = n, "/"+path.Join(dir, file)
		}
		if dir == m.point || !strings.HasPrefix(dir, m.point+"/") {
			break
		}
	}
	return best, where, best > 0
}

func hasController(list, name string) bool {
	for c := range strings.SplitSeq(list, ",") {
		if c == name {
			return true
		}
	}
	return false
}

// readLimit reads a cgroup limit file: a number of bytes below 2^62 (v1
// writes ~2^63 for none), not v2's "max".
func readLimit(root fs.FS, file string) (int64, bool) {
	b, err := fs.ReadFile(root, file)
	if err != nil {
		return 0, false
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || n <= 0 || n >= 1<<62 {
		return 0, false
	}
	return n, true
}

// rootFS is the file system cgroupMemoryLimit reads in serve.
func rootFS() fs.FS { return os.DirFS("/") }
