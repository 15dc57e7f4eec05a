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
// by field cost ~3× more); label keys are sorted in a stack array.
func ExecutorPrint(e *health.Executor) uint64 {
	var stack [512]byte
	b := stack[:0]
	str := func(s string) {
		b = append(b, s...)
		b = append(b, 0)
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
	if e.Err != nil {
		str(e.Err.Error())
	}
	flag(e.LeaseFound)
	str(string(e.LeaseStatus))
	str(string(e.NodeChecks))
	str(string(e.Other))
	num(uint64(e.Load))
	flag(e.Fenced)
	str(e.NewerSessionID)
	num(e.NewerGeneration)
	str(e.Unconfirmed)
	flag(e.LapseSeen)
	b = append(b, byte(e.Reach))
	str(e.ReachDetail)
	flag(e.NodeFailed)
	num(e.CreateIndex)
	str(e.CordonID)
	str(e.CordonReason)
	str(e.CordonHeld)
	return maphash.Bytes(seed, b)
}
