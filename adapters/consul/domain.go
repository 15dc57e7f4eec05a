package consul

import (
	"fmt"
	"sort"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// member converts a health entry into the domain's Member, parsing the
// contract; bad metadata is kept (with Err) so it is shown and counted.
// Strings that repeat across a listing's entries (node names, statuses,
// node checks and their outputs) are kept once through in (nil: not
// interned): the decoder allocates each occurrence, and at 10,000 members
// the copies held ~1.3 MB.
func member(task string, e *api.ServiceEntry, in interner) health.Member {
	addr := e.Service.Address
	if addr == "" {
		addr = e.Node.Address // Consul's rule: no service address means the node's
	}
	reg, err := health.ParseRegistration(task, in.of(addr), e.Service.Port, e.Service.Meta)
	node := in.of(e.Node.Node)
	m := health.Member{Observed: health.Observed{
		Registration: reg, ServiceID: e.Service.ID, Node: node,
		CreateIndex: e.Service.CreateIndex,
	}}
	if err != nil {
		m.Err = fmt.Errorf("registration %s on node %s: %w", e.Service.ID, e.Node.Node, err)
	}
	m.Checks = make([]health.CheckState, 0, len(e.Checks))
	for _, c := range e.Checks {
		cs := checkState(c)
		cs.Node, cs.Status, cs.Output = in.of(cs.Node), health.CheckStatus(in.of(string(cs.Status))),
			in.of(cs.Output)
		switch cs.ServiceID {
		case "":
			cs.CheckID = in.of(cs.CheckID) // a node's check: the same on each of its members
		case m.ServiceID:
			cs.ServiceID = m.ServiceID
		}
		m.Checks = append(m.Checks, cs)
	}
	sortChecks(m.Checks)
	return m
}

// interner keeps one copy of each string it is given (one listing's).
type interner map[string]string

func (in interner) of(s string) string {
	if in == nil {
		return s
	}
	if v, ok := in[s]; ok {
		return v
	}
	in[s] = s
	return s
}

func checkState(c *api.HealthCheck) health.CheckState {
	return health.CheckState{
		Node:        c.Node,
		CheckID:     c.CheckID,
		ServiceID:   c.ServiceID,
		Status:      health.CheckStatus(c.Status),
		Output:      c.Output,
		ModifyIndex: c.ModifyIndex,
		CreateIndex: c.CreateIndex,
	}
}

func sortChecks(cs []health.CheckState) {
	sort.Slice(cs, func(i, j int) bool {
		if cs[i].Node != cs[j].Node {
			return cs[i].Node < cs[j].Node
		}
		return cs[i].CheckID < cs[j].CheckID
	})
}
