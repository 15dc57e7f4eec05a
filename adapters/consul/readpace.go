package consul

import (
	"sync"
	"time"

	"github.com/jonboulle/clockwork"
)

// readPace follows Consul's load through the time its listings take. The
// read budget's rate (--consul-read-rate) is what leasehold may read of a
// Consul with time to spare; a Consul that is busy (a fleet registering by
// the thousand, other clients) answers the same listing slower, and every
// listing leasehold asks for then takes CPU its registrations need. So the
// budget's rate is scaled by factor: the least a byte of a listing has
// cost to answer lately (the baseline: a Consul with time to spare) over
// what it costs now. Measured under churn at 10,000 executors, a listing
// took 15–25 ms idle and 50–190 ms while the fleet registered; at a fixed
// rate, Consul's CPU while registering doubled with leasehold watching.
//
// A cost is a listing's time from the request to its last byte (Consul's
// queue and work, and the transfer), per byte of JSON, sampled from reads of
// at least minPaceSample bytes (below it the request's fixed costs would
// read as load). The baseline is the least cost seen in the last
// paceMinutes, and the last one known when nothing was read in them (a quiet
// fleet reads nothing, and must not forget what quiet costs); the cost now
// is an average of the last reads, weighted to the latest (paceWeight).
// The factor never falls below minPaceFactor, so a baseline measured on a
// fleet smaller than today's cannot starve the reads.
type readPace struct {
	clock clockwork.Clock

	mu       sync.Mutex
	minutes  [paceMinutes]paceMinute // least cost of each of the last minutes
	baseline float64                 // s per byte; 0: no sample yet
	recent   float64                 // s per byte
}

// paceMinute is the least cost sampled in one minute of the window.
type paceMinute struct {
	minute int64 // Unix minute; 0: unused
	least  float64
}

const (
	paceMinutes   = 30 // the window the baseline is the least cost of, in minutes
	minPaceSample = 64 << 10
	paceWeight    = 0.25
	minPaceFactor = 1.0 / 8
)

func newReadPace(clock clockwork.Clock) *readPace { return &readPace{clock: clock} }

// observe takes one read's decoded bytes and the time Consul took to answer
// them.
func (p *readPace) observe(bytes int64, took time.Duration) {
	if p == nil || bytes < minPaceSample || took <= 0 {
		return
	}
	cost := took.Seconds() / float64(bytes)
	minute := p.clock.Now().Unix() / 60
	p.mu.Lock()
	defer p.mu.Unlock()
	slot := &p.minutes[minute%paceMinutes]
	if slot.minute != minute {
		*slot = paceMinute{minute: minute, least: cost}
	} else {
		slot.least = min(slot.least, cost)
	}
	least, others := slot.least, false
	for _, m := range p.minutes {
		if m.minute > minute-paceMinutes && m.minute != minute {
			least, others = min(least, m.least), true
		}
	}
	if !others && p.baseline > 0 && p.baseline < least {
		// Nothing read in the window before this minute: what quiet cost
		// is the last baseline known, carried into this minute.
		least, slot.least = p.baseline, p.baseline
	}
	p.baseline = least
	if p.recent == 0 {
		p.recent = cost
	} else {
		p.recent += paceWeight * (cost - p.recent)
	}
}

// quieted is a pause of the datacenter's registrations (settle.go): the
// load that slowed the listings has stopped, so the cost now is taken to be
// the baseline until a read says otherwise. Without it, a budget in debt
// read nothing after a churn, so nothing told it Consul was quiet again,
// and it paid its debt at the churn's slow rate: measured at 10,000
// executors, the view caught up with a deregistered fleet 17.5 s after
// the last deregistration.
func (p *readPace) quieted() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.recent = min(p.recent, p.baseline)
}

// factor is what the read budget's rate is scaled by now: in
// [minPaceFactor, 1], 1 before the first sample.
func (p *readPace) factor() float64 {
	if p == nil {
		return 1
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.baseline <= 0 || p.recent <= p.baseline {
		return 1
	}
	return max(p.baseline/p.recent, minPaceFactor)
}
