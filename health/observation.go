package health

import "time"

// Observations are what the Consul watch reports, in domain terms: the
// members of each task type (with every check at the time they were read) and,
// separately and much more often, the set of non-passing checks.

// CheckState is one Consul check as observed.
type CheckState struct {
	Node        string
	CheckID     string
	ServiceID   string // "" for a node-level check such as serfHealth
	Status      CheckStatus
	Output      string
	ModifyIndex uint64
	CreateIndex uint64
}

// Member is one registration of a task type with its checks (service and
// node) as read together with the membership.
type Member struct {
	Observed
	Checks []CheckState // the service's checks and its node's checks
}

// Observed is a registration as a membership read found it: the contract's
// fields and what the catalog says of the registration itself, nothing
// decided. Join makes the Executor. Members are held for as long as their
// membership is current, beside the executors decided from them: at 10,000
// executors a member holding a whole Executor (440 bytes, its decisions
// unset) cost ~2 MB more of the heap (issue 30).
type Observed struct {
	Registration
	ServiceID   string
	Node        string
	CreateIndex uint64
	Err         error // bad metadata: the registration cannot be trusted at all
}

// Executor is the registration as observed, nothing decided yet.
func (o *Observed) Executor() Executor {
	return Executor{Registration: o.Registration, ServiceID: o.ServiceID, Node: o.Node,
		CreateIndex: o.CreateIndex, Err: o.Err}
}

// TaskMembers is the full membership of one task type at Index. Gone means
// the task type no longer exists (its last registration left).
type TaskMembers struct {
	Task    string
	Index   uint64
	Members []Member
	Gone    bool
	// Keys are generation keys read after the membership, for members the
	// last generation listing did not confirm and that registered after it
	// (instance_id → its key; an instance without a key is absent). A
	// session start writes its key before it registers, so a registration
	// is never unconfirmed only because the listing lags behind it.
	Keys map[string]GenerationRecord
}

// NonPassing is every non-passing check of leasehold registrations and of
// nodes at Index, and every node's serfHealth (passing too, for its indexes):
// a check absent from it was passing at Index.
type NonPassing struct {
	Index  uint64
	Checks []CheckState
}

// NodeFailedSince reports whether a node's serfHealth (created and last
// modified at the given indexes) changed after a lease check created at
// leaseCreated (0: unknown): the node failed since.
func NodeFailedSince(leaseCreated, serfCreated, serfModified uint64) bool {
	return leaseCreated > 0 && serfModified > serfCreated && serfModified > leaseCreated
}

// LeaseCheckRecreated reports whether a session's lease check, first seen
// created at index first, is now one created at index now (0: not known):
// the catalog lost the check and an agent created it anew — the agent left
// and re-synced its registrations when it came back (restarted with
// leave_on_terminate), or the node was reaped and rejoined. The session is
// over, as after a lapse: while the check was missing another replica may
// have answered the session LAPSED and its tasks gone elsewhere, and the
// check comes back in the state the agent kept, whatever the process did
// meanwhile. The Registrar ends the session and leasehold answers it LAPSED
// for ever, by this one rule.
func LeaseCheckRecreated(first, now uint64) bool {
	return first != 0 && now != 0 && now != first
}

// SerfHealthCheckID is the node check Consul's servers keep for every agent:
// critical when they lost contact with it.
const SerfHealthCheckID = "serfHealth"

type checkKey struct{ node, checkID string }

// NonPassingSet indexes a NonPassing observation for Join.
type NonPassingSet struct {
	index  uint64
	checks map[checkKey]CheckState
	// node checks by node, service checks by node and service id: a member's
	// read may lack a check added since (a node put in maintenance, a new
	// service check) when its catalog entry did not change.
	byNode    map[string][]CheckState
	byService map[checkKey][]CheckState // checkKey{node, serviceID}
}

// Index is the Consul index of the observation.
func (s *NonPassingSet) Index() uint64 {
	if s == nil {
		return 0
	}
	return s.index
}

// NewNonPassingSet indexes np.
func NewNonPassingSet(np NonPassing) *NonPassingSet {
	s := &NonPassingSet{index: np.Index, checks: make(map[checkKey]CheckState, len(np.Checks)),
		byNode: map[string][]CheckState{}, byService: map[checkKey][]CheckState{}}
	for _, c := range np.Checks {
		s.checks[checkKey{c.Node, c.CheckID}] = c
		if c.ServiceID == "" {
			s.byNode[c.Node] = append(s.byNode[c.Node], c)
		} else {
			k := checkKey{c.Node, c.ServiceID}
			s.byService[k] = append(s.byService[k], c)
		}
	}
	return s
}

