package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/health"
)

// controlFlags are the flags every operator command shares.
type controlFlags struct {
	consulAddr, by string
	// audit retention: only the commands that write a record take the flags
	auditKeep   int
	auditMaxAge ageValue
}

func (c *controlFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&c.consulAddr, "consul", "", "Consul agent HTTP address (default $CONSUL_HTTP_ADDR or 127.0.0.1:8500; token and TLS from CONSUL_*)")
	fs.StringVar(&c.by, "by", os.Getenv("USER"), "who acts (used when Consul ACLs are off; with ACLs the token's identity is used)")
	c.auditKeep, c.auditMaxAge = consul.DefaultAuditKeep, ageValue(consul.DefaultAuditMaxAge)
}

// registerRetention adds the audit retention flags of the commands that
// write an audit record (and prune the trail after it).
func (c *controlFlags) registerRetention(fs *flag.FlagSet) {
	fs.IntVar(&c.auditKeep, "audit-keep", consul.DefaultAuditKeep, "audit records kept in Consul KV: after writing its record this command deletes older ones beyond this count")
	fs.Var(&c.auditMaxAge, "audit-max-age", "audit records older than this are deleted after this command writes its record (e.g. 90d, 720h)")
}

// validate checks the flags, naming the bad one.
func (c *controlFlags) validate() error {
	if c.auditKeep < 1 {
		return fmt.Errorf("--audit-keep: must be at least 1, got %d", c.auditKeep)
	}
	if c.auditMaxAge <= 0 {
		return fmt.Errorf("--audit-max-age: must be positive, got %s", c.auditMaxAge.String())
	}
	return nil
}

func (c *controlFlags) control(stderr io.Writer) (*consul.Control, error) {
	if err := c.validate(); err != nil {
		return nil, err
	}
	client, err := consul.NewClient(c.consulAddr, 4)
	if err != nil {
		return nil, err
	}
	return consul.NewControl(client, consul.ControlOptions{
		Retention: consul.AuditRetention{Keep: c.auditKeep, MaxAge: time.Duration(c.auditMaxAge)},
		Logger:    slog.New(slog.NewTextHandler(stderr, nil)),
	})
}

func (c *controlFlags) open(ctx context.Context, stderr io.Writer) (*consul.Control, string, error) {
	k, err := c.control(stderr)
	if err != nil {
		return nil, "", err
	}
	who, err := k.Identity(ctx, c.by)
	return k, who, err
}

// ageValue is a duration flag that also takes days ("90d").
type ageValue time.Duration

func (a *ageValue) String() string {
	d := time.Duration(*a)
	if d > 0 && d%(24*time.Hour) == 0 {
		return strconv.FormatInt(int64(d/(24*time.Hour)), 10) + "d"
	}
	return d.String()
}

func (a *ageValue) Set(v string) error {
	if n, ok := strings.CutSuffix(v, "d"); ok {
		days, err := strconv.ParseInt(n, 10, 32)
		if err != nil {
			return fmt.Errorf("want days (e.g. 90d) or a duration (e.g. 720h): %w", err)
		}
		*a = ageValue(time.Duration(days) * 24 * time.Hour)
		return nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return fmt.Errorf("want days (e.g. 90d) or a duration (e.g. 720h): %w", err)
	}
	*a = ageValue(d)
	return nil
}

func parseFlags(fs *flag.FlagSet, args []string) (int, bool) {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0, false
		}
		return 2, false
	}
	return 0, true
}

