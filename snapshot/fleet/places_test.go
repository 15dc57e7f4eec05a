package fleet

import (
	"slices"
	"testing"
)

// A key's places come back in the order they were added, however many it
// has, and a key never added has none.
func TestPlacesYieldEveryPlaceInOrder(t *testing.T) {
	p := newPlaces[string](4)
	adds := []struct {
		k string
		i int32
	}{{"three", 2}, {"one", 7}, {"two", 5}, {"three", 0}, {"two", 1}, {"three", 9}}
	for _, a := range adds {
		p.add(a.k, a.i)
	}
	want := map[string][]int32{"one": {7}, "three": {2, 0, 9}, "two": {5, 1}}
	for k, w := range want {
		if got := slices.Collect(p.of(k)); !slices.Equal(got, w) {
			t.Errorf("%s: %v, want %v", k, got, w)
		}
	}
	if got := slices.Collect(p.of("none")); len(got) != 0 {
		t.Errorf("a key never added has places %v", got)
	}
	// Stopping early stops.
	for i := range p.of("three") {
		if i != 2 {
			t.Fatalf("first place of three: %d", i)
		}
		break
	}
}

// Walking a key's places allocates nothing: the batch walks them for every
// check that changed, in every task type.
func TestWalkingPlacesAllocatesNothing(t *testing.T) {
	p := newPlaces[checkRef](2)
	p.add(checkRef{"n", "a"}, 1)
	p.add(checkRef{"n", "a"}, 2)
	p.add(checkRef{"n", "b"}, 3)
	var sum int32
	if n := testing.AllocsPerRun(100, func() {
		for i := range p.of(checkRef{"n", "a"}) {
			sum += i
		}
		for i := range p.of(checkRef{"n", "b"}) {
			sum += i
		}
	}); n != 0 {
		t.Fatalf("%v allocations per walk", n)
	}
	if sum == 0 {
		t.Fatal("walked nothing")
	}
}
