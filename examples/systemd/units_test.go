// Package systemd holds the systemd units of examples/systemd and the test
// that keeps them valid.
package systemd

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestUnitsVerify: systemd-analyze verify accepts both units as written (it
// exits 0 on unknown keys and bad values but says so: any word from it
// fails the test), the template as an instance too; and every variable the
// register unit's command line expands is set in its example environment
// file. Skipped, saying so, where systemd is not installed.
func TestUnitsVerify(t *testing.T) {
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze is not installed (Debian: apt-get install systemd): the units are not verified")
	}
	dir := t.TempDir()
	units := map[string]string{
		"leasehold.service":                 "leasehold.service",
		"leasehold-register@.service":       "leasehold-register@.service",
		"leasehold-register@exec-1.service": "leasehold-register@.service",
	}
	for dst, src := range units {
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		// The binary the units name is installed by the operator; verify
		// checks that it exists, so a binary every machine has stands in.
		b = []byte(strings.ReplaceAll(string(b), "/usr/local/bin/leasehold", "/bin/true"))
		if err := os.WriteFile(filepath.Join(dir, dst), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for name := range units {
		cmd := exec.Command(analyze, "verify", "./"+name)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err != nil || len(strings.TrimSpace(string(out))) > 0 {
			t.Errorf("systemd-analyze verify %s: %v\n%s", name, err, out)
		}
	}

	unit, err := os.ReadFile("leasehold-register@.service")
	if err != nil {
		t.Fatal(err)
	}
	env, err := os.ReadFile("leasehold-register.env")
	if err != nil {
		t.Fatal(err)
	}
	set := map[string]bool{}
	for _, line := range strings.Split(string(env), "\n") {
		if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(line, "#") && v != "" {
			set[k] = true
		}
	}
	for _, m := range regexp.MustCompile(`\$\{(\w+)\}`).FindAllStringSubmatch(string(unit), -1) {
		if !set[m[1]] {
			t.Errorf("leasehold-register@.service expands ${%s}, which leasehold-register.env does not set", m[1])
		}
	}
}
