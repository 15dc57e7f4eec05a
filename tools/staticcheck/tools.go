//go:build tools

// Package tools pins the linter make test runs (staticcheck). Build it with
// `make staticcheck` (go build -o ../../bin/staticcheck honnef.co/go/tools/cmd/staticcheck).
package tools

import _ "honnef.co/go/tools/cmd/staticcheck"
