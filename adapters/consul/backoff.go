package consul

import (
	"math/rand/v2"
	"time"
)

// backoff is the retry pace shared by the watches, the control watch, the
// lapse recorder and the Registrar: exponential from base, capped at cap,
// each wait drawn at random between half the step and the whole of it so
// that replicas failing together do not retry together.
type backoff struct {
	base, cap, cur time.Duration
}

func newBackoff(base, cap time.Duration) *backoff { return &backoff{base: base, cap: cap} }

func (b *backoff) next() time.Duration {
	if b.cur == 0 {
		b.cur = b.base
	} else {
		b.cur = min(2*b.cur, b.cap)
	}
	return b.cur/2 + rand.N(b.cur/2+1)
}

func (b *backoff) reset() { b.cur = 0 }
