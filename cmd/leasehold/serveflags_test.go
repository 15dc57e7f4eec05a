package main

import (
	"io"
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
		{[]string{"--authz-policy", "p.yaml", "--tls-cert", "c", "--tls-key", "k"}, "--authz-policy"},
		{[]string{"--authz-policy", "p.yaml", "--tls-cert", "c", "--tls-key", "k", "--tls-client-ca", "ca"}, ""},
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
		{"4MiB", 4 << 20}, {"512KiB", 512 << 10}, {"8MB", 8e6}, {"1000", 1000}, {"2000B", 2000}, {"off", -1},
		{"", 0}, {"0", 0}, {"-1MiB", 0}, {"4 MiB", 0}, {"4mib", 0}, {"MiB", 0}, {"99999999999999MiB", 0}, {"1.5MiB", 0},
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
