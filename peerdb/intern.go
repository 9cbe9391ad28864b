package peerdb

// interned holds values of T under small indexes, counting the users of
// each, for tables that name few distinct values many times (the VTEPs of
// a network's peers, the hosts its records come from).
type interned[T comparable] struct {
	idx  map[T]uint32
	vals []T // by index; the zero T for a free index
	refs []int32
	free []uint32
}

// lookup returns the index of v, if interned.
func (t *interned[T]) lookup(v T) (uint32, bool) {
	i, ok := t.idx[v]
	return i, ok
}

// intern returns the index of v, interning it (with no users) if needed.
func (t *interned[T]) intern(v T) uint32 {
	if i, ok := t.idx[v]; ok {
		return i
	}
	if t.idx == nil {
		t.idx = make(map[T]uint32)
	}
	n := len(t.vals)
	i := putSlot(&t.vals, &t.free, v)
	if len(t.vals) > n {
		t.refs = append(t.refs, 0)
	}
	t.idx[v] = i
	return i
}

// putSlot stores v in a free slot of *vals (listed in *free) or a new one,
// and returns its index.
func putSlot[T any](vals *[]T, free *[]uint32, v T) uint32 {
	if n := len(*free); n > 0 {
		i := (*free)[n-1]
		*free = (*free)[:n-1]
		(*vals)[i] = v
		return i
	}
	*vals = append(*vals, v)
	return uint32(len(*vals) - 1)
}

// release frees index i, which has no users.
func (t *interned[T]) release(i uint32) {
	var zero T
	delete(t.idx, t.vals[i])
	t.vals[i] = zero
	t.free = append(t.free, i)
}
