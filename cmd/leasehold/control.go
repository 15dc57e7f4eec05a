package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"os"
	"os/user"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.yaml.in/yaml/v3"

	"github.com/leasehold/leasehold/adapters/consul"
	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/server"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// controlFlags are the flags every operator command shares.
type controlFlags struct {
	consulAddr, by string
	// The audit retention; only the commands that write a record take its
	// flags.
	auditKeep   int
	auditMaxAge ageValue
}

// register adds what every operator command takes: the Consul agent.
func (c *controlFlags) register(fs *pflag.FlagSet) {
	fs.SortFlags = false
	consulAddrFlag(fs, &c.consulAddr)
	c.auditKeep, c.auditMaxAge = consul.DefaultAuditKeep, ageValue(consul.DefaultAuditMaxAge)
}

// registerWriter adds the flags of the commands that write (a change and
// its audit record): who acts, and the audit retention they prune to.
func (c *controlFlags) registerWriter(fs *pflag.FlagSet) {
	fs.StringVar(&c.by, "by", "",
		"who acts, for the audit trail: a name anyone can type, used when Consul ACLs are off "+
			"(with ACLs the token's identity is used); with neither it nor $USER, this "+
			"process's user@host")
	bindEnv(fs, "by", "USER")
	fs.IntVar(&c.auditKeep, "audit-keep", consul.DefaultAuditKeep,
		"audit records kept in Consul KV: after writing its record this command deletes "+
			"older ones beyond this count")
	fs.Var(&c.auditMaxAge, "audit-max-age",
		"audit records older than this are deleted after this command writes its record (days "+
			"such as 90d, or a duration such as 720h)")
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

// control connects to Consul; errors are usage errors (bad flags).
func (c *controlFlags) control(stderr io.Writer) (*consul.Control, error) {
	if err := c.validate(); err != nil {
		return nil, usagef("%v", err)
	}
	client, err := consul.NewClient(c.consulAddr, 4)
	if err != nil {
		return nil, usagef("--consul-addr: %v", err)
	}
	k, err := consul.NewControl(client, consul.ControlOptions{
		Retention: consul.AuditRetention{Keep: c.auditKeep, MaxAge: time.Duration(c.auditMaxAge)},
		Logger:    slog.New(slog.NewTextHandler(stderr, nil)),
	})
	if err != nil {
		return nil, usagef("%v", err)
	}
	return k, nil
}

// open connects for a write and says who acts.
func (c *controlFlags) open(
	ctx context.Context, stderr io.Writer,
) (*consul.Control, string, error) {
	k, who, err := c.openAs(ctx, stderr)
	return k, who.Name, err
}

// openAs connects for a write and says who acts, and whether Consul
// attributed it. Without --by (and $USER unset, as in containers and
// systemd units) the process's own user and host are recorded, and stderr
// says so: a write must not fail for want of a name ACLs do not check.
func (c *controlFlags) openAs(
	ctx context.Context, stderr io.Writer,
) (*consul.Control, consul.Actor, error) {
	k, err := c.control(stderr)
	if err != nil {
		return nil, consul.Actor{}, err
	}
	by, fallback := strings.TrimSpace(c.by), false
	if by == "" {
		by, fallback = fallbackBy(), true
	}
	who, err := k.Who(ctx, by)
	if errors.Is(err, consul.ErrByRequired) {
		return nil, who, usagef("%v", err)
	} else if err != nil {
		return nil, who, failed(err) // Consul unreachable, or its token unreadable
	}
	if fallback && !who.Attributed() {
		fmt.Fprintf(stderr, "who acts: no --by and $USER unset: recorded as %q (this "+
			"process's user and host); pass --by NAME to record another name\n", who.Name)
	}
	return k, who, nil
}

// fallbackBy names who acts when neither --by nor $USER does: the
// process's user (its uid when the user database has no name for it) on
// this host.
func fallbackBy() string {
	name := "uid " + strconv.Itoa(os.Getuid())
	if u, err := user.Current(); err == nil && u.Username != "" {
		name = u.Username
	}
	if h, err := os.Hostname(); err == nil && h != "" {
		name += "@" + h
	}
	return name
}

// unattributedNote is what approve and cordon print when Consul cannot say
// who acts.
func unattributedNote(who consul.Actor) string {
	return fmt.Sprintf("note: %q is %s; it shows no second person, and a replica started "+
		"with serve --require-acl-approvals does not count it", who.Name, consul.Unattributed)
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
		if maxDays := int64(math.MaxInt64 / int64(24*time.Hour)); days > maxDays ||
			days < -maxDays {
			return fmt.Errorf("%s: at most %dd", v, maxDays) // more would wrap round to a short age
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

// Type names the value in help.
func (a *ageValue) Type() string { return "age" }

// cordonView is the cordons' state as one leasehold replica sees it (its
// /debug/config): whether each is applied, pending approval or held by the
// safety limit is decided there, from the fleet that replica sees, and is
// known to no one reading Consul alone.
type cordonView struct {
	addr     string
	byID     map[string]health.CordonStatus
	limit    float64
	err      error  // set when no replica answered, so the state is unknown here
	notReady string // why the replica is not ready, when what was waited for did not come
	asked    bool
	approval health.CordonApproval
}

// cordonView asks the replica at --admin-addr, until ready accepts the
// answer or wait has passed (then the last answer stands).
func (a *adminFlags) cordonView(
	ctx context.Context, fs *pflag.FlagSet, wait time.Duration,
	ready func(map[string]health.CordonStatus) bool,
) cordonView {
	v := cordonView{addr: a.addr, asked: true}
	var f explainFlags
	if errs := a.explainFlags(fs, &f); len(errs) > 0 {
		v.err = errors.New(strings.Join(errs, "; "))
		return v
	}
	ctx, cancel := context.WithTimeout(ctx, wait+3*time.Second)
	defer cancel()
	deadline := time.Now().Add(wait)
	for {
		var st fleet.ControlState
		if err := getJSON(ctx, f, "/debug/config", &st); err != nil {
			if v.byID == nil {
				v.err = err
			}
			return v
		}
		v.byID = map[string]health.CordonStatus{}
		for _, c := range st.Cordons {
			v.byID[c.Cordon.ID] = c
		}
		v.limit = st.Rollout.Limit()
		if st.Rollout != nil {
			v.approval = st.Rollout.Approval
		}
		if ready == nil || ready(v.byID) {
			return v
		}
		if time.Now().After(deadline) {
			v.notReady = notReady(ctx, f)
			return v
		}
		select {
		case <-ctx.Done():
			return v
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// notReady is why the replica says it is not ready ("" when it is, or does
// not say). It matters because a replica that cannot read the operators'
// controls never sees a cordon, and its /readyz names the missing right.
func notReady(ctx context.Context, f explainFlags) string {
	var rz struct {
		Ready                  bool
		Reason, Detail, Source string
	}
	if status, err := getJSONStatus(ctx, f, "/readyz", &rz); err != nil ||
		status == http.StatusOK || rz.Ready {
		return ""
	}
	why := rz.Reason + ": " + rz.Detail
	if rz.Source != "" {
		why += " (" + rz.Source + ")"
	}
	return why
}

// unknown says why the state is not known here.
func (v cordonView) unknown() string {
	if refused := (*adminRefused)(nil); errors.As(v.err, &refused) {
		return fmt.Sprintf("not known here: whether a cordon is applied, pending approval or "+
			"held is decided by each leasehold serve replica, and the one at --admin-addr %s "+
			"would not tell: %v", v.addr, refused)
	}
	return fmt.Sprintf("not known here: whether a cordon is applied, pending approval or held "+
		"by the safety limit is decided by each leasehold serve replica from the fleet "+
		"it sees, and no replica answered at --admin-addr %s (%v); ask one with "+
		"--admin-addr, or see `leasehold explain`", v.addr, v.err)
}

// long describes cordon id's state in a sentence.
func (v cordonView) long(id string) string {
	if v.err != nil {
		return v.unknown()
	}
	st, ok := v.byID[id]
	if !ok && v.notReady != "" {
		return fmt.Sprintf("not seen by the replica at %s, which is not ready: %s (its /readyz)",
			v.addr, v.notReady)
	}
	if !ok {
		return fmt.Sprintf("not yet seen by the replica at %s (is it watching the same Consul?)",
			v.addr)
	}
	where := " (as the replica at " + v.addr + " sees it)"
	switch {
	case st.Pending && st.ApprovalRefused != "":
		return fmt.Sprintf("pending approval: it selects %d executor(s) and the rules require a "+
			"second person's approval, and the one it carries does not count: %s%s",
			st.Matched, st.ApprovalRefused, where)
	case st.Pending:
		return fmt.Sprintf("pending approval: it selects %d executor(s) and the rules require a "+
			"second person's approval (a version cordon always, or more than %d "+
			"executors): a different identity runs `leasehold approve %s`%s",
			st.Matched, v.approval.MaxExecutors, id, where)
	case st.Held > 0:
		out := ""
		if n := st.Matched - st.Applied - st.Held; n > 0 {
			out = fmt.Sprintf(", %d out of routing already (lapsed, fenced or cordoned earlier)", n)
		}
		var sets []string
		for _, p := range st.HeldBy {
			sets = append(sets, p.String())
		}
		return fmt.Sprintf("held by the safety limit: %d of the %d executor(s) it selects "+
			"stay routed, %d applied%s; cordoning them would leave too few routable executors "+
			"in: %s. The limit counts each constraint set a connected dispatcher uses "+
			"(version constraint and labels) and each task type as a whole: at most "+
			"floor(%g × live executors) of each are cordoned at once, rounded down, so a set "+
			"with a single live executor keeps it%s", st.Held,
			st.Matched, st.Applied, out, strings.Join(sets, "; "), v.limit, where)
	case st.Applied > 0:
		return fmt.Sprintf("applied: %d executor(s) get no new work (DRAINING)%s",
			st.Applied, where)
	case st.Matched == 0:
		return "in force, but it selects no executor now" + where
	default:
		return fmt.Sprintf("in force; the %d executor(s) it selects are out of routing already "+
			"(lapsed, fenced, or cordoned by an earlier cordon)%s", st.Matched, where)
	}
}

// short is cordon id's state for the --list table.
func (v cordonView) short(id string) string {
	if v.err != nil {
		return "?"
	}
	st, ok := v.byID[id]
	switch {
	case !ok:
		return "not seen yet"
	case st.Pending:
		return "pending approval"
	case st.Held > 0:
		return fmt.Sprintf("held %d/%d (safety limit)", st.Held, st.Matched)
	case st.Applied > 0:
		return fmt.Sprintf("applied %d/%d", st.Applied, st.Matched)
	case st.Matched == 0:
		return "selects none"
	default:
		return fmt.Sprintf("applied 0/%d (out already)", st.Matched)
	}
}

// stateWait is how long cordon and approve wait for the replica to apply
// what they wrote; it follows Consul KV with a blocking query, so this takes
// milliseconds.
const stateWait = 3 * time.Second

func newCordonCmd() *cobra.Command {
	var (
		cf        controlFlags
		af        adminFlags
		c         health.Cordon
		list      bool
		allowNone bool
	)
	cmd := &cobra.Command{
		Use: "cordon (--instance ID | --version-constraint C | --task " +
			"T)... --reason R | cordon --list",
		Short: "stop new work to executors (by instance, version, task), for every replica",
		Long: `Store a cordon in Consul KV: every leasehold replica then sends the executors it
selects as DRAINING (no new work; in-flight work finishes). The given selectors
must all match. Prints the cordon id and its state as a replica sees it:
applied, pending approval (a second person runs leasehold approve), or held by
the safety limit. --list shows every cordon with its state.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, fs, stdout, stderr := cmd.Context(), cmd.Flags(), cmd.OutOrStdout(),
				cmd.ErrOrStderr()
			if list {
				return listCordons(ctx, &cf, &af, fs, stdout, stderr)
			}
			var f explainFlags
			if errs := af.explainFlags(fs, &f); len(errs) > 0 {
				return usagef("%s", strings.Join(errs, "\n"))
			}
			c.ID, c.At = consul.NewCordonID(), time.Now().UTC()
			c.By = "-" // checked below, once the identity is known
			if err := c.Validate(); err != nil {
				return usagef("invalid cordon:%s", oneOrLines(cordonFlagNames(err)))
			}
			k, who, err := cf.openAs(ctx, stderr)
			if err != nil {
				return err
			}
			if err := selectsSome(ctx, f, &c, allowNone, stderr); err != nil {
				return err
			}
			c.By, c.ByAccessor = who.Name, who.Accessor
			if err := k.Cordon(ctx, c); err != nil {
				return failed(err)
			}
			fmt.Fprintf(stdout, "%s: cordon of %s stored in Consul KV by %s\n",
				c.ID, c.Selector(), who.Name)
			view := af.cordonView(ctx, fs, stateWait, func(m map[string]health.CordonStatus) bool {
				_, ok := m[c.ID]
				return ok
			})
			fmt.Fprintf(stdout, "state: %s\n", view.long(c.ID))
			return nil
		},
	}
	fs := cmd.Flags()
	fs.SortFlags = false
	fs.StringVar(&c.Instance, "instance", "", "cordon this executor instance")
	fs.StringVar(&c.VersionConstraint, "version-constraint", "",
		"cordon executors whose version satisfies this semver constraint, "+
			"e.g. \"=1.4.2\" or \"<1.5.0\"")
	alias(fs, "version", "version-constraint")
	fs.StringVar(&c.Task, "task", "",
		"cordon executors of this task type (with the others: only those)")
	fs.StringVar(&c.Reason, "reason", "",
		"why (required; shown by explain and kept in the audit trail)")
	fs.BoolVar(&allowNone, "allow-none", false,
		"keep a cordon that selects no executor now (it then cordons any that matches later); "+
			"without it such a cordon is refused")
	fs.BoolVar(&list, "list", false, "list the cordons and their state instead (needs no --by)")
	cf.register(fs)
	cf.registerWriter(fs)
	af.register(fs, "asked for the cordons' state")
	filenameFlags(cmd, "admin-token-file", "tls-ca", "tls-cert", "tls-key")
	return cmd
}

// selectsSome refuses, unless allowNone, a cordon that selects no executor
// the replica at --admin-addr sees now: such a cordon would stay in force
// and take out whatever matches later, which is seldom what a mistyped
// instance id meant. With no replica answering, the check cannot be made:
// it says so and the cordon is stored.
func selectsSome(
	ctx context.Context, f explainFlags, c *health.Cordon, allowNone bool, stderr io.Writer,
) error {
	var ex server.ExplainExecutors
	if err := getJSON(ctx, f, "/debug/executors", &ex); err != nil {
		fmt.Fprintf(stderr, "warning: whether the cordon selects any executor is not known: "+
			"%v\n", err)
		return nil
	}
	for _, x := range ex.Executors {
		e := health.Executor{Registration: health.Registration{InstanceID: x.InstanceID,
			Task: x.Task, Version: x.Version}}
		if x.MetadataError == "" && c.Matches(&e) {
			return nil
		}
	}
	msg := fmt.Sprintf("the cordon of %s selects no executor the replica at %s sees now "+
		"(%d executor(s)); it would stay in force and cordon any executor that matches later",
		c.Selector(), f.admin, len(ex.Executors))
	if allowNone {
		fmt.Fprintf(stderr, "warning: %s; kept (--allow-none)\n", msg)
		return nil
	}
	return usagef("%s: nothing written; check the selector (`leasehold explain` lists the "+
		"executors), or pass --allow-none to keep it", msg)
}

// listCordons prints every cordon with its state as a replica sees it.
func listCordons(
	ctx context.Context, cf *controlFlags, af *adminFlags,
	fs *pflag.FlagSet, stdout, stderr io.Writer,
) error {
	for _, n := range []string{"instance", "version-constraint", "task", "reason", "allow-none"} {
		if fs.Changed(n) {
			return usagef("--list shows every cordon: it takes no --%s", n)
		}
	}
	k, err := cf.control(stderr)
	if err != nil {
		return err
	}
	cs, bad, err := k.Cordons(ctx)
	if err != nil {
		return failed(err)
	}
	view := af.cordonView(ctx, fs, 0, nil)
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSELECTS\tSTATE\tBY\tAT\tAPPROVED BY\tREASON")
	for _, c := range cs {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", c.ID, c.Selector(),
			view.short(c.ID), c.By, c.At.Format(time.RFC3339), dash(c.ApprovedBy), c.Reason)
	}
	tw.Flush()
	if view.err != nil {
		fmt.Fprintf(stderr, "STATE %s\n", view.unknown())
	} else if len(cs) > 0 {
		fmt.Fprintf(stderr,
			"STATE as the replica at %s sees it (held: kept routed by the safety limit, at most "+
				"floor(%g × live executors) cordoned of a task type and of each constraint set "+
				"a connected dispatcher uses)\n", view.addr, view.limit)
	}
	for key, err := range bad {
		fmt.Fprintf(stderr, "invalid cordon %s: %v\n", key, err)
	}
	return nil
}

// oneOrLines puts one problem on the line it follows and several on lines
// of their own.
func oneOrLines(msg string) string {
	if strings.Contains(msg, "\n") {
		return "\n" + msg
	}
	return " " + msg
}

// cordonFlagNames renames a cordon's fields in err to the flags that set
// them.
func cordonFlagNames(err error) string {
	r := strings.NewReplacer("instance_id:", "--instance:",
		"version_constraint:", "--version-constraint:", "task:", "--task:", "reason:", "--reason:",
		"selector:", "selector (--instance, --version-constraint, --task):")
	return r.Replace(err.Error())
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func newUncordonCmd() *cobra.Command {
	var (
		cf     controlFlags
		reason string
	)
	cmd := &cobra.Command{
		Use:   "uncordon CORDON_ID",
		Short: "remove a cordon",
		Args:  exactArgs("CORDON_ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, stderr := cmd.Context(), cmd.ErrOrStderr()
			k, who, err := cf.openAs(ctx, stderr)
			if err != nil {
				return err
			}
			if err := k.UncordonAs(ctx, args[0], who, reason); err != nil {
				return failed(err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: removed by %s\n", args[0], who.Name)
			return nil
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&reason, "reason", "", "why (kept in the audit trail)")
	cf.register(fs)
	cf.registerWriter(fs)
	cmd.ValidArgsFunction = completeCordonIDs(&cf)
	return cmd
}

func newApproveCmd() *cobra.Command {
	var (
		cf controlFlags
		af adminFlags
	)
	cmd := &cobra.Command{
		Use:   "approve CORDON_ID",
		Short: "approve a pending cordon (a different identity than its author)",
		Args:  exactArgs("CORDON_ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, fs, stderr := cmd.Context(), cmd.Flags(), cmd.ErrOrStderr()
			var f explainFlags
			if errs := af.explainFlags(fs, &f); len(errs) > 0 {
				return usagef("%s", strings.Join(errs, "\n"))
			}
			k, who, err := cf.openAs(ctx, stderr)
			if err != nil {
				return err
			}
			id := args[0]
			if err := k.ApproveAs(ctx, id, who); err != nil {
				return failed(err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: approved by %s\n", id, who.Name)
			if !who.Attributed() {
				fmt.Fprintln(cmd.OutOrStdout(), unattributedNote(who))
			}
			view := af.cordonView(ctx, fs, stateWait, func(m map[string]health.CordonStatus) bool {
				return m[id].Cordon.ApprovedBy != ""
			})
			fmt.Fprintf(cmd.OutOrStdout(), "state: %s\n", view.long(id))
			return nil
		},
	}
	fs := cmd.Flags()
	fs.SortFlags = false
	cf.register(fs)
	cf.registerWriter(fs)
	af.register(fs, "asked for the cordon's state")
	filenameFlags(cmd, "admin-token-file", "tls-ca", "tls-cert", "tls-key")
	cmd.ValidArgsFunction = completeCordonIDs(&cf)
	return cmd
}

// completeCordonIDs completes a cordon id from Consul KV.
func completeCordonIDs(cf *controlFlags) cobra.CompletionFunc {
	return func(
		cmd *cobra.Command, args []string, toComplete string,
	) ([]cobra.Completion, cobra.ShellCompDirective) {
		if len(args) > 0 {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		if applyEnv(cmd.Flags()) != nil {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		k, err := cf.control(io.Discard)
		if err != nil {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		ctx, cancel := context.WithTimeout(cmd.Context(), 2*time.Second)
		defer cancel()
		cs, _, err := k.Cordons(ctx)
		if err != nil {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		var out []cobra.Completion
		for _, c := range cs {
			out = append(out, cobra.CompletionWithDesc(c.ID, c.Selector()+": "+c.Reason))
		}
		return out, cobra.ShellCompDirectiveNoFileComp
	}
}

func newRulesCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use: "rules (set FILE | show | clear)",
		Short: "store the rollout rules (enforce/observe modes, safety " +
			"limit, approvals) in Consul KV",
		Long: `The rollout rules every replica applies, in Consul KV ` + consul.RulesKey + ` (they
override each replica's --rules file): set stores a YAML or JSON file after
validating it, show prints what is stored, clear removes it.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usagef("want a subcommand: set FILE, show or clear")
			}
			return usagef("unknown subcommand %q: want set FILE, show or clear", args[0])
		},
	}
	cmd.AddCommand(newRulesSetCmd(), newRulesShowCmd(), newRulesClearCmd())
	return cmd
}

func newRulesSetCmd() *cobra.Command {
	var setFlags controlFlags
	set := &cobra.Command{
		Use:   "set FILE",
		Short: "validate a rules file (YAML or JSON) and store it for every replica",
		Args:  exactArgs("FILE"),
		RunE: func(cmd *cobra.Command, args []string) error {
			raw, err := rulesJSON(args[0])
			if err != nil {
				return usagef("%v", err)
			}
			k, who, err := setFlags.open(cmd.Context(), cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			if err := k.SetRules(cmd.Context(), raw, who); err != nil {
				return failed(err)
			}
			fmt.Fprintf(cmd.OutOrStdout(),
				"rules stored in Consul KV %s by %s: every replica applies them\n",
				consul.RulesKey, who)
			return nil
		},
	}
	setFlags.register(set.Flags())
	setFlags.registerWriter(set.Flags())
	set.ValidArgsFunction = func(
		*cobra.Command, []string, string,
	) ([]cobra.Completion, cobra.ShellCompDirective) {
		return []cobra.Completion{"yaml", "yml", "json"}, cobra.ShellCompDirectiveFilterFileExt
	}
	return set
}

func newRulesShowCmd() *cobra.Command {
	var showFlags controlFlags
	show := &cobra.Command{
		Use:   "show",
		Short: "print the rules stored in Consul KV",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			k, err := showFlags.control(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			raw, err := k.Rules(cmd.Context())
			if err != nil {
				return failed(err)
			}
			if raw == nil {
				fmt.Fprintf(cmd.OutOrStdout(),
					"no rules in Consul KV %s: each replica's --rules file (or the defaults: "+
						"every rule enforced, safety limit 0.5) applies\n", consul.RulesKey)
				return nil
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s\n", raw)
			return nil
		},
	}
	showFlags.register(show.Flags())
	ignoredFlag(show.Flags(), "by", "a read needs no --by")
	return show
}

func newRulesClearCmd() *cobra.Command {
	var clearFlags controlFlags
	clear := &cobra.Command{
		Use: "clear",
		Short: "remove the rules from Consul KV (each replica's --rules " +
			"file, or the defaults, apply)",
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			k, who, err := clearFlags.open(cmd.Context(), cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			if err := k.ClearRules(cmd.Context(), who); err != nil {
				return failed(err)
			}
			fmt.Fprintf(cmd.OutOrStdout(),
				"rules removed from Consul KV by %s: each replica's --rules "+
					"file (or the defaults) applies\n", who)
			return nil
		},
	}
	clearFlags.register(clear.Flags())
	clearFlags.registerWriter(clear.Flags())
	return clear
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

func newAuditCmd() *cobra.Command {
	var (
		cf     controlFlags
		limit  int
		before string
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "audit",
		Short: "list recent operator actions (newest page first)",
		Long: `List the operator actions recorded in Consul KV (cordon, approve, uncordon,
rules set, rules clear), the --limit most recent before --before, oldest first;
the next (older) page's --before is printed on standard error.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			stdout, stderr := cmd.OutOrStdout(), cmd.ErrOrStderr()
			if limit < 1 {
				return usagef("--limit: must be at least 1, got %d", limit)
			}
			if before != "" {
				if _, err := consul.ParseAuditID(before); err != nil {
					return usagef("--before: %v", err)
				}
			}
			k, err := cf.control(stderr)
			if err != nil {
				return err
			}
			page, err := k.AuditLog(cmd.Context(), limit, before)
			if err != nil {
				return failed(err)
			}
			if asJSON {
				enc := json.NewEncoder(stdout)
				enc.SetEscapeHTML(false) // <2.0.0 stays readable, not \u003c2.0.0
				for _, e := range page.Entries {
					if err := enc.Encode(e); err != nil {
						return failed(err)
					}
				}
			} else {
				tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
				fmt.Fprintln(tw, "ID\tAT\tACTOR\tACTION\tTARGET\tDETAIL")
				for _, e := range page.Entries {
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", e.ID, e.At.Format(time.RFC3339),
						e.Actor, e.Action, dash(e.Target), strings.ReplaceAll(e.Detail, "\n", " "))
				}
				tw.Flush()
			}
			if page.Older != "" {
				fmt.Fprintf(stderr, "older records: leasehold audit --limit %d --before %s\n",
					limit, page.Older)
			}
			return nil
		},
	}
	fs := cmd.Flags()
	fs.SortFlags = false
	fs.IntVar(&limit, "limit", 50, "records per page: the most recent ones before --before")
	fs.StringVar(&before, "before", "",
		"show the records older than this record id (the ID column; printed after each page "+
			"as the next page's --before)")
	fs.BoolVar(&asJSON, "json", false, "one JSON object per line")
	cf.register(fs)
	ignoredFlag(fs, "by", "a read needs no --by")
	return cmd
}
