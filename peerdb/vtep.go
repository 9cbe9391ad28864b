package peerdb

import (
	"net/netip"
)

// vtepTable interns VTEP addresses (there are few hosts and many entries),
// counting the remote entries and held records using each. An address
// whose count drops to zero is released when the transaction ends (sweep),
// so the indexes noted during it stay valid.
type vtepTable struct {
	interned[netip.Addr]
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
	i := t.intern(a)
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

// reset empties the table (no entry uses an address), keeping its room.
func (t *vtepTable) reset() {
	clear(t.idx)
	clear(t.vals)
	t.vals, t.refs, t.free, t.zero = t.vals[:0], t.refs[:0], t.free[:0], t.zero[:0]
	t.cache = [vtepCacheSize]vtepCached{}
}

// sweep frees the addresses that are no longer used.
func (t *vtepTable) sweep() {
	for _, i := range t.zero {
		a := t.vals[i]
		if t.refs[i] != 0 || !a.IsValid() { // used again, or listed twice
			continue
		}
		if slot := &t.cache[vtepSlot(a)]; slot.addr == a {
			*slot = vtepCached{}
		}
		t.release(i)
	}
	t.zero = t.zero[:0]
}
