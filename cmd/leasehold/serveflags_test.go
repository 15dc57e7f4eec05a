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
