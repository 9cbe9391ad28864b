package sandbox

import (
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/overlayd/overlayd/peerdb"
)

// movedNeighs is pure bookkeeping (what it finds is announced by
// announce, which the driver's kernel tests cover): these tests drive it
// with a clock of their own on a sandbox that holds no kernel state.

// A change that neither deletes a neighbour nor finds one remembered reads
// no clock: ApplyDelta runs once per peer notification.
func TestMovedNeighsReadsNoClockWhenNothingIsRemembered(t *testing.T) {
	sb := &Sandbox{arp: -1, born: time.Now()}
	moved := peerdb.Neigh{IP: netip.MustParseAddr("198.51.100.20"), MAC: peerdb.MAC{2, 0, 0, 0, 0, 2}}
	d := peerdb.Delta{
		NeighSet:   []peerdb.Neigh{{IP: netip.MustParseAddr("198.51.100.10"), MAC: peerdb.MAC{2, 0, 0, 0, 0, 1}}, moved},
		NeighMoved: []peerdb.Neigh{moved},
	}
	got := sb.movedNeighs(d, func() time.Time {
		t.Error("movedNeighs read the clock for a change with no deletion and nothing remembered")
		return time.Now()
	})
	if !slices.Equal(got, d.NeighMoved) {
		t.Errorf("moved %v, want the delta's own %v", got, d.NeighMoved)
	}
}

// An address deleted, then set with another MAC within goneMemory, is
// reported as moved, and not once goneMemory has passed; the clock is read
// for both, as the deletion is remembered.
func TestMovedNeighsRemembersDeletions(t *testing.T) {
	ip := netip.MustParseAddr("198.51.100.10")
	old, moved := peerdb.MAC{2, 0, 0, 0, 0, 1}, peerdb.MAC{2, 0, 0, 0, 0, 2}
	for _, tc := range []struct {
		after time.Duration
		want  int
	}{{time.Second, 1}, {goneMemory + time.Second, 0}} {
		born := time.Now()
		sb := &Sandbox{arp: -1, born: born}
		reads := 0
		at := func(d time.Duration) func() time.Time {
			return func() time.Time { reads++; return born.Add(d) }
		}
		sb.movedNeighs(peerdb.Delta{NeighDel: []peerdb.Neigh{{IP: ip, MAC: old}}}, at(0))
		got := sb.movedNeighs(peerdb.Delta{NeighSet: []peerdb.Neigh{{IP: ip, MAC: moved}}}, at(tc.after))
		if len(got) != tc.want {
			t.Errorf("set %v after the deletion: moved %v, want %d", tc.after, got, tc.want)
		}
		if reads != 2 {
			t.Errorf("set %v after the deletion: the clock was read %d times, want 2", tc.after, reads)
		}
		if len(sb.gone) != 0 {
			t.Errorf("set %v after the deletion: %d deletions still remembered, want none", tc.after, len(sb.gone))
		}
	}
}
