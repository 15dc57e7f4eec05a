package server

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jonboulle/clockwork"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/snapshot/fleet"
)

// Views is where the fencing and explain APIs read the decided fleet.
type Views interface {
	View() *fleet.View
	// Progress is how far the current view of datacenter dc is known
	// current, for its non-passing checks, generation keys and lapse marks.
	Progress(dc string) fleet.Progress
}

// Fencing serves leasehold.v1.Fencing from the syncer's views.
type Fencing struct {
	leaseholdv1.UnimplementedFencingServer
	views     Views
	freshAsOf func(dc string) time.Time
	opts      FencingOptions
	answers   metric.Int64Counter
}

var _ leaseholdv1.FencingServer = (*Fencing)(nil)

// FencingOptions configure a Fencing server. Zero values mean defaults.
type FencingOptions struct {
	// StaleAfter bounds how old leasehold's view of Consul may be for an
	// answer other than UNKNOWN (by default the default lease, 35 s). Routing
	// keeps the last known snapshot whatever its age (fail static), so a
	// dispatcher with endpoints but no answers stops confirming results; it
	// does not stop working.
	StaleAfter time.Duration
	// Refresh, if set, has Consul in datacenter dc read afresh what of the
	// checks, generation keys and lapse marks (what makes a session LAPSED
	// or STALE) has not reached index least, a request's min_consul_index.
	// It returns a sequence number that views carry
	// (View.Datacenter(dc).Refreshed) once they include the fresh reads. A
	// request whose min_consul_index the view has not reached is answered
	// from such a view, one at least as new as the request.
	Refresh func(ctx context.Context, dc string, least uint64) (uint64, error)
	Clock   clockwork.Clock
	Meter   metric.MeterProvider // nil means no metrics
}

// NewFencing answers from views; freshAsOf tells when the view of Consul in
// a datacenter was last known current (the zero time if never). A session is
// answered by its own datacenter's view: its indexes (min_consul_index and
// consul_index are that datacenter's), its freshness and its refreshes.
func NewFencing(views Views, freshAsOf func(dc string) time.Time, opts ...FencingOptions) *Fencing {
	var o FencingOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	if o.StaleAfter <= 0 {
		o.StaleAfter = health.DefaultLeaseTTL
	}
	if o.Clock == nil {
		o.Clock = clockwork.NewRealClock()
	}
	if o.Meter == nil {
		o.Meter = metricnoop.NewMeterProvider()
	}
	f := &Fencing{views: views, freshAsOf: freshAsOf, opts: o}
	m := o.Meter.Meter("github.com/leasehold/leasehold/server")
	f.answers, _ = m.Int64Counter("leasehold.fencing.answers",
		metric.WithDescription("fencing answers given, by state (CURRENT, STALE, LAPSED, "+
			"DRAINING, UNKNOWN)"))
	m.Float64ObservableGauge("leasehold.fencing.view_age", metric.WithUnit("s"),
		metric.WithDescription("age of the view of Consul the fencing API answers from (-1 "+
			"before the first full read); answers are UNKNOWN past --fencing-stale-after"),
		metric.WithFloat64Callback(func(_ context.Context, obs metric.Float64Observer) error {
			if t := f.freshAsOf(f.views.View().Local); t.IsZero() {
				obs.Observe(-1)
			} else {
				obs.Observe(f.opts.Clock.Since(t).Seconds())
			}
			return nil
		}))
	return f
}

