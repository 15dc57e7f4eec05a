package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"
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
// leasehold's default, the only one paced; apply sets the flag's and the
// default, never overrides GOGC's.
func TestGCPercentIsDecidedAndApplied(t *testing.T) {
	prev := debug.SetGCPercent(100)
	defer debug.SetGCPercent(prev)
	noEnv := func(string) string { return "" }

	g := decideGCPercent(40, noEnv)
	if g.percent != 40 || g.source != "--gc-percent" || g.paced {
		t.Fatalf("flag 40: %+v", g)
	}
	g.apply()
	if got := debug.SetGCPercent(100); got != 40 {
		t.Fatalf("collector at %d after applying 40", got)
	}

	g = decideGCPercent(0, noEnv)
	if g.percent != defaultGCPercent || g.source != "leasehold's default" || !g.paced {
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
	if g.percent != 70 || g.source != "GOGC" || g.paced {
		t.Fatalf("auto with GOGC=70: %+v", g)
	}
	g.apply()
	if got := debug.SetGCPercent(100); got != 70 {
		t.Fatalf("collector at %d after applying GOGC's decision, want 70 left as it was", got)
	}
}

// The pacer's decisions, over the rate of the last gcWindow: calm at the
// quiet percentage, and a burst (30 MiB at once) calm too; 100 as soon as
// the window's rate reaches gcBusyRate; back to the quiet percentage only
// after gcCalmFor below it; a sample back in time restarts the count, and
// two samples are a window.
func TestThePacerLoosensTheCollectorWhileServeAllocatesFast(t *testing.T) {
	t0 := time.Unix(1000, 0)
	const mib = 1 << 20
	p := gcPace{quiet: 25}
	var total uint64
	sample := func(s float64, add uint64, want int, why string) {
		t.Helper()
		total += add
		at := t0.Add(time.Duration(s * float64(time.Second)))
		if got := p.step(at, total, 0); got != want {
			t.Fatalf("at %.1f s, %d MiB allocated (%s): set %d, want %d", s, total/mib, why,
				got, want)
		}
	}
	sample(0, 0, 0, "the first sample")
	for s := 1; s <= 12; s++ {
		sample(float64(s), mib, 0, "1 MiB/s")
	}
	sample(13, 30*mib, 0, "a burst of 30 MiB: 3.9 MiB/s over the window")
	for s, rate := range []float64{4.7, 5.5, 6.3, 7.1, 7.9} {
		sample(float64(14+s), 9*mib, 0, fmt.Sprintf("9 MiB/s for a while: %.1f over the window",
			rate))
	}
	sample(19, 9*mib, gcBusyPercent, "8.7 MiB/s over the window")
	sample(20, 9*mib, 0, "busy, already at 100")
	sample(21, 0, 0, "nothing allocated, the window still at 9.4 MiB/s")
	sample(22, 0, 0, "9.3 MiB/s")
	for s := 23; s <= 32; s++ {
		sample(float64(s), 0, 0, fmt.Sprintf("calm for %d s", s-23))
	}
	sample(33, 0, 25, "calm for 10 s: back to the quiet percentage")
	sample(34, mib, 0, "calm and quiet")
	sample(33.5, 100*mib, 0, "a sample back in time restarts the count")
	sample(34.5, 60*mib, gcBusyPercent, "two samples a second apart: 60 MiB/s")
}

// While calm, the collector's goal is set at least gcHeadroom past the
// live heap: a small heap's quarter would run it inside every fan-out. The
// percentage is raised at once, lowered by gcQuietStep or more or straight
// to the quiet one, and never past 100; busy and back, it is set again
// whatever it was; samples that restart while busy keep it busy.
func TestThePacerKeepsTheHeadroomOfAFanOut(t *testing.T) {
	t0 := time.Unix(1000, 0)
	const mib = 1 << 20
	p := gcPace{quiet: 25}
	var total uint64
	sample := func(s float64, add uint64, retained float64, want int, why string) {
		t.Helper()
		total += add
		at := t0.Add(time.Duration(s * float64(time.Second)))
		if got := p.step(at, total, uint64(retained*mib)); got != want {
			t.Fatalf("at %.1f s, %.1f MiB retained (%s): set %d, want %d", s, retained, why,
				got, want)
		}
	}
	sample(0, 0, 100, 0, "a quarter of 100 MiB is past 10: 25 holds")
	sample(1, mib, 40, 0, "a quarter of 40 MiB is 10")
	sample(2, mib, 20, 50, "20 MiB retained: 50% leaves 10, raised at once")
	sample(3, mib, 21, 0, "48% is 2 below 50")
	sample(4, mib, 22, 0, "46% is 4 below 50")
	sample(5, mib, 22.3, 45, "45% is 5 below 50: lowered")
	sample(6, mib, 21, 48, "48% is above 45: raised at once")
	sample(7, mib, 36, 28, "28% is 20 below 48")
	sample(8, mib, 100, 25, "25, the least, 3 below 28: lowered")
	sample(9, mib, 8, gcBusyPercent, "8 MiB: 125%, held to 100")
	sample(10, mib, 0, 25, "retained not known: the quiet 25")
	p, total = gcPace{quiet: 25}, 0
	sample(0, 0, 100, 0, "a new pace")
	sample(1, 64*mib, 100, gcBusyPercent, "64 MiB/s: busy")
	sample(0.5, 0, 20, 0, "a sample back in time restarts the count, still busy")
	sample(2, 64*mib, 20, 0, "busy, already at 100")
	for s := 3; s <= 18; s++ { // the window's rate falls under 8 MiB/s at 9 s
		sample(float64(s), 0, 20, 0, "busy, or calm for less than 10 s")
	}
	sample(19, 0, 20, 50, "calm for 10 s at 20 MiB retained: 50, not 25")
}

// The bytes heapRetained reads are what the collector's percentage is of:
// the runtime's goal is the live heap plus them times the percentage, to the
// byte (Go's pacer: heapMarked + (heapMarked + lastStackScan + globalsScan)
// × GOGC / 100).
func TestHeapRetainedIsWhatThePercentageIsOf(t *testing.T) {
	keep := make([]byte, 32<<20) // past the runtime's heap minimum, by far
	defer runtime.KeepAlive(keep)
	for range 5 {
		runtime.GC()
		s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}, {Name: "/gc/scan/stack:bytes"},
			{Name: "/gc/scan/globals:bytes"}, {Name: "/gc/heap/goal:bytes"},
			{Name: "/gc/gogc:percent"}}
		metrics.Read(s)
		live, stack, globals := s[0].Value.Uint64(), s[1].Value.Uint64(), s[2].Value.Uint64()
		goal, pct := s[3].Value.Uint64(), s[4].Value.Uint64()
		retained := heapRetained()
		if retained != live+stack+globals {
			continue // a collection in between: read again
		}
		if want := live + retained*pct/100; goal != want {
			t.Errorf("goal %d, want live %d + retained %d × %d%% = %d", goal, live, retained, pct,
				want)
		}
		return
	}
	t.Error("heapRetained never read the live heap, stacks and globals a collection had left")
}

