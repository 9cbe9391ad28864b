package ipam

import (
	"errors"
	"fmt"
	"math"
	"sort"
)

// maxTokens bounds a ring's tokens (each donation adds at most two): it
// keeps a ring message and its state record small (10 bytes a token on the
// wire). A donation that would pass it is refused.
const maxTokens = 16384

// token starts a range of the ring: the range runs from start to the next
// token's start (or the ring's end) and belongs to owner. Invariants (also
// in the package doc):
//
//   - only the owner of a range allocates from it, splits it (adds a token
//     inside it) or gives it away (changes the owner of its tokens);
//   - every change of a token increments its version, and a merge keeps the
//     higher version per start address (ties, which only a broken
//     invariant makes, go to the greater owner, so that the merge stays a
//     function of the set of views);
//   - tokens are never deleted, so views only grow.
type token struct {
	start   uint32
	owner   Identity
	version uint32
}

// newer reports whether t wins over o in a merge (same start).
func (t token) newer(o token) bool {
	if t.version != o.version {
		return t.version > o.version
	}
	return t.owner.compare(o.owner) > 0
}

// ring is one host's view of a pool's ownership: tokens sorted by start,
// the first at lo, all within lo..hi.
type ring struct {
	lo, hi uint32
	tokens []token
}

// span is an inclusive interval of addresses.
type span struct{ first, last uint32 }

func (s span) size() uint64 { return uint64(s.last) - uint64(s.first) + 1 }

// newRing is the ring a won claim creates: all of it owned by owner.
func newRing(lo, hi uint32, owner Identity) *ring {
	return &ring{lo: lo, hi: hi, tokens: []token{{start: lo, owner: owner, version: 1}}}
}

func (r *ring) clone() *ring {
	return &ring{lo: r.lo, hi: r.hi, tokens: append([]token(nil), r.tokens...)}
}

// check verifies the structural invariants; every ring from the network or
// the state file passes it before use.
func (r *ring) check() error { return r.checkLimit(maxTokens) }

// checkLimit is check with another token limit: a ring on the wire may be
// the merge of several hosts' views.
func (r *ring) checkLimit(limit int) error {
	if r.lo > r.hi {
		return fmt.Errorf("ring bounds %s..%s are reversed", addrOf(r.lo), addrOf(r.hi))
	}
	if len(r.tokens) == 0 {
		return errors.New("the ring has no token")
	}
	if len(r.tokens) > limit {
		return fmt.Errorf("the ring has %d tokens, more than %d", len(r.tokens), limit)
	}
	if r.tokens[0].start != r.lo {
		return fmt.Errorf("the first token starts at %s, not at the ring's start %s", addrOf(r.tokens[0].start), addrOf(r.lo))
	}
	for i, t := range r.tokens {
		if t.start > r.hi {
			return fmt.Errorf("token %s lies after the ring's end %s", addrOf(t.start), addrOf(r.hi))
		}
		if i > 0 && t.start <= r.tokens[i-1].start {
			return fmt.Errorf("tokens %s and %s are out of order", addrOf(r.tokens[i-1].start), addrOf(t.start))
		}
		if t.version == 0 {
			return fmt.Errorf("token %s has version 0", addrOf(t.start))
		}
		if err := checkName(t.owner.Name); err != nil {
			return fmt.Errorf("token %s: %w", addrOf(t.start), err)
		}
	}
	return nil
}

// find returns the index of the token whose range holds a (lo <= a <= hi).
func (r *ring) find(a uint32) int {
	return sort.Search(len(r.tokens), func(i int) bool { return r.tokens[i].start > a }) - 1
}

// last returns the last address of token i's range.
func (r *ring) last(i int) uint32 {
	if i+1 < len(r.tokens) {
		return r.tokens[i+1].start - 1
	}
	return r.hi
}

func (r *ring) contains(a uint32) bool { return a >= r.lo && a <= r.hi }

// ownerOf returns the owner of a, which must be in the ring.
func (r *ring) ownerOf(a uint32) Identity { return r.tokens[r.find(a)].owner }

// owned returns the spans id owns, adjacent ranges joined, in order.
func (r *ring) owned(id Identity) []span {
	var out []span
	for i, t := range r.tokens {
		if t.owner != id {
			continue
		}
		s := span{t.start, r.last(i)}
		if n := len(out); n > 0 && out[n-1].last+1 == s.first {
			out[n-1].last = s.last
			continue
		}
		out = append(out, s)
	}
	return out
}

