package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/url"
	"os"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/internal/flagx"
	"github.com/leasehold/leasehold/server"
)

type explainFlags struct {
	admin, task, dispatcher, instance string
	// A question without a connected dispatcher: what one with this
	// constraint set would get (asked is set when any of them is given).
	versionConstraint, datacenter string
	labels                        flagx.Labels
	asked                         bool
	orca                          bool         // read the current load from the executors
	token                         string       // bearer token for a guarded admin port
	client                        *http.Client // HTTPS with --tls-ca/--tls-cert/--tls-key
	color                         bool
}

// adminFlags reach a leasehold replica's admin port: its address, its
// bearer token and the client's TLS (the one client scheme: --tls-ca,
// --tls-cert, --tls-key).
type adminFlags struct {
	addr, tokenFile, ca, cert, key string
}

func (a *adminFlags) register(fs *pflag.FlagSet, what string) {
	fs.StringVar(&a.addr, "admin-addr", "127.0.0.1:19000",
		"admin address of leasehold serve ("+what+")")
	bindEnv(fs, "admin-addr", "LEASEHOLD_ADMIN_ADDR")
	fs.StringVar(&a.tokenFile, "admin-token-file", "",
		"file with the admin port's bearer token (leasehold serve --admin-token-file)")
	bindEnv(fs, "admin-token-file", "LEASEHOLD_ADMIN_TOKEN_FILE")
	tlsClientFlags(fs, &a.ca, &a.cert, &a.key,
		"the admin port (leasehold serve --admin-tls-cert)", "signed by its --admin-client-ca")
	alias(fs, "admin-ca", "tls-ca")
	alias(fs, "admin-cert", "tls-cert")
	alias(fs, "admin-key", "tls-key")
}

// explainFlags fills f's admin connection; errors name the flag.
func (a *adminFlags) explainFlags(fs *pflag.FlagSet, f *explainFlags) []string {
	var errs []string
	f.admin = a.addr
	// An unspecified host (serve's LEASEHOLD_ADMIN_ADDR may be 0.0.0.0:19000)
	// dials this machine, where such a replica listens, so it is accepted;
	// so is the URL form serve's --admin-addr takes (http://HOST:PORT).
	scheme, hp, err := flagx.HostPort(a.addr, 1)
	if err != nil {
		errs = append(errs,
			fmt.Sprintf("invalid %s %q: %v", flagRef(fs, "admin-addr"), a.addr, err))
	} else {
		f.admin = hp
	}
	if a.tokenFile != "" {
		if b, err := os.ReadFile(a.tokenFile); err != nil {
			errs = append(errs, fmt.Sprintf("invalid %s: %v", flagRef(fs, "admin-token-file"), err))
		} else {
			f.token = strings.TrimSpace(string(b))
		}
	}
	if a.ca != "" || a.cert != "" || a.key != "" {
		c, err := adminHTTPS(a.ca, a.cert, a.key)
		if err != nil {
			errs = append(errs, err.Error())
		}
		f.client = c
	}
	switch {
	case scheme == "https" && f.client == nil:
		f.client = &http.Client{} // verified against the system's CAs
	case scheme == "http" && f.client != nil:
		errs = append(errs, fmt.Sprintf("invalid %s %q: http://, but --tls-ca, --tls-cert or "+
			"--tls-key ask for HTTPS: write https://HOST:PORT or HOST:PORT",
			flagRef(fs, "admin-addr"), a.addr))
	}
	return errs
}