// Run samples every gcPaceEvery, sets what the pace decides from the bytes
// allocated and retained, and leaves the calm percentage set when it ends
// busy; it shares whether it counts serve busy with the idle collector.
func TestThePacerSetsWhatItDecidesAndEndsQuiet(t *testing.T) {
	fc := clockwork.NewFakeClock()
	var allocated atomic.Uint64
	sets := make(chan int, 8)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	busy := new(atomic.Bool)
	go func() {
		done <- gcPacer{quiet: 25, clock: fc, allocs: allocated.Load, busy: busy,
			retained: func() uint64 { return 20 << 20 }, // 50% leaves gcHeadroom
			set:      func(p int) int { sets <- p; return 0 }}.Run(ctx)
	}()
	next := func(add uint64) {
		t.Helper()
		if err := fc.BlockUntilContext(ctx, 1); err != nil { // the ticker is set
			t.Fatal(err)
		}
		allocated.Add(add)
		fc.Advance(gcPaceEvery)
	}
	expect := func(want int) {
		t.Helper()
		select {
		case got := <-sets:
			if got != want {
				t.Fatalf("set %d, want %d", got, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("nothing set, want %d", want)
		}
	}
	expect(50) // the first sample: calm, on a small heap
	if busy.Load() {
		t.Fatal("busy shared while calm")
	}
	next(64 << 20) // 64 MiB in a second
	expect(gcBusyPercent)
	if !busy.Load() { // stored before the percentage is set: the idle collector's to read
		t.Fatal("busy not shared with the idle collector")
	}
	cancel()
	expect(50)
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v", err)
	}
}

// A bad --gc-percent stops serve before it starts, naming the flag, and
// the variable when the value came from it; a good one reaches the config.
func TestABadGCPercentNamesTheFlagAndItsVariable(t *testing.T) {
	unsetenv(t, "LEASEHOLD_GC_PERCENT")
	if _, err := parseServeFlags([]string{"--gc-percent", "0"}, io.Discard); err == nil ||
		!strings.Contains(err.Error(), "--gc-percent") ||
		!strings.Contains(err.Error(), "from 1 to 10000") {
		t.Fatalf("--gc-percent 0: %v, want an error naming the flag and the range", err)
	}
	cfg, err := parseServeFlags([]string{"--gc-percent", "40"}, io.Discard)
	if err != nil || cfg.gcPercent != 40 || cfg.gcPace != 0 {
		t.Fatalf("--gc-percent 40: %+v %v", cfg, err)
	}
	t.Setenv("LEASEHOLD_GC_PERCENT", "off")
	if _, err := parseServeFlags(nil, io.Discard); err == nil ||
		!strings.Contains(err.Error(), "--gc-percent (from $LEASEHOLD_GC_PERCENT)") {
		t.Fatalf("LEASEHOLD_GC_PERCENT=off: %v, want an error naming the flag and variable", err)
	}
}
