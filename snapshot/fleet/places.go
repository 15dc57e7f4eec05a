package fleet

import "iter"

// places maps a key to the places (in a task's members) of the members that
// hold it, in the order they were added. Nearly every key has one place — a
// registration's service, an instance's one registration of a task type, a
// session's lease check — so that one is kept in first, and a key's other
// places in more. A map of slices cost a slice header in every slot and an
// allocation of its own per key: at 10,000 members those three maps were
// ~5 MB of the heap profile, and this form cut BenchmarkSyncerMemory by ~4%
// (2,773–2,951 to 2,646–2,819 B per executor, three runs each; issue 30).
type places[K comparable] struct {
	first map[K]int32
	more  map[K][]int32
}

func newPlaces[K comparable](n int) places[K] {
	return places[K]{first: make(map[K]int32, n)}
}

func (p *places[K]) add(k K, i int32) {
	if _, ok := p.first[k]; !ok {
		p.first[k] = i
		return
	}
	if p.more == nil {
		p.more = map[K][]int32{}
	}
	p.more[k] = append(p.more[k], i)
}

// of yields k's places in the order they were added.
func (p places[K]) of(k K) iter.Seq[int32] {
	return func(yield func(int32) bool) {
		i, ok := p.first[k]
		if !ok || !yield(i) {
			return
		}
		for _, i := range p.more[k] {
			if !yield(i) {
				return
			}
		}
	}
}
