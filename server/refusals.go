package server

import (
	"context"
	"sort"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// Refusal reasons: why leasehold refused or ended a dispatcher's stream.
const (
	// RefusedNotGranted: the authorization policy grants its client identity
	// nothing (mTLS with --authz-policy).
	RefusedNotGranted = "not-granted"
	// RefusedInvalidNode: its first request's node metadata is invalid (the
	// detail names the field).
	RefusedInvalidNode = "invalid-node"
	// RefusedNodeChanged: a later request changed the node id, the
	// constraint set or the endpoint metadata of the stream.
	RefusedNodeChanged = "node-changed"
	// RefusedPolicyChanged: a policy change altered its grant, so the stream
	// was ended to reconnect under the new one.
	RefusedPolicyChanged = "policy-changed"
	// RefusedTooManyNames: a request made the stream subscribe more than
	// maxSubscribedNames names of one type.
	RefusedTooManyNames = "too-many-names"
)

// Refusal is one kind of refused stream: the same client refused for the
// same reason is one entry, counted, so that a dispatcher retrying every
// second does not push every other refusal out of the list.
type Refusal struct {
	NodeID   string    `json:"node_id,omitempty"` // "" when refused before its first request
	Identity string    `json:"identity,omitempty"`
	Peer     string    `json:"peer,omitempty"` // the latest one's client address
	Mode     string    `json:"mode"`
	Reason   string    `json:"reason"` // one of the Refused* reasons
	Detail   string    `json:"detail"` // the error the stream was ended with
	Count    int       `json:"count"`
	First    time.Time `json:"first"`
	Last     time.Time `json:"last"`
}

// refusalsKept bounds the kinds of refusal remembered, the least recently
// seen dropped first; refusalTextMax bounds each text a client chose.
const (
	refusalsKept   = 32
	refusalTextMax = 512
)

// refusals are the recent refused streams; guarded by XDS.mu.
type refusals struct {
	recent []*Refusal
	total  int
}

func (r *refusals) add(f Refusal) {
	r.total++
	for _, old := range r.recent {
		if old.NodeID == f.NodeID && old.Identity == f.Identity && old.Reason == f.Reason &&
			old.Detail == f.Detail && old.Mode == f.Mode {
			old.Count++
			old.Last, old.Peer = f.Last, f.Peer
			return
		}
	}
	f.Count, f.First = 1, f.Last
	if len(r.recent) >= refusalsKept {
		oldest := 0
		for i, old := range r.recent {
			if old.Last.Before(r.recent[oldest].Last) {
				oldest = i
			}
		}
		r.recent = append(r.recent[:oldest], r.recent[oldest+1:]...)
	}
	r.recent = append(r.recent, &f)
}

// clip bounds a text a client chose (a node id, an error quoting metadata).
func clip(s string) string {
	if len(s) <= refusalTextMax {
		return s
	}
	s = s[:refusalTextMax]
	for !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s + "…"
}

// opened records who opened stream id (streamKey key), then lets the
// authorization policy decide.
func (x *XDS) opened(ctx context.Context, id, key int64, mode, typeURL string) error {
	c := streamConn{typeURL: typeURL}
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		c.peer = p.Addr.String()
	}
	if ident := PeerIdentity(ctx); !ident.IsZero() {
		c.identity = ident.String()
	}
	x.mu.Lock()
	x.conns[key] = c
	x.mu.Unlock()
	if err := x.openStream(ctx, key, id); err != nil {
		return x.refuse(key, mode, "", RefusedNotGranted, err)
	}
	return nil
}

// refuse records that the stream (streamKey key) is refused or ended with
// err for reason, and returns err.
func (x *XDS) refuse(key int64, mode, nodeID, reason string, err error) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.refuseLocked(key, mode, nodeID, reason, err)
}

// refuseLocked is refuse with x.mu held.
func (x *XDS) refuseLocked(key int64, mode, nodeID, reason string, err error) error {
	c := x.conns[key]
	x.refused.add(Refusal{NodeID: clip(nodeID), Identity: clip(c.identity), Peer: c.peer,
		Mode: mode, Reason: reason, Detail: clip(status.Convert(err).Message()), Last: time.Now()})
	return err
}

// authzReason is the refusal reason of an error authorize returned.
func authzReason(err error) string {
	if status.Code(err) == codes.Unavailable {
		return RefusedPolicyChanged
	}
	return RefusedNotGranted
}

// Refusals are the recent kinds of refused stream, newest first, and how
// many streams were refused since the start.
func (x *XDS) Refusals() ([]Refusal, int) {
	x.mu.Lock()
	defer x.mu.Unlock()
	out := make([]Refusal, len(x.refused.recent))
	for i, r := range x.refused.recent {
		out[i] = *r
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Last.After(out[j].Last) })
	return out, x.refused.total
}