// answer answers req from v. caughtUp says whether v satisfies the request's
// min_consul_index (see catchUp).
func (f *Fencing) answer(
	ctx context.Context, v *fleet.View, req *leaseholdv1.CheckSessionRequest, caughtUp bool,
) *leaseholdv1.CheckSessionResponse {
	st := v.Sessions().Check(req.GetInstanceId(), req.GetSessionId())
	dc := sessionDC(v, st)
	idx, _ := v.Datacenter(dc)
	consulIndex := idx.ConsulIndex
	// With several datacenters the answer carries the highest index, so that a
	// later min_consul_index holds every datacenter to it.
	for _, d := range v.Datacenters() {
		if i, _ := v.Datacenter(d); i.ConsulIndex > consulIndex {
			consulIndex = i.ConsulIndex
		}
	}
	if g, ok := grantFrom(ctx); ok && !slices.ContainsFunc(st.Tasks, g.AllowsTask) {
		// A session of task types the caller is not granted is answered
		// exactly as one never seen: its existence does not leak.
		st = health.SessionIndex{}.Check(req.GetInstanceId(), req.GetSessionId())
	}
	resp := &leaseholdv1.CheckSessionResponse{
		InstanceId: st.InstanceID, SessionId: st.SessionID, State: stateOf(st.State),
		Detail: st.Detail, NewerSessionId: st.NewerSessionID,
		NewerGeneration: st.NewerGeneration, Generation: st.Generation,
		Tasks: st.Tasks, Version: st.Version, ConsulIndex: consulIndex,
	}
	fresh := f.freshAsOf(dc)
	age := f.opts.Clock.Since(fresh)
	if !fresh.IsZero() {
		resp.ViewAge = durationpb.New(age)
	}
	bound, why := f.staleBound(st)
	switch {
	case !v.Synced: // with nothing read yet, no answer can be trusted as CURRENT
		f.unknown(resp, "leasehold has not read Consul yet")
	case fresh.IsZero() || age > bound:
		f.unknown(resp,
			fmt.Sprintf("leasehold's view of Consul is stale: Consul has not answered for %s "+
				"(bound %s, %s); the last known state was %s: %s",
				age.Round(time.Millisecond), bound, why, stateOf(st.State), st.Detail))
	case !caughtUp:
		f.unknown(resp,
			fmt.Sprintf("leasehold's view (in %s: checks at Consul index %d, generation keys at "+
				"%d, lapse marks at %d) has not reached min_consul_index %d, and reading Consul "+
				"afresh did not finish in time",
				orLocal(dc), idx.NonPassingIndex, idx.GenerationsIndex, idx.LapsesIndex,
				req.GetMinConsulIndex()))
	case st.State == health.SessionLapsed && v.LapseUnrecorded(st.InstanceID, st.SessionID):
		// awaitMark gave up waiting, so the lapse is final here but not yet at
		// an index another replica is held to.
		resp.Detail += "; its lapse mark is not recorded in Consul yet (this replica's memory " +
			"only: consul_index may be below the mark's)"
	}
	return resp
}

// lapseMarkWait bounds how long a LAPSED answer waits for its lapse mark to
// be read back: the mark is written, then read by the lapse marks' watch,
// which takes a few Consul round trips.
const lapseMarkWait = 2 * time.Second

// awaitMark returns a view in which the lapse of the session req asks about
// is recorded, when v says this replica saw it lapse but has not read its
// lapse mark back yet. A LAPSED answer then carries a consul_index at or
// above the mark's (the index at which the lapse became final for every
// replica), so a replica asked with it has read the mark (catchUp) and never
// answers CURRENT. It waits at most lapseMarkWait, and only until shortly
// before ctx's deadline; then it returns v as it is.
func (f *Fencing) awaitMark(
	ctx context.Context, v *fleet.View, req *leaseholdv1.CheckSessionRequest,
) *fleet.View {
	unrecorded := func(v *fleet.View) bool {
		st := v.Sessions().Check(req.GetInstanceId(), req.GetSessionId())
		if g, ok := grantFrom(ctx); ok && !slices.ContainsFunc(st.Tasks, g.AllowsTask) {
			return false // it is answered as never seen, which no wait changes
		}
		return st.State == health.SessionLapsed && v.LapseUnrecorded(st.InstanceID, st.SessionID)
	}
	if !unrecorded(v) {
		return v
	}
	budget := waitBudget(ctx, lapseMarkWait)
	if budget <= 0 {
		return v
	}
	t := f.opts.Clock.NewTimer(budget)
	defer t.Stop()
	for {
		select {
		case <-v.Changed():
		case <-t.Chan():
			return v
		case <-ctx.Done():
			return v
		}
		if v = f.views.View(); !unrecorded(v) {
			return v
		}
	}
}

