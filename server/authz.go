package server

import (
	"context"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/leasehold/leasehold/snapshot/translator"
	"github.com/leasehold/leasehold/snapshot/xdscache"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// streamAuth is what a stream's client identity is granted, and under which
// policy version that was decided.
type streamAuth struct {
	id      Identity
	grant   Grant
	version int64
	denied  map[string]bool // resource names already logged as not granted
}

// maxDeniedNames bounds the names outside its grant a stream's denials are
// remembered, counted and logged for: a client naming ever new ones must not
// grow leasehold's memory or its log without end (nothing is sent for any of
// them either way).
const maxDeniedNames = 256

// openStream decides, when stream id (streamKey key) opens, whether its
// client identity has a grant. Without a policy every stream is let through.
func (x *XDS) openStream(ctx context.Context, key, id int64) error {
	if x.policy == nil {
		return nil
	}
	ident := PeerIdentity(ctx)
	version := x.policy.Version()
	g, ok := x.policy.Grant(ident)
	if !ok {
		x.denied.Add(ctx, 1, metric.WithAttributes(attribute.String("api", "xds")))
		x.log.Warn("dispatcher refused: no grant for its identity", "identity", ident.String(),
			"stream", id)
		return status.Errorf(codes.PermissionDenied,
			"no authorization grant for client identity %s", ident)
	}
	x.mu.Lock()
	x.auth[key] = &streamAuth{id: ident, grant: g, version: version, denied: map[string]bool{}}
	x.mu.Unlock()
	return nil
}

// authorize stamps the stream's grant into the node the cache will see (or
// removes whatever a client put there), ends a stream whose grant a policy
// change altered, and logs subscriptions to task types outside the grant —
// which get nothing, exactly as if those task types did not exist.
func (x *XDS) authorize(
	key, id int64, node *corev3.Node, typeURL string, names []string,
) error {
	if x.policy == nil {
		xdscache.StampGrant(node, nil)
		return nil
	}
	x.mu.Lock()
	a := x.auth[key]
	x.mu.Unlock()
	if a == nil {
		return status.Error(codes.PermissionDenied, "stream not authorized")
	}
	if v := x.policy.Version(); v != a.version {
		g, ok := x.policy.Grant(a.id)
		if !ok || !g.equal(a.grant) {
			x.log.Info("authorization policy changed for a connected dispatcher: ending its stream",
				"identity", a.id.String(), "stream", id)
			return status.Error(codes.Unavailable, "authorization policy changed: reconnect")
		}
		a.version = v
	}
	xdscache.StampGrant(node, a.grant.TaskList())
	for _, n := range names {
		if !a.grant.AllowsTask(translator.TaskOf(n)) && !a.denied[n] &&
			len(a.denied) < maxDeniedNames {
			a.denied[n] = true
			x.denied.Add(context.Background(), 1,
				metric.WithAttributes(attribute.String("api", "xds")))
			if len(a.denied) == maxDeniedNames {
				x.log.Info("subscriptions outside the dispatcher's grant: further names of "+
					"this stream are neither counted nor logged", "identity", a.id.String(),
					"stream", id, "names", maxDeniedNames)
			}
			x.log.Info("subscription outside the dispatcher's grant: nothing is sent for it",
				"identity", a.id.String(), "stream", id, "type_url", typeURL, "name", n)
		}
	}
	return nil
}

// FencingAuthorizer guards leasehold.v1.Fencing with the policy: a client
// identity must be granted the call, and a session none of whose task types
// are granted is answered as never seen.
type FencingAuthorizer struct {
	policy *PolicyStore
	denied metric.Int64Counter
}

// NewFencingAuthorizer returns nil without a policy (everything allowed).
func NewFencingAuthorizer(p *PolicyStore, m metric.MeterProvider) *FencingAuthorizer {
	if p == nil {
		return nil
	}
	a := &FencingAuthorizer{policy: p}
	a.denied, _ = m.Meter("github.com/leasehold/leasehold/server").Int64Counter(
		"leasehold.authz.denied", metric.WithDescription(
			"requests refused by the authorization policy, by API (xds, fencing)"))
	return a
}

type grantKey struct{}

// grantFrom is the caller's grant; ok is false when no policy applies.
func grantFrom(ctx context.Context) (Grant, bool) {
	g, ok := ctx.Value(grantKey{}).(Grant)
	return g, ok
}

func (a *FencingAuthorizer) check(ctx context.Context, method string) (context.Context, error) {
	const prefix = "/leasehold.v1.Fencing/"
	if !strings.HasPrefix(method, prefix) {
		return ctx, nil
	}
	call := strings.TrimPrefix(method, prefix)
	ident := PeerIdentity(ctx)
	g, ok := a.policy.Grant(ident)
	if !ok || !g.AllowsCall(call) {
		a.denied.Add(ctx, 1, metric.WithAttributes(attribute.String("api", "fencing")))
		return ctx, status.Errorf(codes.PermissionDenied,
			"client identity %s is not granted %s", ident, call)
	}
	return context.WithValue(ctx, grantKey{}, g), nil
}

// UnaryInterceptor checks unary fencing calls.
func (a *FencingAuthorizer) UnaryInterceptor() grpc.UnaryServerInterceptor {
	return func(
		ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler,
	) (any, error) {
		ctx, err := a.check(ctx, info.FullMethod)
		if err != nil {
			return nil, err
		}
		return h(ctx, req)
	}
}

// StreamInterceptor checks streaming fencing calls.
func (a *FencingAuthorizer) StreamInterceptor() grpc.StreamServerInterceptor {
	return func(
		srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler,
	) error {
		ctx, err := a.check(ss.Context(), info.FullMethod)
		if err != nil {
			return err
		}
		return h(srv, &grantedStream{ServerStream: ss, ctx: ctx})
	}
}

type grantedStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *grantedStream) Context() context.Context { return s.ctx }