func newExplainCmd() *cobra.Command {
	var (
		a adminFlags
		f explainFlags
	)
	cmd := &cobra.Command{
		Use:   "explain",
		Short: "show which executors each dispatcher routes to, and why not the others",
		Long: `Ask a leasehold replica (its admin port) which executors each constraint set in
use routes to, with the reason for every one it does not: all of them, one
dispatcher's (--dispatcher) or one executor's (--instance). With
--version-constraint, --label or --datacenter: what a dispatcher with that
constraint set would get, whether or not one is connected.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			errs := a.explainFlags(cmd.Flags(), &f)
			if f.task != "" {
				if fe := health.ValidateTask(f.task); fe != nil {
					errs = append(errs, "invalid --task: "+fe.Error())
				}
			}
			if f.instance != "" {
				if err := health.ValidateInstanceID(f.instance); err != nil {
					errs = append(errs, "invalid --instance: "+err.Error())
				}
			}
			if f.instance != "" && f.dispatcher != "" {
				errs = append(errs, "invalid --instance: give --instance or --dispatcher, not both")
			}
			errs = append(errs, f.askedFlags(cmd.Flags())...)
			if len(errs) > 0 {
				return usagef("%s", strings.Join(errs, "\n"))
			}
			out := cmd.OutOrStdout()
			f.color = isTerminal(out) && os.Getenv("NO_COLOR") == ""
			if err := explain(cmd.Context(), f, out); err != nil {
				return failed(err)
			}
			return nil
		},
	}
	fs := cmd.Flags()
	fs.SortFlags = false
	fs.StringVar(&f.task, "task", "", "only this task type")
	fs.StringVar(&f.dispatcher, "dispatcher", "",
		"xDS node id: which executors does it route to, and why not the others")
	fs.StringVar(&f.instance, "instance", "",
		"one executor instance: every registration and every verdict")
	f.labels = flagx.Labels{}
	fs.StringVar(&f.versionConstraint, "version-constraint", "",
		"without a connected dispatcher: what one with this constraint would get, and why not "+
			"each executor (with --label, --datacenter)")
	fs.Var(f.labels, "label", "with --version-constraint: a label key=value the dispatcher "+
		"asks for (repeatable; alone, the question too)")
	fs.BoolVar(&f.orca, "orca", false,
		"read each executor's current load from its own ORCA report (gRPC executors "+
			"reporting it: adapters/loadreport) rather than the lease check's older output")
	fs.StringVar(&f.datacenter, "datacenter", "",
		"with --version-constraint: the dispatcher's datacenter (default: leasehold's own)")
	a.register(fs, "where to ask")
	filenameFlags(cmd, "admin-token-file", "tls-ca", "tls-cert", "tls-key")
	return cmd
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// askedFlags validates the constraint set of a question without a
// dispatcher, as a dispatcher's node metadata would be; errors name the flag.
func (f *explainFlags) askedFlags(fs *pflag.FlagSet) []string {
	f.asked = fs.Changed("version-constraint") || fs.Changed("label") ||
		fs.Changed("datacenter")
	if !f.asked {
		return nil
	}
	var errs []string
	if f.dispatcher != "" {
		errs = append(errs, "invalid --dispatcher: give --dispatcher (a connected one) or "+
			"--version-constraint/--label/--datacenter (one that is not), not both")
	}
	if _, err := health.NewDispatcher(f.versionConstraint, f.labels); err != nil {
		var fe health.FieldErrors
		if errors.As(err, &fe) {
			for _, e := range fe {
				flag := "--label"
				if e.Field == health.NodeMetaVersionConstraint {
					flag = "--version-constraint"
				}
				errs = append(errs, fmt.Sprintf("invalid %s: %s", flag, e.Error()))
			}
		} else {
			errs = append(errs, "invalid --version-constraint/--label: "+err.Error())
		}
	}
	if f.datacenter != "" {
		dc := health.NormalizeDatacenter(f.datacenter)
		if err := health.ValidateDatacenter("--datacenter", dc); err != nil {
			errs = append(errs, "invalid "+err.Error())
		}
	}
	return errs
}

// query is /debug/executors' question: the task type and the constraint
// set asked about.
func (f explainFlags) query() string {
	q := url.Values{}
	if f.task != "" {
		q.Set("task", f.task)
	}
	if f.asked {
		q.Set("version_constraint", f.versionConstraint)
		for _, k := range sortedLabelKeys(f.labels) {
			q.Add("label", k+"="+f.labels[k])
		}
		if f.datacenter != "" {
			q.Set("datacenter", f.datacenter)
		}
	}
	if len(q) == 0 {
		return ""
	}
	return "?" + q.Encode()
}

func explain(ctx context.Context, f explainFlags, w io.Writer) error {
	var ex server.ExplainExecutors
	if err := getJSON(ctx, f, "/debug/executors"+f.query(), &ex); err != nil {
		return err
	}
	var ds struct {
		Dispatchers []server.StreamInfo `json:"dispatchers"`
	}
	if err := getJSON(ctx, f, "/debug/dispatchers", &ds); err != nil {
		return err
	}
	// A task type no registration has is an error, as an unknown instance
	// is: an empty table would read as "no executor is eligible".
	if f.task != "" && ex.Tasks != nil && !slices.Contains(ex.Tasks, f.task) {
		return fmt.Errorf("--task %q: no such task type: no executor registers it (known: %s)",
			f.task, listOr(ex.Tasks, "none"))
	}
	if f.asked && ex.Asked == nil {
		return fmt.Errorf("the replica at %s does not answer questions without a connected "+
			"dispatcher (--version-constraint, --label, --datacenter): it runs an older leasehold",
			f.admin)
	}
	p := printer{w: w, color: f.color,
		loadMaxAge: time.Duration(ex.LoadMaxAgeSeconds * float64(time.Second)),
		askedORCA:  f.orca}
	if f.orca {
		shown := ex.Executors
		if f.instance != "" {
			shown = nil
			for _, e := range ex.Executors {
				if e.InstanceID == f.instance {
					shown = append(shown, e)
				}
			}
		}
		p.orca = orcaLoads(ctx, shown)
	}
	switch {
	case f.instance != "":
		return p.instance(ex, f.instance)
	case f.dispatcher != "":
		return p.dispatcher(ex, ds.Dispatchers, f.dispatcher)
	case f.asked:
		p.asked(ex, ds.Dispatchers)
		return nil
	default:
		p.overview(ex, ds.Dispatchers)
		return nil
	}
}

func sortedLabelKeys(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func listOr(xs []string, none string) string {
	if len(xs) == 0 {
		return none
	}
	return strings.Join(xs, ", ")
}

type printer struct {
	w          io.Writer
	color      bool
	loadMaxAge time.Duration  // how old LOAD can be; 0 from a replica that does not say
	orca       map[string]int // by orcaKey: tasks in flight the executor reported now
	askedORCA  bool           // --orca was given
}

func (p printer) route(v server.ExplainVerdict) string {
	text := v.Route
	if v.Reason != "" && v.Route != "DRAINING" {
		text = "no: " + v.Reason
	}
	if !p.color {
		return text
	}
	code := "31" // red
	switch v.Route {
	case "HEALTHY":
		code = "32"
	case "DRAINING":
		code = "33"
	}
	return "\x1b[" + code + "m" + text + "\x1b[0m"
}

func setLabel(cs server.ConstraintSet) string {
	var parts []string
	if cs.VersionConstraint != "" {
		parts = append(parts, "version "+cs.VersionConstraint)
	}
	keys := make([]string, 0, len(cs.Labels))
	for k := range cs.Labels {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		parts = append(parts, k+"="+cs.Labels[k])
	}
	if cs.Datacenter != "" {
		parts = append(parts, "in "+cs.Datacenter)
	}
	if len(parts) == 0 {
		return "unconstrained"
	}
	return strings.Join(parts, ", ")
}

func short(s string) string {
	if len(s) > 10 {
		return s[:10]
	}
	return s
}

// load is the executor's load of its capacity: "?" for the load when none
// has reached Consul yet (a replica older than load_reported says nothing).
func (p printer) load(e server.ExplainExecutor) string {
	if e.MetadataError != "" {
		return "-"
	}
	if n, ok := p.orca[orcaKey(e)]; ok {
		return fmt.Sprintf("%d/%d orca", n, e.Capacity)
	}
	if !e.LoadReported && p.loadMaxAge > 0 {
		return fmt.Sprintf("?/%d", e.Capacity)
	}
	return fmt.Sprintf("%d/%d", e.Load, e.Capacity)
}

// loadLong is load with where it comes from and how old it can be.
func (p printer) loadLong(e server.ExplainExecutor) string {
	if n, ok := p.orca[orcaKey(e)]; ok {
		return fmt.Sprintf("%d/%d (the executor's own ORCA report, read now)", n, e.Capacity)
	}
	switch {
	case p.loadMaxAge <= 0:
		return p.load(e)
	case !e.LoadReported:
		return fmt.Sprintf("?/%d (no load in the lease check's output yet)", e.Capacity)
	}
	return fmt.Sprintf("%s (the lease check's output: up to %s old)", p.load(e), p.loadMaxAge)
}

// loadNote says where LOAD comes from and how old it can be.
func (p printer) loadNote() {
	if p.loadMaxAge <= 0 {
		return
	}
	orca := "--orca reads it from executors that report it"
	if p.askedORCA {
		orca = "orca = the executor's own report, read now"
	}
	fmt.Fprintf(p.w, "\nLOAD: tasks in flight/capacity from the lease check's output, which "+
		"Consul syncs every\ncheck_update_interval: up to %s old (? = none reported yet). "+
		"Dispatchers weigh by\nthe current load, sent to them over ORCA (%s).\n",
		p.loadMaxAge, orca)
}

// overview prints every executor with its verdict for every constraint set
// in use.
func (p printer) overview(ex server.ExplainExecutors, ds []server.StreamInfo) {
	fmt.Fprintf(p.w, "Consul index %d; %d executors; %d dispatcher streams\n",
		ex.ConsulIndex, len(ex.Executors), len(ds))
	for i, cs := range ex.ConstraintSets {
		var nodes []string
		for _, d := range ds {
			if d.Group == cs.Key {
				nodes = append(nodes, d.NodeID)
			}
		}
		fmt.Fprintf(p.w, "  [%d] %s: %s\n", i, setLabel(cs), listOrNone(nodes))
	}
	p.rules(ex)
	if lines := nackLines(ds, ""); len(lines) > 0 {
		fmt.Fprintln(p.w, "\nNACKs (responses dispatchers rejected):")
		for _, l := range lines {
			fmt.Fprintln(p.w, "  "+l)
		}
	}
	p.dispatchOutcomes(ex.DispatchOutcomes)
	fmt.Fprintln(p.w)
	var t table
	head := []string{"TASK", "INSTANCE", "SESSION", "GEN",
		"VERSION", "STATE", "LOAD", "LEASE", "NODE"}
	for i := range ex.ConstraintSets {
		head = append(head, fmt.Sprintf("[%d]", i))
	}
	t.row(head...)
	for _, e := range ex.Executors {
		row := []string{e.Task, e.InstanceID, short(e.SessionID), fmt.Sprint(e.Generation),
			e.Version, e.State, p.load(e), e.LeaseCheck, e.NodeChecks}
		if e.MetadataError != "" {
			row = []string{e.Task, orDash(e.InstanceID), short(orDash(e.SessionID)),
				"-", orDash(e.Version), orDash(e.State), "-", "-", e.NodeChecks}
		}
		for _, v := range e.Verdicts {
			row = append(row, p.route(v))
		}
		t.row(row...)
	}
	t.write(p.w, "")
	p.loadNote()
}

// dispatchOutcomes prints each task type's recent dispatch failure rate as
// dispatchers reported their calls over LRS (nothing from a replica that
// has no LRS server).
func (p printer) dispatchOutcomes(d *server.DispatchOutcomes) {
	if d == nil {
		return
	}
	fmt.Fprintf(p.w, "\nDispatch outcomes over the last %s, per attempt as dispatchers "+
		"report them (LRS, every %s; %d reporting):\n",
		time.Duration(d.WindowSeconds*float64(time.Second)),
		time.Duration(d.IntervalSeconds*float64(time.Second)), d.Reporters)
	if len(d.Tasks) == 0 {
		fmt.Fprintln(p.w, "  none reported (a dispatcher reports for clusters with lrs_server)")
	}
	for _, r := range d.Tasks {
		rate := "no call completed"
		if r.FailureRate != nil {
			rate = fmt.Sprintf("failure rate %.1f%%", *r.FailureRate*100)
		}
		fmt.Fprintf(p.w, "  %s: %s (%d failed, %d succeeded), %d dropped, %d in flight\n",
			r.Task, rate, r.Failed, r.Succeeded, r.Dropped, r.InFlight)
	}
}

// rules prints the version of the rules in force and each task type's
// dispatch policy (what its dispatchers' xDS clients are told to keep).
func (p printer) rules(ex server.ExplainExecutors) {
	if ex.RulesVersion == "" {
		return // an older replica
	}
	fmt.Fprintf(p.w, "Rules version %s; dispatch policy:\n", ex.RulesVersion)
	for _, t := range sortedLabelKeys(ex.DispatchPolicy) {
		fmt.Fprintf(p.w, "  %s: %s\n", t, ex.DispatchPolicy[t])
	}
}

// dispatcher prints which executors one node routes to, and why not the
// others.
func (p printer) dispatcher(ex server.ExplainExecutors, ds []server.StreamInfo, node string) error {
	var stream *server.StreamInfo
	for i := range ds {
		if ds[i].NodeID == node {
			stream = &ds[i]
			break
		}
	}
	if stream == nil {
		return fmt.Errorf("--dispatcher %q: no such dispatcher: no connected xDS node has "+
			"this id (see leasehold dispatchers)", node)
	}
	idx := -1
	for i, cs := range ex.ConstraintSets {
		if cs.Key == stream.Group {
			idx = i
			fmt.Fprintf(p.w, "dispatcher %s (%s xDS): %s\n\n", node, stream.Mode, setLabel(cs))
		}
	}
	if idx < 0 {
		return fmt.Errorf("constraint set %q of %s not in the executor view", stream.Group, node)
	}
	p.routes(ex, idx)
	if ex.RulesVersion != "" {
		fmt.Fprintln(p.w)
		p.rules(ex)
	}
	for _, l := range nackLines([]server.StreamInfo{*stream}, node) {
		fmt.Fprintln(p.w, "\n"+l)
	}
	return nil
}

// asked prints what a dispatcher with the constraint set asked about would
// get, and why not each executor, whether or not one is connected.
func (p printer) asked(ex server.ExplainExecutors, ds []server.StreamInfo) {
	idx := *ex.Asked
	cs := ex.ConstraintSets[idx]
	// Streams are matched by their constraints, not the set's key, which also
	// holds a stream's grant (under an authorization policy).
	var nodes []string
	for _, d := range ds {
		if d.Group == cs.Key || (d.VersionConstraint == cs.VersionConstraint &&
			maps.Equal(d.Labels, cs.Labels) && d.Datacenter == cs.Datacenter) {
			nodes = append(nodes, d.NodeID)
		}
	}
	who := "no dispatcher with it is connected; one would get"
	if len(nodes) > 0 {
		who = "the constraint set of " + strings.Join(nodes, ", ") + ", which get"
	}
	fmt.Fprintf(p.w, "a dispatcher with %s: %s\n\n", setLabel(cs), who)
	p.routes(ex, idx)
}

// routes prints every executor's verdict for constraint set idx, the routed
// first, with why.
func (p printer) routes(ex server.ExplainExecutors, idx int) {
	rows := append([]server.ExplainExecutor(nil), ex.Executors...)
	rank := map[string]int{"HEALTHY": 0, "DRAINING": 1, "NONE": 2}
	sort.SliceStable(rows, func(i, j int) bool {
		return rank[rows[i].Verdicts[idx].Route] < rank[rows[j].Verdicts[idx].Route]
	})
	var t table
	t.row("ROUTE", "TASK", "INSTANCE", "SESSION", "VERSION", "LOAD", "WHY")
	for _, e := range rows {
		v := e.Verdicts[idx]
		why := v.Detail
		if v.Route == "HEALTHY" {
			why = fmt.Sprintf("weight %d (capacity; current load over ORCA)",
				min(max(e.Capacity, 1), 128))
		}
		why += observedText(v)
		t.row(p.route(v), e.Task, orDash(e.InstanceID), short(orDash(e.SessionID)),
			orDash(e.Version), p.load(e), why)
	}
	if len(rows) == 0 {
		fmt.Fprintln(p.w, "no executor is registered")
		return
	}
	t.write(p.w, "")
	p.loadNote()
}

// nackLines describe the last NACK of every stream and type, sorted. With
// node set they are only that node's, without repeating its id.
func nackLines(ds []server.StreamInfo, node string) []string {
	var out []string
	for _, d := range ds {
		types := make([]string, 0, len(d.Types))
		for typ := range d.Types {
			types = append(types, typ)
		}
		sort.Strings(types)
		for _, typ := range types {
			t := d.Types[typ]
			n := t.LastNack
			if n == nil {
				continue
			}
			who := d.NodeID + ": "
			if node != "" {
				who = ""
			}
			after := "not ACKed since"
			if t.LastAcked != "" && t.AckedAt.After(n.At) {
				after = "a later version " + t.LastAcked + " was ACKed"
			}
			out = append(out,
				fmt.Sprintf("%slast NACK of %s (version %s, reason %s, %d on this stream; %s): %s",
					who, typ[strings.LastIndex(typ, ".")+1:], n.Version,
					orDash(n.Reason), max(t.Nacks, 1), after, n.Detail))
		}
	}
	return out
}

// instance prints every registration of one instance, with every verdict.
func (p printer) instance(ex server.ExplainExecutors, instance string) error {
	found := false
	for _, e := range ex.Executors {
		if e.InstanceID != instance {
			continue
		}
		found = true
		fmt.Fprintf(p.w, "%s on task %s (service %s, node %s)\n",
			instance, e.Task, e.ServiceID, e.Node)
		tw := tabwriter.NewWriter(p.w, 0, 4, 2, ' ', 0)
		for _, kv := range [][2]string{
			{"session", fmt.Sprintf("%s (generation %d)", e.SessionID, e.Generation)},
			{"address", fmt.Sprintf("%s:%d", e.Address, e.Port)},
			{"version", e.Version}, {"state", e.State}, {"load", p.loadLong(e)},
			{"lease check", e.LeaseCheck}, {"node checks", e.NodeChecks},
			{"other checks", orDash(e.OtherChecks)},
			{"labels", labelsText(e.Labels)},
		} {
			fmt.Fprintf(tw, "  %s:\t%s\n", kv[0], kv[1])
		}
		if len(e.Replaces) > 0 {
			fmt.Fprintf(tw, "  replaces:\t%s\n", strings.Join(e.Replaces, ", "))
		}
		if e.Datacenter != "" {
			fmt.Fprintf(tw, "  datacenter:\t%s\n", e.Datacenter)
		}
		if e.Reach != "" {
			fmt.Fprintf(tw, "  datacenter reach:\t%s\n", e.Reach)
		}
		if e.MetadataError != "" {
			fmt.Fprintf(tw, "  metadata error:\t%s\n", e.MetadataError)
		}
		if e.CordonHeld != "" {
			fmt.Fprintf(tw, "  cordon held:\t%s selects it, but the safety limit keeps it routed\n",
				e.CordonHeld)
		}
		tw.Flush()
		for i, v := range e.Verdicts {
			fmt.Fprintf(p.w, "  [%d] %s: %s", i, setLabel(ex.ConstraintSets[i]), p.route(v))
			if ex.ConstraintSets[i].Hypothetical {
				fmt.Fprint(p.w, " (asked: no dispatcher with it is connected)")
			}
			if v.Cluster != "" {
				fmt.Fprintf(p.w, " in shard %s", v.Cluster)
			}
			if v.Detail != "" {
				fmt.Fprintf(p.w, " — %s", v.Detail)
			}
			fmt.Fprint(p.w, observedText(v))
			fmt.Fprintln(p.w)
		}
		fmt.Fprintln(p.w)
	}
	if !found {
		return fmt.Errorf("--instance %q: no such instance: no registration of it is known",
			instance)
	}
	return nil
}

func labelsText(m map[string]string) string {
	if len(m) == 0 {
		return "-"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + m[k]
	}
	return strings.Join(parts, ",")
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func listOrNone(xs []string) string {
	if len(xs) == 0 {
		return "no dispatcher"
	}
	return strings.Join(xs, ", ")
}

// observedText names the rules in observe mode that would have excluded.
func observedText(v server.ExplainVerdict) string {
	if len(v.WouldExclude) == 0 {
		return ""
	}
	var parts []string
	for _, x := range v.WouldExclude {
		parts = append(parts, string(x.Reason)+": "+x.Detail)
	}
	return " [observe mode, would exclude: " + strings.Join(parts, "; ") + "]"
}

// adminHTTPS is a client for an admin port served over TLS; errors name
// the flag.
func adminHTTPS(caFile, certFile, keyFile string) (*http.Client, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("invalid --tls-ca: %v", err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("invalid --tls-ca: no PEM certificate in %s", caFile)
		}
	}
	if (certFile == "") != (keyFile == "") {
		return nil, errors.New("invalid --tls-cert/--tls-key: give both or neither")
	}
	if certFile != "" {
		pair, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("invalid --tls-cert/--tls-key: %v", err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return &http.Client{Transport: &http.Transport{TLSClientConfig: cfg},
		Timeout: 10 * time.Second}, nil
}
