package snapshot

import (
	"encoding/binary"
	"hash/maphash"
	"sort"

	"github.com/leasehold/leasehold/health"
)

// seed is per process: fingerprints are only compared within one process.
var seed = maphash.MakeSeed()

// executorPrint hashes everything about one executor that decisions depend
// on. It writes fields straight into the hash: no formatting, no allocation
// beyond the label keys' sort.
func executorPrint(e *health.Executor) uint64 {
	var h maphash.Hash
	h.SetSeed(seed)
	str := func(s string) {
		h.WriteString(s)
		h.WriteByte(0)
	}
	num := func(n uint64) {
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], n)
		h.Write(b[:])
	}
	flag := func(v bool) {
		if v {
			h.WriteByte(1)
		} else {
			h.WriteByte(0)
		}
	}
	r := &e.Registration
	str(e.Node)
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
	if len(r.Labels) > 0 {
		keys := make([]string, 0, len(r.Labels))
		for k := range r.Labels {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			str(k)
			str(r.Labels[k])
		}
	}
	if e.Err != nil {
		str(e.Err.Error())
	}
	flag(e.LeaseFound)
	str(string(e.Lease))
	str(string(e.NodeChecks))
	str(string(e.Other))
	num(uint64(e.Load))
	flag(e.Fenced)
	str(e.NewerSessionID)
	num(e.NewerGeneration)
	flag(e.LapseObserved)
	num(e.CreateIndex)
	return h.Sum64()
}

// taskPrint combines executor prints order-independently: equal sets of
// executors give equal prints.
type taskPrint struct {
	sum, xor uint64
	n        int
}

func (p *taskPrint) add(x uint64) {
	p.sum += x
	p.xor ^= x * 0x9e3779b97f4a7c15
	p.n++
}
