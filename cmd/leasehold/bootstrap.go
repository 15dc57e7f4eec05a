package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/flagx"
	"github.com/leasehold/leasehold/snapshot/xdscache"
)

// bootstrapConfig is an xDS bootstrap for gRPC clients (the gRFC A27 format,
// read by grpc-go, grpc-java, grpc-c++ and the other gRPC xDS clients from
// GRPC_XDS_BOOTSTRAP or GRPC_XDS_BOOTSTRAP_CONFIG).
type bootstrapConfig struct {
	XDSServers []bootstrapServer `json:"xds_servers"`
	Node       bootstrapNode     `json:"node"`
}

type bootstrapServer struct {
	ServerURI      string           `json:"server_uri"`
	ChannelCreds   []map[string]any `json:"channel_creds"`
	ServerFeatures []string         `json:"server_features"`
}

type bootstrapNode struct {
	ID       string             `json:"id"`
	Metadata map[string]any     `json:"metadata,omitempty"`
	Locality *bootstrapLocality `json:"locality,omitempty"`
}

// bootstrapLocality is the node's locality (gRFC A27): the datacenter is
// its region, as Envoy's --locality-region would say it.
type bootstrapLocality struct {
	Region string `json:"region,omitempty"`
}

// bootstrapTLS are the dispatcher's TLS files for the xDS channel (gRFC A65
// "tls" channel credentials, read by grpc-go's file watcher, so rotated
// files are picked up). With all of them empty the channel is plaintext.
type bootstrapTLS struct {
	CA, Cert, Key string
}

func (b bootstrapTLS) channelCreds() ([]map[string]any, []string) {
	if b.CA == "" && b.Cert == "" && b.Key == "" {
		return []map[string]any{{"type": "insecure"}}, nil
	}
	var errs []string
	if (b.Cert == "") != (b.Key == "") {
		errs = append(errs,
			"invalid --tls-cert/--tls-key: give both (a client certificate for mTLS) or neither")
	}
	cfg := map[string]any{"refresh_interval": "60s"}
	for _, f := range []struct{ flag, path, key string }{{"--tls-ca", b.CA, "ca_certificate_file"},
		{"--tls-cert", b.Cert, "certificate_file"}, {"--tls-key", b.Key, "private_key_file"}} {
		if f.path == "" {
			continue
		}
		abs, err := filepath.Abs(f.path)
		if err == nil {
			_, err = os.Stat(abs)
		}
		if err != nil {
			errs = append(errs, fmt.Sprintf("invalid %s: %v", f.flag, err))
			continue
		}
		cfg[f.key] = abs
	}
	return []map[string]any{{"type": "tls", "config": cfg}}, errs
}

// buildBootstrap builds a bootstrap for a dispatcher with the given
// constraints, endpoint metadata (empty for full), datacenter (empty for
// leasehold's own) and whether it takes weighted clusters, validated as leasehold will validate them; errors name
// the xDS address as xdsFlag (with the variable it came from).
func buildBootstrap(
	xdsFlag, xdsAddr, nodeID, versionConstraint string, labels map[string]string,
	endpointMetadata, datacenter string, weighted bool, tf bootstrapTLS,
) ([]byte, error) {
	var errs []string
	creds, cerrs := tf.channelCreds()
	errs = append(errs, cerrs...)
	if err := xdsDialAddr(xdsFlag, xdsAddr); err != nil {
		errs = append(errs, err.Error())
	}
	if strings.TrimSpace(nodeID) == "" {
		errs = append(errs,
			"invalid --node-id: required (names the dispatcher in leasehold's /debug views)")
	}
	if _, err := health.NewDispatcher(versionConstraint, labels); err != nil {
		// One line per mistake, under the flag that made it.
		var fes health.FieldErrors
		if !errors.As(err, &fes) {
			fes = nil
			errs = append(errs, err.Error())
		}
		for _, fe := range fes {
			if fe.Field == health.NodeMetaVersionConstraint {
				errs = append(errs,
					fmt.Sprintf("invalid --version-constraint %q: %s", fe.Value, fe.Reason))
			} else {
				errs = append(errs, fmt.Sprintf("invalid --label: %v", fe))
			}
		}
	}
	if datacenter != "" {
		datacenter = health.NormalizeDatacenter(datacenter)
		if err := health.ValidateDatacenter("--datacenter", datacenter); err != nil {
			errs = append(errs,
				fmt.Sprintf("invalid --datacenter %q: a Consul datacenter name is 1 to 64 "+
					"letters (lowercase), digits, '-' or '_'", datacenter))
		}
	}
	switch xdscache.EndpointMetadata(endpointMetadata) {
	case "", xdscache.MetadataFull, xdscache.MetadataSession, xdscache.MetadataNone:
	default:
		errs = append(errs,
			fmt.Sprintf("invalid --endpoint-metadata %q: must be full, session or none",
				endpointMetadata))
	}
	if len(errs) > 0 {
		return nil, errors.New(strings.Join(errs, "\n"))
	}
	meta := map[string]any{}
	if endpointMetadata != "" {
		meta[xdscache.NodeMetaEndpointMetadata] = endpointMetadata
	}
	if versionConstraint != "" {
		meta[health.NodeMetaVersionConstraint] = versionConstraint
	}
	if len(labels) > 0 {
		ls := map[string]any{}
		for k, v := range labels {
			ls[k] = v
		}
		meta[health.NodeMetaLabels] = ls
	}
	b := bootstrapConfig{
		XDSServers: []bootstrapServer{{
			ServerURI: xdsAddr, ChannelCreds: creds, ServerFeatures: []string{"xds_v3"},
		}},
		Node: bootstrapNode{ID: nodeID, Metadata: meta},
	}
	if !weighted { // the default is true: said only when false
		meta[xdscache.NodeMetaWeightedClusters] = false
	}
	if datacenter != "" {
		meta[health.NodeMetaDatacenter] = datacenter
		b.Node.Locality = &bootstrapLocality{Region: datacenter}
	}
	// A person reads (and edits) the bootstrap: its constraint <2.0.0 is
	// written so, not as \u003c2.0.0 (json.Marshal's escaping for HTML).
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(b); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}

