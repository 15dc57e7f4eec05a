package fleet

import (
	"iter"
	"slices"

	"github.com/leasehold/leasehold/health"
)

// execChunk is how many executors one chunk of a task state's list holds.
// Views share the lists, so a batch that changes an executor must not write
// where a view reads: it copies the chunk it writes (and the list of
// chunks), not the task's every executor. At 10,000 executors in one task
// type the whole copy was 4.4 MB per lapse, a fifth of leasehold's CPU over a
// run of lapses and most of what made the collector run (BENCHMARKS.md,
// "Shards of 250"). A chunk is 14 KB; the list of a 10,000-executor task
// type's chunks 7.5 KB. (Chunks of 128 were 56 KB: ~86 KB of the ~1 MB
// serve allocated per lapse at 1,000 streams, BENCHMARKS.md, "Lapse marks
// after the pushes, and fewer allocations per lapse". A variable, for tests
// to make chunks of a few.)
var execChunk = 32

// execList is a task state's decided registrations, in chunks of
// execChunk, indexed as one list. A chunk is never written once a view may
// hold it (taskState.mut copies it first).
type execList struct {
	chunks [][]health.Executor
	n      int
}

// newExecList is a list of n zero executors.
func newExecList(n int) execList {
	l := execList{n: n, chunks: make([][]health.Executor, 0, (n+execChunk-1)/execChunk)}
	for left := n; left > 0; left -= execChunk {
		l.chunks = append(l.chunks, make([]health.Executor, min(left, execChunk)))
	}
	return l
}

// execListOf is a list over es as they are (one chunk, not copied).
func execListOf(es []health.Executor) execList {
	if len(es) == 0 {
		return execList{}
	}
	return execList{chunks: [][]health.Executor{es}, n: len(es)}
}

func (l execList) len() int { return l.n }

// at is executor i, to read (mut, to write).
func (l execList) at(i int) *health.Executor {
	return &l.chunks[i/execChunk][i%execChunk]
}

// all yields every executor in order.
func (l execList) all() iter.Seq[*health.Executor] {
	return func(yield func(*health.Executor) bool) {
		for _, c := range l.chunks {
			for i := range c {
				if !yield(&c[i]) {
					return
				}
			}
		}
	}
}

// appendTo appends the executors to dst, in order.
func (l execList) appendTo(dst []health.Executor) []health.Executor {
	for _, c := range l.chunks {
		dst = append(dst, c...)
	}
	return dst
}

// mut is executor i of the task state, to write: its chunk is this batch's
// copy, made on the batch's first write to it.
func (ts *taskState) mut(i int32) *health.Executor {
	c := int(i) / execChunk
	if ts.ownChunks == nil { // the batch's first write: the list of chunks is copied
		ts.execs.chunks = slices.Clone(ts.execs.chunks)
		ts.ownChunks = make([]bool, len(ts.execs.chunks))
	}
	if !ts.ownChunks[c] {
		ts.execs.chunks[c] = slices.Clone(ts.execs.chunks[c])
		ts.ownChunks[c] = true
	}
	return ts.execs.at(int(i))
}
