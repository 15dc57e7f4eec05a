package consul

import (
	"context"
	"errors"
	"sort"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/health"
)

// watchServices follows the list of task types and runs one membership
// watch per task type, stopping those whose service disappears.
func (w *Watcher) watchServices(ctx context.Context) {
	type running struct {
		cancel context.CancelFunc
		done   chan struct{}
	}
	tasks := map[string]running{}
	// The badly named services of the last answer: each is warned of once
	// when it appears (again), not at every answer (every 10 s or so).
	badNames := map[string]bool{}
	defer func() {
		for _, r := range tasks {
			r.cancel()
			<-r.done
		}
	}()
	w.blockingLoop(
		ctx,
		watchSpec{name: "services", minInterval: max(w.cfg.MinInterval*4, w.cfg.SlowInterval)},
		queryRead(func(ctx context.Context, index uint64, wait time.Duration) (uint64, error) {
			services, idx, err := cutShort(
				w,
				ctx,
				wait,
				func(ctx context.Context, wait time.Duration) (map[string][]string, uint64, error) {
					return w.cat.Services(ctx, index, wait)
				},
			)
			if err != nil {
				return 0, err
			}
			want, bad := map[string]bool{}, map[string]bool{}
			for name, tags := range services {
				for _, t := range tags {
					if t == w.cfg.Tag {
						if err := health.ValidateTask(name); err != nil {
							if !badNames[name] {
								w.log.Warn("service tagged for leasehold has an invalid name; "+
									"ignored", "service", name, "err", err)
							}
							bad[name] = true
							break
						}
						want[name] = true
						break
					}
				}
			}
			list := make([]string, 0, len(want))
			for task := range want {
				list = append(list, task)
			}
			sort.Strings(list)
			badNames = bad
			w.listTasks(want)
			if !w.send(ctx, health.Observation{Data: &health.TaskList{Index: idx, Tasks: list}}) {
				return idx, nil
			}
			for task, r := range tasks {
				if !want[task] {
					r.cancel()
					<-r.done
					delete(tasks, task)
					w.forgetWatch("task " + task)
					w.budget.forget("task " + task)
					w.log.Info("task type gone", "task", task)
					w.send(
						ctx,
						health.Observation{
							Data: &health.TaskMembers{Task: task, Index: idx, Gone: true},
						},
					)
				}
			}
			for task := range want {
				if _, ok := tasks[task]; ok {
					continue
				}
				tctx, cancel := context.WithCancel(ctx)
				r := running{cancel: cancel, done: make(chan struct{})}
				tasks[task] = r
				w.log.Info("task type found", "task", task)
				go func() { defer close(r.done); w.watchTask(tctx, task) }()
			}
			return idx, nil
		}),
	)
}

// watchTask follows one task type's catalog entries (which do not change on
// heartbeats) and, when they change, reads the changed members with their
// checks (taskMembership).
func (w *Watcher) watchTask(ctx context.Context, task string) {
	known, full := &taskMembership{}, true // full: read every member next time
	spec := watchSpec{
		name:        "task " + task,
		minInterval: w.cfg.MinInterval * 4,
		useSlot:     true,
		budget:      w.budget,
		settles:     true,
	}
	w.blockingLoop(
		ctx,
		spec,
		queryRead(func(ctx context.Context, index uint64, wait time.Duration) (uint64, error) {
			if full {
				index = 0 // a whole listing now, not at the next change
			}
			nodes, idx, err := w.cat.ServiceNodes(ctx, task, w.cfg.Tag, index, wait)
			if errors.Is(err, errCatalogUnchanged) {
				return idx, nil // a check moved the index; no registration changed
			}
			if err != nil {
				full = true // whatever Consul says next is read in full
				return 0, err
			}
			changed, left := known.diff(nodes)
			if !full && len(changed) == 0 && !left {
				return idx, nil // identical catalog entries: nothing changed for this task
			}
			readAll := full || !known.pointReadable(changed, len(nodes))
			var entries []*api.ServiceEntry
			hidx := idx
			if readAll || len(changed) > 0 { // only departures: nothing to read
				var ids []string // nil: every member
				if !readAll {
					ids = serviceIDs(changed)
				}
				entries, hidx, err = w.cat.HealthService(ctx, task, w.cfg.Tag, ids)
				if err != nil {
					full = true
					return 0, err
				}
			}
			known, full = known.apply(task, nodes, entries, readAll, changed), false
			keys := w.readBackKeys(ctx, entries)
			members := known.list()
			w.readLeases(task, members)
			w.send(
				ctx,
				health.Observation{
					Data: &health.TaskMembers{
						Task:    task,
						Index:   max(idx, hidx),
						Members: members,
						Keys:    keys,
					},
				},
			)
			return idx, nil
		}),
	)
}
