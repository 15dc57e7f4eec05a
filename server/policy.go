package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jonboulle/clockwork"
	"go.yaml.in/yaml/v3"

	"github.com/leasehold/leasehold/health"
)

// Fencing calls a grant may allow.
const (
	CallCheckSession = "CheckSession"
	CallWatchSession = "WatchSession"
)

// Policy maps dispatcher identities (a verified client certificate's URI or
// DNS SAN, e.g. a SPIFFE id) to what they may see and ask. A client whose
// identity has no grant is refused. The file is YAML or JSON:
//
//	dispatchers:
//	  - identity: spiffe://example.org/dispatcher/eu
//	    tasks: [work, transcode]          # "*": every task type
//	    fencing: [CheckSession, WatchSession]
type Policy struct {
	Dispatchers []Grant `yaml:"dispatchers" json:"dispatchers"`
}

// Grant is one identity's rights.
type Grant struct {
	Identity string   `yaml:"identity" json:"identity"`
	Tasks    []string `yaml:"tasks" json:"tasks"`
	Fencing  []string `yaml:"fencing" json:"fencing"`
}

// AllTasks reports whether the grant covers every task type.
func (g Grant) AllTasks() bool { return slices.Contains(g.Tasks, "*") }

// TaskList is the granted task types as health.Dispatcher.WithTasks takes
// them, nil when every task type is granted.
func (g Grant) TaskList() []string {
	if g.AllTasks() {
		return nil
	}
	return append([]string{}, g.Tasks...)
}

// AllowsTask reports whether task is granted.
func (g Grant) AllowsTask(task string) bool {
	return g.AllTasks() || slices.Contains(g.Tasks, task)
}

// AllowsCall reports whether a fencing call is granted.
func (g Grant) AllowsCall(call string) bool {
	return slices.Contains(g.Fencing, "*") || slices.Contains(g.Fencing, call)
}

func (g Grant) equal(o Grant) bool {
	return g.Identity == o.Identity && slices.Equal(g.Tasks, o.Tasks) &&
		slices.Equal(g.Fencing, o.Fencing)
}

// ParsePolicy reads and validates a policy; errors name the field
// (dispatchers[1].tasks[0]). Unknown fields are errors too, because a
// misspelt key must not silently grant or deny.
func ParsePolicy(b []byte) (*Policy, error) {
	var p Policy
	dec := yaml.NewDecoder(bytes.NewReader(b)) // YAML is a superset of JSON
	dec.KnownFields(true)
	if err := dec.Decode(&p); err != nil {
		return nil, fmt.Errorf("parse: %w", err)
	}
	var errs []error
	seen := map[string]int{}
	for i, g := range p.Dispatchers {
		at := fmt.Sprintf("dispatchers[%d]", i)
		if g.Identity == "" {
			errs = append(errs,
				fmt.Errorf("%s.identity: required (a certificate URI or DNS SAN)", at))
		} else if j, dup := seen[g.Identity]; dup {
			errs = append(errs, fmt.Errorf("%s.identity: %q already granted in dispatchers[%d]",
				at, g.Identity, j))
		}
		seen[g.Identity] = i
		for k, t := range g.Tasks {
			if t == "*" {
				continue
			}
			if fe := health.ValidateTask(t); fe != nil {
				errs = append(errs, fmt.Errorf("%s.tasks[%d]: %s", at, k, fe.Error()))
			}
		}
		for k, c := range g.Fencing {
			if c != "*" && c != CallCheckSession && c != CallWatchSession {
				errs = append(errs, fmt.Errorf("%s.fencing[%d]: %q: want %s, %s or *",
					at, k, c, CallCheckSession, CallWatchSession))
			}
		}
		slices.Sort(p.Dispatchers[i].Tasks)
		slices.Sort(p.Dispatchers[i].Fencing)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return &p, nil
}

// grantOf is the grant of the first of the identity's names that has one.
func (p *Policy) grantOf(id Identity) (Grant, bool) {
	for _, name := range id.Names() {
		for _, g := range p.Dispatchers {
			if g.Identity == name {
				return g, true
			}
		}
	}
	return Grant{}, false
}

// PolicyStore holds the policy in force and follows its file. A valid new
// version replaces it at once; an invalid one is refused (and logged), and
// the previous one stays in force.
type PolicyStore struct {
	path    string
	log     *slog.Logger
	cur     atomic.Pointer[Policy]
	stamp   string
	version atomic.Int64 // bumped on every accepted change
	changed chan struct{}
	clock   clockwork.Clock // what Run's re-reads are paced by (the real clock)
}

// LoadPolicy reads the policy file; errors name the flag and the field.
func LoadPolicy(path string, log *slog.Logger) (*PolicyStore, error) {
	s := &PolicyStore{path: path, log: log, changed: make(chan struct{}, 1), clock: clockwork.NewRealClock()}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--authz-policy: %w", err)
	}
	p, err := ParsePolicy(b)
	if err != nil {
		return nil, fmt.Errorf("--authz-policy %s: %w", path, err)
	}
	s.cur.Store(p)
	s.stamp = string(b)
	return s, nil
}

// Grant is the grant of an identity under the policy in force.
func (s *PolicyStore) Grant(id Identity) (Grant, bool) { return s.cur.Load().grantOf(id) }

// Version counts accepted policy changes.
func (s *PolicyStore) Version() int64 { return s.version.Load() }

// Run re-reads the file when it changes, every second on the store's clock,
// until ctx ends, and returns ctx's error.
func (s *PolicyStore) Run(ctx context.Context) error {
	t := s.clock.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.Chan():
			s.reload()
		}
	}
}

func (s *PolicyStore) reload() {
	// The file is small, so it is read and compared every time: a same-size
	// rewrite within one clock tick would leave the file's times unchanged.
	b, err := os.ReadFile(s.path)
	if err == nil && string(b) == s.stamp {
		return
	}
	if err == nil {
		s.stamp = string(b)
	}
	var p *Policy
	if err == nil {
		p, err = ParsePolicy(b)
	}
	if err != nil {
		s.log.Error("authorization policy changed but is invalid: "+
			"the previous policy stays in force", "path", s.path, "err", err)
		return
	}
	s.cur.Store(p)
	s.version.Add(1)
	s.log.Info("authorization policy reloaded", "path", s.path, "grants", len(p.Dispatchers))
}

// fileStamp identifies a file's version by its inode (a rename into place
// makes a new one), its size and its modification and change times.
func fileStamp(path string) string {
	st, err := os.Stat(path)
	if err != nil {
		return "missing"
	}
	ino, ctime := uint64(0), int64(0)
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		ino, ctime = sys.Ino, sys.Ctim.Nano()
	}
	return fmt.Sprintf("%d:%d:%d:%d", ino, st.Size(), st.ModTime().UnixNano(), ctime)
}
