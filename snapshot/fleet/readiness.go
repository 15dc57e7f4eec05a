package fleet

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
	// Source is whose reads failed: ControlSource, datacenters, "fleet"
	// (the one, unnamed datacenter's watches) when others failed too,
	// comma-separated ("" for the unnamed datacenter's alone).
	Source string
}

const (
	// ReasonFirstRead means the whole fleet (or the operators' controls) has
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
	s.log.Warn(contactMessage(c.Problem, s.synced)+
		" (operator controls: the rules and cordons last read stay in force)",
		"problem", c.Problem, "err", c.Err)
}

// controlOK reports whether the operators' controls are read (when a control
// watch runs).
func (s *Syncer) controlOK() bool {
	return s.rd.ctlFailure == nil && (s.rd.ctlRead || !s.cfg.AwaitControl)
}

// contactMessage is the log message of a failed read; served says whether a
// snapshot was served yet (before, there is no last known one to serve).
func contactMessage(p health.ContactProblem, served bool) string {
	what, then := "consul unreachable: ", "serving the last known snapshot"
	switch p {
	case health.ProblemACL:
		what = "consul ACL: a right is missing; "
	case health.ProblemTLS:
		what = "consul TLS handshake failed; "
	}
	if !served {
		then = "nothing served yet (the fleet is not read)"
	}
	return what + then
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
	// The failures readiness waits on: the control watch's, and the
	// datacenters' before the first read or when none answers (with
	// several, one failing leaves leasehold ready: its executors' reach
	// says the rest).
	type failure struct {
		source string
		c      health.Contact
	}
	var failures []failure
	if c := s.rd.ctlFailure; c != nil {
		failures = append(failures, failure{ControlSource, *c})
	}
	if !s.synced || !s.anyReachable() {
		dcs := make([]string, 0, len(s.rd.failure))
		for dc := range s.rd.failure {
			dcs = append(dcs, dc)
		}
		sort.Strings(dcs)
		for _, dc := range dcs {
			failures = append(failures, failure{dc, s.rd.failure[dc]})
		}
	}
	if len(failures) == 0 {
		return Readiness{Reason: ReasonFirstRead, Detail: s.pendingReads()}
	}
	// The kind that tells most (a missing right, a certificate problem,
	// an unreachable Consul); every right missing anywhere, else the first
	// failure's detail.
	rank := map[health.ContactProblem]int{
		health.ProblemACL: 3, health.ProblemTLS: 2, health.ProblemUnreachable: 1,
	}
	top := failures[0].c.Problem
	for _, f := range failures {
		if rank[f.c.Problem] > rank[top] {
			top = f.c.Problem
		}
	}
	r := Readiness{Reason: string(top)}
	var sources, details []string
	for _, f := range failures {
		if f.c.Problem != top {
			continue
		}
		src := f.source
		if src == "" {
			src = "fleet" // the one, unnamed datacenter's watches
		}
		sources = append(sources, src)
		details = append(details, f.c.Detail)
	}
	r.Detail = details[0]
	if top == health.ProblemACL {
		r.Detail = joinRights(details)
	}
	if r.Source = strings.Join(sources, ", "); r.Source == "fleet" {
		r.Source = "" // one datacenter, unnamed
	}
	return r
}

// joinRights is every missing right of details (each rights joined by
// " and ", as Contact.Detail carries them), once, sorted.
func joinRights(details []string) string {
	seen := map[string]bool{}
	var rights []string
	for _, d := range details {
		for _, r := range strings.Split(d, " and ") {
			if r != "" && !seen[r] {
				seen[r] = true
				rights = append(rights, r)
			}
		}
	}
	sort.Strings(rights)
	return strings.Join(rights, " and ")
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
				what = append(what,
					fmt.Sprintf("the members of %d of %d task types", n, len(d.tasks)))
			}
		}
		if !d.haveNP {
			what = append(what, "the non-passing checks")
		}
		if !d.haveGen {
			what = append(what, "the generation keys")
		}
		if s.cfg.AwaitLapses && !d.haveMarks {
			what = append(what, "the lapse marks")
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
