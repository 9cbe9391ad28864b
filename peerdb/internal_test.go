package peerdb

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
)

// TestIndexRandom checks index against a Go map under random inserts and
// deletes, with keys crowded into few blocks (to force long probe runs and
// wrap-around) or spread out.
func TestIndexRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, keyBits := range []int{6, 10, 32, 48} {
		var x index
		want := map[uint64]int32{}
		base := rng.Uint64() &^ (1<<keyBits - 1) & (1<<48 - 1)
		for step := range 20000 {
			k := base | rng.Uint64()&(1<<keyBits-1)
			switch rng.IntN(3) {
			case 0, 1:
				slot, found := x.slot(k)
				_, ok := want[k]
				if found != ok {
					t.Fatalf("bits %d step %d: slot(%#x) found %v, want %v", keyBits, step, k, found, ok)
				}
				if !found {
					v := rng.Int32N(math.MaxInt32)
					x.set(slot, k, v)
					want[k] = v
				} else if got := x.at(slot); got != want[k] {
					t.Fatalf("bits %d: at(%#x) = %d, want %d", keyBits, k, got, want[k])
				}
			default:
				x.del(k)
				delete(want, k)
			}
			if step%997 == 0 || step == 19999 {
				got, err := entries(&x)
				if err != nil {
					t.Fatalf("bits %d step %d: %v", keyBits, step, err)
				}
				if len(got) != len(want) {
					t.Fatalf("bits %d step %d: %d keys, want %d", keyBits, step, len(got), len(want))
				}
				for k, v := range want {
					if g, ok := x.get(k); !ok || g != v || got[k] != v {
						t.Fatalf("bits %d step %d: get(%#x) = %d %v, want %d", keyBits, step, k, g, ok, v)
					}
				}
			}
		}
		room := len(x.slots)
		x.reset(false)
		if _, ok := x.get(base); ok || x.len() != 0 || len(x.slots) != room {
			t.Fatalf("reset(false) left keys or changed the room (%d slots, had %d)", len(x.slots), room)
		}
		x.reset(true)
		if _, ok := x.get(base); ok || x.len() != 0 {
			t.Fatal("reset(true) left keys")
		}
	}
}

// TestSortNotes checks the radix sort against slices.Sort on keys with
// various spreads and sizes, sorted or not.
func TestSortNotes(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for _, n := range []int{0, 1, 2, 3, 24, 25, 100, 257, 1000, 5000} {
		for _, mask := range []uint64{0xff, 0xffff_ff00, 0x3_0000_0000_ffff, math.MaxUint64} {
			set := map[uint64]bool{}
			for len(set) < n && len(set) < int(min(mask, 1<<20)) {
				set[rng.Uint64()&mask] = true
			}
			keys := make([]uint64, 0, len(set))
			for k := range set {
				keys = append(keys, k)
			}
			for _, pre := range []string{"random", "sorted", "reversed"} {
				switch pre {
				case "sorted":
					slices.Sort(keys)
				case "reversed":
					slices.Sort(keys)
					slices.Reverse(keys)
				}
				s := make([]note, len(keys))
				for i, k := range keys {
					s[i] = note{key: k, idx: int32(k)}
				}
				sortNotes(s)
				want := slices.Sorted(slices.Values(keys))
				for i := range s {
					if s[i].key != want[i] || s[i].idx != int32(want[i]) {
						t.Fatalf("n %d mask %#x %s: element %d = %#x, want %#x", n, mask, pre, i, s[i].key, want[i])
					}
				}
			}
		}
	}
}

