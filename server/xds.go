package server

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	clusterservice "github.com/envoyproxy/go-control-plane/envoy/service/cluster/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	endpointservice "github.com/envoyproxy/go-control-plane/envoy/service/endpoint/v3"
	listenerservice "github.com/envoyproxy/go-control-plane/envoy/service/listener/v3"
	routeservice "github.com/envoyproxy/go-control-plane/envoy/service/route/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/stream/v3"
	xdsserver "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasehold/leasehold/health"
	"github.com/leasehold/leasehold/snapshot/fleet"
	"github.com/leasehold/leasehold/snapshot/xdscache"
)

// Subscriber is what the xDS server needs from the syncer: streams announce
// and release their dispatcher constraint set.
type Subscriber interface {
	Subscribe(health.Dispatcher)
	Unsubscribe(health.Dispatcher)
}

// XDS is the xDS server.
type XDS struct {
	srv  xdsserver.Server
	subs Subscriber
	log  *slog.Logger

	mu      sync.Mutex
	streams map[int64]*StreamInfo // streams that announced a valid node, by streamKey
	// followers are the streams following load assignments, by constraint
	// set (a stream's never changes) and load assignment name ("" for a
	// wildcard subscription), so a publication notes the streams its lapse
	// waits for without walking any other: walking every stream held x.mu,
	// which every stream's sends and ACKs take too, and walking the set's
	// took ~1.7 ms of each lapse with 1,000 streams in one set, on the
	// syncer's goroutine, before the cache update.
	followers map[string]map[string]map[int64]struct{}
	policy    *PolicyStore          // nil without an authorization policy
	auth      map[int64]*streamAuth // by streamKey
	conns     map[int64]streamConn  // every open stream's client, by streamKey
	refused   refusals
	xdsTelemetry
}

// streamKey names a stream in x's maps. go-control-plane numbers SotW and
// delta streams with separate counters, so the first stream of each is
// stream 1: keyed by that number alone, a delta stream was taken for the
// SotW stream of its number (and refused, its node "changed"), and the end
// of one dropped the other. Delta streams are keyed by their number negated.
func streamKey(id int64, delta bool) int64 {
	if delta {
		return -id
	}
	return id
}

// streamConn is who opened a stream: its peer address and, with mTLS, the
// identity of its client certificate.
type streamConn struct {
	peer, identity string
	// typeURL is the stream's own type: a per-type delta stream's requests
	// may leave theirs empty, and the delta server fills it in only after
	// the request callback has run.
	typeURL string
}

// StreamInfo describes one dispatcher stream for /debug/dispatchers.
type StreamInfo struct {
	Stream int64  `json:"stream"`
	NodeID string `json:"node_id"`
	Group  string `json:"constraint_set"`
	Mode   string `json:"mode"` // sotw or delta
	// EndpointMetadata is what its endpoints carry (node metadata
	// endpoint_metadata: full, session or none).
	EndpointMetadata string `json:"endpoint_metadata"`
	// VersionConstraint, Labels and Datacenter are its constraint set ("":
	// leasehold's own datacenter); GrantedTasks the task types the
	// authorization policy grants it (nil: no policy, every task type).
	VersionConstraint string               `json:"version_constraint,omitempty"`
	Labels            map[string]string    `json:"labels,omitempty"`
	Datacenter        string               `json:"datacenter,omitempty"`
	GrantedTasks      []string             `json:"granted_tasks"`
	Peer              string               `json:"peer,omitempty"`     // its client's address
	Identity          string               `json:"identity,omitempty"` // its mTLS identity
	Opened            time.Time            `json:"opened"`
	AgeSec            float64              `json:"age_seconds"`
	Types             map[string]*TypeInfo `json:"types"`
	dispatch          health.Dispatcher
	key               int64        // streamKey
	node              *corev3.Node // the node of the latest request, guarded by x.mu
}