// runCordon: leasehold cordon (--instance ID | --version C | --task T) --reason R, or --list.
func runCordon(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("leasehold cordon", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cf controlFlags
	cf.register(fs)
	cf.registerRetention(fs)
	var c health.Cordon
	var list bool
	fs.StringVar(&c.Instance, "instance", "", "cordon this executor instance")
	fs.StringVar(&c.VersionConstraint, "version", "", "cordon executors whose version satisfies this constraint, e.g. \"=1.4.2\"")
	fs.StringVar(&c.Task, "task", "", "cordon executors of this task type (with the others: only those)")
	fs.StringVar(&c.Reason, "reason", "", "why (required; shown by explain and kept in the audit log)")
	fs.BoolVar(&list, "list", false, "list the cordons instead")
	if code, ok := parseFlags(fs, args); !ok {
		return code
	}
	k, who, err := cf.open(ctx, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "leasehold cordon: %v\n", err)
		return 2
	}
	if list {
		cs, bad, err := k.Cordons(ctx)
		if err != nil {
			fmt.Fprintf(stderr, "leasehold cordon: %v\n", err)
			return 1
		}
		tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tSELECTS\tBY\tAT\tAPPROVED BY\tREASON")
		for _, c := range cs {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", c.ID, c.Selector(), c.By, c.At.Format(time.RFC3339), dash(c.ApprovedBy), c.Reason)
		}
		tw.Flush()
		for key, err := range bad {
			fmt.Fprintf(stderr, "invalid cordon %s: %v\n", key, err)
		}
		return 0
	}
	c.ID, c.By, c.At = consul.NewCordonID(), who, time.Now().UTC()
	if err := c.Validate(); err != nil {
		fmt.Fprintf(stderr, "leasehold cordon: invalid cordon:\n%v\n", err)
		return 2
	}
	if err := k.Cordon(ctx, c); err != nil {
		fmt.Fprintf(stderr, "leasehold cordon: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "%s: cordoned %s by %s (see `leasehold explain`; pending until approved when approvals are required)\n", c.ID, c.Selector(), who)
	return 0
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// runUncordon: leasehold uncordon ID.
func runUncordon(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	var reason *string
	return runOnCordon(ctx, "uncordon", "removed", args, stdout, stderr,
		func(fs *flag.FlagSet) { reason = fs.String("reason", "", "why (kept in the audit log)") },
		func(k *consul.Control, id, who string) error { return k.Uncordon(ctx, id, who, *reason) })
}

// runApprove: leasehold approve ID (by another identity than the author).
func runApprove(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runOnCordon(ctx, "approve", "approved", args, stdout, stderr, nil,
		func(k *consul.Control, id, who string) error { return k.Approve(ctx, id, who) })
}

// runOnCordon is the shape of the commands acting on one cordon id: flags,
// the id, who acts, the action, what became of it.
func runOnCordon(ctx context.Context, name, done string, args []string, stdout, stderr io.Writer,
	flags func(*flag.FlagSet), act func(k *consul.Control, id, who string) error) int {
	fs := flag.NewFlagSet("leasehold "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cf controlFlags
	cf.register(fs)
	cf.registerRetention(fs)
	if flags != nil {
		flags(fs)
	}
	if code, ok := parseFlags(fs, args); !ok {
		return code
	}
	if fs.NArg() != 1 {
		fmt.Fprintf(stderr, "leasehold %s: want exactly one cordon id (leasehold cordon --list)\n", name)
		return 2
	}
	k, who, err := cf.open(ctx, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "leasehold %s: %v\n", name, err)
		return 2
	}
	if err := act(k, fs.Arg(0), who); err != nil {
		fmt.Fprintf(stderr, "leasehold %s: %v\n", name, err)
		return 1
	}
	fmt.Fprintf(stdout, "%s: %s by %s\n", fs.Arg(0), done, who)
	return 0
}

// runRules: leasehold rules set FILE | show.
func runRules(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("leasehold rules", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cf controlFlags
	cf.register(fs)
	cf.registerRetention(fs) // set and clear write a record
	if code, ok := parseFlags(fs, args); !ok {
		return code
	}
	switch {
	case fs.NArg() == 2 && fs.Arg(0) == "set":
		raw, err := rulesJSON(fs.Arg(1))
		if err != nil {
			fmt.Fprintf(stderr, "leasehold rules: %v\n", err)
			return 2
		}
		k, who, err := cf.open(ctx, stderr)
		if err != nil {
			fmt.Fprintf(stderr, "leasehold rules: %v\n", err)
			return 2
		}
		if err := k.SetRules(ctx, raw, who); err != nil {
			fmt.Fprintf(stderr, "leasehold rules: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "rules stored in Consul KV %s by %s: every replica applies them\n", consul.RulesKey, who)
		return 0
	case fs.NArg() == 1 && fs.Arg(0) == "show":
		k, err := cf.control(stderr)
		if err != nil {
			fmt.Fprintf(stderr, "leasehold rules: %v\n", err)
			return 2
		}
		raw, err := k.Rules(ctx)
		if err != nil {
			fmt.Fprintf(stderr, "leasehold rules: %v\n", err)
			return 1
		}
		if raw == nil {
			fmt.Fprintf(stdout, "no rules in Consul KV %s: each replica's --rules file (or the defaults: every rule enforced, safety limit 0.5) applies\n", consul.RulesKey)
			return 0
		}
		fmt.Fprintf(stdout, "%s\n", raw)
		return 0
	case fs.NArg() == 1 && fs.Arg(0) == "clear":
		k, who, err := cf.open(ctx, stderr)
		if err != nil {
			fmt.Fprintf(stderr, "leasehold rules: %v\n", err)
			return 2
		}
		if err := k.ClearRules(ctx, who); err != nil {
			fmt.Fprintf(stderr, "leasehold rules: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "rules removed from Consul KV by %s: each replica's --rules file (or the defaults) applies\n", who)
		return 0
	default:
		fmt.Fprintln(stderr, "leasehold rules: usage: leasehold rules [--consul ADDR] [--by NAME] [--audit-keep N] [--audit-max-age AGE] set FILE (YAML or JSON) | show | clear")
		return 2
	}
}

// rulesJSON reads a rollout file (YAML or JSON), validates it and returns
// it as JSON; errors name the file and the field.
func rulesJSON(path string) ([]byte, error) {
	raw, err := rulesYAMLToJSON(path)
	if err != nil {
		return nil, err
	}
	if _, err := health.ParseRollout(raw); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return raw, nil
}

// rulesYAMLToJSON converts a YAML (or JSON) file to JSON, unvalidated.
func rulesYAMLToJSON(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var doc any
	if err := yaml.Unmarshal(b, &doc); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if doc == nil {
		doc = map[string]any{}
	}
	raw, err := json.Marshal(doc)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return raw, nil
}

// runAudit: leasehold audit [--limit N] [--before ID] [--json], newest page
// first; each page prints the --before of the next (older) one on stderr.
func runAudit(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("leasehold audit", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cf controlFlags
	cf.register(fs)
	limit := fs.Int("limit", 50, "records per page: the most recent ones before --before")
	before := fs.String("before", "", "show the records older than this record id (the ID column; printed after each page as the next page's --before)")
	asJSON := fs.Bool("json", false, "one JSON object per line")
	if code, ok := parseFlags(fs, args); !ok {
		return code
	}
	if *limit < 1 {
		fmt.Fprintf(stderr, "leasehold audit: --limit: must be at least 1, got %d\n", *limit)
		return 2
	}
	if *before != "" {
		if _, err := consul.ParseAuditID(*before); err != nil {
			fmt.Fprintf(stderr, "leasehold audit: --before: %v\n", err)
			return 2
		}
	}
	if fs.NArg() != 0 {
		fmt.Fprintf(stderr, "leasehold audit: unexpected arguments %q (flags go before them)\n", fs.Args())
		return 2
	}
	k, err := cf.control(stderr)
	if err != nil {
		fmt.Fprintf(stderr, "leasehold audit: %v\n", err)
		return 2
	}
	page, err := k.AuditLog(ctx, *limit, *before)
	if err != nil {
		fmt.Fprintf(stderr, "leasehold audit: %v\n", err)
		return 1
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		for _, e := range page.Entries {
			if err := enc.Encode(e); err != nil {
				fmt.Fprintf(stderr, "leasehold audit: %v\n", err)
				return 1
			}
		}
	} else {
		tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tAT\tACTOR\tACTION\tTARGET\tDETAIL")
		for _, e := range page.Entries {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", e.ID, e.At.Format(time.RFC3339), e.Actor, e.Action, dash(e.Target), strings.ReplaceAll(e.Detail, "\n", " "))
		}
		tw.Flush()
	}
	if page.Older != "" {
		fmt.Fprintf(stderr, "older records: leasehold audit --limit %d --before %s\n", *limit, page.Older)
	}
	return 0
}
