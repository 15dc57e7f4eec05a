package flagx

import (
	"strings"
	"testing"
)

// Addresses are taken as HOST:PORT or as a URL ending at the port; every
// refusal says what to write instead, never Go's "too many colons".
func TestHostPort(t *testing.T) {
	for _, c := range []struct {
		v       string
		min     int
		scheme  string
		hp      string
		wantErr string // "" = accepted
	}{
		{"127.0.0.1:19000", 0, "", "127.0.0.1:19000", ""},
		{"http://127.0.0.1:19100", 0, "http", "127.0.0.1:19100", ""},
		{"https://127.0.0.1:19100/", 0, "https", "127.0.0.1:19100", ""},
		{"[::1]:19000", 0, "", "[::1]:19000", ""},
		{":18000", 0, "", ":18000", ""},
		{"127.0.0.1:0", 0, "", "127.0.0.1:0", ""},
		{"127.0.0.1:0", 1, "", "", "port 0 is out of range: a port is 1 to 65535"},
		{"127.0.0.1:99999", 0, "", "", "port 99999 is out of range: a port is 1 to 65535 " +
			"(0 picks a free one)"},
		{"127.0.0.1:http", 0, "", "", `port "http" is not a number`},
		{"127.0.0.1", 0, "", "", "no port: write HOST:PORT"},
		{"::1", 0, "", "", "an IPv6 address goes in brackets before its port: [::1]:PORT"},
		{"a:b:c", 0, "", "", "too many colons (an IPv6 host goes in brackets"},
		{"ftp://127.0.0.1:1", 0, "", "", "ftp:// is not a scheme this address takes"},
		{"http://127.0.0.1:1/debug", 0, "", "", `"/debug" follows it`},
	} {
		scheme, hp, err := HostPort(c.v, c.min)
		switch {
		case c.wantErr == "" && (err != nil || scheme != c.scheme || hp != c.hp):
			t.Errorf("%q: %q %q %v, want %q %q", c.v, scheme, hp, err, c.scheme, c.hp)
		case c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)):
			t.Errorf("%q: %v, want an error saying %q", c.v, err, c.wantErr)
		}
		if err != nil && strings.Contains(err.Error(), "in address") {
			t.Errorf("%q: Go's words leak out: %v", c.v, err)
		}
	}
}

// A Consul address is what Consul's own clients take (CONSUL_HTTP_ADDR);
// another scheme is refused when given, not at the first request.
func TestConsulAddr(t *testing.T) {
	for _, ok := range []string{"127.0.0.1:8500", "http://127.0.0.1:8500", "https://consul.local",
		"https://consul.local:8501/", "unix:///var/run/consul.sock", "[::1]:8500", "consul:8500"} {
		if err := ConsulAddr(ok); err != nil {
			t.Errorf("%q refused: %v", ok, err)
		}
	}
	for bad, want := range map[string]string{
		"ftp://x":                  "ftp:// is not a scheme Consul speaks",
		"unix://":                  "unix:///PATH",
		"http://127.0.0.1:8500/v1": `"/v1" follows it`,
		"127.0.0.1:99999":          "port 99999 is out of range",
		":8500":                    "no host",
		"::1":                      "brackets",
	} {
		if err := ConsulAddr(bad); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want an error saying %q", bad, err, want)
		}
	}
}

// A Checked flag refuses a value its check refuses, and keeps the one it
// had.
func TestChecked(t *testing.T) {
	var s string
	c := NewChecked(&s, "127.0.0.1:8500", ConsulAddr)
	if s != "127.0.0.1:8500" || c.String() != s || c.Type() != "string" {
		t.Fatalf("default: %q %q %q", s, c.String(), c.Type())
	}
	if err := c.Set("ftp://x"); err == nil || s != "127.0.0.1:8500" {
		t.Fatalf("ftp://x: %v, value %q", err, s)
	}
	if err := c.Set("http://127.0.0.2:8500"); err != nil || s != "http://127.0.0.2:8500" {
		t.Fatalf("http://127.0.0.2:8500: %v, value %q", err, s)
	}
}
