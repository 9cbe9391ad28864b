package ipam

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

var (
	idA = Identity{Name: "node-a", ID: 1}
	idB = Identity{Name: "node-b", ID: 2}
	idC = Identity{Name: "node-c", ID: 3}
)

func ip(s string) uint32 {
	var a, b, c, d uint32
	fmt.Sscanf(s, "%d.%d.%d.%d", &a, &b, &c, &d)
	return a<<24 | b<<16 | c<<8 | d
}

func TestPoolSpecRing(t *testing.T) {
	for _, tc := range []struct{ id, lo, hi, gw string }{
		{"overlayd:198.51.100.0/24", "198.51.100.2", "198.51.100.254", "198.51.100.1"},
		{"overlayd:198.51.100.0/24:198.51.100.128/25", "198.51.100.128", "198.51.100.254", "198.51.100.1"},
		{"overlayd:198.51.100.0/24:198.51.100.0/25", "198.51.100.2", "198.51.100.127", "198.51.100.1"},
		{"overlayd:198.51.100.0/24:198.51.100.64/26", "198.51.100.64", "198.51.100.127", "198.51.100.1"},
		{"overlayd:192.0.2.0/30", "192.0.2.2", "192.0.2.2", "192.0.2.1"},
	} {
		s, err := parsePoolID(tc.id)
		if err != nil {
			t.Fatal(err)
		}
		if addrOf(s.lo).String() != tc.lo || addrOf(s.hi).String() != tc.hi || s.gatewayAddr().String() != tc.gw || s.id() != tc.id {
			t.Fatalf("%s: ring %s-%s gateway %s id %s", tc.id, addrOf(s.lo), addrOf(s.hi), s.gatewayAddr(), s.id())
		}
	}
}

func TestRingDonate(t *testing.T) {
	r := newRing(ip("198.51.100.2"), ip("198.51.100.254"), idA)
	if err := r.donate(idA, idB, span{ip("198.51.100.100"), ip("198.51.100.199")}); err != nil {
		t.Fatal(err)
	}
	if err := r.check(); err != nil {
		t.Fatal(err)
	}
	want := []span{{ip("198.51.100.2"), ip("198.51.100.99")}, {ip("198.51.100.200"), ip("198.51.100.254")}}
	if got := r.owned(idA); !slices.Equal(got, want) {
		t.Fatalf("node-a owns %v, want %v", got, want)
	}
	if got := r.ownedSize(idB); got != 100 {
		t.Fatalf("node-b owns %d, want 100", got)
	}
	// Only the owner gives: node-a cannot give node-b's range, nor a range
	// that straddles it.
	err := r.donate(idA, idC, span{ip("198.51.100.150"), ip("198.51.100.150")})
	if err == nil || !strings.Contains(err.Error(), "node-b") {
		t.Fatalf("donating another's range: %v", err)
	}
	if err := r.donate(idA, idC, span{ip("198.51.100.90"), ip("198.51.100.110")}); err == nil {
		t.Fatal("a range straddling another owner's was donated")
	}
	if err := r.donate(idA, idC, span{ip("198.51.100.1"), ip("198.51.100.5")}); err == nil {
		t.Fatal("a range outside the ring was donated")
	}
	// Giving back joins the ranges again (tokens stay, versions grow).
	if err := r.donate(idB, idA, span{ip("198.51.100.100"), ip("198.51.100.199")}); err != nil {
		t.Fatal(err)
	}
	if got := r.owned(idA); len(got) != 1 || got[0].size() != 253 {
		t.Fatalf("after giving back node-a owns %v", got)
	}
	if len(r.tokens) != 3 || r.tokens[1].version != 3 {
		t.Fatalf("tokens %+v: want 3, the middle one at version 3 (made, given, given back)", r.tokens)
	}
}