// TypeInfo is the state of one resource type on a stream.
type TypeInfo struct {
	Subscribed []string `json:"subscribed"` // the names subscribed ("*" aside)
	// Wildcard: every resource of the type is sent (a legacy wildcard, a
	// first request naming nothing, or "*"), whatever names it also has.
	Wildcard  bool      `json:"wildcard"`
	LastSent  string    `json:"last_sent_version,omitempty"`
	SentAt    time.Time `json:"last_sent_at,omitzero"`
	LastAcked string    `json:"last_acked_version,omitempty"`
	AckedAt   time.Time `json:"last_acked_at,omitzero"`
	LastNack  *Nack     `json:"last_nack,omitempty"`
	Nacks     int       `json:"nacks,omitempty"` // NACKs on this stream
	sentNonce string
	asked     []string // the names of the last state-of-the-world request, as sent
	// sub is the subscription as go-control-plane keeps it (its own type
	// and rules: legacy wildcard, "*", delta's subscribe and unsubscribe),
	// so a stream is said to follow what the library will push it.
	sub *stream.Subscription
	// watchNonce is the nonce go-control-plane's state-of-the-world watch of
	// the type holds: the last response's, until a request (not ignored)
	// replaces the watch with one that holds none.
	watchNonce string
	push       trace.Span // open from a response until its ACK or NACK
}

// Nack is a rejected response.
type Nack struct {
	Version string    `json:"version"`
	Detail  string    `json:"error_detail"`
	Reason  string    `json:"reason"` // NackReason of Detail
	At      time.Time `json:"at"`
}

// NackReason sorts a NACK's error detail into a fixed set of reasons, so that
// a metric label stays bounded whatever a client writes. The reasons are
// duplicate (grpc-go refusing two endpoints at one address), address (Envoy
// refusing a name or a malformed IP in a socket_address), weight,
// validation, decode, unspecified (no message) and other.
func NackReason(detail string) string {
	d := strings.ToLower(detail)
	switch {
	case strings.TrimSpace(d) == "":
		return "unspecified"
	case strings.Contains(d, "duplicate"):
		return "duplicate"
	case strings.Contains(d, "ip address") || strings.Contains(d, "socket_address") ||
		strings.Contains(d, "socketaddress"):
		return "address"
	case strings.Contains(d, "weight"):
		return "weight"
	case strings.Contains(d, "unmarshal") || strings.Contains(d, "unexpected resource type"):
		return "decode"
	case strings.Contains(d, "validation") || strings.Contains(d, "invalid"):
		return "validation"
	}
	return "other"
}

// XDSOptions are optional; zero values mean no tracing and no metrics.
type XDSOptions struct {
	Tracer trace.TracerProvider
	Meter  metric.MeterProvider
	// Policy, when set, grants each client identity (mTLS) its task types;
	// streams of identities without a grant are refused.
	Policy *PolicyStore
}

// NewXDS serves the syncer's cache; the syncer learns which constraint sets
// are in use. Call before the syncer runs.
func NewXDS(ctx context.Context, syncer *fleet.Syncer, log *slog.Logger, opts ...XDSOptions) *XDS {
	var o XDSOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	x := &XDS{subs: syncer, log: log.With("component", "xds"), streams: map[int64]*StreamInfo{},
		policy: o.Policy, auth: map[int64]*streamAuth{}, conns: map[int64]streamConn{}}
	x.initTelemetry(o)
	syncer.Notify(x.onPublish)
	x.srv = xdsserver.NewServer(ctx, syncer.Cache(), x.callbacks())
	return x
}

// Register adds the aggregated and per-type discovery services to g.
func (x *XDS) Register(g *grpc.Server) {
	discovery.RegisterAggregatedDiscoveryServiceServer(g, x.srv)
	endpointservice.RegisterEndpointDiscoveryServiceServer(g, x.srv)
	clusterservice.RegisterClusterDiscoveryServiceServer(g, x.srv)
	routeservice.RegisterRouteDiscoveryServiceServer(g, x.srv)
	listenerservice.RegisterListenerDiscoveryServiceServer(g, x.srv)
}

