package fleet

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

func (p *taskPrint) sub(x uint64) {
	p.sum -= x
	p.xor ^= x * 0x9e3779b97f4a7c15
	p.n--
}
