package translator

import (
	"encoding/binary"
	"encoding/hex"
	"hash/maphash"
	"net/netip"
	"slices"
	"strconv"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"

	"github.com/leasehold/leasehold/health"
)

// Builder builds one task's load assignments for one constraint set again
// and again. It remembers, per executor fingerprint, the verdict and the
// endpoint's encoding (encoded.go), and the sorted order of the previous
// build: executors whose fingerprint is unchanged are neither decided nor
// encoded again, and the new ones are sorted among themselves and merged
// into the previous order. A single change therefore costs a map lookup per
// executor, not a decision, an encoding and a sort. Encodings are immutable
// once made.
//
// Of routed entries claiming one socket (address:port) only the one whose
// health.Claim beats the others' is sent (grpc-go rejects a load assignment
// with two endpoints at one address); the others are excluded as
// duplicate-address. Claims per socket are counted as entries come and go,
// so a fleet without such a conflict pays no more than a map update per
// changed executor.
type Builder struct {
	// Failover orders the datacenters' localities (set before the first
	// build; the zero value: one datacenter).
	Failover Failover
	// Shards is how many shards the task's load assignments are split into
	// (ShardCount; 0 or 1: one, named after the task). Set before a build; a
	// change starts the Builder afresh, since executors move between shards.
	Shards    int
	failover  Failover // as of the last start
	shards    int      // as of the last start: at least 1
	prev      []Shard  // the previous build's shards
	d         health.Dispatcher
	observe   []health.Reason // rules in observe mode
	started   bool
	gen       uint64
	entries   map[uint64]*entry // by executor fingerprint
	all       []*entry          // every entry of the previous build
	sorted    []*entry          // routed entries of the previous build, in order
	sockets   map[uint64]int32  // routed entries claiming each socket, by socketSum
	contested int               // sums claimed by more than one routed entry
	losers    []*entry          // routed entries the previous build did not send
	// localities seen, by id (entry.loc): comparing ids, not names, keeps
	// sorting and splitting the endpoints as cheap as with one locality
	localities []localityName
	localityID map[localityName]int32
	enc        endpointEncoder
}

// localityName is a locality's datacenter and zone.
type localityName struct{ dc, zone string }

// localityOf interns a locality.
func (bl *Builder) localityOf(dc, zone string) int32 {
	n := localityName{dc, zone}
	if id, ok := bl.localityID[n]; ok {
		return id
	}
	if bl.localityID == nil {
		bl.localityID = map[localityName]int32{}
	}
	id := int32(len(bl.localities))
	bl.localities = append(bl.localities, n)
	bl.localityID[n] = id
	return id
}

// entry is one executor as decided for the Builder's constraint set. A
// Builder holds one per executor for as long as the executor is unchanged,
// so nothing is held twice: its sort key and socket are read from its
// claim, address, parsed address and port (192 bytes; with them held apart
// it was 264, ~1 MB more per constraint set at 10,000 executors).
type entry struct {
	lb      []byte       // the endpoint's encoding (LbEndpoint)
	digest  uint64       // FNV-1a of the endpoint's whole content
	gen     uint64       // last build that saw it
	print   uint64       // its key in Builder.entries
	address string       // the executor's address, as registered
	ip      netip.Addr   // address parsed (health.SocketOf; invalid: a host name)
	claim   health.Claim // its claim on its socket, with its instance and session
	status  corev3.HealthStatus
	weight  uint32 // its load_balancing_weight
	loc     int32  // its locality (Builder.localities)
	shard   int32  // its shard (ShardOf its instance id)
	port    int32
	routed  bool
	lost    bool // routed, but another entry's claim on its socket won (this build)
	sent    bool // in the previous build's load assignment
}

type endpointSortKey struct {
	instance, address, session string
	port                       int32
}

// key is what the entry's endpoint is sorted and matched by.
func (en *entry) key() endpointSortKey {
	return endpointSortKey{instance: en.claim.InstanceID, address: en.address,
		session: en.claim.SessionID, port: en.port}
}

