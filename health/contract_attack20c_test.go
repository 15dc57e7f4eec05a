package health

import (
	"fmt"
	"reflect"
	"testing"
)

// TestAttack20cFiftyEightLabelsStillRead: before the replaces key existed a
// registration could carry 58 labels (6 contract keys + 58 = Consul's 64
// meta pairs), and leasehold routed it. Such a registration, already in
// Consul (it fits, or Consul would have refused it), must not be thrown out
// of routing as bad metadata by an upgraded leasehold: the reserved pair for
// replaces only counts when replaces is there. What an executor is told to
// write (Validate, the Registrar's configuration) keeps room for replaces
// and lease_ttl: 56.
func TestAttack20cFiftyEightLabelsStillRead(t *testing.T) {
	r := validReg()
	r.Labels = map[string]string{}
	for i := range consulMetaMaxPairs - 6 {
		r.Labels[fmt.Sprintf("k%02d", i)] = "v"
	}
	meta := r.Meta()
	if len(meta) != consulMetaMaxPairs {
		t.Fatalf("%d meta pairs", len(meta))
	}
	got, err := ParseRegistration(r.Task, r.Address, r.Port, meta)
	if err != nil {
		t.Fatalf("a registration of %d labels without replaces (%d meta pairs, what Consul accepts and leasehold routed before) is refused: %v", len(r.Labels), len(meta), err)
	}
	if len(got.Labels) != len(r.Labels) {
		t.Fatalf("labels %d", len(got.Labels))
	}
	// With replaces it does not fit Consul: refused, naming the field.
	meta[MetaReplaces] = "old"
	if _, err := ParseRegistration(r.Task, r.Address, r.Port, meta); !reflect.DeepEqual(Fields(err), []string{"labels"}) {
		t.Fatalf("58 labels and replaces: %v", err)
	}
	// What executors are told to write keeps room for replaces and
	// lease_ttl: 56.
	if !reflect.DeepEqual(Fields(r.Validate()), []string{"labels"}) {
		t.Fatalf("Validate with 58 labels: %v", r.Validate())
	}
	if !reflect.DeepEqual(Fields(validateLabels(r.Labels, fixedMetaKeys).err()), []string{"labels"}) {
		t.Fatal("validateLabels with 58 labels accepted")
	}
	delete(r.Labels, "k00")
	if !reflect.DeepEqual(Fields(r.Validate()), []string{"labels"}) {
		t.Fatalf("Validate with 57 labels: %v", r.Validate())
	}
	delete(r.Labels, "k01")
	if err := r.Validate(); err != nil {
		t.Fatalf("Validate with 56 labels: %v", err)
	}

}
