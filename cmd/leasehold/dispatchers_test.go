package main

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// A /debug/dispatchers answer with a stream that ACKed, one whose last
// response was NACKed and a refused stream.
const dispatchersJSON = `{"dispatchers": [
  {"stream": 2, "node_id": "eu-strict", "constraint_set": "k2", "mode": "delta",
   "version_constraint": "<2.0.0", "labels": {"zone": "eu-1"}, "datacenter": "dc2",
   "granted_tasks": ["work"], "peer": "127.0.0.1:40002", "age_seconds": 65.5,
   "types": {"type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment":
     {"subscribed": ["work"], "last_sent_version": "def", "last_acked_version": "abc",
      "last_nack": {"version": "def", "error_detail": "zero weight", "reason": "weight",
        "at": "2026-01-01T00:00:01Z"}, "nacks": 2}}},
  {"stream": 1, "node_id": "any-1", "constraint_set": "k1", "mode": "sotw",
   "granted_tasks": null, "peer": "127.0.0.1:40001", "age_seconds": 5,
   "types": {"type.googleapis.com/envoy.config.listener.v3.Listener":
     {"subscribed": [], "wildcard": true, "last_sent_version": "v1", "last_acked_version": "v1"},
     "type.googleapis.com/envoy.config.cluster.v3.Cluster":
     {"subscribed": [], "wildcard": false, "last_sent_version": "c1"}}}],
 "refused": [{"node_id": "bad-meta", "peer": "127.0.0.1:40003", "mode": "sotw",
   "reason": "invalid-node", "detail": "node.metadata.version_constraint: not a constraint",
   "count": 3, "first": "2026-01-01T00:00:00Z", "last": "2026-01-01T00:00:02Z"}],
 "refused_total": 3, "local_datacenter": "dc1"}`

// leasehold dispatchers lists each connected stream with its node id,
// constraint set and datacenter, per type what it ACKed and its last NACK
// with the reason, and the refused streams with why.
func TestDispatchersListsStreamsAcksNacksAndRefusals(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/debug/dispatchers" {
			http.NotFound(w, r)
			return
		}
		w.Write([]byte(dispatchersJSON))
	}))
	t.Cleanup(srv.Close)
	code, out, stderr := runCLI("dispatchers", "--admin-addr",
		strings.TrimPrefix(srv.URL, "http://"))
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	lines := strings.Split(out, "\n")
	has := func(words ...string) bool {
		for _, l := range lines {
			ok := true
			for _, w := range words {
				ok = ok && strings.Contains(l, w)
			}
			if ok {
				return true
			}
		}
		return false
	}
	for _, want := range [][]string{
		{"2 dispatcher streams"},
		{"any-1", "sotw", "unconstrained", "dc1 (leasehold's own)", "every task type",
			"127.0.0.1:40001", "5s"},
		{"eu-strict", "delta", "version <2.0.0, zone=eu-1", "dc2", "work", "1m5s"},
		{"eu-strict", "ClusterLoadAssignment", "def", "abc", "2",
			"version def at 2026-01-01T00:00:01Z, reason weight: zero weight"},
		{"any-1", "Listener", "*", "v1", "0", "-"},
		{"any-1", "Cluster", "none", "c1", "-", "0"},
		{"3 streams refused since the start"},
		{"2026-01-01T00:00:02Z", "3", "bad-meta", "127.0.0.1:40003", "sotw", "invalid-node",
			"node.metadata.version_constraint: not a constraint"},
	} {
		if !has(want...) {
			t.Errorf("no line with %q in:\n%s", want, out)
		}
	}
	if strings.Index(out, "any-1") > strings.Index(out, "eu-strict") {
		t.Errorf("streams not sorted by node id:\n%s", out)
	}
}