// socket is what the entry's endpoint dials (health.SocketOf its address
// and port).
func (en *entry) socket() health.Socket {
	if en.ip.IsValid() {
		return health.Socket{IP: en.ip, Port: int(en.port)}
	}
	return health.Socket{Host: en.address, Port: int(en.port)}
}

// less orders entries by locality first (the Builder's small ids: entries of
// one locality are contiguous; the localities themselves are put in order
// by name when assembled), then by endpoint.
func (a *entry) less(b *entry) bool {
	if a.loc != b.loc {
		return a.loc < b.loc
	}
	if a.claim.InstanceID != b.claim.InstanceID {
		return a.claim.InstanceID < b.claim.InstanceID
	}
	if a.address != b.address {
		return a.address < b.address
	}
	if a.port != b.port {
		return a.port < b.port
	}
	if a.claim.SessionID != b.claim.SessionID {
		return a.claim.SessionID < b.claim.SessionID
	}
	return a.digest < b.digest
}

// Result is one build.
type Result struct {
	CLA     *endpointv3.ClusterLoadAssignment
	Version string // content version: equal on every replica for equal inputs
	// RemovesOrDrains is set when an endpoint of the previous build is gone, or no
	// longer HEALTHY (the change must be published at once).
	RemovesOrDrains bool
	Decided         int // executors decided afresh (the rest were reused)
	// Restarted is set when the Builder started afresh (first build, another
	// constraint set or other rule modes), so RemovesOrDrains knows nothing
	// of earlier builds: compare with RemovesOrDrainsBetween(prev, next) instead.
	Restarted bool
	// Observed are the executors decided afresh that a rule in observe mode
	// would have excluded (they are routed).
	Observed []ObservedDecision
	// Shards are the build's load assignments, one per shard in order: one,
	// named after the task, when it is not sharded (then CLA and Version are
	// its own). A shard whose content did not change is the previous
	// build's, message and all.
	Shards []Shard
}

// Shard is one shard's load assignment.
type Shard struct {
	Name    string // ShardName: the cluster's and the load assignment's
	CLA     *endpointv3.ClusterLoadAssignment
	Version string // content version: equal on every replica for equal inputs
	// Rank is the failover rank (Failover) of the best-placed datacenter
	// where it has HEALTHY endpoints — where a client sends its share, since
	// a priority with none fails over to the next (-1: none at all) — and
	// Capacity the sum of their weights: what its route weight follows
	// (ShardWeights).
	Rank     int
	Capacity uint64
	// Wire is CLA marshalled deterministically, as every replica and the
	// cache marshal it (nil: not made; the cache marshals CLA). CLA's
	// encoded endpoints and the Builder's entries point into it, so the
	// endpoints are held once (wireOf). Never written.
	Wire []byte
}

// ObservedDecision is an executor routed despite rules in observe mode.
type ObservedDecision struct {
	InstanceID, SessionID string
	Exclusions            []health.Exclusion
}

// Build is endpointsVersioned, with reuse.
func (bl *Builder) Build(task string, executors []health.Executor,
	d health.Dispatcher) (*endpointv3.ClusterLoadAssignment, string) {
	r := bl.BuildPrinted(task, executors, nil, d)
	return r.CLA, r.Version
}

// BuildPrinted builds with the executors' fingerprints already computed
// (prints[i] is ExecutorPrint(&executors[i]); nil: computed here).
// Rules listed in observe are in observe mode (see health.EligibleObserving).
func (bl *Builder) BuildPrinted(task string, executors []health.Executor, prints []uint64,
	d health.Dispatcher, observe ...health.Reason) Result {
	return bl.BuildParts(task, [][]health.Executor{executors}, prints, d, observe...)
}

