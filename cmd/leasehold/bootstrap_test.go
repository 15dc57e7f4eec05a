package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

func TestBootstrapCommand(t *testing.T) {
	var out, errOut bytes.Buffer
	code := run([]string{"bootstrap", "--node-id", "d1", "--xds-addr", "127.0.0.1:18000", "--version-constraint", ">=1.4.0, <2.0.0", "--label", "zone=eu-1"}, &out, &errOut)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut.String())
	}
	var b bootstrapConfig
	if err := json.Unmarshal(out.Bytes(), &b); err != nil {
		t.Fatal(err)
	}
	if b.Node.ID != "d1" || b.XDSServers[0].ServerURI != "127.0.0.1:18000" || b.Node.Metadata["version_constraint"] != ">=1.4.0, <2.0.0" {
		t.Fatalf("bootstrap %+v", b)
	}
	if labels, _ := b.Node.Metadata["labels"].(map[string]any); labels["zone"] != "eu-1" {
		t.Fatalf("labels %v", b.Node.Metadata)
	}
	out.Reset()
	if code := run([]string{"bootstrap", "--node-id", "d1", "--endpoint-metadata", "none"}, &out, &errOut); code != 0 {
		t.Fatalf("--endpoint-metadata none: exit %d: %s", code, errOut.String())
	}
	if err := json.Unmarshal(out.Bytes(), &b); err != nil || b.Node.Metadata["endpoint_metadata"] != "none" {
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
		if code := run(append([]string{"bootstrap"}, tt.args...), &o, &o); code != 2 || !strings.Contains(o.String(), tt.flag) {
			t.Errorf("%v: exit %d, %q does not name %s", tt.args, code, o.String(), tt.flag)
		}
	}
}
