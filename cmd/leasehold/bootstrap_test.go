package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

func TestBootstrapCommand(t *testing.T) {
	var out, errOut bytes.Buffer
	code := run(
		[]string{
			"bootstrap",
			"--node-id",
			"d1",
			"--xds-addr",
			"127.0.0.1:18000",
			"--version-constraint",
			">=1.4.0, <2.0.0",
			"--label",
			"zone=eu-1",
		},
		&out, &errOut)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut.String())
	}
	var b bootstrapConfig
	if err := json.Unmarshal(out.Bytes(), &b); err != nil {
		t.Fatal(err)
	}
	if b.Node.ID != "d1" || b.XDSServers[0].ServerURI != "127.0.0.1:18000" ||
		b.Node.Metadata["version_constraint"] != ">=1.4.0, <2.0.0" {
		t.Fatalf("bootstrap %+v", b)
	}
	if labels, _ := b.Node.Metadata["labels"].(map[string]any); labels["zone"] != "eu-1" {
		t.Fatalf("labels %v", b.Node.Metadata)
	}
	out.Reset()
	if code := run([]string{"bootstrap", "--node-id", "d1", "--endpoint-metadata", "none"}, &out,
		&errOut); code != 0 {
		t.Fatalf("--endpoint-metadata none: exit %d: %s", code, errOut.String())
	}
	if err := json.Unmarshal(out.Bytes(), &b); err != nil ||
		b.Node.Metadata["endpoint_metadata"] != "none" {
		t.Fatalf("--endpoint-metadata none: %v, metadata %v", err, b.Node.Metadata)
	}
	for _, tt := range []struct {
		args []string
		flag string
	}{
		{[]string{"--xds-addr", "127.0.0.1:1"}, "--node-id"},
		{[]string{"--node-id", "d", "--version-constraint", ">= banana"}, "--version-constraint"},
		{[]string{"--node-id", "d", "--label", "a.b=c"}, "--label"},
		{[]string{"--node-id", "d", "--xds-addr", "nowhere"}, "--xds-addr"},
		{[]string{"--node-id", "d", "--endpoint-metadata", "compact"}, "--endpoint-metadata"},
	} {
		var o bytes.Buffer
		if code := run(append([]string{"bootstrap"}, tt.args...), &o, &o); code != 2 ||
			!strings.Contains(o.String(), tt.flag) {
			t.Errorf("%v: exit %d, %q does not name %s", tt.args, code, o.String(), tt.flag)
		}
	}
}

// bootstrap's dial address: LEASEHOLD_XDS_ADDR is where serve listens, so
// an unspecified host there (or in the flag) is refused, naming where it
// came from; the flag overrides the variable, and an empty variable is
// unset.
func TestBootstrapRefusesUnspecifiedDialAddress(t *testing.T) {
	for _, c := range []struct {
		env  string
		args []string
		want string // "" = accepted
	}{
		{"0.0.0.0:18000", nil, "--xds-addr (from $LEASEHOLD_XDS_ADDR)"},
		{"[::]:18000", nil, "--xds-addr (from $LEASEHOLD_XDS_ADDR)"},
		{":18000", nil, "--xds-addr (from $LEASEHOLD_XDS_ADDR)"},
		{"", nil, ""}, // an empty variable counts as unset: the default applies
		{"0.0.0.0:18000", []string{"--xds-addr", "10.0.0.5:18000"}, ""},
		{"10.0.0.5:18000", nil, ""},
		{"leasehold.internal:18000", nil, ""},
		{"10.0.0.5:18000", []string{"--xds-addr", "0.0.0.0:18000"},
			`invalid --xds-addr "0.0.0.0:18000"`},
		{"10.0.0.5:18000", []string{"--xds-addr", "10.0.0.5:0"}, "invalid --xds-addr"},
	} {
		t.Setenv("LEASEHOLD_XDS_ADDR", c.env)
		code, stdout, stderr := runCLI(
			append([]string{"bootstrap", "--node-id", "d1"}, c.args...)...)
		switch {
		case c.want == "" && code != 0:
			t.Errorf("LEASEHOLD_XDS_ADDR=%q %v refused: %s", c.env, c.args, stderr)
		case c.want != "" && (code != 2 || !strings.Contains(stderr, c.want) || stdout != ""):
			t.Errorf("LEASEHOLD_XDS_ADDR=%q %v: exit %d, %q; want 2 naming %s",
				c.env, c.args, code, stderr, c.want)
		}
	}
	if _, err := newBootstrap("0.0.0.0:18000", "d1", "", nil, "", ""); err == nil ||
		!strings.Contains(err.Error(), "--xds-addr") {
		t.Errorf("newBootstrap took an unspecified address: %v", err)
	}
}

