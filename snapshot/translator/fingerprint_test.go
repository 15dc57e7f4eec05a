package translator

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/health"
)

// healthyExecutor is eligible for any constraint set it does not fail by
// version or labels.
func healthyExecutor() health.Executor {
	return health.Executor{
		Registration: health.Registration{InstanceID: "i", SessionID: "s", Generation: 1,
			Task: "work", Address: "10.0.0.1",
			Port: 9000, Version: "1.0.0", Capacity: 4, State: health.StateActive},
		ServiceID: "work:i", Node: "n", LeaseFound: true, LeaseStatus: health.StatusPassing,
	}
}

// The example: with NUL-terminated strings both label sets encoded
// to a\0x\0b\0y\0c\0d\0, so the change was never rebuilt and a dispatcher
// selecting c=d kept an executor it now refuses.
func TestExecutorPrintLabelValuesWithNULDiffer(t *testing.T) {
	a, b := healthyExecutor(), healthyExecutor()
	a.Labels = map[string]string{"a": "x\x00b\x00y", "c": "d"}
	b.Labels = map[string]string{"a": "x", "b": "y\x00c\x00d"}
	d, err := health.NewDispatcher("", map[string]string{"c": "d"})
	if err != nil {
		t.Fatal(err)
	}
	if va, vb := health.Eligible(a, d), health.Eligible(b, d); va.Route == vb.Route {
		t.Fatalf("the example does not show the bug: both %s", va.Route)
	}
	if ExecutorPrint(&a) == ExecutorPrint(&b) {
		t.Fatal("executors whose verdicts differ for c=d share a print")
	}
}

// Every variable-length field is delimited by its length, not by a byte it
// may hold, and an absent error differs from an empty one: each pair below
// had the same print when strings were NUL-terminated and the error was
// written only when present.
func TestExecutorPrintFieldBoundaries(t *testing.T) {
	for _, tc := range []struct {
		name string
		a, b func(e *health.Executor)
	}{
		{"node and datacenter", func(e *health.Executor) { e.Node, e.Datacenter = "n\x00dc", "" },
			func(e *health.Executor) { e.Node, e.Datacenter = "n", "dc\x00" }},
		{"cordon id and reason",
			func(e *health.Executor) { e.CordonID, e.CordonReason = "c1\x00why", "" },
			func(e *health.Executor) { e.CordonID, e.CordonReason = "c1", "why\x00" }},
		{"cordon reason and held",
			func(e *health.Executor) { e.CordonReason, e.CordonHeld = "r\x00", "" },
			func(e *health.Executor) { e.CordonReason, e.CordonHeld = "r", "\x00" }},
		{"replaces and error", func(e *health.Executor) { e.Replaces = []string{"x\x00"} },
			func(e *health.Executor) { e.Replaces, e.Err = []string{"x"}, errors.New("") }},
		{"error absent or empty", func(e *health.Executor) { e.Err = errors.New("") },
			func(e *health.Executor) {
				e.LeaseFound, e.LeaseStatus = false, "\x01"+health.StatusPassing
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := healthyExecutor(), healthyExecutor()
			tc.a(&a)
			tc.b(&b)
			if ExecutorPrint(&a) == ExecutorPrint(&b) {
				t.Fatal("different executors share a print")
			}
		})
	}
}

// TestExecutorPrintCoversEveryField changes each exported field of
// health.Executor (and of its Registration) in turn: each change must change
// the print, or a decision depending on the field is never rebuilt. A field
// added to health.Executor fails here until appendPrint has its line.
func TestExecutorPrintCoversEveryField(t *testing.T) {
	base := healthyExecutor()
	basePrint := ExecutorPrint(&base)
	var walk func(path string, v reflect.Value)
	walk = func(path string, v reflect.Value) {
		for i := range v.NumField() {
			f, sf := v.Field(i), v.Type().Field(i)
			if !sf.IsExported() {
				continue // derived (Registration.semver is the parsed Version)
			}
			name := strings.TrimPrefix(path+"."+sf.Name, ".")
			if sf.Anonymous && f.Kind() == reflect.Struct {
				walk(name, f)
				continue
			}
			old := reflect.New(f.Type()).Elem()
			old.Set(f)
			switch {
			case f.Kind() == reflect.String:
				f.SetString(f.String() + "x")
			case f.Kind() == reflect.Bool:
				f.SetBool(!f.Bool())
			case f.CanInt():
				f.SetInt(f.Int() + 1)
			case f.CanUint():
				f.SetUint(f.Uint() + 1)
			case f.Type() == reflect.TypeFor[map[string]string]():
				f.Set(reflect.ValueOf(map[string]string{"k": "v"}))
			case f.Type() == reflect.TypeFor[[]string]():
				f.Set(reflect.ValueOf([]string{"x"}))
			case f.Type() == reflect.TypeFor[error]():
				f.Set(reflect.ValueOf(errors.New("bad")))
			default:
				t.Errorf("%s (%s): no way to change it here; give it a line in appendPrint and a "+
					"case here", name, f.Type())
				continue
			}
			if ExecutorPrint(&base) == basePrint {
				t.Errorf("changing %s does not change the print", name)
			}
			f.Set(old)
		}
	}
	walk("", reflect.ValueOf(&base).Elem())
	if ExecutorPrint(&base) != basePrint {
		t.Fatal("the walk did not restore the executor")
	}
}

// Equal executors share a print whatever order their labels were inserted in.
func TestExecutorPrintLabelOrder(t *testing.T) {
	a, b := healthyExecutor(), healthyExecutor()
	a.Labels = map[string]string{}
	b.Labels = map[string]string{}
	for i := range 20 { // more than the sort's stack array holds
		k := string(rune('a' + i))
		a.Labels[k] = k
		b.Labels[string(rune('a'+19-i))] = string(rune('a' + 19 - i))
	}
	if ExecutorPrint(&a) != ExecutorPrint(&b) {
		t.Fatal("equal executors have different prints")
	}
}
