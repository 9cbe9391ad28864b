// Package countmap provides Map, a set of counters whose zero entries vanish.
//
// It is meant for reference counts kept next to other state (how many
// endpoints use a MAC, how many peers sit behind a VTEP…): a key is present
// exactly while its count is positive, so "is it used?" is a plain lookup and
// the map never accumulates dead keys.
//
// A count never goes below zero. An Add that would make it negative means the
// caller's bookkeeping is broken (a release without an acquire), and Map
// panics rather than storing the impossible value or hiding it, the way
// sync.WaitGroup panics on a negative counter.
package countmap

import "fmt"

// Map is a set of positive counters keyed by T. A key whose count reaches zero
// is removed. The zero Map is empty and ready to use.
//
// A Map is not safe for concurrent use: it is meant to live inside a larger
// structure, and the caller must hold that owner's lock for every call,
// reads included.
type Map[T comparable] struct {
	m map[T]int
}

// Add adds delta (which may be negative) to the count of v and returns the new
// count. A count that reaches zero removes v from the map; adding to an absent
// key starts from zero.
//
// Add panics if the new count would be negative (the caller released more than
// it acquired) or would overflow int. The panic message names the key, its
// current count, delta and the would-be count. The check happens before any
// mutation, so if the panic is recovered the map is unchanged.
func (m *Map[T]) Add(v T, delta int) int {
	cur := m.m[v]
	n := cur + delta
	if delta > 0 && n < cur {
		panic(fmt.Sprintf("countmap: count of %v overflows: %d + %d", v, cur, delta))
	}
	if n < 0 {
		panic(fmt.Sprintf("countmap: negative count for %v: %d + (%d) = %d", v, cur, delta, n))
	}
	if n == 0 {
		delete(m.m, v)
		return 0
	}
	if m.m == nil {
		m.m = make(map[T]int)
	}
	m.m[v] = n
	return n
}

// Get returns the count of v, 0 if v is absent.
func (m *Map[T]) Get(v T) int { return m.m[v] }

// Len returns the number of keys with a positive count.
func (m *Map[T]) Len() int { return len(m.m) }

// Keys returns the keys with a positive count, in unspecified order, as a
// fresh slice the caller owns (nil when the map is empty).
func (m *Map[T]) Keys() []T {
	if len(m.m) == 0 {
		return nil
	}
	keys := make([]T, 0, len(m.m))
	for k := range m.m {
		keys = append(keys, k)
	}
	return keys
}

// Range calls f for each key and its (positive) count, in unspecified order,
// until f returns false. f may call Add on the key it is visiting (including
// dropping it to zero); other changes during Range follow the rules of ranging
// over a Go map (keys added may or may not be visited).
func (m *Map[T]) Range(f func(v T, count int) bool) {
	for k, n := range m.m {
		if !f(k, n) {
			return
		}
	}
}
