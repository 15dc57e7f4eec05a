package main

import (
	"runtime/debug"
	"strings"
	"testing"
)

// --gc-percent takes auto or a percentage in range, and a bad value is
// refused naming what it wants.
func TestGCPercentParses(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
		bad  bool
	}{
		{in: "auto", want: 0},
		{in: "25", want: 25},
		{in: "1", want: 1},
		{in: "10000", want: 10000},
		{in: "0", bad: true},
		{in: "-1", bad: true},
		{in: "off", bad: true},
		{in: "10001", bad: true},
		{in: "25%", bad: true},
		{in: "", bad: true},
	} {
		got, err := parseGCPercent(tc.in)
		if tc.bad {
			if err == nil || !strings.Contains(err.Error(), "from 1 to 10000, or auto") {
				t.Errorf("%q: %d, %v; want refused naming the range", tc.in, got, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%q: %d, %v; want %d", tc.in, got, err, tc.want)
		}
	}
}

// The flag wins; auto takes GOGC as the runtime applied it, else
// leasehold's default; apply sets the flag's and the default, never
// overrides GOGC's.
func TestGCPercentIsDecidedAndApplied(t *testing.T) {
	prev := debug.SetGCPercent(100)
	defer debug.SetGCPercent(prev)
	noEnv := func(string) string { return "" }

	g := decideGCPercent(40, noEnv)
	if g.percent != 40 || g.source != "--gc-percent" {
		t.Fatalf("flag 40: %+v", g)
	}
	g.apply()
	if got := debug.SetGCPercent(100); got != 40 {
		t.Fatalf("collector at %d after applying 40", got)
	}

	g = decideGCPercent(0, noEnv)
	if g.percent != defaultGCPercent || g.source != "leasehold's default" {
		t.Fatalf("auto without GOGC: %+v", g)
	}
	g.apply()
	if got := debug.SetGCPercent(100); got != defaultGCPercent {
		t.Fatalf("collector at %d after applying the default", got)
	}

	// GOGC=70 as the runtime would have applied it at start.
	debug.SetGCPercent(70)
	gogc := func(k string) string {
		if k == "GOGC" {
			return "70"
		}
		return ""
	}
	g = decideGCPercent(0, gogc)
	if g.percent != 70 || g.source != "GOGC" {
		t.Fatalf("auto with GOGC=70: %+v", g)
	}
	g.apply()
	if got := debug.SetGCPercent(100); got != 70 {
		t.Fatalf("collector at %d after applying GOGC's decision, want 70 left as it was", got)
	}
}
