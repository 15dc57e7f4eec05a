package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
	"unicode"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
)

// shBlock returns the first ```sh block after heading in the README.
func shBlock(t *testing.T, readme, heading string) string {
	t.Helper()
	i := strings.Index(readme, "\n"+heading+"\n")
	if i < 0 {
		t.Fatalf("README.md has no heading %q", heading)
	}
	rest := readme[i:]
	start := strings.Index(rest, "```sh\n")
	if start < 0 {
		t.Fatalf("no sh block after %q", heading)
	}
	rest = rest[start+len("```sh\n"):]
	return rest[:strings.Index(rest, "```")]
}

// The README's quickstart works as written: run by bash against a real
// Consul agent, only the ports moved through the environment variables the
// commands read, in a temporary folder that mirrors the repository (links to
// its files), so what the block builds and writes (bin/, d1.json) never
// lands in the checkout.
func TestReadmeQuickstart(t *testing.T) {
	bin := consultest.RequireBinary(t)
	if testing.Short() {
		t.Skip("builds three binaries")
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	script := shBlock(t, string(raw), "## Quickstart by hand")
	agent, err := consultest.Launch(bin, consultest.Options{NodeName: "readme"})
	if err != nil {
		t.Fatal(err)
	}
	defer agent.Close()
	dir := mirror(t, root)

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-euo", "pipefail", "-c", script)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CONSUL_HTTP_ADDR="+agent.HTTPAddr(), "LEASEHOLD_XDS_ADDR="+freeAddr(), "LEASEHOLD_ADMIN_ADDR="+freeAddr())
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // the block's background jobs share it
	// A file, not a pipe: the block's background jobs keep their output
	// open after bash exits.
	out, err := os.Create(filepath.Join(t.TempDir(), "out"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	err = cmd.Run()
	syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // leasehold serve and the executors
	b, _ := os.ReadFile(out.Name())
	out.Close()
	text := string(b)
	if err != nil {
		t.Fatalf("the quickstart failed: %v\n%s", err, text)
	}
	confirmed := 0
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, " confirmed ") && strings.Contains(l, " session ") {
			confirmed++
			if !strings.Contains(l, "exec-1") {
				t.Errorf("a task went elsewhere than exec-1: %s", l)
			}
		}
	}
	if confirmed != 20 {
		t.Errorf("want 20 confirmed tasks, got %d:\n%s", confirmed, text)
	}
	if !strings.Contains(text, "version-incompatible") || !strings.Contains(text, `does not satisfy "<2.0.0"`) {
		t.Errorf("explain does not say why exec-2 is excluded:\n%s", text)
	}
}

// mirror is a temporary folder linking to every entry of the repository at
// root but bin/ (and what a checkout holds of git): the module builds there,
// and what a script writes stays there.
func mirror(t *testing.T, root string) string {
	t.Helper()
	dir := t.TempDir()
	entries, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		switch e.Name() {
		case "bin", ".git", "d1.json":
			continue
		}
		if err := os.Symlink(filepath.Join(root, e.Name()), filepath.Join(dir, e.Name())); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// guideFiles lists README.md and every docs/*.md of the repository at root,
// relative to root.
func guideFiles(t *testing.T, root string) []string {
	t.Helper()
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	files := []string{"README.md"}
	for _, d := range docs {
		rel, err := filepath.Rel(root, d)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, filepath.ToSlash(rel))
	}
	return files
}

// anchor is the fragment GitHub gives a heading: lower case, letters,
// digits, '-' and '_' kept, spaces turned into '-', the rest dropped.
func anchor(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case unicode.IsLetter(r), unicode.IsDigit(r), r == '-', r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteRune('-')
		}
	}
	return b.String()
}

// markdownLink is an inline link's target (no title).
var markdownLink = regexp.MustCompile(`\]\(([^()\s]+)\)`)

// proseLines returns the lines of a markdown text outside fenced code
// blocks, with their numbers (from 1).
func proseLines(text string) map[int]string {
	out := map[int]string{}
	fence := false
	for i, l := range strings.Split(text, "\n") {
		if strings.HasPrefix(l, "```") {
			fence = !fence
			continue
		}
		if !fence {
			out[i+1] = l
		}
	}
	return out
}

// anchors lists the fragments of a markdown text's headings, a repeated
// heading's with GitHub's -1, -2... suffix.
func anchors(text string) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	for _, l := range proseLines(text) {
		if !strings.HasPrefix(l, "#") {
			continue
		}
		a := anchor(strings.TrimSpace(strings.TrimLeft(l, "#")))
		if n := seen[a]; n > 0 {
			out[fmt.Sprintf("%s-%d", a, n)] = true
		} else {
			out[a] = true
		}
		seen[a]++
	}
	return out
}

// The guides link to each other by relative paths and heading fragments:
// every such link in README.md and docs/*.md names a file of the repository
// and, with a fragment, a heading of that file — so moving a section breaks
// this test rather than a reader's link.
func TestReadmeLinksResolve(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	links := 0
	for _, file := range guideFiles(t, root) {
		raw, err := os.ReadFile(filepath.Join(root, file))
		if err != nil {
			t.Fatal(err)
		}
		for n, line := range proseLines(string(raw)) {
			for _, m := range markdownLink.FindAllStringSubmatch(line, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				links++
				path, frag, _ := strings.Cut(target, "#")
				dest := file
				if path != "" {
					dest = filepath.ToSlash(filepath.Join(filepath.Dir(file), path))
				}
				text, err := os.ReadFile(filepath.Join(root, dest))
				if err != nil {
					t.Errorf("%s:%d: link %q: %v", file, n, target, err)
					continue
				}
				if frag != "" && !anchors(string(text))[frag] {
					t.Errorf("%s:%d: link %q: %s has no heading #%s", file, n, target, dest, frag)
				}
			}
		}
	}
	if links == 0 {
		t.Error("the guides hold no relative links: the check read nothing")
	}
}

// README is a guide: at most 300 lines, leading to docs/ for the rest.
func TestReadmeIsAGuide(t *testing.T) {
	raw, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(raw), "\n"); n > 300 {
		t.Errorf("README.md has %d lines; at most 300: move the detail into docs/", n)
	}
}
