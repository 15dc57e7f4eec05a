package main

import (
	"io"
	"slices"
	"strings"
	"testing"
)

// Security flags that cannot work together are refused naming the flag.
func TestServeSecurityFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string // "" = accepted
	}{
		{[]string{"--admin-addr", "0.0.0.0:19000"}, "--admin-addr"},
		{[]string{"--admin-addr", "0.0.0.0:19000", "--admin-token-file", "/tmp/t"}, ""},
		{[]string{"--tls-cert", "c.pem"}, "--tls-cert"},
		{[]string{"--tls-client-ca", "ca.pem"}, "--tls-client-ca"},
		{[]string{"--authz-policy", "p.yaml", "--tls-cert", "c", "--tls-key", "k"},
			"--authz-policy"},
		{[]string{"--authz-policy", "p.yaml", "--tls-cert", "c",
			"--tls-key", "k", "--tls-client-ca", "ca"}, ""},
	} {
		_, err := parseServeFlags(c.args, io.Discard)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%v refused: %v", c.args, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%v: want an error naming %s, got %v", c.args, c.want, err)
		}
	}
}

func TestServeConsulReadRate(t *testing.T) {
	for _, c := range []struct {
		v    string
		want int64 // 0: refused naming the flag
	}{
		{"4MiB", 4 << 20}, {"512KiB", 512 << 10}, {"8MB", 8e6},
		{"1000", 1000}, {"2000B", 2000}, {"off", -1},
		{"", 0}, {"0", 0}, {"-1MiB", 0}, {"4 MiB", 0}, {"4mib", 0},
		{"MiB", 0}, {"99999999999999MiB", 0}, {"1.5MiB", 0},
	} {
		cfg, err := parseServeFlags([]string{"--consul-read-rate", c.v}, io.Discard)
		switch {
		case c.want == 0 && (err == nil || !strings.Contains(err.Error(), "--consul-read-rate")):
			t.Errorf("%q: want an error naming --consul-read-rate, got %v", c.v, err)
		case c.want != 0 && err != nil:
			t.Errorf("%q refused: %v", c.v, err)
		case c.want != 0 && cfg.consulReadRate != c.want:
			t.Errorf("%q = %d, want %d", c.v, cfg.consulReadRate, c.want)
		}
	}
}

// --datacenters: what is refused (naming the flag) and what is read.
func TestDatacentersFlag(t *testing.T) {
	for _, c := range []struct {
		v    string
		want []string // nil: refused naming --datacenters
	}{
		{"dc1", []string{"dc1"}},
		{"dc1,dc2", []string{"dc1", "dc2"}},
		{" dc1 , dc2 ", []string{"dc1", "dc2"}},
		{"dc1,,dc2", nil}, {",dc1", nil}, {"dc1,", nil}, {" ", nil}, {",", nil},
		{"dc1,dc1", nil}, {"dc1, dc1", nil},
		{"dc.1", nil}, {"dc 1", nil}, {"dc1;dc2", nil},
		{"dc1/x", nil}, {strings.Repeat("d", 65), nil},
		{"dc_1,dc-2", []string{"dc_1", "dc-2"}},
	} {
		cfg, err := parseServeFlags([]string{"--datacenters", c.v}, io.Discard)
		switch {
		case c.want == nil && (err == nil || !strings.Contains(err.Error(), "--datacenters")):
			t.Errorf("%q: want an error naming --datacenters, got %v (read %q)",
				c.v, err, cfg.datacenters)
		case c.want != nil && err != nil:
			t.Errorf("%q refused: %v", c.v, err)
		case c.want != nil && !slices.Equal(cfg.datacenters, c.want):
			t.Errorf("%q read as %q, want %q", c.v, cfg.datacenters, c.want)
		}
	}
	if cfg, err := parseServeFlags(nil, io.Discard); err != nil || cfg.datacenters != nil {
		t.Errorf("no --datacenters: %q, %v; want none (the agent's own, unnamed)",
			cfg.datacenters, err)
	}
}