// xdsDialAddr checks the address dispatchers will dial: HOST:PORT whose
// host is not unspecified (0.0.0.0, ::, empty), which is where leasehold
// serve listens — $LEASEHOLD_XDS_ADDR may well be one — not an address a
// dispatcher on another machine reaches.
//
// A gRPC dns target names several replicas behind one name:
// dns:///NAME:PORT (the system's resolver) or dns://DNS-SERVER/NAME:PORT (a
// resolver of its own, such as a Consul agent's DNS port). gRPC's xDS
// client re-resolves it when its stream breaks and moves to another of the
// name's addresses: replicas behind one name are failed over between.
func xdsDialAddr(flag, addr string) error {
	typed := addr // what errors quote: the target as given, not the part read
	if rest, ok := strings.CutPrefix(addr, "dns://"); ok {
		authority, target, ok := strings.Cut(rest, "/")
		if !ok || target == "" {
			return fmt.Errorf("invalid %s %q: a dns target is dns:///NAME:PORT or "+
				"dns://DNS-SERVER/NAME:PORT", flag, addr)
		}
		if _, _, err := net.SplitHostPort(authority); authority != "" && err != nil &&
			net.ParseIP(authority) == nil {
			return fmt.Errorf("invalid %s %q: the DNS server %q: want HOST:PORT or an IP "+
				"address (port 53)", flag, addr, authority)
		}
		addr = target
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		// Said in flagx's words (what to write), not Go's ("too many colons").
		_, _, err = flagx.HostPort(addr, 1)
		if err == nil || strings.Contains(addr, "://") {
			err = errors.New("a dispatcher dials HOST:PORT (gRPC), no scheme")
		}
		return fmt.Errorf("invalid %s %q: %v", flag, typed, err)
	}
	if err := flagx.CheckPort(port, 1); err != nil {
		return fmt.Errorf("invalid %s %q: %v", flag, typed, err)
	}
	// netip also reads an address with a zone ([::%lo]), and one mapped
	// from IPv4 (::ffff:0.0.0.0) is unspecified once unmapped.
	ipa, ipErr := netip.ParseAddr(strings.Trim(host, "[]"))
	if ip := net.ParseIP(strings.Trim(host, "[]")); host == "" ||
		(ip != nil && ip.IsUnspecified()) ||
		(ipErr == nil && ipa.WithZone("").Unmap().IsUnspecified()) {
		return fmt.Errorf("invalid %s %q: an unspecified host is a listen address (where "+
			"leasehold serve listens), not one a dispatcher can dial: give leasehold's "+
			"reachable address, e.g. --xds-addr 10.0.0.5:18000", flag, typed)
	}
	if ipErr == nil {
		return nil
	}
	if p := hostNameProblem(host); p != "" {
		return fmt.Errorf("invalid %s %q: the host %q: %s", flag, typed, host, p)
	}
	return nil
}

