package consul

// The operators' controls on a real Consul agent: every change commits with
// its audit record or not at all, the trail is pruned by count and by age,
// and paging returns every record exactly once.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/leasehold/leasehold/adapters/consul/consultest"
	"github.com/leasehold/leasehold/health"
)

// fakeClock is the audit clock of a test: it moves only when told, or by
// step after each reading.
type fakeClock struct {
	mu   sync.Mutex
	now  time.Time
	step time.Duration
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now
	c.now = c.now.Add(c.step)
	return now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func newControl(t *testing.T, c *api.Client, clock *fakeClock, r AuditRetention) *Control {
	t.Helper()
	k, err := NewControl(c, ControlOptions{Retention: r, Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// auditIDs lists the record ids in Consul KV, oldest first.
func auditIDs(t *testing.T, c *api.Client) []string {
	t.Helper()
	keys, _, err := c.KV().Keys(AuditPrefix, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]string, 0, len(keys))
	for _, k := range keys {
		ids = append(ids, strings.TrimPrefix(k, AuditPrefix))
	}
	slices.Sort(ids)
	return ids
}

func testCordon(id, by string) health.Cordon {
	return health.Cordon{
		ID:       id,
		Instance: "exec-1",
		Reason:   "disk failing",
		By:       by,
		At:       time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC),
	}
}

func TestControlChangeAndAuditRecordCommitTogether(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	ctx := context.Background()
	start := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	clock := &fakeClock{now: start, step: time.Second} // records order as written
	k := newControl(t, c, clock, AuditRetention{})
	cordon := func(id string) *api.KVPair {
		t.Helper()
		p, _, err := c.KV().Get(CordonPrefix+id, nil)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}

	// both: the cordon and its record
	if err := k.Cordon(ctx, testCordon("c-1", "alice")); err != nil {
		t.Fatal(err)
	}
	if cordon("c-1") == nil {
		t.Fatal("cordon not stored")
	}
	page, err := k.AuditLog(ctx, 10, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(page.Entries) != 1 || page.Entries[0].Action != "cordon" ||
		page.Entries[0].Actor != "alice" ||
		page.Entries[0].Target != "c-1" ||
		!page.Entries[0].At.Equal(start) {
		t.Fatalf("audit after the cordon: %+v", page.Entries)
	}

	// neither: the same cordon id again loses its check-and-set
	if err := k.Cordon(ctx, testCordon("c-1", "alice")); !errors.Is(err, ErrControl) ||
		!strings.Contains(err.Error(), "exists already") {
		t.Fatalf("second cordon c-1: %v", err)
	}
	if ids := auditIDs(t, c); len(ids) != 1 {
		t.Fatalf("a refused cordon was audited: %v", ids)
	}

	// neither: a concurrent operator changes the cordon between the read
	// and the commit of an approval, then of an uncordon
	changes := 0
	k.beforeCommit = func(api.TxnOps) {
		changes++ // a new value each time: Consul keeps the index of an unchanged one
		v := fmt.Sprintf(
			`{"id":"c-1","instance_id":"exec-1","reason":"changed meanwhile (%d)","by":"carol"}`,
			changes,
		)
		_, err := c.KV().Put(&api.KVPair{Key: CordonPrefix + "c-1", Value: []byte(v)}, nil)
		if err != nil {
			t.Error(err)
		}
	}
	if err := k.Approve(ctx, "c-1", "bob"); !errors.Is(err, ErrControl) ||
		!strings.Contains(err.Error(), "changed meanwhile") {
		t.Fatalf("approve racing a change: %v", err)
	}
	if p := cordon("c-1"); p == nil || !strings.Contains(string(p.Value), "changed meanwhile") ||
		strings.Contains(string(p.Value), "approved_by") {
		t.Fatalf("cordon after the refused approval: %+v", p)
	}
	if err := k.Uncordon(ctx, "c-1", "bob", "fixed"); !errors.Is(err, ErrControl) ||
		!strings.Contains(err.Error(), "changed meanwhile") {
		t.Fatalf("uncordon racing a change: %v", err)
	}
	if cordon("c-1") == nil {
		t.Fatal("a refused uncordon removed the cordon")
	}
	if ids := auditIDs(t, c); len(ids) != 1 {
		t.Fatalf("refused approval or uncordon audited: %v", ids)
	}

	// neither, the other way round: when the record cannot be written
	// (its key taken), the change is not applied either
	k.beforeCommit = func(ops api.TxnOps) {
		rec := ops[len(ops)-1].KV
		if !strings.HasPrefix(rec.Key, AuditPrefix) {
			t.Errorf("last operation %s is not the audit record", rec.Key)
		}
		_, err := c.KV().Put(&api.KVPair{Key: rec.Key, Value: []byte("taken by the test")}, nil)
		if err != nil {
			t.Error(err)
		}
	}
	err = k.SetRules(ctx, []byte(`{"safety_limit":0.25}`), "alice")
	if !errors.Is(err, ErrControl) || !strings.Contains(err.Error(), "audit record") {
		t.Fatalf("rules set whose record cannot be written: %v", err)
	}
	if raw, err := k.Rules(ctx); err != nil || raw != nil {
		t.Fatalf("rules stored without their audit record: %q %v", raw, err)
	}
	if err := k.Uncordon(ctx, "c-1", "bob", "fixed"); !errors.Is(err, ErrControl) {
		t.Fatalf("uncordon whose record cannot be written: %v", err)
	}
	if cordon("c-1") == nil {
		t.Fatal("cordon removed without its audit record")
	}

	// both again, for each kind of change
	k.beforeCommit = nil
	if err := k.Approve(ctx, "c-1", "bob"); err != nil {
		t.Fatal(err)
	}
	if err := k.SetRules(ctx, []byte(`{"safety_limit":0.25}`), "alice"); err != nil {
		t.Fatal(err)
	}
	if err := k.ClearRules(ctx, "alice"); err != nil {
		t.Fatal(err)
	}
	if err := k.Uncordon(ctx, "c-1", "bob", "fixed"); err != nil {
		t.Fatal(err)
	}
	if cordon("c-1") != nil {
		t.Fatal("uncordon left the cordon")
	}
	page, err = k.AuditLog(ctx, 100, "")
	if err != nil {
		t.Fatal(err)
	}
	var actions []string
	for _, e := range page.Entries {
		actions = append(actions, e.Actor+":"+e.Action)
	}
	// the two records whose keys the test took are there too, as unreadable ones
	want := []string{
		"alice:cordon",
		":unreadable",
		":unreadable",
		"bob:approve",
		"alice:rules-set",
		"alice:rules-cleared",
		"bob:uncordon",
	}
	if !slices.Equal(actions, want) {
		t.Fatalf("audit trail %v, want %v", actions, want)
	}
}

func TestControlAuditRetentionByCount(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	ctx := context.Background()
	clock := &fakeClock{now: time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)}
	write := func(k *Control, n int) {
		t.Helper()
		for range n {
			clock.Advance(time.Second)
			if err := k.ClearRules(ctx, "alice"); err != nil {
				t.Fatal(err)
			}
		}
	}
	// 70 records, more than one transaction can delete (64 operations)
	write(newControl(t, c, clock, AuditRetention{Keep: 1000, MaxAge: 365 * 24 * time.Hour}), 70)
	all := auditIDs(t, c)
	if len(all) != 70 {
		t.Fatalf("%d records, want 70", len(all))
	}
	// a command run with --audit-keep 5 leaves the 5 newest: 4 of the
	// 70 and its own
	write(newControl(t, c, clock, AuditRetention{Keep: 5, MaxAge: 365 * 24 * time.Hour}), 1)
	got := auditIDs(t, c)
	if len(got) != 5 || !slices.Equal(got[:4], all[66:]) {
		t.Fatalf("kept %v, want the newest 4 of before (%v) and one more", got, all[66:])
	}
	write(newControl(t, c, clock, AuditRetention{Keep: 5, MaxAge: 365 * 24 * time.Hour}), 3)
	if now := auditIDs(t, c); len(now) != 5 || !slices.Equal(now[:2], got[3:]) {
		t.Fatalf("kept %v after 3 more writes, want the 2 newest of %v first", now, got)
	}
}

func TestControlAuditRetentionByAge(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	ctx := context.Background()
	day := 24 * time.Hour
	clock := &fakeClock{now: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)}
	k := newControl(t, c, clock, AuditRetention{Keep: 1000, MaxAge: 90 * day})
	at := map[string]time.Duration{} // id → age on the last write
	write := func(by string) {
		t.Helper()
		if err := k.ClearRules(ctx, by); err != nil {
			t.Fatal(err)
		}
	}
	write("day0")
	write("day0")
	clock.Advance(30 * day)
	write("day30")
	clock.Advance(60*day + time.Hour) // day 90 and an hour: the day-0 records are past 90 days
	write("day90")
	page, err := k.AuditLog(ctx, 100, "")
	if err != nil {
		t.Fatal(err)
	}
	var actors []string
	for _, e := range page.Entries {
		actors = append(actors, e.Actor)
		at[e.ID] = clock.Now().Sub(e.At)
	}
	if !slices.Equal(actors, []string{"day30", "day90"}) {
		t.Fatalf("after day 90 the trail holds %v (ages %v), want day30 and day90", actors, at)
	}
	// exactly at the limit a record stays; a moment past it, it goes
	clock.Advance(30*day - time.Hour)
	write("day120")
	if ids := auditIDs(t, c); len(ids) != 3 {
		t.Fatalf("a record exactly 90 days old was deleted: %v", ids)
	}
	clock.Advance(time.Nanosecond)
	write("day120+")
	page, err = k.AuditLog(ctx, 100, "")
	if err != nil {
		t.Fatal(err)
	}
	actors = actors[:0]
	for _, e := range page.Entries {
		actors = append(actors, e.Actor)
	}
	if !slices.Equal(actors, []string{"day90", "day120", "day120+"}) {
		t.Fatalf("after day 120 the trail holds %v", actors)
	}
}

func TestControlAuditPagesReturnEveryRecordOnce(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	ctx := context.Background()
	clock := &fakeClock{now: time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)}
	k := newControl(t, c, clock, AuditRetention{})
	var written []string // actors, oldest first
	write := func() {
		t.Helper()
		by := fmt.Sprintf("op-%02d", len(written))
		if err := k.ClearRules(ctx, by); err != nil {
			t.Fatal(err)
		}
		written = append(written, by)
	}
	for range 23 {
		clock.Advance(time.Millisecond) // several share a second: order must not depend on it
		write()
	}
	first := slices.Clone(written)

	// page from the newest back, writing more records between pages
	var pages [][]AuditEntry
	before := ""
	for {
		page, err := k.AuditLog(ctx, 5, before)
		if err != nil {
			t.Fatal(err)
		}
		if len(page.Entries) == 0 || len(page.Entries) > 5 {
			t.Fatalf("page %d has %d records", len(pages), len(page.Entries))
		}
		for i := 1; i < len(page.Entries); i++ {
			if page.Entries[i-1].ID >= page.Entries[i].ID {
				t.Fatalf(
					"page not oldest first: %s then %s",
					page.Entries[i-1].ID,
					page.Entries[i].ID,
				)
			}
		}
		pages = append(pages, page.Entries)
		if page.Older == "" {
			break
		}
		if page.Older != page.Entries[0].ID {
			t.Fatalf("cursor %s is not the page's oldest record %s", page.Older, page.Entries[0].ID)
		}
		before = page.Older
		clock.Advance(time.Millisecond)
		write() // newer than every cursor: never on a later page
	}
	var got []string
	for i := len(pages) - 1; i >= 0; i-- {
		for _, e := range pages[i] {
			got = append(got, e.Actor)
		}
	}
	if !slices.Equal(got, first) {
		t.Fatalf("pages returned %v, want each of %v once, in order", got, first)
	}
	if len(pages) != 5 {
		t.Fatalf("%d pages of 5 for 23 records", len(pages))
	}

	// the newest page now starts with the records written while paging
	page, err := k.AuditLog(ctx, 4, "")
	if err != nil {
		t.Fatal(err)
	}
	var newest []string
	for _, e := range page.Entries {
		newest = append(newest, e.Actor)
	}
	if !slices.Equal(newest, written[len(written)-4:]) {
		t.Fatalf("newest page %v, want %v", newest, written[len(written)-4:])
	}

	// bad arguments name themselves
	if _, err := k.AuditLog(ctx, 0, ""); err == nil || !strings.HasPrefix(err.Error(), "limit:") {
		t.Fatalf("limit 0: %v", err)
	}
	if _, err := k.AuditLog(ctx, 5, "yesterday"); err == nil ||
		!strings.HasPrefix(err.Error(), "before:") {
		t.Fatalf("before yesterday: %v", err)
	}
}

