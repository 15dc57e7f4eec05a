package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	v3orcaservicepb "github.com/cncf/xds/go/xds/service/orca/v3"

	"github.com/leasehold/leasehold/adapters/loadreport"
)

// prober checks that the executor itself serves, so a heartbeat proves more
// than that the sidecar runs.
type prober interface {
	Probe(ctx context.Context) error
	Close() error
}

// newProber parses --probe: grpc://HOST:PORT[/service] runs the standard gRPC
// health check (SERVING passes); http(s)://... passes on a 2xx answer.
func newProber(raw string) (prober, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("%q is not a URL: %w", raw, err)
	}
	if u.Host == "" || u.Port() == "" {
		return nil, fmt.Errorf("%q: want scheme://HOST:PORT", raw)
	}
	switch u.Scheme {
	case "grpc":
		conn, err := grpc.NewClient(u.Host,
			grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, fmt.Errorf("%q: %w", raw, err)
		}
		p := &grpcProber{conn: conn, client: healthpb.NewHealthClient(conn),
			service: strings.TrimPrefix(u.Path, "/")}
		p.inFlight.Store(-1)
		return p, nil
	case "http", "https":
		return &httpProber{url: u.String(), client: &http.Client{}}, nil
	default:
		return nil, fmt.Errorf("%q: scheme must be grpc, http or https", raw)
	}
}

type grpcProber struct {
	conn    *grpc.ClientConn
	client  healthpb.HealthClient
	service string

	// The tasks in flight (-1 when it reports none) and the number of probes
	// in a row that got no report, from the executor's own ORCA report read
	// at each probe.
	inFlight atomic.Int64
	misses   atomic.Int32
}

func (p *grpcProber) Probe(ctx context.Context) error {
	resp, err := p.client.Check(ctx, &healthpb.HealthCheckRequest{Service: p.service})
	if err != nil {
		return fmt.Errorf("grpc health check: %w", err)
	}
	if resp.Status != healthpb.HealthCheckResponse_SERVING {
		return fmt.Errorf("grpc health check: %s", resp.Status)
	}
	// The load report is optional: it may take a quarter of what is left of
	// the probe's time, never all of it. The Registrar stamps a heartbeat
	// before its probe, so a report that never comes would otherwise delay
	// every renewal by a whole heartbeat interval — with a lease of 2× the
	// heartbeat, past the lease's end.
	octx := ctx
	if dl, ok := ctx.Deadline(); ok {
		var cancel context.CancelFunc
		octx, cancel = context.WithTimeout(ctx, time.Until(dl)/4)
		defer cancel()
	}
	switch n, err := p.readORCA(octx); {
	case err == nil:
		p.inFlight.Store(n)
		p.misses.Store(0)
	case status.Code(err) == codes.Unimplemented: // it sends no reports
		p.inFlight.Store(-1)
	case p.misses.Add(1) > maxORCAMisses:
		p.inFlight.Store(-1)
	default:
		// There was no answer this time. An overloaded executor is slow to
		// answer, so its last load stands for a few probes rather than "free".
	}
	return nil
}

// maxORCAMisses is how many probes in a row may go without a load report
// before the last one reported stops counting.
const maxORCAMisses = 3

// maxORCALoad bounds a reported load, because a float beyond int64's range
// converts to an implementation-defined integer (negative on amd64, which
// would read as "no report").
const maxORCALoad = 1 << 30

// readORCA is the executor's tasks in flight, read from the first report of
// its out-of-band ORCA service: the in_flight metric, or else utilization ×
// capacity, and -1 when its report has neither. The first report is sent at
// once when the stream opens, while grpc-go sends the next only 30 s later,
// so a stream per probe keeps the load current.
func (p *grpcProber) readORCA(ctx context.Context) (int64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := v3orcaservicepb.NewOpenRcaServiceClient(p.conn).StreamCoreMetrics(ctx,
		&v3orcaservicepb.OrcaLoadReportRequest{})
	if err != nil {
		return -1, err
	}
	rep, err := stream.Recv()
	if err != nil {
		return -1, err
	}
	if n, ok := rep.GetNamedMetrics()[loadreport.MetricInFlight]; ok && n >= 0 {
		return int64(min(n, maxORCALoad)), nil
	}
	if c, ok := rep.GetNamedMetrics()[loadreport.MetricCapacity]; ok &&
		rep.GetApplicationUtilization() > 0 {
		if n := rep.GetApplicationUtilization() * c; n >= 0 { // not NaN, not negative
			return int64(min(n, maxORCALoad) + 0.5), nil
		}
	}
	return -1, nil
}

// Load is the tasks in flight the executor last reported over ORCA; ok is
// false when it reports none.
func (p *grpcProber) Load() (n int, ok bool) {
	v := p.inFlight.Load()
	return int(max(v, 0)), v >= 0
}

func (p *grpcProber) Close() error { return p.conn.Close() }

type httpProber struct {
	url    string
	client *http.Client
}

func (p *httpProber) Probe(ctx context.Context) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.url, nil)
	if err != nil {
		return err
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return fmt.Errorf("http probe: %w", err)
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("http probe: %s", resp.Status)
	}
	return nil
}

func (p *httpProber) Close() error { p.client.CloseIdleConnections(); return nil }

// loadReader polls --load-url in the background; Load returns the last good
// reading, so a slow endpoint never delays a heartbeat.
type loadReader struct {
	url    string
	client *http.Client
	load   atomic.Int64
}

func newLoadReader(raw string) (*loadReader, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("%q: want an http(s) URL", raw)
	}
	return &loadReader{url: u.String(), client: &http.Client{}}, nil
}

func (l *loadReader) Load() int { return int(l.load.Load()) }

func (l *loadReader) poll(ctx context.Context, every time.Duration, log *slog.Logger) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		if n, err := l.read(ctx, every); err == nil {
			l.load.Store(int64(n))
		} else if ctx.Err() == nil {
			log.Warn("load not read; keeping the last value", "url", l.url,
				"load", l.Load(), "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (l *loadReader) read(ctx context.Context, timeout time.Duration) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, l.url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := l.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if err != nil {
		return 0, err
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("load url: %s", resp.Status)
	}
	return parseLoad(body)
}

// parseLoad accepts "3" or {"load": 3}.
func parseLoad(body []byte) (int, error) {
	text := strings.TrimSpace(string(body))
	if n, err := strconv.Atoi(text); err == nil {
		if n < 0 {
			return 0, errors.New("load is negative")
		}
		return n, nil
	}
	var v struct {
		Load *int `json:"load"`
	}
	if err := json.Unmarshal([]byte(text), &v); err != nil || v.Load == nil {
		return 0, fmt.Errorf("load body %.40q: want an integer or {\"load\": N}", text)
	}
	if *v.Load < 0 {
		return 0, errors.New("load is negative")
	}
	return *v.Load, nil
}
