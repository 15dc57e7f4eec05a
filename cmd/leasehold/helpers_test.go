package main

import (
	"context"
	"fmt"
	"io"

	"github.com/spf13/pflag"
)

// Entry points of the commands the tests call directly.

// newBootstrap builds a bootstrap for a dispatcher with the given
// constraints, endpoint metadata ("": the default, full) and datacenter
// ("": leasehold's own), validated as leasehold will validate them.
func newBootstrap(
	xdsAddr, nodeID, versionConstraint string, labels map[string]string,
	endpointMetadata, datacenter string, tlsFiles ...bootstrapTLS,
) ([]byte, error) {
	var tf bootstrapTLS
	if len(tlsFiles) > 0 {
		tf = tlsFiles[0]
	}
	return buildBootstrap("--xds-addr", xdsAddr, nodeID,
		versionConstraint, labels, endpointMetadata, datacenter, true, tf)
}

// runExplain runs leasehold explain with args.
func runExplain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return execute(ctx, append([]string{"explain"}, args...), stdout, stderr)
}

// runRegister runs leasehold register with args under ctx: the sidecar
// drains when ctx ends (as on SIGTERM).
func runRegister(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return execute(ctx, append([]string{"register"}, args...), stdout, stderr)
}

// parseServeFlags parses leasehold serve's arguments (what the serve
// command does before it runs) into a validated configuration.
func parseServeFlags(args []string, stderr io.Writer) (*serveConfig, error) {
	fs := pflag.NewFlagSet("leasehold serve", pflag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var f serveFlags
	f.register(fs)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q: leasehold serve takes no arguments",
			fs.Arg(0))
	}
	if err := finishFlags(fs, stderr); err != nil {
		return nil, err
	}
	return f.config()
}
