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
// import. Only cmd/, examples/ and internal/ (the wiring, and what tests
// share) may import anything; a package elsewhere must be listed.
var allowed = map[string][]string{
	"adapters/consul/consultest": {},
	"health":                     {},
	"snapshot/translator":        {"health"},
	"snapshot/xdscache":          {"health", "snapshot/translator"},
	"snapshot/fleet":             {"health", "snapshot/translator", "snapshot/xdscache"},
	"server":                     {"health", "snapshot/translator", "snapshot/xdscache", "snapshot/fleet", "proto/leasehold/v1"},
	"adapters/consul":            {"health"},
	"adapters/loadreport":        {},
	"adapters/otel":              {},
	"proto/leasehold/v1":         {},
}

// TestImportsPointOneWay: no package imports one above it or beside it
// (the syncer never reaches into the server, the translator never into the
// syncer, no adapter into the rest), so each can be read and changed alone.
func TestImportsPointOneWay(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	unlisted(t, root)
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

// unlisted fails for a package of the module that allowed does not list
// outside cmd/, examples/ and internal/ (tools/ holds other modules).
func unlisted(t *testing.T, root string) {
	t.Helper()
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			switch rel {
			case "cmd", "examples", "internal", "tools", "bin", ".git":
				return filepath.SkipDir
			}
			if strings.HasSuffix(rel, "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		if _, ok := allowed[filepath.Dir(rel)]; !ok {
			t.Errorf("package %s is not in allowed: say which of the module's packages it may import", filepath.Dir(rel))
			return filepath.SkipDir
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
