package snapshot

import (
	"fmt"
	"sort"
	"strings"

	"github.com/leasehold/leasehold/health"
)

// Readiness is whether the syncer is ready and, when it is not, why: what
// /readyz says.
type Readiness struct {
	Ready bool
	// Reason is ReasonFirstRead or a health.ContactProblem:
	// "consul_unreachable", "acl" (a right is missing) or "tls".
	Reason string
	// Detail is what is pending, the error, the missing rights (Consul
	// policy rules) or the certificate problem.
	Detail string
	// Source is whose read it is: ControlSource, or a datacenter ("" with
	// one, unnamed).
	Source string
}

const (
	// ReasonFirstRead: the whole fleet (or the operators' controls) has
	// not been read yet.
	ReasonFirstRead = "first_read_pending"
	// ControlSource names the watch of the operators' controls (rules and
	// cordons) as a Readiness source.
	ControlSource = "operator controls"
)

// readiness is what the Syncer knows of its reads' failures (owned by Run).
type readiness struct {
	failure    map[string]health.Contact // per failing datacenter: the failure as last reported
	ctlRead    bool                      // the control watch answered once
	ctlFailure *health.Contact           // the control watch's failure, while it fails
}

// noteContact records a datacenter watch's contact report.
func (s *Syncer) noteContact(dc string, c health.Contact) {
	if s.rd.failure == nil {
		s.rd.failure = map[string]health.Contact{}
	}
	if c.OK {
		delete(s.rd.failure, dc)
		return
	}
	if c.Problem == "" {
		c.Problem = health.ProblemUnreachable
	}
	if c.Detail == "" && c.Err != nil {
		c.Detail = c.Err.Error()
	}
	s.rd.failure[dc] = c
}

// applyControlContact records the control watch's contact report.
func (s *Syncer) applyControlContact(c health.Contact) {
	if c.OK {
		if s.rd.ctlFailure != nil {
			s.log.Info("operator controls read again", "prefix", "leasehold/control/")
		}
		s.rd.ctlRead, s.rd.ctlFailure = true, nil
		return
	}
	if c.Problem == "" {
		c.Problem = health.ProblemUnreachable
	}
	if c.Detail == "" && c.Err != nil {
		c.Detail = c.Err.Error()
	}
	s.rd.ctlFailure = &c
	s.log.Warn(contactMessage(c.Problem)+" (operator controls: the rules and cordons last read stay in force)", "problem", c.Problem, "err", c.Err)
}

// controlOK: the operators' controls are read (when a control watch runs).
func (s *Syncer) controlOK() bool {
	return s.rd.ctlFailure == nil && (s.rd.ctlRead || !s.cfg.AwaitControl)
}

// contactMessage is the log message of a failed read.
func contactMessage(p health.ContactProblem) string {
	switch p {
	case health.ProblemACL:
		return "consul ACL: a right is missing; serving the last known snapshot"
	case health.ProblemTLS:
		return "consul TLS handshake failed; serving the last known snapshot"
	}
	return "consul unreachable: serving the last known snapshot"
}

// storeReadiness decides readiness (the whole fleet read once, Consul
// answering, the operators' controls read) and publishes it with its reason.
func (s *Syncer) storeReadiness() {
	r := s.readiness()
	s.readyWhy.Store(&r)
	s.ready.Store(r.Ready)
}

func (s *Syncer) readiness() Readiness {
	if s.synced && s.anyReachable() && s.controlOK() {
		return Readiness{Ready: true}
	}
	rank := map[health.ContactProblem]int{health.ProblemACL: 3, health.ProblemTLS: 2, health.ProblemUnreachable: 1}
	var worst *Readiness
	consider := func(source string, c health.Contact) {
		if worst == nil || rank[c.Problem] > rank[health.ContactProblem(worst.Reason)] {
			worst = &Readiness{Reason: string(c.Problem), Detail: c.Detail, Source: source}
		}
	}
	if c := s.rd.ctlFailure; c != nil {
		consider(ControlSource, *c)
	}
	dcs := make([]string, 0, len(s.rd.failure))
	for dc := range s.rd.failure {
		dcs = append(dcs, dc)
	}
	sort.Strings(dcs)
	for _, dc := range dcs {
		consider(dc, s.rd.failure[dc])
	}
	// With several datacenters one failing leaves leasehold ready (its
	// executors' reach says the rest); a failure is the reason only when
	// readiness needs what failed — the control watch, or every datacenter
	// when none answers, or any before the first read.
	if worst != nil && (s.rd.ctlFailure != nil || !s.anyReachable() || !s.synced) {
		return *worst
	}
	return Readiness{Reason: ReasonFirstRead, Detail: s.pendingReads()}
}

// pendingReads says what the first read still waits for.
func (s *Syncer) pendingReads() string {
	var pending []string
	if s.cfg.AwaitControl && !s.rd.ctlRead {
		pending = append(pending, "the operators' controls (Consul KV leasehold/control/)")
	}
	for _, name := range s.dcNames() {
		d := s.dcs[name]
		if d.reach == health.Lost {
			continue
		}
		var what []string
		if d.tasks == nil {
			what = append(what, "the task types")
		} else {
			n := 0
			for _, task := range d.tasks {
				if _, ok := s.members[fleetKey{name, task}]; !ok {
					n++
				}
			}
			if n > 0 {
				what = append(what, fmt.Sprintf("the members of %d of %d task types", n, len(d.tasks)))
			}
		}
		if !d.haveNP {
			what = append(what, "the non-passing checks")
		}
		if !d.haveGen {
			what = append(what, "the generation keys")
		}
		if len(what) > 0 {
			where := ""
			if name != "" {
				where = " in " + name
			}
			pending = append(pending, strings.Join(what, ", ")+where)
		}
	}
	if len(pending) == 0 {
		return "Consul has not answered yet"
	}
	return "waiting for " + strings.Join(pending, "; ")
}

// Readiness is Ready with its reason. Safe from any goroutine.
func (s *Syncer) Readiness() Readiness {
	if r := s.readyWhy.Load(); r != nil {
		return *r
	}
	return Readiness{Reason: ReasonFirstRead, Detail: "Consul has not answered yet"}
}
