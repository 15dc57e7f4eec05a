package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"
)

// A run's samples, written with --samples and pooled with --pool: over 100
// lapses a run's p99 is its largest lapse, and the floor's its second
// largest push, so one run's p99 ratio is decided by two values. Pooled
// over several runs, the p99 is read among as many times more samples.

// samples is what --samples writes of a run (durations in nanoseconds).
type samples struct {
	Invocation  string          `json:"invocation"`
	Lapse       []time.Duration `json:"lapse"`
	AfterConsul []time.Duration `json:"after_consul"`
	Consul      []time.Duration `json:"consul"`
	Floor       []time.Duration `json:"floor"`
	FloorTask   []time.Duration `json:"floor_task"`
	Fanout      []time.Duration `json:"fanout"`
}

// samplesOf is res's samples.
func samplesOf(res results) samples {
	return samples{
		Invocation: res.invocation(), Lapse: res.lapse, AfterConsul: res.afterConsul,
		Consul: res.consulPart, Floor: res.floor, FloorTask: res.floorTask, Fanout: res.fanout,
	}
}

// writeSamples writes res's samples to path as JSON.
func writeSamples(path string, res results) error {
	b, err := json.MarshalIndent(samplesOf(res), "", " ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("--samples: %w", err)
	}
	return nil
}

// readSamples reads the samples files paths, each a run; they must all be
// runs of one invocation, or pooling them means nothing.
func readSamples(paths []string) ([]samples, error) {
	if len(paths) == 0 {
		return nil, errors.New("--pool: name the samples files (--samples) to pool")
	}
	var runs []samples
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, fmt.Errorf("--pool: %w", err)
		}
		var s samples
		if err := json.Unmarshal(b, &s); err != nil {
			return nil, fmt.Errorf("--pool: %s: %w", p, err)
		}
		if len(s.AfterConsul) == 0 || len(s.Floor) == 0 {
			return nil, fmt.Errorf("--pool: %s: no lapses measured on the harness's clock "+
				"(after_consul: run with --consul-probe) or no floor", p)
		}
		if len(runs) > 0 && s.Invocation != runs[0].Invocation {
			return nil, fmt.Errorf("--pool: %s is a run of %q, %s of %q: only runs of one "+
				"invocation pool", p, s.Invocation, paths[0], runs[0].Invocation)
		}
		runs = append(runs, s)
	}
	return runs, nil
}

// pooled is the report of runs pooled: each series' distribution over all
// of them, leasehold's part ÷ its floor pooled, and each run's own ratio.
func pooled(runs []samples) string {
	var all samples
	var perRun []string
	for i, s := range runs {
		all.Lapse = append(all.Lapse, s.Lapse...)
		all.AfterConsul = append(all.AfterConsul, s.AfterConsul...)
		all.Consul = append(all.Consul, s.Consul...)
		all.Floor = append(all.Floor, s.Floor...)
		all.FloorTask = append(all.FloorTask, s.FloorTask...)
		all.Fanout = append(all.Fanout, s.Fanout...)
		perRun = append(perRun, fmt.Sprintf("run %d: %s", i+1, ratios(s.AfterConsul, s.Floor)))
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d runs of %s pooled.\n\n", len(runs), runs[0].Invocation)
	b.WriteString("| series | samples | distribution |\n|---|---|---|\n")
	for _, row := range []struct {
		name string
		ds   []time.Duration
	}{
		{"lapse → stop", all.Lapse},
		{"of which Consul (expiry → the harness's probe has it critical)", all.Consul},
		{"of which leasehold on the harness's clock (probe → last stream)", all.AfterConsul},
		{"floor: push → last stream, leasehold's layout", all.Floor},
		{"floor: push → last stream, the pushed task type's streams alone", all.FloorTask},
		{"fan-out", all.Fanout},
	} {
		if len(row.ds) > 0 {
			fmt.Fprintf(&b, "| %s | %d | %s |\n", row.name, len(row.ds), dist(row.ds))
		}
	}
	fmt.Fprintf(&b, "\nleasehold's part ÷ floor, pooled: %s (target at p99 ≤ 1.3×)\n",
		ratios(all.AfterConsul, all.Floor))
	fmt.Fprintf(&b, "each run's own: %s\n", strings.Join(perRun, "; "))
	return b.String()
}

// runPool prints the pooled report of the samples files named.
func runPool(paths []string) error {
	runs, err := readSamples(paths)
	if err != nil {
		return err
	}
	fmt.Print(pooled(runs))
	return nil
}
