// Package server is leasehold's gRPC and HTTP edge. It serves xDS
// (state-of-the-world and delta, over ADS and the per-type services) from the
// syncer's cache and validates each dispatcher's node metadata (xds.go); it
// answers the Fencing API over gRPC and as JSON from the syncer's views
// (fencing.go); it serves the admin HTTP endpoints (admin.go), guarded by a
// bearer token or a client certificate (adminguard.go). An optional
// authorization policy grants each client identity its task types and fencing
// calls (policy.go, authz.go); TLS certificates reload when their files change
// (tls.go); responses are encoded without copying their resources (codec.go);
// metrics and traces of pushes and NACKs are in telemetry.go.
package server