// BuildParts is BuildPrinted of the executors of parts one after another
// (prints aligned with them as one list): a caller that keeps a large task
// type's executors in chunks, copying only a changed chunk, builds from them
// without making them one slice.
func (bl *Builder) BuildParts(task string, parts [][]health.Executor, prints []uint64,
	d health.Dispatcher, observe ...health.Reason) Result {
	restarted := bl.restartFor(d, observe)
	bl.gen++
	b := build{gen: bl.gen}
	bl.decide(&b, parts, prints, d)
	bl.order(&b)
	bl.settleSockets(&b)
	removes := b.sendChanges()
	r := Result{RemovesOrDrains: removes, Decided: len(b.fresh), Observed: b.observed,
		Restarted: restarted}
	if bl.shards == 1 {
		a := bl.assemble(task, b.sorted, len(b.sorted)-len(b.losers), d)
		if len(bl.prev) == 1 && bl.prev[0].Name == task && bl.prev[0].Version == a.version {
			// The same content: the same message, as a shard's. A new one
			// would hold a second copy of every endpoint's encoding (the
			// entries point into the newest message) while the syncer
			// keeps the one it has.
			r.Shards = []Shard{bl.prev[0]}
		} else {
			rank, capacity := a.serving(bl.Failover, d.Datacenter)
			cla, wire := a.message()
			r.Shards = []Shard{{Name: task, CLA: cla, Version: a.version, Rank: rank,
				Capacity: capacity, Wire: wire}}
		}
		r.CLA, r.Version = r.Shards[0].CLA, r.Shards[0].Version
	} else {
		r.Shards = bl.assembleShards(task, &b, d, restarted)
		r.Version = shardsVersion(r.Shards)
	}
	bl.prev = r.Shards
	return r
}

// build is what the steps of one BuildPrinted hand each other.
type build struct {
	gen        uint64
	all        []*entry // every entry seen, in the executors' order
	fresh      []*entry // routed entries decided in this build
	reused     int      // routed entries reused from the previous build
	gone       []*entry // routed entries of the previous build not seen again
	sorted     []*entry // routed entries, in order
	losers     []*entry // routed entries another's claim on their socket beat
	prevLosers []*entry // the previous build's losers
	observed   []ObservedDecision
}

// restartFor starts afresh when the constraint set, the rule modes or the
// failover order changed: remembered verdicts are then worthless.
func (bl *Builder) restartFor(d health.Dispatcher, observe []health.Reason) bool {
	shards := max(bl.Shards, 1)
	if bl.started && bl.d.Key() == d.Key() && slices.Equal(bl.observe, observe) &&
		bl.failover.equal(bl.Failover) && bl.shards == shards {
		return false
	}
	f := bl.Failover
	*bl = Builder{Failover: f, failover: f, Shards: bl.Shards, shards: shards, d: d,
		observe: slices.Clone(observe), started: true,
		entries: map[uint64]*entry{}, sockets: map[uint64]int32{}}
	return true
}

// decide finds each executor's entry by fingerprint, deciding and encoding
// only those not seen before, and forgets the entries no executor has now.
func (bl *Builder) decide(b *build, parts [][]health.Executor, prints []uint64,
	d health.Dispatcher) {
	n := 0
	for _, part := range parts {
		n += len(part)
	}
	b.all = make([]*entry, 0, n)
	var buf []byte
	i := -1
	for _, part := range parts {
		for j := range part {
			i++
			bl.decideOne(b, &part[j], i, prints, d, &buf)
		}
	}
	for _, en := range bl.all { // forget what this build did not see
		if en.gen != b.gen {
			delete(bl.entries, en.print)
		}
	}
}

// decideOne decides executor e, the i-th of the build, reusing its entry
// when its print is known.
func (bl *Builder) decideOne(b *build, e *health.Executor, i int, prints []uint64,
	d health.Dispatcher, buf *[]byte) {
	var p uint64
	if prints != nil {
		p = prints[i]
	} else {
		p = ExecutorPrint(e)
	}
	var en *entry
	if i < len(bl.all) && bl.all[i].print == p {
		en = bl.all[i] // same executor at the same place: no map lookup
	} else {
		en = bl.entries[p]
	}
	if en != nil && en.gen == b.gen {
		return // the same registration twice: one endpoint
	}
	if en == nil {
		en = &entry{print: p}
		bl.entries[p] = en
		v := health.EligibleObserving(*e, d, bl.observe)
		if len(v.Observed) > 0 {
			b.observed = append(b.observed,
				ObservedDecision{InstanceID: e.InstanceID, SessionID: e.SessionID,
					Exclusions: v.Observed})
		}
		if bl.route(en, e, v.Route, buf) {
			b.fresh = append(b.fresh, en)
		}
	} else if en.routed {
		b.reused++
	}
	en.gen = b.gen
	b.all = append(b.all, en)
}