func (x *XDS) callbacks() xdsserver.CallbackFuncs {
	return xdsserver.CallbackFuncs{
		StreamOpenFunc: func(ctx context.Context, id int64, _ string) error {
			return x.opened(ctx, id, streamKey(id, false), "sotw", "")
		},
		DeltaStreamOpenFunc: func(ctx context.Context, id int64, typeURL string) error {
			return x.opened(ctx, id, streamKey(id, true), "delta", typeURL)
		},
		StreamRequestFunc: func(id int64, req *discovery.DiscoveryRequest) error {
			key := streamKey(id, false)
			if err := x.authorize(key, id, req.GetNode(), req.GetTypeUrl(),
				req.GetResourceNames()); err != nil {
				return x.refuse(key, "sotw", req.GetNode().GetId(), authzReason(err), err)
			}
			info, err := x.onRequest(key, id, req.GetNode(), req.GetTypeUrl(), "sotw")
			if err != nil {
				return err
			}
			x.mu.Lock()
			defer x.mu.Unlock()
			t := info.typeInfo(req.GetTypeUrl())
			x.sotwRequest(info, req.GetTypeUrl(), t, req.GetResourceNames(),
				req.GetResponseNonce())
			if err := tooManyNames(t, req.GetTypeUrl(), "resource_names"); err != nil {
				return x.refuseLocked(key, "sotw", info.NodeID, RefusedTooManyNames, err)
			}
			x.ackOrNack(t, req.GetTypeUrl(), req.GetResponseNonce(), req.GetVersionInfo(),
				req.GetErrorDetail().GetMessage(), req.GetErrorDetail() != nil, info)
			return nil
		},
		StreamResponseFunc: func(
			_ context.Context, id int64, _ *discovery.DiscoveryRequest,
			resp *discovery.DiscoveryResponse,
		) {
			x.sent(streamKey(id, false), resp.GetTypeUrl(), resp.GetVersionInfo(), resp.GetNonce())
		},
		StreamDeltaRequestFunc: func(id int64, req *discovery.DeltaDiscoveryRequest) error {
			key := streamKey(id, true)
			if err := x.authorize(key, id, req.GetNode(), req.GetTypeUrl(),
				req.GetResourceNamesSubscribe()); err != nil {
				return x.refuse(key, "delta", req.GetNode().GetId(), authzReason(err), err)
			}
			info, err := x.onRequest(key, id, req.GetNode(), req.GetTypeUrl(), "delta")
			if err != nil {
				return err
			}
			x.mu.Lock()
			defer x.mu.Unlock()
			typeURL := req.GetTypeUrl()
			if typeURL == "" {
				typeURL = x.conns[key].typeURL // a per-type stream's (ADS: refused next)
			}
			t := info.typeInfo(typeURL)
			x.deltaRequest(info, typeURL, t, req.GetResourceNamesSubscribe(),
				req.GetResourceNamesUnsubscribe())
			if err := tooManyNames(t, typeURL, "resource_names_subscribe"); err != nil {
				return x.refuseLocked(key, "delta", info.NodeID, RefusedTooManyNames, err)
			}
			x.ackOrNack(t, typeURL, req.GetResponseNonce(), t.LastSent,
				req.GetErrorDetail().GetMessage(), req.GetErrorDetail() != nil, info)
			return nil
		},
		StreamDeltaResponseFunc: func(
			id int64, _ *discovery.DeltaDiscoveryRequest, resp *discovery.DeltaDiscoveryResponse,
		) {
			var parts []string
			for _, r := range resp.GetResources() {
				parts = append(parts, r.GetName()+"@"+r.GetVersion())
			}
			sort.Strings(parts)
			x.sent(streamKey(id, true), resp.GetTypeUrl(), strings.Join(parts, ","),
				resp.GetNonce())
		},
		StreamClosedFunc:      func(id int64, _ *corev3.Node) { x.onClosed(streamKey(id, false)) },
		DeltaStreamClosedFunc: func(id int64, _ *corev3.Node) { x.onClosed(streamKey(id, true)) },
		FetchRequestFunc: func(ctx context.Context, req *discovery.DiscoveryRequest) error {
			if x.policy == nil {
				xdscache.StampGrant(req.GetNode(), nil)
			} else if g, ok := x.policy.Grant(PeerIdentity(ctx)); ok {
				xdscache.StampGrant(req.GetNode(), g.TaskList())
			} else {
				return status.Errorf(codes.PermissionDenied,
					"no authorization grant for client identity %s", PeerIdentity(ctx))
			}
			if _, err := xdscache.DispatcherOf(req.GetNode()); err != nil {
				return status.Error(codes.InvalidArgument, err.Error())
			}
			return nil
		},
	}
}

func (i *StreamInfo) typeInfo(typeURL string) *TypeInfo {
	t := i.Types[typeURL]
	if t == nil {
		t = &TypeInfo{}
		i.Types[typeURL] = t
	}
	return t
}

// maxSubscribedNames bounds the names a stream subscribes of one type. A
// dispatcher follows a load assignment per task type and shard (thousands);
// without a bound a delta client adding names request after request would
// grow the subscription (the library's, this record and the cache's index)
// and the work of each of its requests without end.
const maxSubscribedNames = 1 << 16

