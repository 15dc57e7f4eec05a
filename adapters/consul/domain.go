package consul

import (
	"fmt"
	"sort"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// member converts a health entry into the domain's Member, parsing the
// contract; bad metadata is kept (with Err) so it is shown and counted.
func member(task string, e *api.ServiceEntry) health.Member {
	addr := e.Service.Address
	if addr == "" {
		addr = e.Node.Address // Consul's rule: no service address means the node's
	}
	reg, err := health.ParseRegistration(task, addr, e.Service.Port, e.Service.Meta)
	m := health.Member{Executor: health.Executor{
		Registration: reg, ServiceID: e.Service.ID, Node: e.Node.Node,
		CreateIndex: e.Service.CreateIndex,
	}}
	if err != nil {
		m.Err = fmt.Errorf("registration %s on node %s: %w", e.Service.ID, e.Node.Node, err)
	}
	for _, c := range e.Checks {
		m.Checks = append(m.Checks, checkState(c))
	}
	sortChecks(m.Checks)
	return m
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