// route fills a new entry from its executor's verdict, encoding its
// endpoint, and reports whether it is routed.
func (bl *Builder) route(en *entry, e *health.Executor, r health.Route, buf *[]byte) bool {
	switch r {
	case health.RouteHealthy:
		en.status = corev3.HealthStatus_HEALTHY
	case health.RouteDraining:
		en.status = corev3.HealthStatus_DRAINING
	default:
		return false
	}
	lb, err := bl.enc.encode(nil, e, en.status)
	if err != nil {
		// Only a string that is not UTF-8 fails, which no registration
		// parsed from Consul holds (ids are ASCII by validation, versions
		// semantic, addresses hosts): an executor made by hand is left out
		// rather than sending a load assignment no client parses.
		return false
	}
	en.routed, en.lb, en.weight = true, lb, weight(*e)
	*buf = endpointContent((*buf)[:0], e, en.status)
	zone := e.Labels[ZoneLabel]
	// Its locality (none: one unnamed locality, the content alone).
	if e.Datacenter != "" || zone != "" {
		*buf = append(append(append(append(*buf, 0), e.Datacenter...), 0), zone...)
	}
	en.loc = bl.localityOf(e.Datacenter, zone)
	en.shard = int32(ShardOf(e.InstanceID, bl.shards))
	en.digest = fnv64a(*buf)
	en.address, en.port = e.Address, int32(e.Port)
	en.ip, en.claim = health.SocketOf(e.Address, e.Port).IP, health.ClaimOf(e)
	return true
}

// order is the previous order minus what is gone, merged with the new
// entries sorted among themselves.
func (bl *Builder) order(b *build) {
	kept := bl.sorted
	if b.reused != len(bl.sorted) {
		kept = make([]*entry, 0, b.reused)
		for _, en := range bl.sorted {
			if en.gen == b.gen {
				kept = append(kept, en)
			} else {
				b.gone = append(b.gone, en)
			}
		}
	}
	b.sorted = kept
	if len(b.fresh) > 0 {
		slices.SortFunc(b.fresh, func(x, y *entry) int {
			if x.less(y) {
				return -1
			}
			if y.less(x) {
				return 1
			}
			return 0
		})
		b.sorted = mergeSorted(kept, b.fresh)
	}
	bl.all, bl.sorted = b.all, b.sorted
}

// settleSockets sends one endpoint per socket: of routed entries claiming
// the same one, those whose claim another's beats are this build's losers.
func (bl *Builder) settleSockets(b *build) {
	for _, en := range b.gone {
		bl.unclaim(en.socket())
	}
	for _, en := range b.fresh {
		bl.claimSocket(en.socket())
	}
	b.prevLosers = bl.losers
	for _, en := range b.prevLosers {
		en.lost = false
	}
	if bl.contested > 0 {
		best := map[health.Socket]*entry{}
		for _, en := range b.sorted {
			if s := en.socket(); bl.sockets[socketSum(s)] > 1 {
				if w := best[s]; w == nil || en.claim.Beats(w.claim) {
					best[s] = en
				}
			}
		}
		for _, en := range b.sorted {
			if w := best[en.socket()]; w != nil && w != en {
				en.lost = true
				b.losers = append(b.losers, en)
			}
		}
	}
	bl.losers = b.losers
}

