package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

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