func TestRingTokenLimit(t *testing.T) {
	r := newRing(0, 1<<20, idA)
	var err error
	for i := uint32(1); err == nil; i += 2 {
		err = r.donate(idA, idB, span{i, i})
	}
	if !strings.Contains(err.Error(), "the most allowed is") || len(r.tokens) > maxTokens {
		t.Fatalf("at %d tokens: %v", len(r.tokens), err)
	}
}

func TestRingCheck(t *testing.T) {
	base := func() *ring {
		return &ring{lo: 10, hi: 100, tokens: []token{{10, idA, 1}, {50, idB, 1}}}
	}
	for name, tc := range map[string]struct {
		mod  func(r *ring)
		want string
	}{
		"no token":        {func(r *ring) { r.tokens = nil }, "no token"},
		"first not at lo": {func(r *ring) { r.tokens[0].start = 11 }, "first token starts at"},
		"after end":       {func(r *ring) { r.tokens[1].start = 101 }, "after the ring's end"},
		"order":           {func(r *ring) { r.tokens[1].start = 10 }, "out of order"},
		"version 0":       {func(r *ring) { r.tokens[1].version = 0 }, "version 0"},
		"bad name":        {func(r *ring) { r.tokens[1].owner.Name = "a\nb" }, "control character"},
		"reversed":        {func(r *ring) { r.lo, r.hi = 100, 10 }, "reversed"},
	} {
		r := base()
		tc.mod(r)
		if err := r.check(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", name, err, tc.want)
		}
	}
	if err := base().check(); err != nil {
		t.Fatal(err)
	}
}

// history runs random donations (and a reclaim) on one ring, as a cluster
// would, and returns the ring after every step: the views hosts may hold.
func history(rng *rand.Rand, steps int) []*ring {
	ids := []Identity{idA, idB, idC, {Name: "node-d", ID: 4}}
	r := newRing(1000, 1999, idA)
	out := []*ring{r.clone()}
	for range steps {
		if rng.IntN(20) == 0 {
			r.reclaim(map[Identity]bool{ids[rng.IntN(len(ids))]: true}, ids[rng.IntN(len(ids))])
			out = append(out, r.clone())
			continue
		}
		from := ids[rng.IntN(len(ids))]
		spans := r.owned(from)
		if len(spans) == 0 {
			continue
		}
		sp := spans[rng.IntN(len(spans))]
		first := sp.first + uint32(rng.Uint64N(sp.size()))
		last := first + uint32(rng.Uint64N(uint64(sp.last-first)+1))
		to := ids[rng.IntN(len(ids))]
		if to == from {
			continue
		}
		if err := r.donate(from, to, span{first, last}); err != nil {
			panic(err)
		}
		out = append(out, r.clone())
	}
	return out
}

func mergeAll(views []*ring) *ring {
	r := views[0].clone()
	for _, v := range views[1:] {
		r.merge(v)
	}
	return r
}

func sameRing(a, b *ring) bool { return slices.Equal(a.tokens, b.tokens) }