// waitBudget is how long a call may wait for Consul: at most bound, and only
// until shortly before ctx's deadline.
func waitBudget(ctx context.Context, bound time.Duration) time.Duration {
	if dl, ok := ctx.Deadline(); ok {
		left := time.Until(dl)
		bound = min(bound, left-min(left/10, 100*time.Millisecond))
	}
	return bound
}

// unknown turns an answer into UNKNOWN, keeping what identifies the session
// but nothing a caller could act on as if it were current.
func (f *Fencing) unknown(resp *leaseholdv1.CheckSessionResponse, detail string) {
	resp.State, resp.Detail = leaseholdv1.SessionState_UNKNOWN, detail
	resp.NewerSessionId, resp.NewerGeneration = "", 0
}

func (f *Fencing) count(ctx context.Context, resp *leaseholdv1.CheckSessionResponse) {
	f.answers.Add(ctx, 1,
		metric.WithAttributes(attribute.String("state", resp.GetState().String())))
}

// sessionDC is the datacenter whose view answers for st: the one where its
// registrations are, or else leasehold's own.
func sessionDC(v *fleet.View, st health.SessionStatus) string {
	if _, ok := v.Datacenter(st.Datacenter); ok && st.Datacenter != "" {
		return st.Datacenter
	}
	return v.Local
}

// dcOf is the datacenter whose view answers for a request.
func (f *Fencing) dcOf(req *leaseholdv1.CheckSessionRequest) string {
	v := f.views.View()
	return sessionDC(v, v.Sessions().Check(req.GetInstanceId(), req.GetSessionId()))
}

func orLocal(dc string) string {
	if dc == "" {
		return "leasehold's datacenter"
	}
	return dc
}

// staleBound is how old a view may be to answer for st: the staleness
// bound, or the session's own lease when shorter — past a lease without an
// answer from Consul the session may have lapsed unseen and its work been
// dispatched again. why names the bound that applies.
func (f *Fencing) staleBound(st health.SessionStatus) (time.Duration, string) {
	if st.LeaseTTL > 0 && st.LeaseTTL < f.opts.StaleAfter {
		return st.LeaseTTL, "the session's lease_ttl"
	}
	return f.opts.StaleAfter, "--fencing-stale-after"
}

// Silence reports whether Consul has been silent for longer than the
// staleness bound in every datacenter of v (in the only one, when there is
// one). The fencing API then answers UNKNOWN for every session, so leasehold
// is not ready. A datacenter's bound is the fencing bound, or the shortest
// lease declared there when that is shorter, but never under
// health.MinStaleBound, since any registration may declare any lease. detail
// says how long and which bound; age is the shortest silence.
func (f *Fencing) Silence(v *fleet.View) (silent bool, detail string, age time.Duration) {
	dcs := v.Datacenters()
	if len(dcs) == 0 {
		dcs = []string{v.Local}
	}
	var details []string
	for i, dc := range dcs {
		fresh := f.freshAsOf(dc)
		if fresh.IsZero() {
			return false, "", 0 // not read yet, which first_read_pending reports
		}
		a := f.opts.Clock.Since(fresh)
		idx, _ := v.Datacenter(dc)
		bound, why := f.staleBound(health.SessionStatus{
			LeaseTTL: health.DatacenterLeaseBound(idx.ShortestLease)})
		if why != "--fencing-stale-after" {
			why = "the shortest lease_ttl of its executors"
		}
		if a <= bound {
			return false, "", 0
		}
		if i == 0 || a < age {
			age = a
		}
		details = append(details, fmt.Sprintf("%s has not answered for %s, longer than %s (%s)",
			orLocal(dc), a.Round(time.Millisecond), bound, why))
	}
	return true, strings.Join(details, "; ") +
		": the fencing API answers UNKNOWN; dispatchers keep the last snapshot", age
}

// staleIn is how long until datacenter dc's view passes bound; zero or less
// means it has.
func (f *Fencing) staleIn(dc string, bound time.Duration) time.Duration {
	fresh := f.freshAsOf(dc)
	if fresh.IsZero() {
		return 0
	}
	return bound - f.opts.Clock.Since(fresh)
}

