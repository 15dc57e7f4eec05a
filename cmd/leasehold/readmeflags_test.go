package main

import (
	"bytes"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
)

// helpFlag is one flag as a command's --help shows it.
type helpFlag struct {
	env []string // variables it reads, in order
	def string   // "" when help shows no default
}

var (
	helpLine    = regexp.MustCompile(`^\s+(?:-\w, )?--([a-z0-9-]+)(?: \S+)?\s{2,}(.*)$`)
	helpEnv     = regexp.MustCompile(`\[(\$[A-Z_]+(?:, \$[A-Z_]+)*)\]`)
	helpDefault = regexp.MustCompile(`\(default (.*)\)$`)
)

// helpFlags runs `leasehold <path> --help` and reads its flags (but -h).
func helpFlags(t *testing.T, path []string) map[string]helpFlag {
	t.Helper()
	var out, errOut bytes.Buffer
	if code := run(append(slices.Clone(path), "--help"), &out, &errOut); code != 0 {
		t.Fatalf("leasehold %s --help: exit %d\n%s", strings.Join(path, " "), code, errOut.String())
	}
	flags := map[string]helpFlag{}
	inFlags := false
	for _, line := range strings.Split(out.String(), "\n") {
		switch {
		case strings.HasSuffix(line, "Flags:"):
			inFlags = true
			continue
		case line == "" || !strings.HasPrefix(line, " "):
			inFlags = false
			continue
		}
		m := helpLine.FindStringSubmatch(line)
		if !inFlags || m == nil || m[1] == "help" {
			continue
		}
		var f helpFlag
		if e := helpEnv.FindAllStringSubmatch(m[2], -1); e != nil {
			for _, v := range strings.Split(e[len(e)-1][1], ", ") {
				f.env = append(f.env, strings.TrimPrefix(v, "$"))
			}
		}
		if d := helpDefault.FindStringSubmatch(m[2]); d != nil {
			f.def = strings.Trim(d[1], `"`)
		}
		flags[m[1]] = f
	}
	return flags
}

// commandPaths lists every leasehold command but cobra's own (help,
// completion).
func commandPaths() [][]string {
	var out [][]string
	var walk func(c *cobra.Command, path []string)
	walk = func(c *cobra.Command, path []string) {
		for _, sub := range c.Commands() {
			if sub.Hidden || sub.Name() == "help" || sub.Name() == "completion" {
				continue
			}
			p := append(slices.Clone(path), sub.Name())
			out = append(out, p)
			walk(sub, p)
		}
	}
	walk(newRootCmd(), nil)
	return out
}

// flagTablesDoc is the guide holding every command's flag table, the one
// README's "The command line" points at.
const flagTablesDoc = "docs/operating.md"

// flagRow is one row of a flag table, for the commands it names.
type flagRow struct {
	flag, env, def string
	commands       []string
	line           int
}

var (
	flagsMarker = regexp.MustCompile(`^<!-- flags: (.*) -->$`)
	codeSpan    = regexp.MustCompile("`([^`]*)`")
)

