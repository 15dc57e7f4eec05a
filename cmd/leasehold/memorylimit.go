package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path"
	"runtime/debug"
	"strconv"
	"strings"
)

// The Go runtime's soft memory limit (runtime/debug.SetMemoryLimit), which
// --memory-limit sets. Without one the collector lets the heap grow to
// twice what is live before collecting, and the runtime keeps what it
// freed for a while: at 10,000 executors and 1,000 streams serve's live
// heap was ~40 MB and its resident set ~130 MB after a run of lapses
// (BENCHMARKS.md, "A memory limit"). A limit makes the collector run before
// the process outgrows it, at a cost in CPU that grows as the live heap
// nears it; past it the runtime gives the collector at most half the CPU
// rather than fail, so a limit set too low slows serve but does not stop it.

// memoryLimitAuto is --memory-limit's default: GOMEMLIMIT when set, else
// this share of the memory limit of serve's cgroup (the rest is for what the
// Go runtime does not count: the binary's pages, which a cgroup charges
// too), else none.
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
	case getenv("GOMEMLIMIT") != "" && getenv("GOMEMLIMIT") != "off":
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

// cgroupMemoryLimit is the memory limit of the process's cgroup: v2's
// memory.max of the cgroup /proc/self/cgroup names, else v1's
// memory.limit_in_bytes; false when neither sets one (v2's "max", v1's
// near-2^63 unlimited value) or neither can be read.
func cgroupMemoryLimit(root fs.FS) (int64, string, bool) {
	self, err := fs.ReadFile(root, "proc/self/cgroup")
	if err != nil {
		return 0, "", false
	}
	sc := bufio.NewScanner(bytes.NewReader(self))
	for sc.Scan() {
		// hierarchy-ID:controllers:path; v2's is 0::/path.
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		var file string
		switch {
		case parts[0] == "0" && parts[1] == "":
			file = path.Join("sys/fs/cgroup", parts[2], "memory.max")
		case hasController(parts[1], "memory"):
			file = path.Join("sys/fs/cgroup/memory", parts[2], "memory.limit_in_bytes")
		default:
			continue
		}
		if n, ok := readLimit(root, file); ok {
			return n, "/" + file, true
		}
	}
	return 0, "", false
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

// errNoSize is what parseByteSize says of what is not a size.
var errNoSize = errors.New("want a positive size such as 512MiB, 1GiB or 800MB")