// tooManyNames is the error ending a stream whose subscription of typeURL
// names more than maxSubscribedNames, naming the request's field.
func tooManyNames(t *TypeInfo, typeURL, field string) error {
	if n := len(t.Subscribed); n > maxSubscribedNames {
		return status.Errorf(codes.InvalidArgument,
			"%s: the stream would subscribe %d names of %s; at most %d of one type",
			field, n, typeURL, maxSubscribedNames)
	}
	return nil
}

// sotwRequest follows a state-of-the-world request's names as
// go-control-plane does: a first request makes the subscription (legacy
// wildcard allowed, as the server is built), a later one replaces its names
// unless its nonce is stale (the library ignores such a request); an ACK
// repeating its names, in the same order, changes nothing and costs no copy
// or sort. x.mu is held.
func (x *XDS) sotwRequest(info *StreamInfo, typeURL string, t *TypeInfo, names []string,
	nonce string) {
	switch {
	case t.sub == nil:
		x.resubscribe(info, typeURL, t, func() {
			s := stream.NewSotwSubscription(names, true)
			t.sub = &s
		})
	case t.watchNonce != "" && nonce != t.watchNonce:
		return
	case !slices.Equal(t.asked, names):
		x.resubscribe(info, typeURL, t, func() { t.sub.SetResourceSubscription(names) })
	}
	// The library replaced the type's watch with one that holds no nonce
	// until its next response: until then no request is stale.
	t.watchNonce = ""
	t.asked = names
}

// deltaRequest follows a delta request's subscribe and unsubscribe lists as
// go-control-plane does (a first request naming nothing is a wildcard that
// names added later do not end; only unsubscribing "*" does). x.mu is held.
func (x *XDS) deltaRequest(info *StreamInfo, typeURL string, t *TypeInfo, sub, unsub []string) {
	switch {
	case t.sub == nil:
		x.resubscribe(info, typeURL, t, func() {
			s := stream.NewDeltaSubscription(sub, unsub, nil, true)
			t.sub = &s
		})
	case len(sub)+len(unsub) > 0:
		x.resubscribe(info, typeURL, t, func() { t.sub.UpdateResourceSubscriptions(sub, unsub) })
	}
	// An unsubscribed name is kept among the returned resources (at version
	// ""), which the library replaces at its next response; this copy
	// follows names only, and must not grow with every name ever dropped.
	if len(t.sub.ReturnedResources()) > 0 {
		t.sub.SetReturnedResources(map[string]string{}) // not nil: an unsubscribe writes to it
	}
}

// resubscribe applies change to t's subscription and, for a held stream's
// endpoints, moves the stream in followers from what it followed to what it
// follows now; x.mu is held.
func (x *XDS) resubscribe(info *StreamInfo, typeURL string, t *TypeInfo, change func()) {
	held := typeURL == resource.EndpointType && x.streams[info.key] == info
	if held {
		x.follow(info, false)
	}
	change()
	t.Wildcard = t.sub.IsWildcard()
	t.Subscribed = slices.Sorted(maps.Keys(t.sub.SubscribedResources()))
	if held {
		x.follow(info, true)
	}
}

// ackOrNack records what a request says of the previous response.
func (x *XDS) ackOrNack(
	t *TypeInfo, typeURL, nonce, version, detail string, nack bool, info *StreamInfo,
) {
	if nonce == "" || nonce != t.sentNonce {
		return // first request, or about an older response
	}
	now := time.Now()
	reason := ""
	if nack {
		reason = NackReason(detail)
	}
	x.answered(t, typeURL, now, nack, reason, detail)
	if nack {
		t.LastNack = &Nack{Version: t.LastSent, Detail: detail, Reason: reason, At: now}
		t.Nacks++
		// Every stream of a constraint set gets the same version: one line
		// per version, not one per dispatcher.
		if x.firstNack(typeURL, t.LastSent) {
			x.log.Warn("dispatcher rejected a response (NACK); "+
				"further NACKs of this version are counted, not logged",
				"node_id", info.NodeID, "stream", info.Stream, "group", info.Group,
				"type_url", typeURL, "version", t.LastSent, "reason", reason,
				"error_detail", detail)
		}
		return
	}
	t.LastAcked, t.AckedAt = version, now
	if typeURL == resource.EndpointType {
		x.endpointsAcked(info.key, t, now)
	}
}

func (x *XDS) sent(key int64, typeURL, version, nonce string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if info := x.streams[key]; info != nil {
		t := info.typeInfo(typeURL)
		t.LastSent, t.SentAt, t.sentNonce, t.watchNonce = version, time.Now(), nonce, nonce
		x.startPush(info, t, typeURL, version)
	}
}