// ownedSize counts the addresses owner owns.
func (r *ring) ownedSize(id Identity) uint64 {
	var n uint64
	for i, t := range r.tokens {
		if t.owner == id {
			n += uint64(r.last(i)) - uint64(t.start) + 1
		}
	}
	return n
}

// owners returns every owner with the addresses it owns.
func (r *ring) owners() map[Identity]uint64 {
	out := map[Identity]uint64{}
	for i, t := range r.tokens {
		out[t.owner] += uint64(r.last(i)) - uint64(t.start) + 1
	}
	return out
}

// boundary makes sure a token starts at a (inside the ring), splitting the
// range that holds it; the new token keeps that range's owner. Only that
// owner may call it (invariant 1).
func (r *ring) boundary(a uint32) {
	i := r.find(a)
	if r.tokens[i].start == a {
		return
	}
	r.tokens = append(r.tokens, token{})
	copy(r.tokens[i+2:], r.tokens[i+1:])
	r.tokens[i+1] = token{start: a, owner: r.tokens[i].owner, version: 1}
}

// donate gives sp, which self owns entirely, to the identity to: tokens at
// its ends (splits) and every token inside it changes owner, version+1.
// It fails, changing nothing, if self does not own all of sp or the ring
// would pass maxTokens.
func (r *ring) donate(self, to Identity, sp span) error {
	if sp.first > sp.last || !r.contains(sp.first) || !r.contains(sp.last) {
		return fmt.Errorf("range %s-%s is not inside the ring %s-%s", addrOf(sp.first), addrOf(sp.last), addrOf(r.lo), addrOf(r.hi))
	}
	for i := r.find(sp.first); i < len(r.tokens) && r.tokens[i].start <= sp.last; i++ {
		if r.tokens[i].owner != self {
			return fmt.Errorf("range %s-%s is not all this host's: %s owns from %s", addrOf(sp.first), addrOf(sp.last), r.tokens[i].owner, addrOf(max(sp.first, r.tokens[i].start)))
		}
		if r.tokens[i].version == math.MaxUint32 {
			return fmt.Errorf("token %s has reached the last version", addrOf(r.tokens[i].start))
		}
	}
	extra := 0
	if r.tokens[r.find(sp.first)].start != sp.first {
		extra++
	}
	if sp.last < r.hi && r.tokens[r.find(sp.last+1)].start != sp.last+1 {
		extra++
	}
	if len(r.tokens)+extra > maxTokens {
		return fmt.Errorf("the pool's ring is split into %d ranges, the most allowed is %d", len(r.tokens), maxTokens)
	}
	r.boundary(sp.first)
	if sp.last < r.hi {
		r.boundary(sp.last + 1)
	}
	for i := r.find(sp.first); i < len(r.tokens) && r.tokens[i].start <= sp.last; i++ {
		r.tokens[i].owner = to
		r.tokens[i].version++
	}
	return nil
}

// merge folds o (a view of the same pool) into r: per start address the
// newer token wins. It reports whether r changed. Commutative, associative
// and idempotent: the result depends only on the set of tokens seen.
func (r *ring) merge(o *ring) (changed bool) {
	if o.lo != r.lo || o.hi != r.hi {
		return false
	}
	out := make([]token, 0, max(len(r.tokens), len(o.tokens)))
	i, j := 0, 0
	for i < len(r.tokens) || j < len(o.tokens) {
		switch {
		case j == len(o.tokens) || (i < len(r.tokens) && r.tokens[i].start < o.tokens[j].start):
			out = append(out, r.tokens[i])
			i++
		case i == len(r.tokens) || o.tokens[j].start < r.tokens[i].start:
			out = append(out, o.tokens[j])
			changed = true
			j++
		default:
			t := r.tokens[i]
			if o.tokens[j].newer(t) {
				t = o.tokens[j]
				changed = true
			}
			out = append(out, t)
			i++
			j++
		}
	}
	if changed {
		r.tokens = out
	}
	return changed
}

// covers reports whether r already holds every token of o at least as new:
// merging o would change nothing.
func (r *ring) covers(o *ring) bool {
	c := r.clone()
	return !c.merge(o)
}

// reclaim makes to the owner of every token owned by one of from
// (version+1), returning how many addresses moved. The one change of a
// token not made by its owner: from must be gone for good (invariant 6).
func (r *ring) reclaim(from map[Identity]bool, to Identity) uint64 {
	var n uint64
	for i := range r.tokens {
		t := &r.tokens[i]
		if !from[t.owner] || t.version == math.MaxUint32 {
			continue
		}
		n += uint64(r.last(i)) - uint64(t.start) + 1
		t.owner = to
		t.version++
	}
	return n
}
