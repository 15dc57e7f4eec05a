package health

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"
)

// The address rules. Both always exclude (they are not ObservableRules): a
// load assignment holding such an endpoint is rejected whole by a client, so
// routing it would stop every later change of its task type — lapses
// included — from reaching that client.
const (
	// ReasonAddressNotIP means the registration's address is a host name. Envoy
	// takes only IP addresses in an EDS socket_address, and leasehold does
	// not resolve names, so routing never depends on DNS answers.
	ReasonAddressNotIP Reason = "address-not-ip"
	// ReasonDuplicateAddress means another registration of the task routed to
	// the same constraint set claims the same address:port, and grpc-go
	// rejects a load assignment with two endpoints at one address. One of
	// them is sent (Claim.Beats); the others are excluded with this reason.
	ReasonDuplicateAddress Reason = "duplicate-address"
)

// ValidateIP checks that an address ValidateHost accepts is an IP address,
// which is what dispatchers can take. It reports nothing ValidateHost
// reports, so a field is never named twice.
func ValidateIP(v string) *FieldError {
	if ValidateHost(v) != nil || net.ParseIP(v) != nil {
		return nil
	}
	return fieldErr("address", v,
		"a host name, not an IP address: dispatchers take only IP addresses in EDS (Envoy "+
			"rejects the whole assignment otherwise) and leasehold does not resolve names; "+
			"register the executor's reachable IP")
}

// addressRule excludes registrations whose address is not an IP address;
// it comes right after bad metadata: such a registration is never routable.
func addressRule(e *Executor, _ Dispatcher) (Verdict, bool) {
	if net.ParseIP(e.Address) != nil {
		return Verdict{}, false
	}
	detail := "address: not an IP address"
	if fe := ValidateIP(e.Address); fe != nil {
		detail = fe.Error()
	}
	return Verdict{Route: RouteNone, Reason: ReasonAddressNotIP, Detail: detail}, true
}

// Socket identifies what an endpoint dials: one IP address spelled two ways
// (10.0.0.1 and ::ffff:10.0.0.1) is one socket.
type Socket struct {
	IP   netip.Addr
	Host string // when the address is not an IP address
	Port int
}

// SocketOf is the socket of an address and port.
func SocketOf(address string, port int) Socket {
	if ip, err := netip.ParseAddr(address); err == nil {
		return Socket{IP: ip.Unmap().WithZone(""), Port: port}
	}
	return Socket{Host: address, Port: port}
}

// Claim is what decides which of several routed registrations of one task
// type claiming one socket becomes its endpoint.
type Claim struct {
	InstanceID, SessionID, Node, ServiceID string
	Generation, CreateIndex                uint64
}

// ClaimOf is e's claim on its socket.
func ClaimOf(e *Executor) Claim {
	return Claim{InstanceID: e.InstanceID, SessionID: e.SessionID, Node: e.Node,
		ServiceID: e.ServiceID, Generation: e.Generation, CreateIndex: e.CreateIndex}
}

// Beats reports whether c is kept over o. Of two instances, the one that
// claimed the socket first (the lower CreateIndex) keeps it — stable while
// both stay routed, the same on every replica, and a later claim (any token
// that may register the task type can write one: addresses are not an
// instance's to prove) never takes an established executor's work —, then
// the lowest instance id. Of one instance its newest session, ordered as
// Fence orders them (generation, then CreateIndex, then session id): the
// process most likely listening there. Node and service id settle the
// rest, so the order is total.
func (c Claim) Beats(o Claim) bool {
	switch {
	case c.InstanceID != o.InstanceID && c.CreateIndex != o.CreateIndex:
		return c.CreateIndex < o.CreateIndex
	case c.InstanceID != o.InstanceID:
		return c.InstanceID < o.InstanceID
	case c.Generation != o.Generation || c.CreateIndex != o.CreateIndex ||
		c.SessionID != o.SessionID:
		return newer(c.Generation, c.CreateIndex, c.SessionID, o.Generation, o.CreateIndex,
			o.SessionID)
	case c.Node != o.Node:
		return c.Node < o.Node
	}
	return c.ServiceID < o.ServiceID
}

// DuplicateVerdict is the verdict on a routed registration whose socket the
// registration kept also claims.
func DuplicateVerdict(e *Executor, kept Claim) Verdict {
	return Verdict{Route: RouteNone, Reason: ReasonDuplicateAddress, Detail: fmt.Sprintf(
		"%s is also claimed by %s (session %s, node %s), which is sent instead: one endpoint per "+
			"address:port (grpc-go rejects duplicates); the first to claim it is kept (the lower "+
			"CreateIndex, then the lower instance id), and of one instance its newest session",
		net.JoinHostPort(e.Address, strconv.Itoa(e.Port)), kept.InstanceID, kept.SessionID,
		kept.Node)}
}

// ExcludeDuplicates applies the duplicate-address rule to the verdicts
// vs[i] on es[i] for one constraint set: of the routed registrations of a
// task type claiming one socket, only the one whose claim beats the others'
// stays routed.
func ExcludeDuplicates(es []Executor, vs []Verdict) {
	type key struct {
		task string
		s    Socket
	}
	kept := map[key]int{}
	routed := 0
	for i := range es {
		if vs[i].Route == RouteNone {
			continue
		}
		routed++
		k := key{es[i].Task, SocketOf(es[i].Address, es[i].Port)}
		if j, ok := kept[k]; !ok || ClaimOf(&es[i]).Beats(ClaimOf(&es[j])) {
			kept[k] = i
		}
	}
	if len(kept) == routed {
		return // no socket claimed twice
	}
	for i := range es {
		if vs[i].Route == RouteNone {
			continue
		}
		if j := kept[key{es[i].Task, SocketOf(es[i].Address, es[i].Port)}]; j != i {
			vs[i] = DuplicateVerdict(&es[i], ClaimOf(&es[j]))
		}
	}
}