// onRequest validates the node of a stream's first request, refusing the
// stream with InvalidArgument naming the bad field, and subscribes its
// constraint set before the cache sees the request. A later request whose
// node differs from the stream's latest is checked by sameNode.
func (x *XDS) onRequest(
	key, id int64, node *corev3.Node, typeURL, mode string,
) (*StreamInfo, error) {
	x.mu.Lock()
	info, known := x.streams[key]
	var last *corev3.Node
	if known {
		last = info.node
	}
	x.mu.Unlock()
	if known {
		// A delta request may come without a node (nil); the stream's node
		// then stands.
		if node != nil && node != last {
			if err := x.sameNode(info, last, node); err != nil {
				return nil, x.refuse(key, mode, info.NodeID, RefusedNodeChanged, err)
			}
			x.mu.Lock()
			info.node = node
			x.mu.Unlock()
		}
		return info, nil
	}
	d, err := xdscache.DispatcherOf(node)
	if err != nil {
		x.log.Warn("dispatcher refused: invalid node metadata", "node_id", node.GetId(), "err", err)
		return nil, x.refuse(key, mode, node.GetId(), RefusedInvalidNode,
			status.Error(codes.InvalidArgument, err.Error()))
	}
	form, _ := xdscache.EndpointMetadataOf(node) // DispatcherOf has validated it
	x.subs.Subscribe(d)
	info = &StreamInfo{Stream: id, NodeID: node.GetId(), Group: d.Key(), Mode: mode,
		EndpointMetadata: string(form), VersionConstraint: d.VersionConstraint,
		Labels: d.Labels, Datacenter: d.Datacenter, GrantedTasks: d.Tasks,
		Opened: time.Now(), Types: map[string]*TypeInfo{}, dispatch: d, key: key, node: node}
	x.mu.Lock()
	c := x.conns[key]
	info.Peer, info.Identity = c.peer, c.identity
	x.addStream(key, info)
	n := len(x.streams)
	x.mu.Unlock()
	x.log.Info("dispatcher stream", "node_id", node.GetId(), "stream", id, "mode", mode,
		"type_url", typeURL, "group", d.Key(), "streams", n)
	return info, nil
}

