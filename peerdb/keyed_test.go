package peerdb

import (
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// The keyed model: the source's view is a map Key → Peer; the table must
// hold exactly its valid records (the remote set is their values) and
// reject the others, whatever the order and batching of updates.

var (
	keyedVNIs   = []uint32{100, 101} // the segments of modelSegments
	uKeyVNIs    = []uint32{100, 101}
	uBadKeyVNIs = []uint32{7}
	uOrigins    = []string{"h1", "h2"}
)

type keyedModel struct {
	src map[Key]Peer // what the source has in force (valid or not)
}

// validFor is the rule written out directly: a valid remote record whose
// endpoint is its key's and whose addresses lie on the segment of its
// key's VNI.
func validFor(k Key, p Peer) bool {
	if !modelValid(p, true) || p.EndpointID != k.EndpointID {
		return false
	}
	seg, _ := modelSegment(p)
	i := slices.Index(keyedVNIs, k.VNI)
	return i >= 0 && i == seg
}

func (m *keyedModel) held() map[Key]Peer {
	out := map[Key]Peer{}
	for k, p := range m.src {
		if validFor(k, p) {
			out[k] = p
		}
	}
	return out
}

func (m *keyedModel) rejected() map[Key]Peer {
	out := map[Key]Peer{}
	for k, p := range m.src {
		if !validFor(k, p) {
			out[k] = p
		}
	}
	return out
}

// asEventModel returns the event model with the remote set the keyed model
// implies, for the desired-state comparison.
func (m *keyedModel) asEventModel(local map[string]Peer) *model {
	em := newModel()
	maps.Copy(em.local, local)
	for _, p := range m.held() {
		em.remote[p] = true
	}
	return em
}

func (s *byteSource) key() Key {
	return Key{VNI: pick(s, uKeyVNIs, uBadKeyVNIs), Origin: uOrigins[int(s.next())%len(uOrigins)], EndpointID: pick(s, uIDs, uBadIDs)}
}

// update returns an update for a key the model knows (mostly) or a new one;
// the record mostly matches the key and is sometimes shared by two keys.
func (s *byteSource) update(m *keyedModel) Update {
	k := s.key()
	if c := s.next(); c < 128 && len(m.src) > 0 {
		keys := slices.SortedFunc(maps.Keys(m.src), compareKey)
		k = keys[int(c)%len(keys)]
	}
	switch s.next() % 6 {
	case 0:
		return Update{Key: k}
	case 1:
		// Copy another key's record: equal values under two keys.
		for _, p := range m.src {
			if p.EndpointID == k.EndpointID {
				return Update{Key: k, Peer: &p}
			}
		}
	}
	p := s.peer()
	if s.next() < 230 {
		p.EndpointID = k.EndpointID
	}
	return Update{Key: k, Peer: &p}
}

type keyedHarness struct {
	*harness
	km    *keyedModel
	local map[string]Peer
}

func newKeyedHarness(t testing.TB) *keyedHarness {
	h := newHarness(t)
	h.db = NewSegments(modelSegments(true))
	return &keyedHarness{harness: h, km: &keyedModel{src: map[Key]Peer{}}, local: map[string]Peer{}}
}

func (h *keyedHarness) run(data []byte) {
	s := &byteSource{b: data}
	for s.more() {
		h.step(s)
	}
}

func (h *keyedHarness) step(s *byteSource) {
	t := h.t
	h.steps++
	var d Delta
	var rej []Rejection
	var desc func() string
	apply := func(ups []Update) {
		for _, u := range ups {
			if u.Peer == nil {
				delete(h.km.src, u.Key)
			} else {
				h.km.src[u.Key] = *u.Peer
			}
		}
	}
	switch op := s.next() % 8; op {
	case 0, 1, 2:
		u := s.update(h.km)
		desc = func() string { return fmt.Sprintf("SetRemotes(%v → %v)", u.Key, fmtP(u.Peer)) }
		d, rej = h.db.SetRemotes([]Update{u})
		apply([]Update{u})
	case 3:
		p := s.peer()
		desc = func() string { return fmt.Sprintf("AddLocal(%v)", p) }
		var err error
		if d, err = h.db.AddLocal(p); err == nil {
			h.local[p.EndpointID] = p
		}
	case 4:
		id := pick(s, uIDs, uBadIDs)
		desc = func() string { return fmt.Sprintf("RemoveLocal(%q)", id) }
		d, _ = h.db.RemoveLocal(id)
		delete(h.local, id)
	case 5:
		// A full pull of one VNI: some keys kept, some dropped, some new.
		vni := pick(s, uKeyVNIs, uBadKeyVNIs)
		all := map[Key]Peer{}
		for k, p := range h.km.src {
			if k.VNI == vni && s.next() < 180 {
				all[k] = p
			}
		}
		for range int(s.next() % 3) {
			u := s.update(h.km)
			if u.Peer != nil && u.Key.VNI == vni {
				all[u.Key] = *u.Peer
			}
		}
		desc = func() string { return fmt.Sprintf("SyncVNI(%d, %v)", vni, all) }
		d, rej = h.db.SyncVNI(vni, all)
		for k := range h.km.src {
			if k.VNI == vni {
				delete(h.km.src, k)
			}
		}
		maps.Copy(h.km.src, all)
	default:
		ups := make([]Update, s.next()%10)
		for i := range ups {
			ups[i] = s.update(h.km)
		}
		if s.next()%2 == 0 {
			desc = func() string { return fmt.Sprintf("SetRemotes(%d updates)", len(ups)) }
			d, rej = h.db.SetRemotes(ups)
			apply(ups)
			break
		}
		// The pull path: the keys of one VNI take the source's values.
		vni := pick(s, uKeyVNIs, uBadKeyVNIs)
		keys := make([]Key, len(ups))
		for i, u := range ups {
			keys[i] = u.Key
			if u.Key.VNI == vni {
				apply([]Update{u})
			}
		}
		desc = func() string { return fmt.Sprintf("Pull(%d, %d keys)", vni, len(keys)) }
		d, rej = h.db.Pull(vni, keys, func(i int) (Peer, bool) {
			p, ok := h.km.src[keys[i]]
			return p, ok
		})
	}
	for _, r := range rej {
		if validFor(r.Key, r.Peer) {
			t.Fatalf("step %d %s: valid record rejected: %v %v: %v", h.steps, desc(), r.Key, r.Peer, r.Err)
		}
		var ip *InvalidPeerError
		if !errors.As(r.Err, &ip) {
			t.Fatalf("step %d %s: rejection of %v is not an InvalidPeerError: %v", h.steps, desc(), r.Key, r.Err)
		}
	}
	// The table against the keyed model, then everything the event
	// harness checks (deltas, invariants, desired state, conflicts).
	if got, want := h.db.Held(), h.km.held(); !reflect.DeepEqual(got, want) {
		t.Fatalf("step %d %s: Held\n got  %v\n want %v", h.steps, desc(), got, want)
	}
	gotRej := map[Key]Peer{}
	for _, r := range h.db.Rejected() {
		gotRej[r.Key] = r.Peer
	}
	if want := h.km.rejected(); !reflect.DeepEqual(gotRej, want) {
		t.Fatalf("step %d %s: Rejected\n got  %v\n want %v", h.steps, desc(), gotRej, want)
	}
	h.m = h.km.asEventModel(h.local)
	h.check(desc, d)
}

func fmtP(p *Peer) string {
	if p == nil {
		return "nil"
	}
	return p.String()
}

func FuzzKeyed(f *testing.F) {
	for _, s := range fuzzSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 1024 {
			t.Skip()
		}
		newKeyedHarness(t).run(data)
	})
}

