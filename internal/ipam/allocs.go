package ipam

import (
	"net"
	"slices"
	"sort"
)

// allocation is one address this host handed out: to which endpoint MAC
// (when dockerd gave one) and when. It lives only on this host.
type allocation struct {
	mac    [6]byte
	hasMAC bool
	at     int64 // unix seconds
	// seq: the journal mark that writes it, until it is on disk (then 0);
	// a replay of the request waits for it too.
	seq uint64
}

func (a allocation) macString() string {
	if !a.hasMAC {
		return ""
	}
	return net.HardwareAddr(a.mac[:]).String()
}

// allocSet is a pool's allocations on this host: by address, and the
// addresses sorted, for counting per range and finding free ones.
type allocSet struct {
	byAddr map[uint32]allocation
	sorted []uint32
	// byMAC: an address allocated to each MAC (for replays of requests
	// for any address).
	byMAC map[[6]byte]uint32
}

func newAllocSet() allocSet {
	return allocSet{byAddr: map[uint32]allocation{}, byMAC: map[[6]byte]uint32{}}
}

// withMAC returns an address allocated to mac.
func (s *allocSet) withMAC(mac [6]byte) (uint32, bool) { x, ok := s.byMAC[mac]; return x, ok }

func (s *allocSet) len() int { return len(s.sorted) }

func (s *allocSet) get(a uint32) (allocation, bool) { r, ok := s.byAddr[a]; return r, ok }

func (s *allocSet) put(a uint32, r allocation) {
	if _, ok := s.byAddr[a]; !ok {
		i, _ := slices.BinarySearch(s.sorted, a)
		s.sorted = slices.Insert(s.sorted, i, a)
	}
	s.byAddr[a] = r
	if r.hasMAC {
		s.byMAC[r.mac] = a
	}
}

func (s *allocSet) remove(a uint32) {
	r, ok := s.byAddr[a]
	if !ok {
		return
	}
	if x, ok := s.byMAC[r.mac]; r.hasMAC && ok && x == a {
		delete(s.byMAC, r.mac)
	}
	delete(s.byAddr, a)
	i, _ := slices.BinarySearch(s.sorted, a)
	s.sorted = slices.Delete(s.sorted, i, i+1)
}

// countIn counts allocations inside sp.
func (s *allocSet) countIn(sp span) uint64 {
	i, _ := slices.BinarySearch(s.sorted, sp.first)
	j := sort.Search(len(s.sorted), func(k int) bool { return s.sorted[k] > sp.last })
	return uint64(j - i)
}

// firstFree returns the first unallocated address of sp at or after from.
func (s *allocSet) firstFree(sp span, from uint32) (uint32, bool) {
	x := max(from, sp.first)
	i, _ := slices.BinarySearch(s.sorted, x)
	for ; i < len(s.sorted) && s.sorted[i] == x; i++ {
		if x == sp.last {
			return 0, false
		}
		x++
	}
	return x, x <= sp.last
}

// largestFree returns the longest run of unallocated addresses inside the
// spans (sorted, disjoint); ok is false when all are allocated.
func (s *allocSet) largestFree(spans []span) (best span, ok bool) {
	consider := func(first, last uint32) {
		if first > last {
			return
		}
		c := span{first, last}
		if !ok || c.size() > best.size() {
			best, ok = c, true
		}
	}
	for _, sp := range spans {
		i, _ := slices.BinarySearch(s.sorted, sp.first)
		next, open := sp.first, true // open: next is inside sp
		for ; i < len(s.sorted) && s.sorted[i] <= sp.last; i++ {
			if s.sorted[i] > next {
				consider(next, s.sorted[i]-1)
			}
			if s.sorted[i] == sp.last {
				open = false
				break
			}
			next = s.sorted[i] + 1
		}
		if open {
			consider(next, sp.last)
		}
	}
	return best, ok
}
