package peerdb

import "math/rand/v2"

// index is a hash table from 64-bit keys to non-negative int32 values (slab
// indexes), with open addressing and linear probing. Keys hold at most 64
// bits but the users' are 32-bit (IPs) or 48-bit (MACs).
//
// It replaces Go maps on the hot paths of the DB because it can keep nearby
// keys nearby: the home slot of a key is the hash of its high bits followed
// by its low blockBits bits, so keys that differ only in their low bits (the
// consecutive IPs of a subnet, the MACs derived from them) land in
// consecutive slots and a batch of such keys touches few cache lines. At
// most 1<<blockBits keys share a block, and block numbers are mixed with a
// per-table random seed, so long probe runs are hard to cause on purpose.
//
// The zero index is empty and ready to use.
type index struct {
	slots []islot // len is zero or a power of two, at least 1<<blockBits
	n     int     // keys held
	shift uint    // 64 - log2(len(slots)/(1<<blockBits))
	seed  uint64
}

// islot is a slot of an index: 12 bytes, not 16, as the key is split.
type islot struct {
	lo, hi uint32 // the key
	val    int32  // value + 1; 0 marks an empty slot
}

func (s *islot) key() uint64 { return uint64(s.hi)<<32 | uint64(s.lo) }

func mkslot(k uint64, v int32) islot { return islot{lo: uint32(k), hi: uint32(k >> 32), val: v + 1} }

const (
	blockBits = 3
	blockMask = 1<<blockBits - 1
	minSlots  = 1 << blockBits
)

// home returns the slot where the probe for k starts.
func (x *index) home(k uint64) int {
	// Mix the block number with the seed (the finalizer of MurmurHash3).
	h := (k >> blockBits) ^ x.seed
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	h *= 0xc4ceb9fe1a85ec53
	h ^= h >> 33
	return int(h>>x.shift)<<blockBits | int(k&blockMask)
}

// find returns the slot holding k, or else the empty slot where k would be
// inserted (which is only meaningful while the table has room). The table
// must have slots.
func (x *index) find(k uint64) (slot int, found bool) {
	mask := len(x.slots) - 1
	for i := x.home(k); ; i = (i + 1) & mask {
		s := &x.slots[i]
		if s.val == 0 {
			return i, false
		}
		if s.lo == uint32(k) && s.hi == uint32(k>>32) {
			return i, true
		}
	}
}

// get returns the value of k.
func (x *index) get(k uint64) (int32, bool) {
	if x.n == 0 {
		return 0, false
	}
	i, ok := x.find(k)
	if !ok {
		return 0, false
	}
	return x.slots[i].val - 1, true
}

// slot returns the slot holding k, or else, after making room for one more
// key, the empty slot where k goes: fill it with set before any other change
// to the table.
func (x *index) slot(k uint64) (slot int, found bool) {
	if len(x.slots) == 0 || (x.n+1)*4 > len(x.slots)*3 {
		x.grow(x.n + 1)
	}
	return x.find(k)
}

// set stores k with value v in slot i, an empty slot returned by slot(k).
func (x *index) set(i int, k uint64, v int32) {
	x.slots[i] = mkslot(k, v)
	x.n++
}

// at returns the value in slot i, a full slot returned by slot.
func (x *index) at(i int) int32 { return x.slots[i].val - 1 }

// put replaces the value in slot i, a full slot returned by slot.
func (x *index) put(i int, v int32) { x.slots[i].val = v + 1 }

// del removes k if present.
func (x *index) del(k uint64) {
	if x.n == 0 {
		return
	}
	i, ok := x.find(k)
	if !ok {
		return
	}
	// Backward-shift deletion: move later entries of the probe run into the
	// hole when their home slot allows it, so no tombstones are needed.
	mask := len(x.slots) - 1
	for j := (i + 1) & mask; x.slots[j].val != 0; j = (j + 1) & mask {
		h := x.home(x.slots[j].key())
		// The entry at j may move to i unless its home lies cyclically in
		// (i, j].
		if i <= j {
			if i < h && h <= j {
				continue
			}
		} else if i < h || h <= j {
			continue
		}
		x.slots[i] = x.slots[j]
		i = j
	}
	x.slots[i] = islot{}
	x.n--
}

// reserve makes room for n keys in all, so that inserting up to them does
// not rehash.
func (x *index) reserve(n int) {
	if n*4 > len(x.slots)*3 {
		x.grow(n)
	}
}

// grow rehashes into a table that holds at least n keys under the maximum
// load factor of 3/4.
func (x *index) grow(n int) {
	size := minSlots
	for size*3 < n*4 {
		size *= 2
	}
	if size < 2*len(x.slots) {
		size = 2 * len(x.slots)
	}
	old := x.slots
	x.slots = make([]islot, size)
	x.shift = 64
	for s := size >> blockBits; s > 1; s >>= 1 {
		x.shift--
	}
	x.seed = rand.Uint64()
	mask := size - 1
	for _, s := range old {
		if s.val == 0 {
			continue
		}
		i := x.home(s.key())
		for x.slots[i].val != 0 {
			i = (i + 1) & mask
		}
		x.slots[i] = s
	}
}

// len returns the number of keys.
func (x *index) len() int { return x.n }

// reset removes every key; with release, a large table's room goes too.
func (x *index) reset(release bool) {
	if release && len(x.slots) > 1024 {
		*x = index{}
		return
	}
	clear(x.slots)
	x.n = 0
}