// EachChange calls f with every check whose entry differs between prev and
// s (added, removed or changed), and reports whether the index moved: a
// member's join depends on the set only through the entries of its own
// checks and, for a check its read saw non-passing, on the index. A set
// where there was none (or none where there was one) counts as moved, also
// at index 0: no set says nothing of the checks it would lack.
//
// f gets the entry as it is in s, or as it was in prev when s has none.
func (s *NonPassingSet) EachChange(prev *NonPassingSet, f func(c CheckState)) (indexMoved bool) {
	var cur, old map[checkKey]CheckState
	if s != nil {
		cur = s.checks
	}
	if prev != nil {
		old = prev.checks
	}
	for k, c := range cur {
		if o, ok := old[k]; !ok || o != c {
			f(c)
		}
	}
	for k, o := range old {
		if _, ok := cur[k]; !ok {
			f(o)
		}
	}
	return s.Index() != prev.Index() || (s == nil) != (prev == nil)
}

// current is the newest known state of c: the membership read or the
// non-passing set, whichever observed it later. A check missing from the set
// was passing at the set's index.
func (s *NonPassingSet) current(c CheckState) CheckState {
	if s == nil {
		return c
	}
	if np, ok := s.checks[checkKey{c.Node, c.CheckID}]; ok {
		if np.ModifyIndex >= c.ModifyIndex {
			return np
		}
		return c
	}
	if s.index >= c.ModifyIndex && c.Status != StatusPassing {
		c.Status = StatusPassing // the output (load) is kept: the newest we know
		c.ModifyIndex = s.index
	}
	return c
}

// Join computes a member's check statuses from its membership read and the
// newest non-passing set: the lease check of its own session, the worst node
// check, the worst other check of the service, and the load from the lease
// check's output.
func Join(m Member, np *NonPassingSet) Executor {
	e := m.Executor()
	if e.Err != nil {
		return e
	}
	leaseID := CheckID(e.InstanceID, e.SessionID, e.Task)
	var leaseCreated, serfCreated, serfModified uint64
	for _, read := range m.Checks {
		switch {
		case read.CheckID == leaseID && read.ServiceID != "":
			leaseCreated = read.CreateIndex
		case read.CheckID == SerfHealthCheckID && read.ServiceID == "":
			// The fast path carries every node's serfHealth, passing or not:
			// its indexes are current without re-reading the membership.
			c := np.current(read)
			serfCreated, serfModified = max(c.CreateIndex, read.CreateIndex), c.ModifyIndex
		}
	}
	// A check's ModifyIndex moves only when its status or output changes,
	// and serfHealth's change only when the node fails or comes back: once
	// modified after this session's lease check was created (and after its
	// own creation, which may follow a join), the node failed meanwhile, even
	// if it is passing again. Derived from Consul, so every replica, also one
	// started after the failure, sees it; the Registrar applies the same rule.
	if NodeFailedSince(leaseCreated, serfCreated, serfModified) {
		e.NodeFailed = true
	}
	e.LeaseCreateIndex = leaseCreated
	apply := func(read, c CheckState) {
		switch {
		case c.ServiceID == "":
			e.NodeChecks = worst(e.NodeChecks, c.Status)
			if c.CheckID == SerfHealthCheckID && worst("", c.Status) == StatusCritical {
				e.NodeFailed = true
			}
		case c.CheckID == leaseID:
			e.LeaseStatus, e.LeaseFound = c.Status, true
			if n, ok := ParseLoad(c.Output); ok {
				e.Load, e.LoadReported = n, true
			} else if n, ok := ParseLoad(read.Output); ok {
				// The check's output is not a load (e.g. "TTL expired"): keep the last one.
				e.Load, e.LoadReported = n, true
			}
		default:
			e.Other = worst(e.Other, c.Status)
		}
	}
	for _, read := range m.Checks {
		apply(read, np.current(read))
	}
	// Checks of the member's node or service the set has and the read lacks
	// (added since the read: maintenance mode, a new service check).
	if np != nil {
		inRead := func(c CheckState) bool {
			for _, r := range m.Checks {
				if r.Node == c.Node && r.CheckID == c.CheckID {
					return true
				}
			}
			return false
		}
		for _, c := range np.byNode[e.Node] {
			if !inRead(c) {
				apply(c, c)
			}
		}
		for _, c := range np.byService[checkKey{e.Node, e.ServiceID}] {
			if !inRead(c) {
				apply(c, c)
			}
		}
	}
	return e
}

// worst orders statuses critical > warning > passing; anything unknown counts
// as critical.
func worst(a, b CheckStatus) CheckStatus {
	rank := func(s CheckStatus) int {
		switch s {
		case "":
			return 0
		case StatusPassing:
			return 1
		case StatusWarning:
			return 2
		default:
			return 3
		}
	}
	if rank(b) > rank(a) {
		if rank(b) == 3 {
			return StatusCritical
		}
		return b
	}
	return a
}

// Contact reports whether Consul answers: OK false on the first failure of a
// run of failures, OK true when it answers again.
type Contact struct {
	OK  bool
	Err error
	// Problem classifies Err (with OK false) for readiness, and Detail says
	// what to fix: for ProblemACL the missing rights (Consul policy rules),
	// for ProblemTLS the certificate problem, else the error.
	Problem ContactProblem
	Detail  string
	// IndexWentBack: Consul answered with an index below one it gave before
	// (a restart without state, a restore): what was learned from its past,
	// such as the highest session generation of each instance, may be void.
	IndexWentBack bool
}

// ContactProblem is why Consul's answers cannot be used.
type ContactProblem string