// TestModelLargeUniverse runs the model harness with operations drawn from a
// larger universe than the fuzz target's: hundreds of IPs, MACs shared by
// many IPs, over a hundred VTEPs (IPv6 and zoned ones too) and large
// batches, so that the indexes grow, wrap around, get emptied and are
// reused, and the VTEP cache sees collisions. The transaction counter starts
// close to wrapping.
func TestModelLargeUniverse(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	var ids []string
	for i := range 40 {
		ids = append(ids, fmt.Sprintf("ep-%02d", i))
	}
	var ips, ips6 []netip.Addr
	for s := range 2 {
		for i := range 200 {
			ips = append(ips, netip.AddrFrom4([4]byte{10, 0, byte(s), byte(i)}))
			ips6 = append(ips6, netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 0, byte(s), 14: byte(i >> 3), 15: byte(i)}))
		}
	}
	var macs []MAC
	for i := range 50 {
		macs = append(macs, MAC{2, 0x42, 0, 0, byte(i >> 8), byte(i)})
	}
	var vteps []netip.Addr
	for i := range 130 {
		switch i % 3 {
		case 0, 1:
			vteps = append(vteps, netip.AddrFrom4([4]byte{192, 0, byte(i / 64), byte(i)}))
		default:
			a := netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 15: byte(i)})
			if i%6 == 2 {
				a = netip.MustParseAddr("fe80::" + fmt.Sprint(i) + "%eth" + fmt.Sprint(i%2))
			}
			vteps = append(vteps, a)
		}
	}
	peer := func() Peer {
		p := Peer{
			EndpointID: ids[rng.IntN(len(ids))],
			IP:         ips[rng.IntN(len(ips))],
			MAC:        macs[rng.IntN(len(macs))],
			VTEP:       vteps[rng.IntN(len(vteps))],
		}
		if rng.IntN(50) == 0 {
			p.MAC = MAC{} // invalid
		}
		switch rng.IntN(4) {
		case 0: // IPv6 only
			p.IP, p.IPv6 = netip.Addr{}, ips6[rng.IntN(len(ips6))]
		case 1: // dual stack, mostly on one segment
			i := slices.Index(ips, p.IP)
			if rng.IntN(20) == 0 {
				i = rng.IntN(len(ips6))
			}
			p.IPv6 = ips6[i]
		}
		return p
	}

	for run := range 2 {
		h := newHarness(t)
		h.db.tx.id = math.MaxUint32 - 20
		remote := []Peer{} // what the model holds, in a stable order
		pick := func() Peer {
			if len(remote) > 0 && rng.IntN(4) != 0 {
				return remote[rng.IntN(len(remote))]
			}
			return peer()
		}
		event := func() Event {
			switch rng.IntN(6) {
			case 0, 1, 2:
				p := peer()
				return Event{Next: &p}
			case 3:
				p := pick()
				return Event{Prev: &p}
			default:
				p, q := pick(), peer()
				if rng.IntN(2) == 0 {
					q.EndpointID, q.IP, q.IPv6 = p.EndpointID, p.IP, p.IPv6
				}
				return Event{Prev: &p, Next: &q}
			}
		}
		refresh := func() {
			remote = remote[:0]
			for p := range h.m.remote {
				remote = append(remote, p)
			}
			slices.SortFunc(remote, func(a, b Peer) int { return cmp.Or(a.IP.Compare(b.IP), compareRemote(a, b)) })
		}
		for step := range 250 {
			h.steps++
			var d Delta
			var desc func() string
			switch op := rng.IntN(10); {
			case op < 3:
				ev := event()
				desc = func() string { return "Apply(" + evString(ev) + ")" }
				var err error
				d, err = h.db.applyEvent(ev)
				if ok := h.m.apply(ev); ok != (err == nil) {
					t.Fatalf("run %d step %d %s: err %v, model valid %v", run, step, desc(), err, ok)
				}
			case op < 5:
				p := peer()
				p.VTEP = netip.Addr{}
				desc = func() string { return fmt.Sprintf("AddLocal(%v)", p) }
				var err error
				d, err = h.db.AddLocal(p)
				if modelValid(p, false) != (err == nil) {
					t.Fatalf("run %d step %d %s: err %v", run, step, desc(), err)
				}
				if err == nil {
					h.m.local[p.EndpointID] = p
					h.check(desc, d)
					d, _ = h.db.AddLocal(p) // again: a no-op
					if !d.Empty() {
						t.Fatalf("run %d step %d: AddLocal twice changed %+v", run, step, d)
					}
				}
			case op < 6:
				id := ids[rng.IntN(len(ids))]
				desc = func() string { return fmt.Sprintf("RemoveLocal(%q)", id) }
				var ok bool
				d, ok = h.db.RemoveLocal(id)
				if _, want := h.m.local[id]; ok != want {
					t.Fatalf("run %d step %d %s: ok %v", run, step, desc(), ok)
				}
				delete(h.m.local, id)
			default:
				n := rng.IntN(400)
				if op == 9 {
					// Delete most of what is there.
					refresh()
					n = len(remote)
				}
				evs := make([]Event, n)
				for i := range evs {
					if op == 9 {
						p := remote[i]
						evs[i] = Event{Prev: &p}
						if rng.IntN(10) == 0 {
							evs[i] = event()
						}
					} else {
						evs[i] = event()
					}
				}
				desc = func() string { return fmt.Sprintf("ApplyAll(%d events)", len(evs)) }
				var errs []error
				d, errs = h.db.applyEvents(evs)
				for i, ev := range evs {
					ok := h.m.apply(ev)
					if ok != (errs == nil || errs[i] == nil) {
						t.Fatalf("run %d step %d: event %d %s: errs %v, model valid %v", run, step, i, evString(ev), errs, ok)
					}
				}
			}
			h.check(desc, d)
			refresh()
		}
		if h.db.tx.id > 1000 {
			t.Fatalf("transaction counter did not wrap: %d", h.db.tx.id)
		}
	}
}

