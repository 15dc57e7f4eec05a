//go:build !grpcnotrace

package main

// grpcTraceLinked says whether gRPC's request tracing (golang.org/x/net/trace)
// is linked in: it is unless the binary was built with -tags grpcnotrace, as
// make builds it. With it the linker keeps every method of every type (its
// html/template calls methods by name), and serve says so at start.
const grpcTraceLinked = true
