//go:build grpcnotrace

package main

// grpcTraceLinked: see grpctrace.go. Built with -tags grpcnotrace.
const grpcTraceLinked = false