// flagTables reads the flag tables of doc, a guide named file: each follows
// a marker `<!-- flags: cmd, cmd ... -->` naming the commands it covers, has
// the columns flag, env and default, and may have a commands column ("all":
// every command of the marker) when a row does not apply to all of them.
func flagTables(file, doc string) (rows []flagRow, covered map[string]bool, problems []string) {
	covered = map[string]bool{}
	bad := func(format string, a ...any) {
		problems = append(problems, file+":"+fmt.Sprintf(format, a...))
	}
	lines := strings.Split(doc, "\n")
	for i := 0; i < len(lines); i++ {
		m := flagsMarker.FindStringSubmatch(strings.TrimSpace(lines[i]))
		if m == nil {
			continue
		}
		var all []string
		for _, c := range strings.Split(m[1], ",") {
			all = append(all, strings.TrimSpace(c))
			covered[strings.TrimSpace(c)] = true
		}
		i++
		for i < len(lines) && strings.TrimSpace(lines[i]) == "" {
			i++
		}
		if i+1 >= len(lines) || !strings.HasPrefix(lines[i], "|") {
			bad("%d: no table after %s", i, lines[i-1])
			continue
		}
		cols := map[string]int{}
		for j, h := range cells(lines[i]) {
			cols[strings.ToLower(strings.TrimSpace(h))] = j
		}
		missing := false
		for _, need := range []string{"flag", "env", "default"} {
			if _, ok := cols[need]; !ok {
				bad("%d: the flag table has no %q column", i+1, need)
				missing = true
			}
		}
		if missing {
			continue
		}
		for i += 2; i < len(lines) && strings.HasPrefix(lines[i], "|"); i++ {
			cs := cells(lines[i])
			r := flagRow{commands: all, line: i + 1}
			spans := codeSpan.FindAllStringSubmatch(cs[cols["flag"]], -1)
			if len(spans) != 1 || !strings.HasPrefix(spans[0][1], "--") {
				bad("%d: want one `--flag` in the flag cell, got %q", i+1, cs[cols["flag"]])
				continue
			}
			r.flag = strings.Fields(strings.TrimPrefix(spans[0][1], "--"))[0]
			var envs []string
			for _, s := range codeSpan.FindAllStringSubmatch(cs[cols["env"]], -1) {
				envs = append(envs, s[1])
			}
			r.env = strings.Join(envs, ",")
			def := strings.TrimSpace(cs[cols["default"]])
			switch {
			case strings.HasPrefix(def, "none"), strings.HasPrefix(def, "off"),
				strings.HasPrefix(def, "required"):
			default:
				s := codeSpan.FindStringSubmatch(def)
				if s == nil {
					bad("%d: --%s: the default cell starts with neither a "+
						"`value` nor none/off/required: %q", i+1, r.flag, def)
					continue
				}
				r.def = s[1]
			}
			if j, ok := cols["commands"]; ok {
				if c := strings.TrimSpace(cs[j]); c != "all" {
					r.commands = nil
					for _, name := range strings.Split(c, ",") {
						name = strings.TrimSpace(name)
						if !slices.Contains(all, name) {
							bad("%d: --%s names command %q, not one of the table's %v",
								i+1, r.flag, name, all)
						}
						r.commands = append(r.commands, name)
					}
				}
			}
			rows = append(rows, r)
		}
	}
	return rows, covered, problems
}

func cells(line string) []string {
	line = strings.TrimSpace(line)
	line = strings.TrimPrefix(strings.TrimSuffix(line, "|"), "|")
	// a `|` inside a code span is no cell border
	var out []string
	var cur strings.Builder
	inCode := false
	for _, r := range line {
		switch {
		case r == '`':
			inCode = !inCode
		case r == '|' && !inCode:
			out = append(out, cur.String())
			cur.Reset()
			continue
		}
		cur.WriteRune(r)
	}
	return append(out, cur.String())
}

// sameDefault compares defaults, durations as durations (10m is 10m0s).
func sameDefault(readme, help string) bool {
	if readme == help {
		return true
	}
	a, errA := time.ParseDuration(readme)
	b, errB := time.ParseDuration(help)
	return errA == nil && errB == nil && a == b
}

// guides reads README.md and every docs/*.md of the repository, by their
// paths relative to its root.
func guides(t *testing.T) map[string]string {
	t.Helper()
	docs, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, p := range append([]string{"../../README.md"}, docs...) {
		raw, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		out[strings.TrimPrefix(filepath.ToSlash(p), "../../")] = string(raw)
	}
	return out
}

// The flag tables of docs/operating.md are the commands' help: every flag
// every command shows is in a table covering that command, with the
// variables it reads (in order) and its default, and every row is a flag of
// each command it names — so the two cannot drift apart. No other guide
// (README.md, docs/*.md) holds a flag table, so none goes unchecked.
func TestReadmeFlagTablesMatchHelp(t *testing.T) {
	for _, p := range checkFlagTables(t, guides(t)) {
		t.Error(p)
	}
}