func TestControlRetentionValidated(t *testing.T) {
	for _, tt := range []struct {
		r    AuditRetention
		want string
	}{
		{AuditRetention{Keep: -1}, "keep"},
		{AuditRetention{MaxAge: -time.Hour}, "max age"},
	} {
		if _, err := NewControl(nil, ControlOptions{Retention: tt.r}); err == nil ||
			!strings.Contains(err.Error(), tt.want) {
			t.Errorf("%+v: %v, want an error naming %s", tt.r, err, tt.want)
		}
	}
}

// TestUncordonStoresWhoRemovedIt: an uncordon writes, in the removal's
// transaction, a removal record naming who removed the cordon and why (the
// control watch hands it to every replica with the removal), and deletes
// the removal records older than removalKeep; an approval by the cordon's
// own token under another name is refused, and one without ACLs says in its
// audit record that it is not attributed.
func TestUncordonStoresWhoRemovedIt(t *testing.T) {
	a := consultest.Start(t)
	c := a.Client()
	ctx := context.Background()
	clock := &fakeClock{now: time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)}
	k := newControl(t, c, clock, AuditRetention{})
	removal := func(id string) *health.CordonRemoval {
		t.Helper()
		p, _, err := c.KV().Get(RemovedPrefix+id, nil)
		if err != nil {
			t.Fatal(err)
		}
		if p == nil {
			return nil
		}
		var r health.CordonRemoval
		if err := json.Unmarshal(p.Value, &r); err != nil {
			t.Fatal(err)
		}
		return &r
	}
	for _, id := range []string{"c-1", "c-2"} {
		if err := k.Cordon(ctx, testCordon(id, "alice")); err != nil {
			t.Fatal(err)
		}
	}
	if err := k.UncordonAs(ctx, "c-1", Actor{Name: "bob"}, "fixed"); err != nil {
		t.Fatal(err)
	}
	if r := removal("c-1"); r == nil || r.By != "bob" || r.Reason != "fixed" || r.ID != "c-1" {
		t.Fatalf("removal record of c-1: %+v", r)
	}
	clock.Advance(removalKeep + time.Hour)
	if err := k.UncordonAs(ctx, "c-2", Actor{Name: "carol"}, ""); err != nil {
		t.Fatal(err)
	}
	if r := removal("c-1"); r != nil {
		t.Errorf("a removal record older than %s kept: %+v", removalKeep, r)
	}
	if r := removal("c-2"); r == nil || r.By != "carol" {
		t.Fatalf("removal record of c-2: %+v", r)
	}

	// The same token cannot approve its own cordon under another name.
	own := testCordon("c-3", "token:alice (aaaa)")
	own.ByAccessor = "aaaa"
	if err := k.Cordon(ctx, own); err != nil {
		t.Fatal(err)
	}
	err := k.ApproveAs(ctx, "c-3", Actor{Name: "token:renamed (aaaa)", Accessor: "aaaa"})
	if !errors.Is(err, ErrControl) || !strings.Contains(err.Error(), "different identity") {
		t.Fatalf("approval by the cordon's own token: %v", err)
	}
	if err := k.ApproveAs(ctx, "c-3", Actor{Name: "bob"}); err != nil {
		t.Fatal(err)
	}
	page, err := k.AuditLog(ctx, 100, "")
	if err != nil {
		t.Fatal(err)
	}
	var approval, cordon AuditEntry
	for _, e := range page.Entries {
		if e.Target == "c-3" && e.Action == "approve" {
			approval = e
		}
		if e.Target == "c-3" && e.Action == "cordon" {
			cordon = e
		}
	}
	if !strings.Contains(approval.Detail, Unattributed) || approval.Accessor != "" {
		t.Errorf("the unattributed approval's record: %+v", approval)
	}
	if cordon.Accessor != "aaaa" {
		t.Errorf("the token's cordon record has no accessor: %+v", cordon)
	}
}