// TestKeyedModelRandom drives the keyed harness with a deterministic
// pseudo-random operation stream.
func TestKeyedModelRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	steps := 0
	for run := 0; run < 40; run++ {
		h := newKeyedHarness(t)
		data := make([]byte, 1500)
		for i := range data {
			data[i] = byte(rng.Uint32())
		}
		h.run(data)
		steps += h.steps
	}
	if steps < 3000 {
		t.Fatalf("only %d steps", steps)
	}
	t.Logf("%d steps", steps)
}

// TestKeyedModelCollidingHashes is TestKeyedModelRandom with the hashes
// of the held records' keys narrowed to two values, so that nearly every
// lookup, insert and removal walks a chain of records with equal hashes.
func TestKeyedModelCollidingHashes(t *testing.T) {
	heldHashMask = 1
	defer func() { heldHashMask = ^uint64(0) }()
	rng := rand.New(rand.NewPCG(5, 6))
	for run := 0; run < 20; run++ {
		data := make([]byte, 1500)
		for i := range data {
			data[i] = byte(rng.Uint32())
		}
		newKeyedHarness(t).run(data)
	}
}

// TestSetRemotesReplacesWithoutPrev: an update names only the key; the
// table removes what the key held before (the old bug: an update whose
// previous value was invalid dropped its valid next value too).
func TestSetRemotesReplacesWithoutPrev(t *testing.T) {
	db := New(modelSubnets, keyedVNIs...)
	k := Key{VNI: 100, Origin: "h1", EndpointID: "a"}
	p1 := Peer{EndpointID: "a", IP: uIPs[0], MAC: uMACs[0], VTEP: uVTEPs[0]}
	p2 := Peer{EndpointID: "a", IP: uIPs[1], MAC: uMACs[1], VTEP: uVTEPs[1]}
	db.SetRemotes([]Update{{Key: k, Peer: &p1}})
	d, rej := db.SetRemotes([]Update{{Key: k, Peer: &p2}})
	if len(rej) != 0 || len(d.NeighDel) != 1 || len(d.NeighSet) != 1 {
		t.Fatalf("move of a key: delta %+v rejections %v", d, rej)
	}
	if got := db.Remote(); len(got) != 1 || got[0] != p2 {
		t.Fatalf("remote set %v, want only %v", got, p2)
	}
	// An invalid value for the key drops what it held and is reported.
	bad := p2
	bad.MAC = MAC{}
	d, rej = db.SetRemotes([]Update{{Key: k, Peer: &bad}})
	if len(rej) != 1 || rej[0].Key != k || len(d.NeighDel) != 1 {
		t.Fatalf("invalid value: delta %+v rejections %v", d, rej)
	}
	if r := db.Rejected(); len(r) != 1 {
		t.Fatalf("Rejected %v", r)
	}
	// Fixed at the source: held again, no longer rejected.
	db.SetRemotes([]Update{{Key: k, Peer: &p2}})
	if r := db.Rejected(); len(r) != 0 || len(db.Remote()) != 1 {
		t.Fatalf("after the fix: rejected %v remote %v", r, db.Remote())
	}
}

