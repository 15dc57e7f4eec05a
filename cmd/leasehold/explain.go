package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
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
	token                             string       // bearer token for a guarded admin port
	client                            *http.Client // HTTPS with --tls-ca/--tls-cert/--tls-key
	color                             bool
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
dispatcher's (--dispatcher) or one executor's (--instance).`,
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

func getJSON(ctx context.Context, f explainFlags, path string, v any) error {
	status, b, err := adminGet(ctx, f, path)
	if err != nil {
		return err
	}
	if status != http.StatusOK {
		return fmt.Errorf("%s: %d %s: %s", path, status, http.StatusText(status),
			strings.TrimSpace(string(b[:min(len(b), 4096)])))
	}
	return json.Unmarshal(b, v)
}

// getJSONStatus is getJSON for a path whose every status carries a JSON
// body (/readyz answers 503 with its reason).
func getJSONStatus(ctx context.Context, f explainFlags, path string, v any) (int, error) {
	status, b, err := adminGet(ctx, f, path)
	if err != nil {
		return 0, err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return 0, fmt.Errorf("%s: %d %s: %w", path, status, http.StatusText(status), err)
	}
	return status, nil
}

// adminGet reads path from the replica's admin port.
func adminGet(ctx context.Context, f explainFlags, path string) (int, []byte, error) {
	base := f.admin
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	scheme, client := "http://", http.DefaultClient
	if f.client != nil {
		scheme, client = "https://", f.client
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, scheme+base+path, nil)
	if err != nil {
		return 0, nil, err
	}
	if f.token != "" {
		req.Header.Set("Authorization", "Bearer "+f.token)
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, nil, fmt.Errorf("admin API at %s: %w", base, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, nil, fmt.Errorf("%s: %w", path, err)
	}
	return resp.StatusCode, b, nil
}

func explain(ctx context.Context, f explainFlags, w io.Writer) error {
	var ex server.ExplainExecutors
	path := "/debug/executors"
	if f.task != "" {
		path += "?task=" + url.QueryEscape(f.task)
	}
	if err := getJSON(ctx, f, path, &ex); err != nil {
		return err
	}
	var ds struct {
		Dispatchers []server.StreamInfo `json:"dispatchers"`
	}
	if err := getJSON(ctx, f, "/debug/dispatchers", &ds); err != nil {
		return err
	}
	p := printer{w: w, color: f.color}
	switch {
	case f.instance != "":
		return p.instance(ex, f.instance)
	case f.dispatcher != "":
		return p.dispatcher(ex, ds.Dispatchers, f.dispatcher)
	default:
		p.overview(ex, ds.Dispatchers)
		return nil
	}
}

type printer struct {
	w     io.Writer
	color bool
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

func load(e server.ExplainExecutor) string { return fmt.Sprintf("%d/%d", e.Load, e.Capacity) }

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
	if lines := nackLines(ds, ""); len(lines) > 0 {
		fmt.Fprintln(p.w, "\nNACKs (responses dispatchers rejected):")
		for _, l := range lines {
			fmt.Fprintln(p.w, "  "+l)
		}
	}
	fmt.Fprintln(p.w)
	tw := tabwriter.NewWriter(p.w, 0, 4, 2, ' ', 0)
	head := []string{"TASK", "INSTANCE", "SESSION", "GEN",
		"VERSION", "STATE", "LOAD", "LEASE", "NODE"}
	for i := range ex.ConstraintSets {
		head = append(head, fmt.Sprintf("[%d]", i))
	}
	fmt.Fprintln(tw, strings.Join(head, "\t"))
	for _, e := range ex.Executors {
		row := []string{e.Task, e.InstanceID, short(e.SessionID), fmt.Sprint(e.Generation),
			e.Version, e.State, load(e), e.LeaseCheck, e.NodeChecks}
		if e.MetadataError != "" {
			row = []string{e.Task, orDash(e.InstanceID), short(orDash(e.SessionID)),
				"-", orDash(e.Version), orDash(e.State), "-", "-", e.NodeChecks}
		}
		for _, v := range e.Verdicts {
			row = append(row, p.route(v))
		}
		fmt.Fprintln(tw, strings.Join(row, "\t"))
	}
	tw.Flush()
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
		return fmt.Errorf("--dispatcher %q: no connected xDS node with "+
			"this id (see /debug/dispatchers)", node)
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
	rows := append([]server.ExplainExecutor(nil), ex.Executors...)
	rank := map[string]int{"HEALTHY": 0, "DRAINING": 1, "NONE": 2}
	sort.SliceStable(rows, func(i, j int) bool {
		return rank[rows[i].Verdicts[idx].Route] < rank[rows[j].Verdicts[idx].Route]
	})
	tw := tabwriter.NewWriter(p.w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ROUTE\tTASK\tINSTANCE\tSESSION\tVERSION\tLOAD\tWHY")
	for _, e := range rows {
		v := e.Verdicts[idx]
		why := v.Detail
		if v.Route == "HEALTHY" {
			why = fmt.Sprintf("weight %d (capacity; current load over ORCA)",
				min(max(e.Capacity, 1), 128))
		}
		why += observedText(v)
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", p.route(v), e.Task,
			orDash(e.InstanceID), short(orDash(e.SessionID)), orDash(e.Version), load(e), why)
	}
	tw.Flush()
	for _, l := range nackLines([]server.StreamInfo{*stream}, node) {
		fmt.Fprintln(p.w, "\n"+l)
	}
	return nil
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
			{"version", e.Version}, {"state", e.State}, {"load", load(e)},
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
			if v.Detail != "" {
				fmt.Fprintf(p.w, " — %s", v.Detail)
			}
			fmt.Fprint(p.w, observedText(v))
			fmt.Fprintln(p.w)
		}
		fmt.Fprintln(p.w)
	}
	if !found {
		return fmt.Errorf("--instance %q: no registration of this instance is known", instance)
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
