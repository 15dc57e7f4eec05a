package translator

import (
	"encoding/binary"
	"hash/maphash"
	"slices"

	"github.com/leasehold/leasehold/health"
)

// seed is per process: fingerprints are only compared within one process.
var seed = maphash.MakeSeed()

// ExecutorPrint hashes everything about one executor that decisions depend
// on. Fields are appended to one stack buffer and hashed once (hashing field
// by field cost ~3× more).
func ExecutorPrint(e *health.Executor) uint64 {
	var stack [512]byte
	return maphash.Bytes(seed, appendPrint(stack[:0], e))
}

// appendPrint appends the encoding of everything about e that decisions
// depend on to b: one line per field, in a fixed order. A new field of
// health.Executor gets its line here (TestExecutorPrintCoversEveryField says
// when one is missing).
//
// Every string is prefixed with its length and every list with its count (a
// terminator would not do: label values, cordon reasons and details may hold
// any byte, NUL too), numbers have a fixed width, and an optional field is a
// flag followed by its value: no two different sequences of fields give the
// same bytes.
func appendPrint(b []byte, e *health.Executor) []byte {
	str := func(s string) {
		if len(s) < 0x80 { // one byte, as AppendUvarint would write, without its loop
			b = append(b, byte(len(s)))
		} else {
			b = binary.AppendUvarint(b, uint64(len(s)))
		}
		b = append(b, s...)
	}
	num := func(n uint64) { b = binary.LittleEndian.AppendUint64(b, n) }
	flag := func(v bool) {
		if v {
			b = append(b, 1)
		} else {
			b = append(b, 0)
		}
	}
	r := &e.Registration
	str(e.Node)
	str(e.Datacenter)
	str(e.ServiceID)
	str(r.InstanceID)
	str(r.SessionID)
	num(r.Generation)
	str(r.Task)
	str(r.Address)
	num(uint64(r.Port))
	str(r.Version)
	num(uint64(r.Capacity))
	str(string(r.State))
	num(uint64(len(r.Labels)))
	if len(r.Labels) > 0 {
		// Sorted in a stack array: map order is random.
		var keyStack [16]string
		keys := keyStack[:0]
		for k := range r.Labels {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			str(k)
			str(r.Labels[k])
		}
	}
	num(uint64(len(r.Replaces)))
	for _, s := range r.Replaces {
		str(s)
	}
	num(uint64(r.LeaseTTL))
	flag(e.Err != nil)
	if e.Err != nil {
		str(e.Err.Error())
	}
	flag(e.LeaseFound)
	str(string(e.LeaseStatus))
	str(string(e.NodeChecks))
	str(string(e.Other))
	num(uint64(e.Load))
	flag(e.LoadReported)
	flag(e.Fenced)
	str(e.NewerSessionID)
	num(e.NewerGeneration)
	str(e.Unconfirmed)
	flag(e.LapseSeen)
	num(uint64(e.Reach))
	str(e.ReachDetail)
	flag(e.NodeFailed)
	num(e.CreateIndex)
	num(e.LeaseCreateIndex)
	str(e.CordonID)
	str(e.CordonReason)
	str(e.CordonHeld)
	return b
}
