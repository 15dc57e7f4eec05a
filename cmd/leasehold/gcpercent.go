package main

import (
	"fmt"
	"runtime/debug"
	"strconv"
)

// The collector's target percentage (runtime/debug.SetGCPercent), which
// --gc-percent sets. The runtime's default, 100, lets the heap grow by as
// much as is live (and the goroutines' stacks) before it collects, and the
// process's resident set follows that goal, not the live heap. leasehold's
// heap is nearly all state that lives as long as the fleet does, and a
// change allocates little beside it: at 10,000 executors a lapse allocated
// ~2 MB against a live heap of ~40 MB. Collecting at a quarter of that
// growth costs a collection per ~13 MB allocated instead of per ~53 MB, and
// kept the resident set after a run of lapses at 101 MB instead of 128 MB
// (BENCHMARKS.md, "The collector's target").
const defaultGCPercent = 25

// gcPercent is --gc-percent decided: the percentage (-1: off, as GOGC=off
// may set it) and where it came from, for the log.
type gcPercent struct {
	percent int
	source  string
}

// parseGCPercent reads --gc-percent: auto (0) or a percentage from 1 to
// 10,000 (off is not offered: without a memory limit the heap would grow
// without bound; GOGC=off stays the runtime's to take).
func parseGCPercent(s string) (int, error) {
	if s == "auto" {
		return 0, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 10000 {
		return 0, fmt.Errorf("%q: want a percentage from 1 to 10000, or auto", s)
	}
	return n, nil
}

// decideGCPercent is the percentage serve runs with: the flag's, or (auto:
// 0) GOGC's when set (the runtime applied it already), else
// defaultGCPercent.
func decideGCPercent(flagPercent int, getenv func(string) string) gcPercent {
	switch {
	case flagPercent > 0:
		return gcPercent{percent: flagPercent, source: "--gc-percent"}
	case getenv("GOGC") != "":
		// What the runtime read from GOGC, read back (setting it again).
		p := debug.SetGCPercent(100)
		debug.SetGCPercent(p)
		return gcPercent{percent: p, source: "GOGC"}
	}
	return gcPercent{percent: defaultGCPercent, source: "leasehold's default"}
}

// apply sets the collector's percentage; GOGC's, already applied by the
// runtime, is left as it is.
func (g gcPercent) apply() {
	if g.source != "GOGC" {
		debug.SetGCPercent(g.percent)
	}
}
