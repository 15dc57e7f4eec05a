package consul

import (
	"context"
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

// TestGenerationKeyAtMaxUint64IsGarbage: anyone who may write the generation
// keys puts 18446744073709551615 (or anything above health.MaxGeneration) in
// another instance's key. That is garbage for leasehold and the Registrar
// alike: the live session is not overtaken, and the next generation is taken
// from the registered floor (no overflow to 0).
func TestGenerationKeyAtMaxUint64IsGarbage(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	e := runLive(t, a, "victim", nil)
	s1 := e.session(t, nil)
	maxUint64 := []byte(strconv.FormatUint(math.MaxUint64, 10))
	_, err := c.KV().Put(&api.KVPair{Key: health.GenerationKey("victim"), Value: maxUint64}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if g, err := NewAPIAgent(c).Generation(ctx, "victim"); err != nil || g.Present() {
		t.Fatalf("Generation = %+v, %v: want none (garbage)", g, err)
	}
	g, err := NewAPIAgent(c).NextGeneration(ctx, "victim", "s-next", s1.Generation)
	if err != nil || g != s1.Generation+1 {
		t.Fatalf(
			"NextGeneration = %d, %v: want %d (above the registered floor)",
			g,
			err,
			s1.Generation+1,
		)
	}
}

// TestNextGenerationNeverOverflows: the next generation after a garbage
// MaxUint64 key is never 0.
func TestNextGenerationNeverOverflows(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	maxUint64 := []byte(strconv.FormatUint(math.MaxUint64, 10))
	_, err := c.KV().Put(&api.KVPair{Key: health.GenerationKey("x"), Value: maxUint64}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	g, err := NewAPIAgent(c).NextGeneration(ctx, "x", "s1", 0)
	if err == nil && g == 0 {
		t.Fatalf(
			"NextGeneration after %d = 0: a generation the contract calls invalid",
			uint64(math.MaxUint64),
		)
	}
}
