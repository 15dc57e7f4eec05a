package snapshot

import (
	"sort"

	"github.com/leasehold/leasehold/health"
)

// View is one decided state of the fleet: the executors (joined, fenced)
// that the current xDS resources come from, the constraint sets in use and
// the session index. A new View is published after every change, once the
// removals it implies are in the cache, so a session that a View calls STALE
// or LAPSED is in no snapshot.
type View struct {
	ConsulIndex uint64
	Executors   []health.Executor   // sorted by task, node, service id
	Groups      []health.Dispatcher // constraint sets with streams, plus the unconstrained set
	Sessions    health.SessionIndex
	Synced      bool

	changed chan struct{}
}

// Changed is closed when a newer View replaces this one.
func (v *View) Changed() <-chan struct{} { return v.changed }

// View is the latest decided state (never nil).
func (s *Syncer) View() *View { return s.view.Load() }

func emptyView() *View {
	return &View{Sessions: health.IndexSessions(nil, nil), Groups: []health.Dispatcher{{}}, changed: make(chan struct{})}
}

// publishView replaces the view; called by Run only.
func (s *Syncer) publishView() {
	index := s.consulIndex()
	var all []health.Executor
	for _, task := range sortedTasks(s.members) {
		all = append(all, s.byTask[task]...)
	}
	sort.SliceStable(all, func(i, j int) bool {
		a, b := all[i], all[j]
		if a.Task != b.Task {
			return a.Task < b.Task
		}
		if a.Node != b.Node {
			return a.Node < b.Node
		}
		return a.ServiceID < b.ServiceID
	})
	groups := []health.Dispatcher{{}}
	keys := make([]string, 0, len(s.groups))
	for k := range s.groups {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if k != groups[0].Key() {
			groups = append(groups, s.groups[k].d)
		}
	}
	v := &View{ConsulIndex: index, Executors: all, Groups: groups, Sessions: health.IndexSessions(all, s.past()), Synced: s.synced, changed: make(chan struct{})}
	old := s.view.Swap(v)
	close(old.changed)
}
