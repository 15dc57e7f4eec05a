// Package flagx holds flag.Value types (also github.com/spf13/pflag
// Values) shared by leasehold's commands.
package flagx

import (
	"fmt"
	"strings"
)

// List collects a repeatable flag; each value may also be comma-separated.
type List []string

func (l *List) String() string { return strings.Join(*l, ",") }

// Type names the value in help (github.com/spf13/pflag).
func (l *List) Type() string { return "list" }

func (l *List) Set(v string) error {
	for _, p := range strings.Split(v, ",") {
		if p = strings.TrimSpace(p); p != "" {
			*l = append(*l, p)
		}
	}
	return nil
}

// Labels collects repeatable key=value flags. Use with make(Labels).
type Labels map[string]string

func (l Labels) String() string {
	parts := make([]string, 0, len(l))
	for k, v := range l {
		parts = append(parts, k+"="+v)
	}
	return strings.Join(parts, ",")
}

// Type names the value in help (github.com/spf13/pflag).
func (l Labels) Type() string { return "key=value" }

func (l Labels) Set(v string) error {
	k, val, ok := strings.Cut(v, "=")
	if !ok || k == "" {
		return fmt.Errorf("want key=value, got %q", v)
	}
	if _, dup := l[k]; dup {
		return fmt.Errorf("label %q given twice", k)
	}
	l[k] = val
	return nil
}

// Once is a single-valued string flag given at most once: where a second
// value would silently replace the first, it is refused, with Hint saying
// what to do instead.
type Once struct {
	V    *string // the value, preset to the default
	Hint string
	set  bool
}

func (o *Once) String() string {
	if o.V == nil {
		return ""
	}
	return *o.V
}

// Type names the value in help (github.com/spf13/pflag).
func (o *Once) Type() string { return "string" }

func (o *Once) Set(v string) error {
	if o.set {
		return fmt.Errorf("given twice (%q, then %q): %s", *o.V, v, o.Hint)
	}
	o.set, *o.V = true, v
	return nil
}
