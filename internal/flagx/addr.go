package flagx

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
)

// Addresses are read here, alike in every command, so that each mistake an
// operator makes is answered with a sentence saying what to write instead
// (not Go's "too many colons in address"). The errors do not name the flag:
// the caller does, with the variable the value came from.

// HostPort reads a network address written HOST:PORT, or as a URL that ends
// at its port, http://HOST:PORT or https://HOST:PORT (the form a browser
// shows, and the one CONSUL_HTTP_ADDR takes), and returns the scheme ("" when
// none was written) and HOST:PORT. The port must be within minPort..65535: 0
// for an address to listen on (where 0 picks a free port), 1 for one to dial.
func HostPort(v string, minPort int) (scheme, hostport string, err error) {
	rest := v
	if s, r, ok := strings.Cut(v, "://"); ok {
		if s != "http" && s != "https" {
			return "", "", fmt.Errorf("%s:// is not a scheme this address takes: write "+
				"HOST:PORT, http://HOST:PORT or https://HOST:PORT", s)
		}
		scheme, rest = s, strings.TrimSuffix(r, "/")
		if i := strings.IndexAny(rest, "/?#"); i >= 0 {
			return "", "", fmt.Errorf("an address ends at its port, but %q follows it: write "+
				"%s://HOST:PORT", rest[i:], s)
		}
	}
	host, port, err := net.SplitHostPort(rest)
	if err != nil {
		return "", "", hostPortProblem(rest, err)
	}
	if err := CheckPort(port, minPort); err != nil {
		return "", "", err
	}
	return scheme, net.JoinHostPort(host, port), nil
}

// hostPortProblem says what is wrong with an address net.SplitHostPort
// refused.
func hostPortProblem(v string, err error) error {
	var ae *net.AddrError
	if errors.As(err, &ae) {
		switch {
		case strings.Contains(ae.Err, "missing port"):
			return errors.New("no port: write HOST:PORT, e.g. 127.0.0.1:9000")
		case strings.Contains(ae.Err, "too many colons") && net.ParseIP(v) != nil:
			return fmt.Errorf("an IPv6 address goes in brackets before its port: [%s]:PORT", v)
		case strings.Contains(ae.Err, "too many colons"):
			return errors.New("not HOST:PORT: too many colons (an IPv6 host goes in " +
				"brackets, e.g. [::1]:9000)")
		}
	}
	return errors.New("not HOST:PORT, e.g. 127.0.0.1:9000")
}

// checkPort checks a port number: within minPort..65535.
func CheckPort(port string, minPort int) error {
	n, err := strconv.Atoi(port)
	if err != nil {
		return fmt.Errorf("port %q is not a number", port)
	}
	if n < minPort || n > 65535 {
		if minPort == 0 {
			return fmt.Errorf("port %d is out of range: a port is 1 to 65535 (0 picks a free one)",
				n)
		}
		return fmt.Errorf("port %d is out of range: a port is %d to 65535", n, minPort)
	}
	return nil
}

// ConsulAddr checks a Consul agent's HTTP address as Consul's own clients
// take it in CONSUL_HTTP_ADDR: HOST:PORT, http://HOST[:PORT],
// https://HOST[:PORT] or unix:///PATH. Anything else (ftp://x) would fail
// only at the first request, far from the flag that said it.
func ConsulAddr(v string) error {
	scheme, rest, ok := strings.Cut(v, "://")
	if !ok {
		scheme, rest = "", v
	}
	switch scheme {
	case "unix":
		if rest == "" {
			return errors.New("unix:// needs the socket's path: unix:///PATH")
		}
		return nil
	case "", "http", "https":
	default:
		return fmt.Errorf("%s:// is not a scheme Consul speaks: write HOST:PORT, "+
			"http://HOST:PORT, https://HOST:PORT or unix:///PATH", scheme)
	}
	rest = strings.TrimSuffix(rest, "/")
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		return fmt.Errorf("an address ends at its port, but %q follows it", rest[i:])
	}
	host, port, err := net.SplitHostPort(rest)
	if err != nil {
		// A URL may leave its port out (80, 443), as Consul's clients allow.
		var ae *net.AddrError
		if errors.As(err, &ae) && strings.Contains(ae.Err, "missing port") && rest != "" {
			return nil
		}
		return hostPortProblem(rest, err)
	}
	if host == "" {
		return errors.New("no host: write HOST:PORT, e.g. 127.0.0.1:8500")
	}
	return CheckPort(port, 1)
}

// Checked is a string flag whose values must pass a check when they are
// given, on the command line or from a variable, so a bad one is refused at
// once, naming the flag. The default is not checked.
type Checked struct {
	p     *string
	check func(string) error
}

// NewChecked is a Checked flag storing into p, which starts as def.
func NewChecked(p *string, def string, check func(string) error) *Checked {
	*p = def
	return &Checked{p: p, check: check}
}

func (c *Checked) String() string {
	if c.p == nil {
		return ""
	}
	return *c.p
}

func (c *Checked) Set(v string) error {
	if err := c.check(v); err != nil {
		return err
	}
	*c.p = v
	return nil
}

// Type names the value in help (github.com/spf13/pflag): a string, as
// before it was checked.
func (c *Checked) Type() string { return "string" }