// hostNameProblem says what keeps host from being a name a resolver can be
// asked ("": nothing): labels of letters, digits, '-' or '_' separated by
// dots, at most 63 characters each and 253 in all (a final dot aside).
func hostNameProblem(host string) string {
	name := strings.TrimSuffix(host, ".")
	if len(name) > 253 {
		return fmt.Sprintf("a host name is at most 253 characters, this one %d", len(name))
	}
	for label := range strings.SplitSeq(name, ".") {
		if label == "" {
			return "a host name has no empty label (two dots, or a dot first)"
		}
		if len(label) > 63 {
			return fmt.Sprintf("a host name's label is at most 63 characters, %q has %d",
				label, len(label))
		}
		for _, r := range label {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' ||
				r == '-' || r == '_') {
				return "neither an IP address nor a host name (letters, digits, '-', '_' " +
					"and '.'; a name in another script is written in punycode, xn--…)"
			}
		}
	}
	return ""
}

func newBootstrapCmd() *cobra.Command {
	var (
		xdsAddr, nodeID, constraint, out, endpointMeta, datacenter string
		weighted                                                   bool
		labels                                                     = flagx.Labels{}
		tf                                                         bootstrapTLS
	)
	cmd := &cobra.Command{
		Use: "bootstrap --node-id ID [flags]",
		Short: "print an xDS bootstrap for a gRPC dispatcher " +
			"(GRPC_XDS_BOOTSTRAP, GRPC_XDS_BOOTSTRAP_CONFIG)",
		Long: `Print (or write with --out) a gRPC xDS bootstrap (gRFC A27) pointing at
leasehold, with the dispatcher's constraints as node metadata, checked as
leasehold will check them. grpc-go reads it from GRPC_XDS_BOOTSTRAP (a file)
or GRPC_XDS_BOOTSTRAP_CONFIG (the JSON) when the process starts.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			b, err := buildBootstrap(flagRef(cmd.Flags(), "xds-addr"), xdsAddr,
				nodeID, constraint, labels, endpointMeta, datacenter, weighted, tf)
			if err != nil {
				return usagef("%v", err)
			}
			b = append(b, '\n')
			if out == "" {
				cmd.OutOrStdout().Write(b)
				return nil
			}
			if err := os.WriteFile(out, b, 0o644); err != nil {
				return failedf("--out: %v", err)
			}
			return nil
		},
	}
	fs := cmd.Flags()
	fs.SortFlags = false
	fs.StringVar(&nodeID, "node-id", "",
		"the dispatcher's xDS node id (required; names it in leasehold's /debug views and explain)")
	xdsAddr = "127.0.0.1:18000"
	fs.Var(&flagx.Once{V: &xdsAddr, Hint: "one bootstrap names one xDS server; put several " +
		"replicas behind one name and give it as dns:///NAME:PORT (docs/operating.md, " +
		"\"Several replicas behind one name\")"}, "xds-addr",
		"leasehold's xDS address as dispatchers dial it: HOST:PORT, or a dns target naming "+
			"several replicas, dns:///NAME:PORT or dns://DNS-SERVER/NAME:PORT (an unspecified "+
			"host such as 0.0.0.0 is refused)")
	bindEnv(fs, "xds-addr", "LEASEHOLD_XDS_ADDR") // the variable leasehold serve listens on
	fs.StringVar(&constraint, "version-constraint", "",
		"semver constraint executors must satisfy, e.g. \">=1.4.0, <2.0.0\"")
	fs.Var(labels, "label", "label key=value executors must carry (repeatable)")
	fs.StringVar(&endpointMeta, "endpoint-metadata", "",
		"what endpoints carry under filter_metadata.leasehold: full (instance_id, "+
			"session_id, version; the default), session (session_id only) or none; "+
			"less is fewer bytes per push")
	fs.StringVar(&datacenter, "datacenter", "",
		"the Consul datacenter the dispatcher runs in: its executors get priority 0, "+
			"the other watched datacenters follow in leasehold's --datacenters "+
			"order (default: leasehold's own)")
	fs.BoolVar(&weighted, "weighted-clusters", true,
		"the dispatcher takes a route over weighted clusters (gRFC A28: grpc-go, Envoy); "+
			"false: each task type comes as one cluster, never split into shards")
	tlsClientFlags(fs, &tf.CA, &tf.Cert, &tf.Key, "the xDS channel",
		"its URI/DNS SAN is the identity leasehold's --authz-policy grants")
	fs.StringVar(&out, "out", "",
		"write to this file instead of standard output (then: GRPC_XDS_BOOTSTRAP=<file>)")
	completeWords(cmd, "endpoint-metadata", string(xdscache.MetadataFull),
		string(xdscache.MetadataSession), string(xdscache.MetadataNone))
	filenameFlags(cmd, "tls-ca", "tls-cert", "tls-key", "out")
	return cmd
}
