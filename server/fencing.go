package server

import (
	"context"
	"encoding/json"
	"net/http"
	"slices"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasehold/leasehold/health"
	leaseholdv1 "github.com/leasehold/leasehold/proto/leasehold/v1"
	"github.com/leasehold/leasehold/snapshot"
)

// Views is where the fencing and explain APIs read the decided fleet.
type Views interface {
	View() *snapshot.View
}

// Fencing serves leasehold.v1.Fencing from the syncer's views.
type Fencing struct {
	leaseholdv1.UnimplementedFencingServer
	views       Views
	lastContact func() time.Time
}

var _ leaseholdv1.FencingServer = (*Fencing)(nil)

// NewFencing answers from views; lastContact tells how old the view of Consul is.
func NewFencing(views Views, lastContact func() time.Time) *Fencing {
	return &Fencing{views: views, lastContact: lastContact}
}

func (f *Fencing) answer(ctx context.Context, v *snapshot.View, req *leaseholdv1.CheckSessionRequest) *leaseholdv1.CheckSessionResponse {
	st := v.Sessions().Check(req.GetInstanceId(), req.GetSessionId())
	if g, ok := grantFrom(ctx); ok && !slices.ContainsFunc(st.Tasks, g.AllowsTask) {
		// A session of task types the caller is not granted is answered
		// exactly as one never seen: its existence does not leak.
		st = health.SessionIndex{}.Check(req.GetInstanceId(), req.GetSessionId())
	}
	resp := &leaseholdv1.CheckSessionResponse{
		InstanceId: st.InstanceID, SessionId: st.SessionID, State: stateOf(st.State), Detail: st.Detail,
		NewerSessionId: st.NewerSessionID, NewerGeneration: st.NewerGeneration, Generation: st.Generation,
		Tasks: st.Tasks, Version: st.Version, ConsulIndex: v.ConsulIndex,
	}
	if t := f.lastContact(); !t.IsZero() {
		resp.ViewAge = durationpb.New(time.Since(t))
	}
	if !v.Synced { // nothing read yet: no answer can be trusted as CURRENT
		resp.State, resp.Detail = leaseholdv1.SessionState_UNKNOWN, "leasehold has not read Consul yet"
	}
	return resp
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

// CheckSession answers once.
func (f *Fencing) CheckSession(ctx context.Context, req *leaseholdv1.CheckSessionRequest) (*leaseholdv1.CheckSessionResponse, error) {
	if err := validate(req); err != nil {
		return nil, err
	}
	return f.answer(ctx, f.views.View(), req), nil
}

// WatchSession answers now and on every change of the answer (view age and
// index aside) until the caller cancels.
func (f *Fencing) WatchSession(req *leaseholdv1.CheckSessionRequest, stream leaseholdv1.Fencing_WatchSessionServer) error {
	if err := validate(req); err != nil {
		return err
	}
	var last *leaseholdv1.CheckSessionResponse
	for {
		v := f.views.View()
		resp := f.answer(stream.Context(), v, req)
		if last == nil || !sameAnswer(last, resp) {
			if err := stream.Send(resp); err != nil {
				return err
			}
			last = resp
		}
		select {
		case <-stream.Context().Done():
			return nil
		case <-v.Changed():
		}
	}
}

func sameAnswer(a, b *leaseholdv1.CheckSessionResponse) bool {
	a, b = proto.Clone(a).(*leaseholdv1.CheckSessionResponse), proto.Clone(b).(*leaseholdv1.CheckSessionResponse)
	a.ViewAge, b.ViewAge, a.ConsulIndex, b.ConsulIndex = nil, nil, 0, 0
	return proto.Equal(a, b)
}

// ServeHTTP is CheckSession as JSON: GET /v1/session?instance_id=..&session_id=..
func (f *Fencing) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	req := &leaseholdv1.CheckSessionRequest{InstanceId: r.URL.Query().Get("instance_id"), SessionId: r.URL.Query().Get("session_id")}
	resp, err := f.CheckSession(r.Context(), req)
	w.Header().Set("Content-Type", "application/json")
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		json.NewEncoder(w).Encode(map[string]string{"error": status.Convert(err).Message(), "code": status.Code(err).String()})
		return
	}
	b, _ := protojson.MarshalOptions{EmitUnpopulated: true}.Marshal(resp)
	w.Write(append(b, '\n'))
}
