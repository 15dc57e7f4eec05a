// Command leasehold is the xDS discovery server for executor fleets and its
// executor-side tools. Subcommands:
//
//	leasehold serve ...      the discovery server: Consul watch → eligibility → xDS
//	leasehold bootstrap ...  xDS bootstrap for a gRPC dispatcher
//	leasehold explain ...    why executors do or do not receive work
//	leasehold register ...   sidecar: register a non-Go executor, heartbeat while its probe passes
//	leasehold cordon|uncordon|approve|rules|audit ...   operator controls in Consul KV
//	leasehold version, leasehold completion bash|zsh|fish|powershell
//
// Every command parses its flags the same way (github.com/spf13/cobra):
// flags may follow positional arguments, unexpected arguments are refused,
// a flag overrides the environment variables it reads, and errors name the
// flag. Exit codes: 0 success or help, 1 a failure at run time, 2 a usage
// error.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/spf13/cobra"
)

// version is set at build time (-ldflags "-X main.version=...").
var version = "dev"

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run runs the command line args and returns the process exit code.
func run(args []string, stdout, stderr io.Writer) int {
	return execute(context.Background(), args, stdout, stderr)
}

// execute runs args under ctx (serve and register also end on SIGTERM and
// SIGINT).
func execute(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	root := newRootCmd()
	root.SetOut(stdout)
	root.SetErr(stderr)
	if len(args) == 0 {
		root.InitDefaultHelpCmd()
		root.InitDefaultCompletionCmd()
		root.SetOut(stderr)
		root.Help()
		return 2
	}
	root.SetArgs(args)
	cmd, err := root.ExecuteContextC(ctx)
	if err == nil {
		return 0
	}
	code := 2
	var ee *exitError
	if errors.As(err, &ee) {
		code = ee.code
		if ee.quiet {
			return code
		}
	}
	name := root.Name()
	if cmd != nil {
		name = cmd.CommandPath()
	}
	fmt.Fprintf(stderr, "%s: %v\n", name, err)
	if code == 2 {
		fmt.Fprintf(stderr, "Run '%s --help' for usage.\n", name)
	}
	return code
}

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "leasehold",
		Short: "xDS discovery server for executor fleets, and its tools",
		Long: `leasehold watches executors' leases in Consul and serves the executors that may
receive new work to dispatchers over xDS; its other commands write dispatcher
bootstraps, explain routing, register executors not written in Go, and give
operators cordons, rollout rules and an audit trail in Consul KV.`,
		SilenceErrors: true,
		SilenceUsage:  true,
		// Aliases and environment variables apply once the command line is
		// parsed, before any command runs.
		PersistentPreRunE: func(cmd *cobra.Command, args []string) error {
			return finishFlags(cmd.Flags(), cmd.ErrOrStderr())
		},
	}
	root.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error { return usagef("%v", err) })
	root.AddCommand(
		newServeCmd(),
		newBootstrapCmd(),
		newExplainCmd(),
		newDispatchersCmd(),
		newRegisterCmd(),
		newCordonCmd(),
		newUncordonCmd(),
		newApproveCmd(),
		newRulesCmd(),
		newAuditCmd(),
		newVersionCmd(),
	)
	return root
}

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "print leasehold's version",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			fmt.Fprintf(cmd.OutOrStdout(), "leasehold %s\n", version)
			return nil
		},
	}
}
