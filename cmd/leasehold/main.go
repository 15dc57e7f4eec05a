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
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/spf13/cobra"
)

// version and revision are set by builds from a checkout (the Makefile's
// -ldflags "-X main.version=... -X main.revision=..."); otherwise readBuild
// takes them from what the Go toolchain recorded in the binary.
var version, revision string

// buildInfo is what this binary says it is: `leasehold version`, serve's
// start line, the leasehold_build_info metric and the OTel resource.
type buildInfo struct {
	Version   string // a module version (v1.2.3, or a pseudo-version), or "dev"
	Revision  string // the VCS commit, "-dirty" when built with local changes; "unknown"
	GoVersion string
}

// readBuild reads the build's version and revision: -ldflags first (a
// build from a checkout knows its tag), then debug.ReadBuildInfo — the
// module version `go install …@v1.2.3` records, and the commit (vcs.revision,
// vcs.modified) `go build` records in a checkout.
func readBuild() buildInfo {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		bi = nil
	}
	return resolveBuild(bi, version, revision)
}

// resolveBuild is readBuild's rule, on bi (nil when the binary carries no
// build information) and the -ldflags values ("" when not set).
func resolveBuild(bi *debug.BuildInfo, ldVersion, ldRevision string) buildInfo {
	b := buildInfo{Version: ldVersion, Revision: ldRevision, GoVersion: runtime.Version()}
	if bi != nil {
		if bi.GoVersion != "" {
			b.GoVersion = bi.GoVersion
		}
		if v := bi.Main.Version; b.Version == "" && v != "" && v != "(devel)" {
			b.Version = v
		}
		var rev string
		var dirty bool
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
		if b.Revision == "" && rev != "" {
			b.Revision = rev
			if dirty {
				b.Revision += "-dirty"
			}
		}
	}
	if b.Version == "" {
		b.Version = "dev"
	}
	if b.Revision == "" {
		b.Revision = "unknown"
	}
	return b
}

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
	strictHelpAndCompletion(root)
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

// completionShells are the shells `leasehold completion` writes scripts for
// (cobra's).
var completionShells = []string{"bash", "zsh", "fish", "powershell"}

// strictHelpAndCompletion makes cobra's own help and completion commands
// refuse what they do not know as every other command does (exit 2, saying
// what they take): as cobra leaves them, `leasehold help nosuch` and
// `leasehold completion tcsh` print help and exit 0, and a script checking
// the status (or a shell's rc file sourcing the output) takes that for
// success.
func strictHelpAndCompletion(root *cobra.Command) {
	root.InitDefaultHelpCmd()
	root.InitDefaultCompletionCmd()
	for _, c := range root.Commands() {
		switch c.Name() {
		case "help":
			show := c.Run
			c.RunE = func(c *cobra.Command, args []string) error {
				if found, rest, err := c.Root().Find(args); err != nil || found == nil ||
					len(rest) > 0 {
					return usagef("no command %q: the commands are listed by "+
						"'leasehold --help'", strings.Join(args, " "))
				}
				show(c, args)
				return nil
			}
		case "completion":
			c.Args = cobra.ArbitraryArgs // refused below, in words naming the shells
			c.RunE = func(c *cobra.Command, args []string) error {
				want := strings.Join(completionShells, ", ")
				if len(args) == 0 {
					return usagef("name a shell: %s", want)
				}
				return usagef("no completion for shell %q: the shells are %s", args[0], want)
			}
		}
	}
}

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "print leasehold's version, the commit it was built from and its Go version",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			b := readBuild()
			fmt.Fprintf(cmd.OutOrStdout(), "leasehold %s (revision %s, %s)\n",
				b.Version, b.Revision, b.GoVersion)
			return nil
		},
	}
}