// The refusal of unspecified dial addresses looks past net.ParseIP of the
// host: a gRPC target (`dns:///0.0.0.0:18000`, which grpc-go's xDS client
// dials as written: 0.0.0.0, this machine) and an unspecified address with a
// zone (`[::%lo]:18000`) are refused as well, never written for dispatchers
// to dial.
func TestBootstrapRefusesUnspecifiedTargetsAndZones(t *testing.T) {
	for _, addr := range []string{"dns:///0.0.0.0:18000", "passthrough:///[::]:18000",
		"[::%lo]:18000", "[0:0:0:0:0:ffff:0.0.0.0]:18000", "[::ffff:0:0]:18000"} {
		if b, err := newBootstrap(addr, "d1", "", nil, "", ""); err == nil {
			t.Errorf("--xds-addr %s accepted:\n%s", addr, b)
		}
	}
	for _, addr := range []string{"10.0.0.5:18000", "[fe80::1%eth0]:18000",
		"leasehold.internal:18000", "localhost:18000"} {
		if _, err := newBootstrap(addr, "d1", "", nil, "", ""); err != nil {
			t.Errorf("--xds-addr %s refused: %v", addr, err)
		}
	}
}

// A bootstrap is read and edited by people: its constraint and labels are
// written as given (<2.0.0), not escaped for HTML (\u003c2.0.0).
func TestBootstrapIsNotHTMLEscaped(t *testing.T) {
	code, stdout, stderr := runCLI("bootstrap", "--node-id", "d1",
		"--version-constraint", "<2.0.0, >=1.0.0", "--label", "team=a&b")
	if code != 0 || !strings.Contains(stdout, `"version_constraint": "<2.0.0, >=1.0.0"`) ||
		!strings.Contains(stdout, `"team": "a&b"`) || strings.Contains(stdout, `\u00`) ||
		!strings.HasSuffix(stdout, "}\n") || strings.HasSuffix(stdout, "\n\n") {
		t.Fatalf("exit %d: %s%s", code, stdout, stderr)
	}
}

// --weighted-clusters=false writes the node metadata leasehold reads as a
// dispatcher that takes each task type as one cluster; the default writes
// nothing.
func TestBootstrapWeightedClustersFalse(t *testing.T) {
	for _, tt := range []struct {
		args []string
		want any // the metadata value; nil: absent
	}{
		{nil, nil},
		{[]string{"--weighted-clusters=false"}, false},
	} {
		var out, errOut bytes.Buffer
		if code := run(append([]string{"bootstrap", "--node-id", "d1"}, tt.args...), &out,
			&errOut); code != 0 {
			t.Fatalf("%v: exit %d: %s", tt.args, code, errOut.String())
		}
		var b bootstrapConfig
		if err := json.Unmarshal(out.Bytes(), &b); err != nil {
			t.Fatal(err)
		}
		if got := b.Node.Metadata["weighted_clusters"]; got != tt.want {
			t.Fatalf("%v: weighted_clusters = %v, want %v", tt.args, got, tt.want)
		}
	}
}

// --xds-addr takes a gRPC dns target naming several replicas, checked as
// strictly as HOST:PORT.
func TestBootstrapTakesADNSTargetOfReplicas(t *testing.T) {
	for _, ok := range []string{"dns:///leasehold.example:18000",
		strings.Repeat("a.", 126) + "a.:1", // 253 characters and a final dot
		strings.Repeat("a", 63) + ".example:1", "xn--bcher-kva.example:1", "LEASEHOLD_1.local.:1",
		"dns://127.0.0.1:8600/leasehold-xds.service.consul:18000",
		"dns://10.0.0.2/leasehold.example:18000"} {
		if err := xdsDialAddr("--xds-addr", ok); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
	for _, bad := range []string{"dns://leasehold.example:18000", "dns:///leasehold.example",
		"dns:///0.0.0.0:18000", "dns://not a server/x:1", "dns:///x:99999",
		"dns:///not@a#name:1", "not@a#name:1", "dns:///leasehold..example:18000",
		strings.Repeat("a", 64) + ".example:1", strings.Repeat("a.", 127) + "ab:1"} {
		// The error quotes the target as given, not only the part it read.
		if err := xdsDialAddr("--xds-addr", bad); err == nil ||
			!strings.Contains(err.Error(), "--xds-addr") ||
			!strings.Contains(err.Error(), fmt.Sprintf("%q", bad)) {
			t.Errorf("%s: %v, want an error naming --xds-addr and quoting it", bad, err)
		}
	}
}

// One bootstrap names one xDS server: a second --xds-addr is refused naming
// the flag and pointing at a dns target of several replicas, never dropped
// for the last one. LEASEHOLD_XDS_ADDR is a default the flag overrides, not
// a second value.
func TestBootstrapRefusesASecondXDSAddr(t *testing.T) {
	code, stdout, stderr := runCLI("bootstrap", "--node-id", "d1",
		"--xds-addr", "10.0.0.1:18000", "--xds-addr", "10.0.0.2:18000")
	if code != 2 || stdout != "" || !strings.Contains(stderr, "--xds-addr") ||
		!strings.Contains(stderr, "given twice") || !strings.Contains(stderr, "dns:///NAME:PORT") {
		t.Fatalf("exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	t.Setenv("LEASEHOLD_XDS_ADDR", "10.0.0.3:18000")
	code, stdout, stderr = runCLI("bootstrap", "--node-id", "d1", "--xds-addr", "10.0.0.4:18000")
	if code != 0 || !strings.Contains(stdout, `"server_uri": "10.0.0.4:18000"`) {
		t.Fatalf("exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	code, stdout, stderr = runCLI("bootstrap", "--node-id", "d1")
	if code != 0 || !strings.Contains(stdout, `"server_uri": "10.0.0.3:18000"`) {
		t.Fatalf("from the variable: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
}
