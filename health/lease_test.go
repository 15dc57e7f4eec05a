package health

import (
	"reflect"
	"testing"
	"time"
)

func TestLeaseDefaultsAndValidate(t *testing.T) {
	d := Lease{}.WithDefaults()
	if d.TTL != 35*time.Second || d.Heartbeat != 10*time.Second ||
		d.DeregisterAfter != 10*time.Minute {
		t.Fatalf("defaults = %+v", d)
	}
	if err := d.Validate(); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		l      Lease
		fields []string
	}{
		{"short test lease",
			Lease{TTL: time.Second, Heartbeat: 250 * time.Millisecond,
				DeregisterAfter: time.Minute}, nil},
		{"exactly 2x",
			Lease{TTL: 2 * time.Second, Heartbeat: time.Second, DeregisterAfter: time.Minute}, nil},
		{"lease under 2x",
			Lease{TTL: 19 * time.Second, Heartbeat: 10 * time.Second, DeregisterAfter: time.Minute},
			[]string{"lease"}},
		{"negative heartbeat", Lease{TTL: time.Second, Heartbeat: -1, DeregisterAfter: time.Minute},
			[]string{"heartbeat"}},
		{"negative lease",
			Lease{TTL: -time.Second, Heartbeat: time.Second, DeregisterAfter: time.Minute},
			[]string{"lease"}},
		{"deregister too soon",
			Lease{TTL: 35 * time.Second, Heartbeat: 10 * time.Second,
				DeregisterAfter: 30 * time.Second}, []string{"deregister_after"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Fields(tt.l.Validate()); !reflect.DeepEqual(got, tt.fields) {
				t.Fatalf("fields = %v, want %v", got, tt.fields)
			}
		})
	}
}

func TestLeaseExpired(t *testing.T) {
	l := Lease{TTL: 35 * time.Second}
	t0 := time.Unix(1000, 0)
	for _, tt := range []struct {
		after time.Duration
		want  bool
	}{{0, false}, {20 * time.Second, false}, {35*time.Second - 1, false}, {35 * time.Second, true},
		{time.Hour, true}} {
		if got := l.Expired(t0, t0.Add(tt.after)); got != tt.want {
			t.Errorf("Expired after %s = %v, want %v", tt.after, got, tt.want)
		}
	}
}

func TestHeartbeatStatusAndLoad(t *testing.T) {
	for _, tt := range []struct {
		load, capacity int
		want           CheckStatus
	}{{0, 4, StatusPassing}, {3, 4, StatusPassing}, {4, 4, StatusWarning}, {9, 4, StatusWarning}} {
		if got := HeartbeatStatus(tt.load, tt.capacity); got != tt.want {
			t.Errorf("HeartbeatStatus(%d,%d) = %s, want %s", tt.load, tt.capacity, got, tt.want)
		}
	}
	if LoadOutput(3) != "load=3" {
		t.Fatal(LoadOutput(3))
	}
	for _, tt := range []struct {
		in   string
		n    int
		okay bool
	}{{"load=3", 3, true}, {"load=12 session=x", 12, true}, {" load=0\nmore", 0, true},
		{"load=-1", 0, false}, {"TTL expired", 0, false}, {"", 0, false}} {
		n, ok := ParseLoad(tt.in)
		if n != tt.n || ok != tt.okay {
			t.Errorf("ParseLoad(%q) = %d,%v want %d,%v", tt.in, n, ok, tt.n, tt.okay)
		}
	}
}
