// Package layering holds the test that keeps leasehold's imports pointing
// one way: domain at the bottom, adapters wired only by cmd/ and examples.
package layering

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

const module = "github.com/leasehold/leasehold/"

// allowed lists, per package, the module's packages its non-test files may
// import. Packages not listed (cmd/, examples/, tools) may import anything.
var allowed = map[string][]string{
	"health":              {},
	"translator":          {"health"},
	"xdscache":            {"health", "translator"},
	"fleet":               {"health", "translator", "xdscache"},
	"server":              {"health", "translator", "xdscache", "fleet", "proto/leasehold/v1"},
	"adapters/consul":     {"health"},
	"adapters/loadreport": {},
	"adapters/otel":       {},
	"proto/leasehold/v1":  {},
}

// TestImportsPointOneWay: no package imports one above it or beside it
// (the syncer never reaches into the server, the translator never into the
// syncer, no adapter into the rest), so each can be read and changed alone.
func TestImportsPointOneWay(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for pkg, ok := range allowed {
		files, _ := filepath.Glob(filepath.Join(root, pkg, "*.go"))
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			src, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			parsed, err := parser.ParseFile(token.NewFileSet(), f, src, parser.ImportsOnly)
			if err != nil {
				t.Fatal(err)
			}
			checked++
			for _, imp := range parsed.Imports {
				path, _ := strconv.Unquote(imp.Path.Value)
				dep, inModule := strings.CutPrefix(path, module)
				if inModule && !slices.Contains(ok, dep) {
					t.Errorf("%s imports %s: %s may import only %v of this module", strings.TrimPrefix(f, root+"/"), dep, pkg, ok)
				}
			}
		}
	}
	if checked < 40 {
		t.Fatalf("read %d files: the layout moved (update allowed)", checked)
	}
}
