package peerdb

import (
	"net/netip"
)

// vtepTable interns VTEP addresses (there are few hosts and many entries),
// counting the remote entries using each.
type vtepTable struct {
	idx  map[netip.Addr]uint32
	addr []netip.Addr // by index; the zero Addr for a free index
	refs []int32
	free []uint32
	zero []uint32 // indexes whose count dropped to zero in this transaction

	// cache is a direct-mapped cache of idx, by the low bits of the
	// address: events name VTEPs far more often than there are VTEPs.
	cache [vtepCacheSize]vtepCached
}

const vtepCacheSize = 64

type vtepCached struct {
	addr netip.Addr // the zero Addr when empty
	idx  uint32
}

func vtepSlot(a netip.Addr) int {
	b := a.As16()
	return int(b[15]^b[14]<<2) % vtepCacheSize
}

func (t *vtepTable) ref(a netip.Addr) uint32 {
	slot := &t.cache[vtepSlot(a)]
	if slot.addr == a {
		t.refs[slot.idx]++
		return slot.idx
	}
	i, ok := t.idx[a]
	if !ok {
		if t.idx == nil {
			t.idx = make(map[netip.Addr]uint32)
		}
		if n := len(t.free); n > 0 {
			i = t.free[n-1]
			t.free = t.free[:n-1]
			t.addr[i] = a
		} else {
			i = uint32(len(t.addr))
			t.addr = append(t.addr, a)
			t.refs = append(t.refs, 0)
		}
		t.idx[a] = i
	}
	t.refs[i]++
	*slot = vtepCached{addr: a, idx: i}
	return i
}

func (t *vtepTable) unref(i uint32) {
	t.refs[i]--
	if t.refs[i] == 0 {
		t.zero = append(t.zero, i)
	}
}

// sweep frees the addresses that are no longer used.
func (t *vtepTable) sweep() {
	for _, i := range t.zero {
		a := t.addr[i]
		if t.refs[i] != 0 || !a.IsValid() { // used again, or listed twice
			continue
		}
		delete(t.idx, a)
		if slot := &t.cache[vtepSlot(a)]; slot.addr == a {
			*slot = vtepCached{}
		}
		t.addr[i] = netip.Addr{}
		t.free = append(t.free, i)
	}
	t.zero = t.zero[:0]
}