func stateOf(s health.SessionState) leaseholdv1.SessionState {
	switch s {
	case health.SessionCurrent:
		return leaseholdv1.SessionState_CURRENT
	case health.SessionStale:
		return leaseholdv1.SessionState_STALE
	case health.SessionLapsed:
		return leaseholdv1.SessionState_LAPSED
	case health.SessionDraining:
		return leaseholdv1.SessionState_DRAINING
	default:
		return leaseholdv1.SessionState_UNKNOWN
	}
}

func validate(req *leaseholdv1.CheckSessionRequest) error {
	if err := health.ValidateSessionQuery(req.GetInstanceId(), req.GetSessionId()); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	return nil
}

// CheckSession answers once. A view below the request's min_consul_index is
// waited for until shortly before the request's deadline (at most the
// staleness bound), then the answer is UNKNOWN.
func (f *Fencing) CheckSession(
	ctx context.Context, req *leaseholdv1.CheckSessionRequest,
) (*leaseholdv1.CheckSessionResponse, error) {
	if err := validate(req); err != nil {
		return nil, err
	}
	v, caughtUp := f.catchUp(ctx, req.GetMinConsulIndex())
	v = f.awaitMark(ctx, v, req)
	resp := f.answer(ctx, v, req, caughtUp)
	f.count(ctx, resp)
	return resp, nil
}

// current returns the latest view and the datacenters in which it has not
// seen every change up to index least that can make a session LAPSED or
// STALE. A datacenter has seen them when its non-passing checks, its
// generation keys and (when they are read) its lapse marks are all known
// current at that index or later. (A view's highest index says nothing of
// the others, since the watches answer independently.)
//
// With several datacenters Consul's indexes are per datacenter and a
// min_consul_index does not say whose it is (an answer may rest on another
// datacenter's data, such as a newer session of the instance there), so
// every datacenter that answers is held to it; one whose index space is
// lower is read afresh instead. A datacenter that does not answer is not
// waited for, since its sessions are UNKNOWN anyway.
func (f *Fencing) current(least uint64) (*fleet.View, []string) {
	v := f.views.View()
	dcs := v.Datacenters()
	if len(dcs) == 0 {
		dcs = []string{v.Local}
	}
	progress := make([]fleet.Progress, len(dcs))
	// Progress is read before the view, because it is published after the
	// view it vouches for.
	for i, dc := range dcs {
		progress[i] = f.views.Progress(dc)
	}
	v = f.views.View()
	var behind []string
	for i, dc := range dcs {
		idx, _ := v.Datacenter(dc)
		if len(dcs) > 1 && idx.Reach != health.Reached {
			continue
		}
		p := progress[i]
		p.NonPassing, p.Generations, p.Lapses = max(p.NonPassing, idx.NonPassingIndex),
			max(p.Generations, idx.GenerationsIndex), max(p.Lapses, idx.LapsesIndex)
		if p.Current() < least {
			behind = append(behind, dc)
		}
	}
	return v, behind
}

// catchUp returns a view that satisfies min_consul_index least: one that
// reached it in every datacenter that answers, or that includes fresh reads
// made after this call of those that had not. When that does not come in
// time (shortly before ctx's deadline, at most the staleness bound) it
// returns the latest view and false.
func (f *Fencing) catchUp(ctx context.Context, least uint64) (*fleet.View, bool) {
	v, behind := f.current(least)
	if len(behind) == 0 {
		return v, true
	}
	budget := waitBudget(ctx, f.opts.StaleAfter)
	if budget <= 0 {
		return v, false
	}
	seqs := map[string]uint64{}
	if f.opts.Refresh != nil {
		for _, dc := range behind {
			if s, err := f.opts.Refresh(ctx, dc, least); err == nil {
				seqs[dc] = s
			}
		}
	}
	t := f.opts.Clock.NewTimer(budget)
	defer t.Stop()
	poll := time.NewTicker(20 * time.Millisecond) // progress alone publishes no view
	defer poll.Stop()
	for {
		v, behind = f.current(least)
		caughtUp := true
		for _, dc := range behind {
			idx, _ := v.Datacenter(dc)
			if seq, asked := seqs[dc]; !asked || idx.Refreshed < seq {
				caughtUp = false
			}
		}
		if caughtUp {
			return v, true
		}
		select {
		case <-v.Changed():
		case <-poll.C:
		case <-t.Chan():
			return v, false
		case <-ctx.Done():
			return v, false
		}
	}
}