// TestSetRemotesWrongSubnetOfVNI: a record published under one VNI whose IP
// lies in the subnet of another VNI of the network is refused, naming both.
func TestSetRemotesWrongSubnetOfVNI(t *testing.T) {
	db := New(modelSubnets, keyedVNIs...)
	p := Peer{EndpointID: "a", IP: netip.MustParseAddr("10.0.1.1"), MAC: uMACs[0], VTEP: uVTEPs[0]}
	_, rej := db.SetRemotes([]Update{{Key: Key{VNI: 100, Origin: "h1", EndpointID: "a"}, Peer: &p}})
	if len(rej) != 1 || !containsAll(rej[0].Err.Error(), "10.0.1.1", "VNI 100", "10.0.0.0/24") {
		t.Fatalf("rejections %v", rej)
	}
}

// TestSharedRecordStaysWhileAnyKeyHoldsIt: two keys with equal records; the
// entry stays until both are gone.
func TestSharedRecordStaysWhileAnyKeyHoldsIt(t *testing.T) {
	db := New(modelSubnets, keyedVNIs...)
	p := Peer{EndpointID: "a", IP: uIPs[0], MAC: uMACs[0], VTEP: uVTEPs[0]}
	k1, k2 := Key{VNI: 100, Origin: "h1", EndpointID: "a"}, Key{VNI: 100, Origin: "h2", EndpointID: "a"}
	db.SetRemotes([]Update{{Key: k1, Peer: &p}, {Key: k2, Peer: &p}})
	if d, _ := db.SetRemotes([]Update{{Key: k1}}); !d.Empty() || len(db.Remote()) != 1 {
		t.Fatalf("entry gone while k2 holds it: delta %+v remote %v", d, db.Remote())
	}
	if d, _ := db.SetRemotes([]Update{{Key: k2}}); len(d.NeighDel) != 1 || len(db.Remote()) != 0 {
		t.Fatalf("entry kept after both keys went: delta %+v remote %v", d, db.Remote())
	}
}

func containsAll(s string, subs ...string) bool {
	for _, x := range subs {
		if !strings.Contains(s, x) {
			return false
		}
	}
	return true
}
