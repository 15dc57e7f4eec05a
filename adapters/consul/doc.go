// Package consul is leasehold's only Consul code, both sides of the
// contract.
//
// The executor side is the Registrar (registrar.go, with its Config,
// sessions, telemetry and the Agent it talks to in agent.go): it registers
// an executor's task types through the local Consul agent under a fresh
// session, keeps the TTL lease alive with heartbeats, fences itself when the
// lease is lost and drains on request.
//
// The server side follows Consul with blocking queries and sends what it
// reads to the syncer as health.Observation values:
//   - a Watcher watches one datacenter (watcher.go; its config in
//     watchconfig.go, its contact state in contact.go, its blocking-query
//     glue in watchloop.go over queryloop.go, the fast wait under short
//     leases in fastwait.go, its metrics in watchmetrics.go): the non-passing
//     checks and every node's serfHealth (fastpath.go), the task types and
//     their members (watchtasks.go, membership.go, domain.go), the
//     generation keys (watchgenerations.go) and the lapse marks (lapses.go),
//     read afresh on the fencing API's demand (refresh.go) and paced by a
//     read budget (budget.go); Watchers run one per datacenter
//     (datacenters.go), all through the local agent (watch_api.go);
//   - the ControlWatch follows the operators' controls, which Control reads
//     and writes with their audit trail (control.go, controlread.go,
//     controlwrite.go, controlwatch.go);
//   - the LapseRecorder records the lapses seen in Consul KV, so that a lapse
//     stays final across restarts and replicas (lapses.go).
//
// Every long-running part is Run(ctx) error. Retries share one back-off
// (backoff.go), and failures are classified for readiness (problem.go).
package consul