// checkFlagTables lists where the guides' flag tables and the help differ:
// the tables are read from flagTablesDoc, and a table in another guide is a
// problem too.
func checkFlagTables(t *testing.T, guides map[string]string) []string {
	var problems []string
	bad := func(format string, a ...any) { problems = append(problems, fmt.Sprintf(format, a...)) }
	doc, ok := guides[flagTablesDoc]
	if !ok {
		return []string{flagTablesDoc + " is missing: it holds the commands' flag tables"}
	}
	for file, text := range guides {
		if file == flagTablesDoc {
			continue
		}
		for i, line := range strings.Split(text, "\n") {
			if flagsMarker.MatchString(strings.TrimSpace(line)) {
				bad("%s:%d: a flag table outside %s, which the check reads",
					file, i+1, flagTablesDoc)
			}
		}
	}
	rows, covered, tableProblems := flagTables(flagTablesDoc, doc)
	problems = append(problems, tableProblems...)
	documented := map[string]map[string]flagRow{} // command → flag → row
	for _, r := range rows {
		for _, c := range r.commands {
			if documented[c] == nil {
				documented[c] = map[string]flagRow{}
			}
			if prev, dup := documented[c][r.flag]; dup {
				bad("%s:%d: --%s of leasehold %s is documented twice (also line %d)",
					flagTablesDoc, r.line, r.flag, c, prev.line)
			}
			documented[c][r.flag] = r
		}
	}
	seen := map[string]bool{}
	for _, path := range commandPaths() {
		name := strings.Join(path, " ")
		seen[name] = true
		flags := helpFlags(t, path)
		if len(flags) == 0 {
			continue
		}
		if !covered[name] {
			bad("%s has no flag table for leasehold %s (a <!-- flags: %s "+
				"--> marker before its table)", flagTablesDoc, name, name)
			continue
		}
		names := make([]string, 0, len(flags))
		for n := range flags {
			names = append(names, n)
		}
		sort.Strings(names)
		for _, n := range names {
			f := flags[n]
			r, ok := documented[name][n]
			if !ok {
				bad("%s: leasehold %s --%s is not in its flag table (env %v, default %q)",
					flagTablesDoc, name, n, f.env, f.def)
				continue
			}
			if env := strings.Join(f.env, ","); r.env != env {
				bad("%s:%d: leasehold %s --%s: env %q, help says %q",
					flagTablesDoc, r.line, name, n, r.env, env)
			}
			if !sameDefault(r.def, f.def) {
				bad("%s:%d: leasehold %s --%s: default %q, help says %q",
					flagTablesDoc, r.line, name, n, r.def, f.def)
			}
		}
		for n, r := range documented[name] {
			if _, ok := flags[n]; !ok {
				bad("%s:%d: leasehold %s has no flag --%s (a stale row)",
					flagTablesDoc, r.line, name, n)
			}
		}
	}
	for c := range covered {
		if !seen[c] {
			bad("%s: a flag table names leasehold %s, which is no command", flagTablesDoc, c)
		}
	}
	return problems
}

// The check catches drift: a missing row, a stale one, a wrong variable or
// default, a command without a table, a table in another guide, and the
// guide holding the tables gone.
func TestReadmeFlagCheckCatchesDrift(t *testing.T) {
	all := guides(t)
	doc := all[flagTablesDoc]
	for _, tt := range []struct{ name, old, new, want string }{
		{"missing row", "| `--xds-addr` | `LEASEHOLD_XDS_ADDR` | `127.0.0.1:18000` (gRPC",
			"| `--xds-adr` | `LEASEHOLD_XDS_ADDR` | `127.0.0.1:18000` (gRPC",
			"leasehold serve --xds-addr is not in its flag table"},
		{"stale row", "| `--metrics-addr` |", "| `--metrics-address` |",
			"has no flag --metrics-address"},
		{"wrong env", "| `--consul-max-conns` | `LEASEHOLD_CONSUL_MAX_CONNS` |",
			"| `--consul-max-conns` | `LEASEHOLD_MAX_CONNS` |", "--consul-max-conns: env"},
		{"wrong default", "| `--limit` | audit | | `50` |",
			"| `--limit` | audit | | `20` |", "--limit: default \"20\""},
		{"no table", "<!-- flags: explain -->", "", "no flag table for leasehold explain"},
	} {
		if strings.Count(doc, tt.old) != 1 {
			t.Fatalf("%s: %s does not hold %q once", tt.name, flagTablesDoc, tt.old)
		}
		changed := maps.Clone(all)
		changed[flagTablesDoc] = strings.Replace(doc, tt.old, tt.new, 1)
		problems := strings.Join(checkFlagTables(t, changed), "\n")
		if !strings.Contains(problems, tt.want) {
			t.Errorf("%s: want a problem saying %q, got:\n%s", tt.name, tt.want, problems)
		}
	}

	elsewhere := maps.Clone(all)
	elsewhere["README.md"] += "\n<!-- flags: version -->\n| flag | env | default |\n|---|---|---|\n"
	if p := strings.Join(checkFlagTables(t, elsewhere), "\n"); !strings.Contains(p, "README.md:") ||
		!strings.Contains(p, "a flag table outside "+flagTablesDoc) {
		t.Errorf("a flag table in README.md: want a problem naming it, got:\n%s", p)
	}

	gone := maps.Clone(all)
	delete(gone, flagTablesDoc)
	if p := strings.Join(checkFlagTables(t, gone),
		"\n"); !strings.Contains(p, flagTablesDoc+" is missing") {
		t.Errorf("without %s: want a problem saying it is missing, got:\n%s", flagTablesDoc, p)
	}
}