// sendChanges marks what this load assignment sends and reports whether
// it removes (or drains) an endpoint the previous one sent. A dropped
// endpoint is removed unless a new one has its instance, address and
// session with a status no worse (a weight change keeps the endpoint; a new
// session at the same address is pushed at once, so no snapshot carries a
// session the View calls STALE).
func (b *build) sendChanges() bool {
	var dropped, added []*entry
	for _, en := range b.gone {
		if en.sent {
			dropped = append(dropped, en)
		}
	}
	for _, en := range b.losers {
		if en.sent {
			dropped = append(dropped, en)
		}
	}
	for _, en := range b.fresh {
		if !en.lost {
			added = append(added, en)
		}
	}
	for _, en := range b.prevLosers {
		if en.gen == b.gen && !en.lost {
			added = append(added, en)
		}
	}
	removes := false
	if len(dropped) > 0 {
		now := make(map[endpointSortKey]corev3.HealthStatus, len(added))
		for _, en := range added {
			now[en.key()] = en.status
		}
		for _, en := range dropped {
			st, ok := now[en.key()] // an endpoint that moved to another zone is no removal
			if !ok ||
				(en.status == corev3.HealthStatus_HEALTHY && st != corev3.HealthStatus_HEALTHY) {
				removes = true
				break
			}
		}
	}
	for _, en := range dropped {
		en.sent = false
	}
	for _, en := range added {
		en.sent = true
	}
	return removes
}

// assembly is a load assignment laid out: named name, of the localities
// of the routed entries sent, and its content version, which hashes the
// name and, order-independently, the content digest of each endpoint (the
// order is a function of the contents) and the localities' layout.
type assembly struct {
	name    string
	locs    []*locality
	version string
}

// assemble lays out the load assignment named name of sorted (n of them
// sent, the others lost their socket).
func (bl *Builder) assemble(name string, sorted []*entry, n int, d health.Dispatcher) assembly {
	a := assembly{name: name}
	var sum, xor uint64
	if n > 0 {
		var layout uint64
		a.locs, layout, sum, xor = layoutLocalities(sorted, n, bl.localities,
			bl.Failover, d.Datacenter)
		// The localities' priorities and weights (they follow the dispatcher's datacenter).
		xor ^= layout
	}
	var vb [8 + 8 + 8 + 8]byte
	binary.LittleEndian.PutUint64(vb[0:], fnv64a([]byte("cla\x00"+name)))
	binary.LittleEndian.PutUint64(vb[8:], uint64(n))
	binary.LittleEndian.PutUint64(vb[16:], sum)
	binary.LittleEndian.PutUint64(vb[24:], xor)
	a.version = "e" + hex.EncodeToString(vb[16:]) + strconv.FormatUint(fnv64a(vb[:])&0xffff, 16)
	return a
}

// message makes the load assignment, its endpoints encoded, and its wire
// (encoded.go).
func (a assembly) message() (*endpointv3.ClusterLoadAssignment, []byte) {
	cla := &endpointv3.ClusterLoadAssignment{ClusterName: a.name}
	if len(a.locs) > 0 {
		cla.Endpoints = localityMessages(a.locs)
	}
	return cla, wireOf(cla, a.locs)
}

// serving is where the load assignment's new work goes for dispatchers in
// dispatcherDC: the failover rank of the best-placed datacenter with
// HEALTHY endpoints (-1: none) and the sum of those endpoints' weights.
func (a assembly) serving(f Failover, dispatcherDC string) (rank int, capacity uint64) {
	rank = -1
	for _, l := range a.locs {
		if l.healthy == 0 {
			continue
		}
		r := f.rank(dispatcherDC, l.dc)
		switch {
		case rank < 0 || r < rank:
			rank, capacity = r, l.healthy
		case r == rank:
			capacity += l.healthy
		}
	}
	return rank, capacity
}

// claimSocket and unclaim count the routed entries claiming a socket, by
// a sum of it: a map keyed by the socket itself (48 bytes) held ~1.25 MB per
// constraint set at 10,000 executors. Sums that collide only make sockets
// look contested: settleSockets then compares the sockets themselves, which
// keep apart (TestCollidingSocketSumsChangeNothing).
func (bl *Builder) claimSocket(s health.Socket) {
	k := socketSum(s)
	n := bl.sockets[k] + 1
	bl.sockets[k] = n
	if n == 2 {
		bl.contested++
	}
}

