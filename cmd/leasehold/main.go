// Command leasehold is the xDS discovery server for executor fleets and its
// executor-side tools. Subcommands:
//
//	leasehold serve ...      the discovery server: Consul watch → eligibility → xDS
//	leasehold bootstrap ...  xDS bootstrap for a gRPC dispatcher
//	leasehold explain ...    why executors do or do not receive work
//	leasehold register ...   sidecar: register a non-Go executor and heartbeat while its probe passes
//	leasehold cordon|uncordon|approve|rules|audit ...   operator controls in Consul KV
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// version is set at build time (-ldflags "-X main.version=...").
var version = "dev"

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

const usage = `usage: leasehold <command> [flags]

commands:
  serve      watch Consul and serve executor endpoints over xDS to dispatchers
  bootstrap  print an xDS bootstrap for a gRPC dispatcher (GRPC_XDS_BOOTSTRAP_CONFIG)
  explain    show which executors each dispatcher routes to, and why not the others
  register   register an executor through the local Consul agent and keep its
             lease alive while a probe of the executor passes (sidecar)
  cordon     stop new work to executors (by instance, version, task), for every replica
  uncordon   remove a cordon
  approve    approve a pending cordon (a different identity than its author)
  rules      store the rollout rules (enforce/observe modes) in Consul KV
  audit      list recent operator actions

run "leasehold <command> -h" for the flags of a command.
`

// run dispatches a subcommand and returns the process exit code.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "serve":
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
		defer stop()
		return runServe(ctx, args[1:], stdout, stderr)
	case "bootstrap":
		return runBootstrap(args[1:], stdout, stderr)
	case "explain":
		return runExplain(context.Background(), args[1:], stdout, stderr)
	case "register":
		// SIGTERM/SIGINT start a drain; the command exits when it is done.
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
		defer stop()
		return runRegister(ctx, args[1:], stdout, stderr)
	case "cordon":
		return runCordon(context.Background(), args[1:], stdout, stderr)
	case "uncordon":
		return runUncordon(context.Background(), args[1:], stdout, stderr)
	case "approve":
		return runApprove(context.Background(), args[1:], stdout, stderr)
	case "rules":
		return runRules(context.Background(), args[1:], stdout, stderr)
	case "audit":
		return runAudit(context.Background(), args[1:], stdout, stderr)
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "leasehold: unknown command %q\n\n%s", args[0], usage)
		return 2
	}
}
