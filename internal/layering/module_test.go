package layering

import (
	"os"
	"strings"
	"testing"
)

// TestModuleInstallsWithGoInstall: `go install
// github.com/leasehold/leasehold/cmd/leasehold@<version>` builds the module
// as published, which the go command refuses when go.mod has replace or
// exclude directives; and the module path is the one the docs install.
func TestModuleInstallsWithGoInstall(t *testing.T) {
	b, err := os.ReadFile("../../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(b), "\n")
	if !strings.HasPrefix(lines[0], "module "+strings.TrimSuffix(module, "/")) {
		t.Fatalf("go.mod names %q: the docs install %scmd/leasehold", lines[0], module)
	}
	for i, l := range lines {
		f := strings.Fields(l)
		if len(f) > 0 && (f[0] == "replace" || f[0] == "exclude") {
			t.Errorf("go.mod:%d: %q — go install <module>@<version> refuses a module with replace or exclude directives", i+1, l)
		}
	}
}