// TestWideSubnets covers networks with more subnets than 16 bits can index
// (FDB notes then sort by subnet and MAC separately).
func TestWideSubnets(t *testing.T) {
	const n = 1<<16 + 10
	subnets := make([]netip.Prefix, n)
	for i := range subnets {
		subnets[i] = netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32)
	}
	db := New(subnets)
	ip := func(i int) netip.Addr { return subnets[i].Addr() }
	var evs []Event
	for _, i := range []int{n - 1, 5, n - 3, 1 << 16, 7} {
		for _, m := range []MAC{mac2, mac1} {
			p := &Peer{EndpointID: fmt.Sprint("ep", i, m), IP: ip(i), MAC: m, VTEP: vtep1}
			evs = append(evs, Event{Next: p})
		}
	}
	d, errs := db.applyEvents(evs)
	if errs != nil {
		t.Fatal(errs)
	}
	if len(d.NeighSet) != 5 || len(d.FDBSet) != 5 {
		t.Fatalf("delta %+v", d)
	}
	want := slices.Clone(d.FDBSet)
	slices.SortFunc(want, compareFDB)
	if !slices.Equal(d.FDBSet, want) || d.FDBSet[4].Subnet != n-1 {
		t.Fatalf("FDBSet not sorted: %v", d.FDBSet)
	}
	if err := checkInvariants(db); err != nil {
		t.Fatal(err)
	}
	var dels []Event
	for _, ev := range evs {
		dels = append(dels, Event{Prev: ev.Next})
	}
	d, _ = db.applyEvents(dels)
	if len(d.NeighDel) != 5 || len(d.FDBDel) != 5 || !slices.IsSortedFunc(d.FDBDel, compareFDB) {
		t.Fatalf("delta %+v", d)
	}
	if err := checkInvariants(db); err != nil {
		t.Fatal(err)
	}
}

// TestRoomKeptAcrossBulkChanges checks the scratch and room policy (txn):
// a table emptied and loaded again, and bulk changes in a row, reuse the
// room and the Delta's slices instead of allocating; a transaction that
// changes nothing releases the scratch space, and one that finds the table
// still empty releases its room.
func TestRoomKeptAcrossBulkChanges(t *testing.T) {
	const n = 5000
	subnet := netip.MustParsePrefix("10.0.0.0/16")
	db := New([]netip.Prefix{subnet}, 100)
	keys := make([]Key, n)
	src := map[Key]Peer{}
	for i := range keys {
		ip := addr4(ip4(subnet.Addr()) + uint32(i) + 1)
		p := Peer{EndpointID: fmt.Sprintf("e%d", i), IP: ip, MAC: MACFromIP(ip), VTEP: netip.MustParseAddr("192.0.2.1")}
		keys[i] = Key{VNI: 100, Origin: "h", EndpointID: p.EndpointID}
		src[keys[i]] = p
	}
	present := true
	get := func(i int) (Peer, bool) {
		p, ok := src[keys[i]]
		return p, ok && present
	}
	cycle := func() {
		present = true
		if d, _ := db.Pull(100, keys, get); len(d.NeighSet) != n {
			t.Fatalf("add: %d neighbours set, want %d", len(d.NeighSet), n)
		}
		present = false
		if d, _ := db.Pull(100, keys, get); len(d.NeighDel) != n {
			t.Fatalf("delete: %d neighbours deleted, want %d", len(d.NeighDel), n)
		}
	}
	cycle() // sizes everything
	if allocs := testing.AllocsPerRun(5, cycle); allocs > 2 {
		t.Errorf("an add and a delete of %d records in a table emptied before: %.0f allocations, want at most 2", n, allocs)
	}
	if cap(db.claims) < n || cap(db.tx.neigh) < n || cap(db.tx.out.NeighDel) < n {
		t.Fatalf("room not kept after emptying once: %d claims, %d notes, %d deletes", cap(db.claims), cap(db.tx.neigh), cap(db.tx.out.NeighDel))
	}
	// The owner's periodic full pull finds the table still empty.
	if d, _ := db.SyncVNI(100, nil); !d.Empty() {
		t.Fatalf("SyncVNI of an empty table: %+v", d)
	}
	if cap(db.claims) != 0 || len(db.byIP.slots) > 1024 || cap(db.held.recs) != 0 || cap(db.tx.neigh) > 4096 || cap(db.tx.out.NeighDel) != 0 {
		t.Fatalf("room kept after a second empty transaction: %d claims, %d index slots, %d held, %d notes, %d deletes",
			cap(db.claims), len(db.byIP.slots), cap(db.held.recs), cap(db.tx.neigh), cap(db.tx.out.NeighDel))
	}
	// A full table at rest: its periodic pull changes nothing and drops the
	// scratch space of the load.
	present = true
	db.Pull(100, keys, get)
	if d, _ := db.SyncVNI(100, src); !d.Empty() {
		t.Fatalf("SyncVNI of an unchanged table: %+v", d)
	}
	if cap(db.tx.neigh) > 4096 || cap(db.tx.out.NeighSet) != 0 {
		t.Fatalf("scratch kept at rest: %d notes, %d sets", cap(db.tx.neigh), cap(db.tx.out.NeighSet))
	}
}
