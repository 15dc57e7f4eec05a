package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"time"
)

// The admin client: every command that asks a replica's admin port (explain,
// dispatchers, cordon's view of the cordons) goes through adminGet, so that
// each says in a sentence what went wrong — the wrong port, a missing token —
// rather than quoting the HTTP client or the answer's raw JSON.

func getJSON(ctx context.Context, f explainFlags, path string, v any) error {
	status, b, err := adminGet(ctx, f, path)
	if err != nil {
		return err
	}
	if status != http.StatusOK {
		return adminStatusError(f, path, status, b)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("admin API at %s: %s: the answer is not leasehold's JSON (is it "+
			"leasehold serve's --admin-addr?): %w", f.admin, path, err)
	}
	return nil
}

// getJSONStatus is getJSON for a path whose every status carries a JSON
// body (/readyz answers 503 with its reason).
func getJSONStatus(ctx context.Context, f explainFlags, path string, v any) (int, error) {
	status, b, err := adminGet(ctx, f, path)
	if err != nil {
		return 0, err
	}
	if status == http.StatusUnauthorized || status == http.StatusForbidden {
		return 0, adminStatusError(f, path, status, b)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return 0, fmt.Errorf("%s: %d %s: %w", path, status, http.StatusText(status), err)
	}
	return status, nil
}

// adminGet reads path from the replica's admin port.
func adminGet(ctx context.Context, f explainFlags, path string) (int, []byte, error) {
	base := f.admin
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	scheme, client := "http://", http.DefaultClient
	if f.client != nil {
		scheme, client = "https://", f.client
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, scheme+base+path, nil)
	if err != nil {
		return 0, nil, err
	}
	if f.token != "" {
		req.Header.Set("Authorization", "Bearer "+f.token)
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, nil, adminDialError(ctx, base, f.client == nil, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return 0, nil, fmt.Errorf("admin API at %s: %s: %w", base, path, err)
	}
	return resp.StatusCode, b, nil
}

// errGRPCPort is the wrong port most easily given: leasehold's own xDS port.
var errGRPCPort = errors.New("that is leasehold's gRPC (xDS and fencing) port, not its " +
	"admin port: give leasehold serve's --admin-addr (default 127.0.0.1:19000)")

// adminDialError says why the admin port could not be read. A gRPC server
// sends an HTTP/2 SETTINGS frame as a connection opens, which net/http
// quotes as a malformed response starting "\x00\x00\x06\x04" — or, when the
// frame comes before the request is written, as a bare read error; over TLS
// it refuses a client that does not offer HTTP/2 before any byte is read.
func adminDialError(ctx context.Context, addr string, plain bool, err error) error {
	msg := err.Error()
	if strings.Contains(msg, `malformed HTTP response "\x00\x00`) ||
		strings.Contains(msg, "no application protocol") ||
		(plain && ctx.Err() == nil && !errors.Is(err, syscall.ECONNREFUSED) &&
			opensWithHTTP2Settings(ctx, addr)) {
		return fmt.Errorf("admin API at %s: %w", addr, errGRPCPort)
	}
	if errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("admin API at %s: nothing listens there (connection refused): is "+
			"leasehold serve running with this --admin-addr?", addr)
	}
	return fmt.Errorf("admin API at %s: %w", addr, err)
}

// opensWithHTTP2Settings reports whether a server at addr sends an HTTP/2
// SETTINGS frame (a 9-byte header of type 4 on stream 0) as a connection
// opens, unasked: what a gRPC server does and an HTTP/1 one never does.
func opensWithHTTP2Settings(ctx context.Context, addr string) bool {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return false
	}
	defer conn.Close()
	deadline, _ := ctx.Deadline()
	conn.SetReadDeadline(deadline)
	var h [9]byte
	if _, err := io.ReadFull(conn, h[:]); err != nil {
		return false
	}
	return h[3] == 0x4 && h[5]&0x7f == 0 && h[6] == 0 && h[7] == 0 && h[8] == 0
}

// adminRefused is an admin port's 401 or 403: it answered, and would not
// tell without the right credentials.
type adminRefused struct{ err error }

func (e *adminRefused) Error() string { return e.err.Error() }
func (e *adminRefused) Unwrap() error { return e.err }

// adminStatusError turns an answer other than 200 into a sentence: what the
// admin port wants for 401 and 403, its own error text (not its JSON) else.
func adminStatusError(f explainFlags, path string, status int, body []byte) error {
	err := adminStatusText(f, path, status, body)
	if status == http.StatusUnauthorized || status == http.StatusForbidden {
		return &adminRefused{err}
	}
	return err
}

func adminStatusText(f explainFlags, path string, status int, body []byte) error {
	var e struct {
		Error string `json:"error"`
	}
	text := strings.TrimSpace(string(body[:min(len(body), 4096)]))
	if json.Unmarshal(body, &e) == nil && e.Error != "" {
		text = e.Error
	}
	code := fmt.Sprintf("%d %s", status, http.StatusText(status))
	switch {
	case status == http.StatusUnauthorized && f.token == "":
		why := fmt.Sprintf("admin API at %s needs credentials (%s): give --admin-token-file "+
			"(or LEASEHOLD_ADMIN_TOKEN_FILE), a file holding the token of leasehold serve's "+
			"--admin-token-file", f.admin, code)
		if strings.Contains(text, "client certificate") {
			why += ", or --tls-cert and --tls-key: a client certificate signed by its " +
				"--admin-client-ca"
		}
		return errors.New(why)
	case status == http.StatusUnauthorized:
		return fmt.Errorf("admin API at %s did not accept the token in --admin-token-file (%s): "+
			"it must be the token in leasehold serve's --admin-token-file", f.admin, code)
	case status == http.StatusForbidden:
		return fmt.Errorf("admin API at %s refused %s (%s): %s", f.admin, path, code, text)
	case status == http.StatusNotFound && !strings.HasPrefix(text, "no such"):
		return fmt.Errorf("admin API at %s has no %s (%s): is it leasehold serve's --admin-addr?",
			f.admin, path, code)
	}
	return fmt.Errorf("admin API at %s: %s: %s: %s", f.admin, path, code, text)
}
