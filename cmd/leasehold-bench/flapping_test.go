package main

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/hashicorp/consul/api"
)

// The flapper flips each check in turn, round robin, every change a new
// status for its check, through the agent of each service.
func TestFlapperFlipsRoundRobin(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const n, want = 3, 12
	var mu sync.Mutex
	var seen []string             // check ids in the order the agents got them
	status := map[string]string{} // check → last status
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id, ok := strings.CutPrefix(r.URL.Path, "/v1/agent/check/update/")
		var body struct{ Status string }
		if !ok || json.NewDecoder(r.Body).Decode(&body) != nil {
			http.Error(w, "unexpected "+r.URL.Path, http.StatusBadRequest)
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if status[id] == body.Status || (status[id] == "" && body.Status == "passing") {
			t.Errorf("%s set to %s again", id, body.Status)
		}
		status[id] = body.Status
		if seen = append(seen, id); len(seen) == want {
			cancel()
		}
	}))
	defer srv.Close()
	c, err := api.NewClient(&api.Config{Address: strings.TrimPrefix(srv.URL, "http://")})
	if err != nil {
		t.Fatal(err)
	}
	f := newFlapper([]*api.Client{c}, n, 1000)
	f.run(ctx) // returns once ctx ends and every change in flight is answered
	mu.Lock()
	defer mu.Unlock()
	count := map[string]int{}
	for _, id := range seen {
		count[id]++
	}
	for k := range n {
		if count[bystanderCheck(k)] < want/n-1 {
			t.Errorf("%s flipped %d times of %d: not round robin (%v)", bystanderCheck(k), count[bystanderCheck(k)], len(seen), count)
		}
	}
	if f.failed.Load() != 0 || f.ok.Load() < want {
		t.Fatalf("ok %d, failed %d", f.ok.Load(), f.failed.Load())
	}
}