func (bl *Builder) unclaim(s health.Socket) {
	k := socketSum(s)
	n := bl.sockets[k] - 1
	if n <= 0 {
		delete(bl.sockets, k)
	} else {
		bl.sockets[k] = n
	}
	if n == 1 {
		bl.contested--
	}
}

var socketSeed = maphash.MakeSeed()

// socketSum is a socket's sum for Builder.sockets (a variable: tests make
// every sum collide).
var socketSum = func(s health.Socket) uint64 { return maphash.Comparable(socketSeed, s) }

// endpointContent is everything an endpoint holds, for its digest.
func endpointContent(buf []byte, e *health.Executor, status corev3.HealthStatus) []byte {
	buf = append(buf, 0)
	buf = append(buf, e.InstanceID...)
	buf = append(buf, 0)
	buf = append(buf, e.SessionID...)
	buf = append(buf, 0)
	buf = append(buf, e.Version...)
	buf = append(buf, 0)
	buf = append(buf, e.Address...)
	buf = append(buf, 0)
	buf = strconv.AppendInt(buf, int64(e.Port), 10)
	buf = append(buf, 0)
	buf = strconv.AppendInt(buf, int64(status), 10)
	buf = append(buf, 0)
	return strconv.AppendUint(buf, uint64(weight(*e)), 10)
}

// mergeSorted merges two sorted lists into a new one.
func mergeSorted(a, b []*entry) []*entry {
	out := make([]*entry, 0, len(a)+len(b))
	i, j := 0, 0
	for i < len(a) && j < len(b) {
		if b[j].less(a[i]) {
			out = append(out, b[j])
			j++
		} else {
			out = append(out, a[i])
			i++
		}
	}
	out = append(out, a[i:]...)
	return append(out, b[j:]...)
}

// mix64 is the splitmix64 finalizer.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// RemovesOrDrainsBetween compares two load assignments: the definition
// Result.RemovesOrDrains implements incrementally (used when a Builder starts
// afresh, e.g. because rule modes changed): an
// endpoint (instance, address, port) of prev is missing from next, or was
// HEALTHY and no longer is.
func RemovesOrDrainsBetween(prev, next *endpointv3.ClusterLoadAssignment) bool {
	return RemovesOrDrainsAcross([]*endpointv3.ClusterLoadAssignment{prev},
		[]*endpointv3.ClusterLoadAssignment{next})
}

// RemovesOrDrainsAcross is RemovesOrDrainsBetween over a task's shards: an
// endpoint that moved to another shard is no removal.
// A load assignment whose endpoints do not parse is taken to remove them.
func RemovesOrDrainsAcross(prev, next []*endpointv3.ClusterLoadAssignment) bool {
	status := map[string]corev3.HealthStatus{}
	for _, cla := range next {
		for _, loc := range cla.GetEndpoints() {
			lbs, err := LbEndpoints(loc)
			if err != nil {
				return true
			}
			for _, lb := range lbs {
				status[endpointKey(lb)] = lb.GetHealthStatus()
			}
		}
	}
	for _, cla := range prev {
		for _, loc := range cla.GetEndpoints() {
			lbs, err := LbEndpoints(loc)
			if err != nil {
				return true
			}
			for _, lb := range lbs {
				now, kept := status[endpointKey(lb)]
				if !kept ||
					(lb.GetHealthStatus() == corev3.HealthStatus_HEALTHY &&
						now != corev3.HealthStatus_HEALTHY) {
					return true
				}
			}
		}
	}
	return false
}

// endpointKey identifies an endpoint across load assignments.
func endpointKey(lb *endpointv3.LbEndpoint) string {
	sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
	md := lb.GetMetadata().GetFilterMetadata()[MetadataNamespace].GetFields()
	session := md["session_id"].GetStringValue()
	port := strconv.FormatUint(uint64(sa.GetPortValue()), 10)
	return lb.GetEndpoint().GetHostname() + "|" + sa.GetAddress() + "|" + port + "|" + session
}
