package main

import (
	"context"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/leasehold/leasehold/server"
)

func newDispatchersCmd() *cobra.Command {
	var (
		a adminFlags
		f explainFlags
	)
	cmd := &cobra.Command{
		Use:   "dispatchers",
		Short: "list the connected dispatchers, what they ACKed and NACKed, and refused streams",
		Long: `Ask a leasehold replica (its admin port, /debug/dispatchers) for its connected
xDS dispatchers: node id, constraint set, datacenter, per resource type the
version sent and ACKed, the last NACK with its reason; and the streams it
refused recently, with why.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if errs := a.explainFlags(cmd.Flags(), &f); len(errs) > 0 {
				return usagef("%s", strings.Join(errs, "\n"))
			}
			if err := dispatchers(cmd.Context(), f, cmd.OutOrStdout()); err != nil {
				return failed(err)
			}
			return nil
		},
	}
	cmd.Flags().SortFlags = false
	a.register(cmd.Flags(), "where to ask")
	filenameFlags(cmd, "admin-token-file", "tls-ca", "tls-cert", "tls-key")
	return cmd
}

func dispatchers(ctx context.Context, f explainFlags, w io.Writer) error {
	var d server.DebugDispatchers
	if err := getJSON(ctx, f, "/debug/dispatchers", &d); err != nil {
		return err
	}
	ds := slices.Clone(d.Dispatchers)
	slices.SortFunc(ds, func(a, b server.StreamInfo) int {
		return strings.Compare(a.NodeID+"\x00"+a.Mode, b.NodeID+"\x00"+b.Mode)
	})
	local := "leasehold's own"
	if d.LocalDatacenter != "" {
		local = d.LocalDatacenter + " (leasehold's own)"
	}
	fmt.Fprintf(w, "%d dispatcher streams\n", len(ds))
	if len(ds) > 0 {
		var t table
		t.row("NODE", "MODE", "CONSTRAINTS", "DATACENTER", "GRANTED", "PEER", "AGE")
		for _, s := range ds {
			dc := local
			if s.Datacenter != "" {
				dc = s.Datacenter
			}
			granted := "every task type"
			if s.GrantedTasks != nil {
				granted = listOr(s.GrantedTasks, "none")
			}
			cs := setLabel(server.ConstraintSet{VersionConstraint: s.VersionConstraint,
				Labels: s.Labels})
			t.row(s.NodeID, s.Mode, cs, dc, granted, orDash(s.Peer),
				(time.Duration(s.AgeSec) * time.Second).String())
		}
		fmt.Fprintln(w)
		t.write(w, "  ")
		fmt.Fprintln(w, "\nper resource type:")
		var rt table
		rt.row("NODE", "TYPE", "SUBSCRIBED", "SENT", "ACKED", "NACKS", "LAST NACK")
		for _, s := range ds {
			for _, typ := range slices.Sorted(maps.Keys(s.Types)) {
				ti := s.Types[typ]
				nack := "-"
				if n := ti.LastNack; n != nil {
					nack = fmt.Sprintf("version %s at %s, reason %s: %s", n.Version,
						n.At.UTC().Format(time.RFC3339), orDash(n.Reason), n.Detail)
				}
				rt.row(s.NodeID, typ[strings.LastIndex(typ, ".")+1:],
					subscribedText(ti), orDash(ti.LastSent), orDash(ti.LastAcked),
					fmt.Sprint(ti.Nacks), nack)
			}
		}
		rt.write(w, "  ")
	}
	fmt.Fprintf(w, "\n%d streams refused since the start", d.RefusedTotal)
	if len(d.Refused) == 0 {
		fmt.Fprintln(w)
		return nil
	}
	fmt.Fprintln(w, "; the latest of each kind, newest first:")
	var t table
	t.row("LAST", "COUNT", "NODE", "IDENTITY", "PEER", "MODE", "REASON", "WHY")
	for _, r := range d.Refused {
		t.row(r.Last.UTC().Format(time.RFC3339), fmt.Sprint(r.Count), orDash(r.NodeID),
			orDash(r.Identity), orDash(r.Peer), r.Mode, r.Reason, r.Detail)
	}
	t.write(w, "  ")
	return nil
}

// subscribedText is what a stream's type follows: "*" for a wildcard (with
// the names it also gave), its names, or "none" (a state-of-the-world
// stream that named resources and then none subscribes nothing).
func subscribedText(ti *server.TypeInfo) string {
	if ti.Wildcard {
		return strings.Join(append([]string{"*"}, ti.Subscribed...), ", ")
	}
	return listOr(ti.Subscribed, "none")
}