// The merge is a CRDT: any order of merging any views gives the same ring
// (commutative, associative), merging a view twice changes nothing
// (idempotent), and merging every view gives the latest ring: nobody's
// change is lost, and every result passes the invariant checks.
func TestMergeProperties(t *testing.T) {
	for seed := range uint64(200) {
		rng := rand.New(rand.NewPCG(seed, 1))
		hist := history(rng, 60)
		latest := hist[len(hist)-1]
		// A few random views (each a merge of some snapshots).
		views := make([]*ring, 4)
		for i := range views {
			var picked []*ring
			for _, h := range hist {
				if rng.IntN(3) == 0 {
					picked = append(picked, h)
				}
			}
			if len(picked) == 0 {
				picked = hist[:1]
			}
			views[i] = mergeAll(picked)
			if err := views[i].check(); err != nil {
				t.Fatalf("seed %d: a merged view breaks an invariant: %v", seed, err)
			}
		}
		want := mergeAll(views)
		for range 5 {
			perm := rng.Perm(len(views))
			shuffled := make([]*ring, len(views))
			for i, p := range perm {
				shuffled[i] = views[p]
			}
			if got := mergeAll(shuffled); !sameRing(got, want) {
				t.Fatalf("seed %d: merge order changes the result", seed)
			}
		}
		// Associativity: (v0 ∪ v1) ∪ (v2 ∪ v3) == ((v0 ∪ v1) ∪ v2) ∪ v3.
		left := mergeAll(views[:2])
		left.merge(mergeAll(views[2:]))
		if !sameRing(left, want) {
			t.Fatalf("seed %d: grouping changes the result", seed)
		}
		again := want.clone()
		for _, v := range views {
			if again.merge(v) {
				t.Fatalf("seed %d: merging a view twice changed the ring", seed)
			}
		}
		if all := mergeAll(hist); !sameRing(all, latest) {
			t.Fatalf("seed %d: merging every view is not the latest ring:\n%v\n%v", seed, all.tokens, latest.tokens)
		}
		// Each owner's knowledge of its own ranges is exact: in the latest
		// ring, merging any older view changes no owner's ranges.
		for _, h := range hist {
			c := latest.clone()
			if c.merge(h) {
				t.Fatalf("seed %d: an older view changed the latest ring", seed)
			}
		}
	}
}

func TestRingReclaim(t *testing.T) {
	r := newRing(10, 100, idA)
	if err := r.donate(idA, idB, span{20, 29}); err != nil {
		t.Fatal(err)
	}
	if err := r.donate(idA, idB, span{50, 59}); err != nil {
		t.Fatal(err)
	}
	n := r.reclaim(map[Identity]bool{idB: true}, idC)
	if n != 20 || r.ownedSize(idB) != 0 || r.ownedSize(idC) != 20 {
		t.Fatalf("reclaimed %d; b owns %d, c %d", n, r.ownedSize(idB), r.ownedSize(idC))
	}
	// The reclaim wins over node-b's older view.
	old := newRing(10, 100, idA)
	old.donate(idA, idB, span{20, 29})
	c := r.clone()
	if c.merge(old) {
		t.Fatal("an older view undid the reclaim")
	}
}

func TestAllocSet(t *testing.T) {
	s := newAllocSet()
	for _, x := range []uint32{5, 6, 7, 10, 20} {
		s.put(x, allocation{})
	}
	if x, ok := s.firstFree(span{5, 30}, 5); !ok || x != 8 {
		t.Fatalf("first free from 5: %d %v", x, ok)
	}
	if _, ok := s.firstFree(span{5, 7}, 5); ok {
		t.Fatal("a full span has a free address")
	}
	if n := s.countIn(span{6, 10}); n != 3 {
		t.Fatalf("count in 6-10: %d", n)
	}
	best, ok := s.largestFree([]span{{5, 20}, {30, 33}})
	if !ok || best != (span{11, 19}) {
		t.Fatalf("largest free: %v %v", best, ok)
	}
	if _, ok := s.largestFree([]span{{5, 7}, {20, 20}}); ok {
		t.Fatal("fully allocated spans have a free run")
	}
	s.put(8, allocation{mac: [6]byte{2}, hasMAC: true})
	if x, ok := s.withMAC([6]byte{2}); !ok || x != 8 {
		t.Fatal("by MAC")
	}
	s.remove(8)
	if _, ok := s.withMAC([6]byte{2}); ok || s.len() != 5 {
		t.Fatal("remove")
	}
}

func TestSubtract(t *testing.T) {
	got := subtract([]span{{1, 10}, {20, 30}}, []span{{3, 4}, {8, 22}, {25, 25}})
	want := []span{{1, 2}, {5, 7}, {23, 24}, {26, 30}}
	if !slices.Equal(got, want) {
		t.Fatalf("%v, want %v", got, want)
	}
}