// sameNode ends a stream whose node changed after its first request
// (InvalidArgument naming the field) unless its id, constraint set and
// endpoint metadata are unchanged. It does not re-subscribe: the watches of
// the other types on the stream were made under the first node's constraint
// set, so the stream would be answered from two sets at once — or, for a
// set with no snapshot, never. Envoy sends the same node on every request
// and grpc-go sends it once, so only a client changing its mind meets this,
// and it reconnects.
func (x *XDS) sameNode(info *StreamInfo, last, node *corev3.Node) error {
	if last != nil && sameDispatch(last, node) {
		return nil
	}
	refuse := func(field, format string, args ...any) error {
		msg := field + ": " + fmt.Sprintf(format, args...)
		x.log.Warn("dispatcher stream ended: node changed on a later request",
			"node_id", info.NodeID, "stream", info.Stream, "field", field, "err", msg)
		return status.Error(codes.InvalidArgument, msg)
	}
	if node.GetId() != info.NodeID {
		return refuse("node.id",
			"changed from %q to %q on a later request of the stream; a stream serves one node: "+
				"open a new one", info.NodeID, node.GetId())
	}
	d, err := xdscache.DispatcherOf(node)
	if err != nil {
		x.log.Warn("dispatcher stream ended: invalid node metadata on a later request",
			"node_id", info.NodeID, "stream", info.Stream, "err", err)
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if form, _ := xdscache.EndpointMetadataOf(node); string(form) != info.EndpointMetadata {
		// The stream's watches are in its first form's cache group.
		field := "node.metadata." + xdscache.NodeMetaEndpointMetadata
		return refuse(field,
			"changed from %q to %q on a later request of the stream; a stream keeps the endpoint "+
				"metadata of its first request: open a new stream", info.EndpointMetadata, form)
	}
	if d.Key() == info.Group {
		return nil // other metadata changed, not the constraint set
	}
	field := "node.metadata"
	switch {
	case d.VersionConstraint != info.dispatch.VersionConstraint:
		field += "." + health.NodeMetaVersionConstraint
	case !maps.Equal(d.Labels, info.dispatch.Labels):
		field += "." + health.NodeMetaLabels
	case d.Datacenter != info.dispatch.Datacenter:
		field += "." + health.NodeMetaDatacenter + " (or node.locality.region)"
	case d.SingleCluster != info.dispatch.SingleCluster:
		field += "." + xdscache.NodeMetaWeightedClusters
	}
	return refuse(field,
		"the constraint set changed on a later request of the stream (from %q to %q); a stream "+
			"keeps the constraint set of its first request: open a new stream", info.Group, d.Key())
}

// sameDispatch reports whether two nodes have the same id and give the
// cache's GroupOf the same inputs (xdscache.SameGroupInputs: the constraint
// set's metadata, datacenter, weighted_clusters, grant, endpoint metadata and
// locality region), so the stream goes on as it is. It compares nothing
// else: Envoy repeats its whole node on every request, and comparing all of
// it (user agent, hundreds of extensions) on every ACK cost more CPU than
// anything else leasehold does per ACK.
func sameDispatch(a, b *corev3.Node) bool {
	return a.GetId() == b.GetId() && xdscache.SameGroupInputs(a, b)
}

func (x *XDS) onClosed(key int64) {
	x.mu.Lock()
	info, ok := x.streams[key]
	x.dropStream(key)
	delete(x.conns, key)
	delete(x.auth, key)
	if ok {
		x.streamGone(info)
	}
	x.mu.Unlock()
	if ok {
		x.subs.Unsubscribe(info.dispatch)
	}
}

// addStream holds info as stream key's state, and the load assignments it
// follows in followers; x.mu is held.
func (x *XDS) addStream(key int64, info *StreamInfo) {
	x.dropStream(key) // onRequest adds a stream once; this keeps followers exact regardless
	x.streams[key] = info
	x.follow(info, true)
}

// dropStream forgets stream key's state; x.mu is held.
func (x *XDS) dropStream(key int64) {
	info, ok := x.streams[key]
	if !ok {
		return
	}
	x.follow(info, false)
	delete(x.streams, key)
}

// follow adds (or removes) info's stream as a follower of each load
// assignment its endpoints subscription names, or of all ("") as a
// wildcard; a stream that asked for no endpoints, or subscribes none,
// follows none; x.mu is held.
func (x *XDS) follow(info *StreamInfo, add bool) {
	t := info.Types[resource.EndpointType]
	if t == nil {
		return
	}
	names := t.Subscribed
	if t.Wildcard {
		names = []string{""}
	}
	set := x.followers[info.Group]
	for _, n := range names {
		if add {
			if set == nil {
				if x.followers == nil {
					x.followers = map[string]map[string]map[int64]struct{}{}
				}
				set = map[string]map[int64]struct{}{}
				x.followers[info.Group] = set
			}
			if set[n] == nil {
				set[n] = map[int64]struct{}{}
			}
			set[n][info.key] = struct{}{}
			continue
		}
		if keys := set[n]; keys != nil {
			delete(keys, info.key)
			if len(keys) == 0 {
				delete(set, n)
			}
		}
	}
	if set != nil && len(set) == 0 {
		delete(x.followers, info.Group)
	}
}

// streamsByMode counts the open streams per mode (sotw, delta; both
// always present). The gauge asks at every collection: counting, not
// copying every stream's state as Dispatchers does (~10 KB a stream).
func (x *XDS) streamsByMode() map[string]int64 {
	counts := map[string]int64{"sotw": 0, "delta": 0}
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, s := range x.streams {
		counts[s.Mode]++
	}
	return counts
}

// Dispatchers is a copy of every stream's state, sorted by node id.
func (x *XDS) Dispatchers() []StreamInfo {
	x.mu.Lock()
	defer x.mu.Unlock()
	out := make([]StreamInfo, 0, len(x.streams))
	for _, s := range x.streams {
		c := *s
		c.AgeSec = time.Since(s.Opened).Seconds()
		c.Labels = maps.Clone(s.Labels)
		c.GrantedTasks = slices.Clone(s.GrantedTasks)
		c.Types = make(map[string]*TypeInfo, len(s.Types))
		for k, t := range s.Types {
			tc := *t
			tc.Subscribed = append([]string(nil), t.Subscribed...)
			tc.sub, tc.asked, tc.push = nil, nil, nil // the stream's own, not a copy's
			if t.LastNack != nil {
				n := *t.LastNack
				tc.LastNack = &n
			}
			c.Types[k] = &tc
		}
		out = append(out, c)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].NodeID != out[j].NodeID {
			return out[i].NodeID < out[j].NodeID
		}
		return out[i].Stream < out[j].Stream
	})
	return out
}