const (
	ProblemUnreachable ContactProblem = "consul_unreachable" // no answer, or an error answer
	// Refused or filtered by Consul's ACLs: a right is missing.
	ProblemACL ContactProblem = "acl"
	ProblemTLS ContactProblem = "tls" // the TLS handshake with Consul failed (certificate)
)

// TaskList is the set of task types at Index (services carrying the tag).
type TaskList struct {
	Index uint64
	Tasks []string
}

// Observation is one report of the Consul watch: when Consul's answer
// arrived (At), the datacenter it came from, and what it says (Data, one of
// the kinds below). The state owner handles each kind in a type switch.
type Observation struct {
	At time.Time
	// Datacenter is the Consul datacenter the answer came from ("" with
	// one, unnamed; rules, cordons and the control watch's contact belong
	// to none).
	Datacenter string
	Data       ObservationData
}

// ObservationData is what one observation says. It is sealed: its kinds
// are *TaskList, *TaskMembers, *NonPassing, *Contact, *RulesSource,
// *CordonSet, *Generations, *LapseMarks, *Refreshed, *Progress and
// *ControlContact.
type ObservationData interface{ observation() }

func (*TaskList) observation()       {}
func (*TaskMembers) observation()    {}
func (*NonPassing) observation()     {}
func (*Contact) observation()        {}
func (*RulesSource) observation()    {}
func (*CordonSet) observation()      {}
func (*Generations) observation()    {}
func (*LapseMarks) observation()     {}
func (*Refreshed) observation()      {}
func (*Progress) observation()       {}
func (*ControlContact) observation() {}

// Refreshed says every observation of a fresh read made for refresh request
// Seq (Watcher.Refresh) has been sent before it; those reads were made after
// Consul's index reached AtLeast (the highest index the requesters had
// seen), so the non-passing checks and generation keys are current at that
// index.
type Refreshed struct {
	Seq, AtLeast uint64
}

// ControlContact says whether the watch of the operators' controls (rules
// and cordons) reads them: OK after each first answer of a run (its rules
// and cordons, if any, were sent before it).
type ControlContact Contact

// The kinds of an observation, for readers that want one: nil when the
// observation is of another kind.

// Tasks is the observation's TaskList, or nil.
func (o Observation) Tasks() *TaskList {
	v, _ := o.Data.(*TaskList)
	return v
}

// Members is the observation's TaskMembers, or nil.
func (o Observation) Members() *TaskMembers {
	v, _ := o.Data.(*TaskMembers)
	return v
}

// NonPassing is the observation's NonPassing, or nil.
func (o Observation) NonPassing() *NonPassing {
	v, _ := o.Data.(*NonPassing)
	return v
}

// Contact is the observation's Contact, or nil.
func (o Observation) Contact() *Contact {
	v, _ := o.Data.(*Contact)
	return v
}

// Rules is the observation's RulesSource, or nil.
func (o Observation) Rules() *RulesSource {
	v, _ := o.Data.(*RulesSource)
	return v
}

// Cordons is the observation's CordonSet, or nil.
func (o Observation) Cordons() *CordonSet {
	v, _ := o.Data.(*CordonSet)
	return v
}

// Generations is the observation's Generations, or nil.
func (o Observation) Generations() *Generations {
	v, _ := o.Data.(*Generations)
	return v
}

// Lapses is the observation's LapseMarks, or nil.
func (o Observation) Lapses() *LapseMarks {
	v, _ := o.Data.(*LapseMarks)
	return v
}

// Refreshed is the observation's Refreshed, or nil.
func (o Observation) Refreshed() *Refreshed {
	v, _ := o.Data.(*Refreshed)
	return v
}

// Progress is the observation's Progress, or nil.
func (o Observation) Progress() *Progress {
	v, _ := o.Data.(*Progress)
	return v
}

// ControlContact is the observation's ControlContact, or nil.
func (o Observation) ControlContact() *ControlContact {
	v, _ := o.Data.(*ControlContact)
	return v
}

// Progress says a watch's content, unchanged, is current at a higher index.
type Progress struct {
	NonPassing, Generations, Lapses uint64 // the one that answered; the others are 0
}

// Generations is every generation key in Consul KV (GenerationKeyPrefix +
// instance_id) at Index: the generation (and session) each instance's
// newest session took before it registered. Every replica reads the same
// keys, so every replica orders sessions the same way, also after a restart
// and after the newest session deregistered.
type Generations struct {
	Index uint64
	Keys  map[string]GenerationRecord // instance_id → its key
}

// RulesSource is the raw rollout configuration (JSON) from one source: a
// file, or Consul KV. Raw nil: the source has none (any more).
type RulesSource struct {
	Source string // "file:<path>" or "consul-kv:<key>"
	Raw    []byte
}

// CordonSet is every cordon stored in Consul KV, raw (JSON) by key; the
// state owner validates them.
type CordonSet struct {
	Index uint64
	Raw   map[string][]byte
	// Removed are the removal records (CordonRemoval, JSON) by cordon id,
	// read with the cordons: who removed those that are gone.
	Removed map[string][]byte
}
