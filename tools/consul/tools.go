//go:build tools

// Package tools pins the Consul agent used by tests, the demo and benchmarks.
// Build it with `make consul` (go build -o ../../bin/consul github.com/hashicorp/consul).
package tools

import _ "github.com/hashicorp/consul"
