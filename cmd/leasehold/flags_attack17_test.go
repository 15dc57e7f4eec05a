package main

import (
	"io"
	"slices"
	"strings"
	"testing"
)

// --datacenters: what is refused and what is read. (Holds.)
func TestAttack17DatacentersFlag(t *testing.T) {
	for _, c := range []struct {
		v    string
		want []string // nil: refused naming --datacenters
	}{
		{"dc1", []string{"dc1"}},
		{"dc1,dc2", []string{"dc1", "dc2"}},
		{" dc1 , dc2 ", []string{"dc1", "dc2"}},
		{"dc1,,dc2", nil}, {",dc1", nil}, {"dc1,", nil}, {" ", nil}, {",", nil},
		{"dc1,dc1", nil}, {"dc1, dc1", nil},
		{"dc.1", nil}, {"dc 1", nil}, {"dc1;dc2", nil}, {"dc1/x", nil}, {strings.Repeat("d", 65), nil},
		{"dc_1,dc-2", []string{"dc_1", "dc-2"}},
	} {
		cfg, err := parseServeFlags([]string{"--datacenters", c.v}, io.Discard)
		switch {
		case c.want == nil && (err == nil || !strings.Contains(err.Error(), "--datacenters")):
			t.Errorf("%q: want an error naming --datacenters, got %v (read %q)", c.v, err, cfg.datacenters)
		case c.want != nil && err != nil:
			t.Errorf("%q refused: %v", c.v, err)
		case c.want != nil && !slices.Equal(cfg.datacenters, c.want):
			t.Errorf("%q read as %q, want %q", c.v, cfg.datacenters, c.want)
		}
	}
	if cfg, err := parseServeFlags(nil, io.Discard); err != nil || cfg.datacenters != nil {
		t.Errorf("no --datacenters: %q, %v; want none (the agent's own, unnamed)", cfg.datacenters, err)
	}
}

// TestAttack17DatacenterNamesAreLowercase (fixed; failed before, LOW): Consul's
// datacenter names are lowercase (the agent lowercases its -datacenter;
// measured with bin/consul 1.13.9: -datacenter=DC1 runs as "dc1", and
// ?dc=DC1 is answered 500, "No path to datacenter"), but --datacenters and
// bootstrap --datacenter accept capitals. `serve --datacenters DC1,dc2`
// starts and watches a datacenter that can never answer (dc1's executors
// are never read; after a lease DC1 is lost and leasehold serves dc2 alone,
// its own datacenter missing); `--datacenters DC1` alone is never ready;
// a dispatcher bootstrapped --datacenter DC2 is not in dc2 (it gets dc1's
// executors first, across the WAN). Either refuse capitals or fold them.
func TestAttack17DatacenterNamesAreLowercase(t *testing.T) {
	for _, v := range []string{"DC1", "dc1,DC2", "dc1,DC1"} {
		cfg, err := parseServeFlags([]string{"--datacenters", v}, io.Discard)
		if err == nil && slices.ContainsFunc(cfg.datacenters, func(dc string) bool { return dc != strings.ToLower(dc) }) {
			t.Errorf("--datacenters %q accepted as %q: Consul has no such datacenter (its names are lowercase)", v, cfg.datacenters)
		}
	}
	if b, err := newBootstrap("127.0.0.1:18000", "d1", "", nil, "", "DC2"); err == nil && strings.Contains(string(b), `"DC2"`) {
		t.Errorf("bootstrap --datacenter DC2 accepted as is: the dispatcher names a datacenter Consul does not have")
	}
}