// Consul's datacenter names are lowercase: the agent lowercases its
// -datacenter (Consul 1.13.9 runs -datacenter=DC1 as "dc1", and answers
// ?dc=DC1 with 500, "No path to datacenter"). So --datacenters and bootstrap
// --datacenter do not take capitals as they are: they are refused or
// folded. Taken as they are, `serve --datacenters DC1,dc2` would watch a
// datacenter that can never answer (dc1's executors never read; after a
// lease DC1 lost and dc2 served alone, leasehold's own datacenter missing),
// `--datacenters DC1` alone would never be ready, and a dispatcher
// bootstrapped --datacenter DC2 would not be in dc2 (it would get dc1's
// executors first, across the WAN).
func TestDatacenterNamesAreLowercase(t *testing.T) {
	for _, v := range []string{"DC1", "dc1,DC2", "dc1,DC1"} {
		cfg, err := parseServeFlags([]string{"--datacenters", v}, io.Discard)
		if err == nil &&
			slices.ContainsFunc(cfg.datacenters,
				func(dc string) bool { return dc != strings.ToLower(dc) }) {
			t.Errorf(
				"--datacenters %q accepted as %q: Consul has no such datacenter (its names are "+
					"lowercase)",
				v, cfg.datacenters)
		}
	}
	if b, err := newBootstrap("127.0.0.1:18000", "d1", "", nil, "", "DC2"); err == nil &&
		strings.Contains(string(b), `"DC2"`) {
		t.Errorf(
			"bootstrap --datacenter DC2 accepted as is: the dispatcher names a datacenter Consul " +
				"does not have")
	}
}

// Mistakes in serve's addresses and log level are refused naming the flag
// (and the variable a value came from) in a sentence saying what to write;
// the admin port's address may be written as a URL, as --consul-addr's may.
func TestServeFlagErrorsSayWhatToWrite(t *testing.T) {
	for _, c := range []struct {
		args []string
		env  map[string]string
		want string // "" = accepted
	}{
		{[]string{"--log-level", "verbose"}, nil,
			`invalid --log-level "verbose": not a level: want debug, info, warn or error`},
		{nil, map[string]string{"LEASEHOLD_LOG_LEVEL": "verbose"},
			`invalid --log-level (from $LEASEHOLD_LOG_LEVEL) "verbose": not a level`},
		{[]string{"--xds-addr", "127.0.0.1:99999"}, nil,
			`invalid --xds-addr "127.0.0.1:99999": port 99999 is out of range: a port is 1 to ` +
				`65535 (0 picks a free one)`},
		{[]string{"--xds-addr", "http://127.0.0.1:18000"}, nil,
			"the gRPC port (xDS and fencing) takes HOST:PORT, no scheme"},
		{[]string{"--admin-addr", "127.0.0.1"}, nil,
			`invalid --admin-addr "127.0.0.1": no port: write HOST:PORT`},
		{[]string{"--admin-addr", "https://127.0.0.1:19100"}, nil,
			"https:// needs the admin port's certificate"},
		{[]string{"--consul-addr", "ftp://x"}, nil,
			`"ftp://x" for "--consul-addr" flag: ftp:// is not a scheme Consul speaks`},
		{nil, map[string]string{"LEASEHOLD_CONSUL_ADDR": "ftp://x"},
			"--consul-addr (from $LEASEHOLD_CONSUL_ADDR)"},
		{[]string{"--consul-addr", "http://127.0.0.1:8500"}, nil, ""},
		{[]string{"--admin-addr", "http://127.0.0.1:19100"}, nil, ""},
		{[]string{"--shard-size", "1"}, nil,
			"invalid --shard-size: 1: want at least 100 instances per shard, or 0 never to shard"},
		{[]string{"--shard-size", "-5"}, nil, "invalid --shard-size: -5"},
		{[]string{"--shard-size", "0"}, nil, ""},
		{[]string{"--shard-size", "500"}, nil, ""},
	} {
		for k, v := range c.env {
			t.Setenv(k, v)
		}
		cfg, err := parseServeFlags(c.args, io.Discard)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%v refused: %v", c.args, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%v %v: want an error saying %s, got %v", c.args, c.env, c.want, err)
		case err != nil && strings.Contains(err.Error(), "in address"):
			t.Errorf("%v: Go's words leak out: %v", c.args, err)
		}
		for k := range c.env {
			unsetenv(t, k)
		}
		if len(c.args) == 2 && c.args[0] == "--admin-addr" && err == nil &&
			cfg.adminAddr != "127.0.0.1:19100" {
			t.Errorf("--admin-addr %s: serves on %q", c.args[1], cfg.adminAddr)
		}
	}
}