// WatchSession answers now and on every change of the answer (view age and
// index aside) until the caller cancels: also when the view turns stale
// (UNKNOWN) and fresh again, and when it reaches min_consul_index.
func (f *Fencing) WatchSession(
	req *leaseholdv1.CheckSessionRequest, stream leaseholdv1.Fencing_WatchSessionServer,
) error {
	if err := validate(req); err != nil {
		return err
	}
	ctx := stream.Context()
	var last *leaseholdv1.CheckSessionResponse
	timer := f.opts.Clock.NewTimer(time.Hour)
	defer timer.Stop()
	_, caughtUp := f.catchUp(ctx, req.GetMinConsulIndex()) // every later view is newer still
	for {
		dc := f.dcOf(req)
		v, behind := f.current(req.GetMinConsulIndex())
		caughtUp = caughtUp || len(behind) == 0
		if w := f.awaitMark(ctx, v, req); w != v { // a newer view is judged again
			v, behind = f.current(req.GetMinConsulIndex())
			caughtUp = caughtUp || len(behind) == 0
		}
		resp := f.answer(ctx, v, req, caughtUp)
		if last == nil || !sameAnswer(last, resp) {
			if err := stream.Send(resp); err != nil {
				return err
			}
			f.count(ctx, resp)
			last = resp
		}
		// Wake when the view changes or when it would pass the staleness
		// bound; a stale view is checked again every second, since the
		// watch's answer arriving does not change the View.
		bound, _ := f.staleBound(v.Sessions().Check(req.GetInstanceId(), req.GetSessionId()))
		wake := f.staleIn(dc, bound)
		if wake <= 0 {
			wake = time.Second
		}
		timer.Reset(wake + time.Millisecond)
		select {
		case <-ctx.Done():
			// The caller's deadline or cancellation, said as such: a clean
			// end would read as the server closing a watch it still owed.
			return status.FromContextError(ctx.Err()).Err()
		case <-v.Changed():
		case <-timer.Chan():
		}
	}
}

func sameAnswer(a, b *leaseholdv1.CheckSessionResponse) bool {
	a, b = proto.Clone(a).(*leaseholdv1.CheckSessionResponse),
		proto.Clone(b).(*leaseholdv1.CheckSessionResponse)
	a.ViewAge, b.ViewAge, a.ConsulIndex, b.ConsulIndex = nil, nil, 0, 0
	return proto.Equal(a, b)
}

// ServeHTTP is CheckSession as JSON:
//
//	GET /v1/session?instance_id=..&session_id=..[&min_consul_index=..]
func (f *Fencing) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	req := &leaseholdv1.CheckSessionRequest{InstanceId: r.URL.Query().Get("instance_id"),
		SessionId: r.URL.Query().Get("session_id")}
	var err error
	if m := r.URL.Query().Get("min_consul_index"); m != "" {
		if req.MinConsulIndex, err = strconv.ParseUint(m, 10, 64); err != nil {
			err = status.Errorf(codes.InvalidArgument,
				"min_consul_index %q: not a non-negative integer", m)
		}
	}
	var resp *leaseholdv1.CheckSessionResponse
	if err == nil {
		resp, err = f.CheckSession(r.Context(), req)
	}
	w.Header().Set("Content-Type", "application/json")
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		json.NewEncoder(w).Encode(map[string]string{"error": status.Convert(err).Message(),
			"code": status.Code(err).String()})
		return
	}
	b, _ := protojson.MarshalOptions{EmitUnpopulated: true}.Marshal(resp)
	w.Write(append(b, '\n'))
}
