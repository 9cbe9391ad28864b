package peerdb

import (
	"fmt"
	"net/netip"
)

// DB is one network's peer table: its remote and local entries, indexes over
// them, and the desired kernel state derived from them (see the package
// documentation for the rules).
//
// A DB is not safe for concurrent use: it is owned by one network and every
// call, reads included, must be made with that network's lock held. Create
// one with New.
type DB struct {
	segs  []Segment
	nets  []v4net // the IPv4 prefixes of segs in a form cheap to match (see subnet4)
	nets6 []v6net // the IPv6 prefixes of segs

	local map[string]Peer // local entries by EndpointID

	// byIP maps every claimed IPv4 address (as a big-endian uint32) to its
	// claim in claims. Slots of freed claims are listed in freeClaims.
	byIP       index
	claims     []claim
	freeClaims []int32

	// byIP6 maps every claimed IPv6 address to its claim. IPv6 claims are
	// kept apart so the IPv4 path stays as it was: a claim of an IPv6
	// address has v6 set and, as its ip, its address's slot in addr6
	// (slots of freed claims are listed in free6; a freed slot keeps its
	// address until the next transaction reuses it, so the Delta of the
	// transaction that freed it can still name it).
	byIP6 map[netip.Addr]int32
	addr6 []netip.Addr
	free6 []uint32

	// fdbIdx[s] maps a MAC (see macKey) to the FDB record of (subnet s,
	// MAC) in fdbs. A record exists while the key has an FDB proposal or a
	// local entry. Slots of freed records are listed in freeFDB.
	fdbIdx  []index
	fdbs    []fdbRec
	freeFDB []int32
	// fdbMore holds the proposers of an FDB record beyond its first one
	// (fdbRec.one), for the rare MAC proposed by several IPs.
	fdbMore map[int32]moreProposers

	vteps vtepTable

	// wideSubnets is set when subnet indexes do not fit in 16 bits (see
	// fdbNoteKey).
	wideSubnets bool

	nRemote int // number of remote entries
	nNeigh  int // number of desired neighbour entries
	nFDB    int // number of desired FDB entries

	keyed // remote records by source key (SetRemotes)

	tx txn
}

// v4net is an IPv4 prefix of segment seg as a base and mask.
type v4net struct {
	base, mask uint32
	seg        int
}

// v6net is an IPv6 prefix of segment seg.
type v6net struct {
	prefix netip.Prefix
	seg    int
}

// Segment is one L2 segment of a network (one VNI, one VXLAN link): the
// prefixes whose addresses live on it, of either family, and its VNI (0
// when the DB checks no VNIs).
type Segment struct {
	Prefixes []netip.Prefix
	VNI      uint32
}

// claim is the set of entries claiming one IP.
//
// The remote claimants are kept with the smallest one (the remote winner,
// see compareRemote) inline as the head; the others and the local claimants
// live in x, which is nil when there are none. A claim is empty when it has
// no head and no x.
//
// A dual-stack entry claims its IPv4 and its IPv6 address: each claim
// names, for each remote claimant, the claim of the claimant's other
// address (other, when hasOther), which tells apart records that differ
// only there and gives back the whole record. Both claims live as long as
// the entry, so the index stays valid.
type claim struct {
	id       string // EndpointID of the head; "" when there is no remote claimant
	mac      MAC    // of the head
	v6       bool   // ip is a slot of DB.addr6, not an IPv4 address
	hasOther bool   // of the head
	vtep     uint32 // of the head, interned in DB.vteps
	ip       uint32
	sub      int32  // index of the segment of ip
	mark     uint32 // txn.id of the last transaction that noted this claim
	other    int32  // of the head: the claim of its other address, when hasOther
	x        *claimExtra
}

type claimExtra struct {
	remotes []remote // the remote claimants other than the head, unordered
	locals  []Peer   // local claimants; locals[0] has the smallest EndpointID
}

// remote is a remote claimant of a known IP.
type remote struct {
	id       string
	mac      MAC
	hasOther bool
	vtep     uint32
	other    int32 // the claim of the claimant's other address, when hasOther
}

// contrib is what a claim contributes to the desired state: when ok, its
// winner is remote and yields a neighbour entry (mac) and an FDB proposal
// (mac -> vtep).
type contrib struct {
	mac  MAC
	ok   bool
	vtep uint32
}

func (c *claim) empty() bool    { return c.id == "" && c.x == nil }
func (c *claim) hasLocal() bool { return c.x != nil && len(c.x.locals) > 0 }

func (c *claim) contrib() contrib {
	if c.id == "" || c.hasLocal() {
		return contrib{}
	}
	return contrib{mac: c.mac, ok: true, vtep: c.vtep}
}

func (c *claim) claimants() int {
	n := 0
	if c.id != "" {
		n = 1
	}
	if c.x != nil {
		n += len(c.x.remotes) + len(c.x.locals)
	}
	return n
}

// fdbRec is the state of one FDB key: the active remote claimants proposing
// it, the number of local entries with its MAC in its subnet, and the desired
// value derived from them (cached, so that a transaction can note the value
// before recomputing it).
type fdbRec struct {
	one   int32  // a proposer (claim index); -1 if none, and then !multi
	local int32  // local entries with this MAC in this subnet
	cur   uint32 // the desired VTEP (interned) when ok
	mark  uint32 // txn.id of the last transaction that noted this record
	ok    bool   // an FDB entry is desired
	multi bool   // more proposers are in DB.fdbMore
}

// Conflict describes an IP claimed by more than one entry.
type Conflict struct {
	IP          netip.Addr
	Active      Peer
	ActiveLocal bool
	// Shadowed are the other claimants in precedence order: local entries
	// (by EndpointID) before remote ones (by EndpointID, MAC, VTEP).
	Shadowed []Peer
}

// New returns an empty DB for a network with these IPv4 subnets, one segment
// each (index = segment index used in Neigh/FDB). Subnets are disjoint (the
// caller validates); New keeps its own copy of the slice. With vnis (one per
// subnet, in the same order), a record set through SetRemotes must lie in
// the subnet of its key's VNI; New panics if the counts differ.
func New(subnets []netip.Prefix, vnis ...uint32) *DB {
	if len(vnis) > 0 && len(vnis) != len(subnets) {
		panic(fmt.Sprintf("peerdb.New: %d VNIs for %d subnets", len(vnis), len(subnets)))
	}
	segs := make([]Segment, len(subnets))
	for i, p := range subnets {
		segs[i].Prefixes = []netip.Prefix{p}
		if len(vnis) > 0 {
			segs[i].VNI = vnis[i]
		}
	}
	return newTable(segs, len(vnis) > 0)
}

// NewSegments returns an empty DB for a network made of these segments
// (index = segment index used in Neigh/FDB). Prefixes are disjoint (the
// caller validates); a segment may hold prefixes of both families. When
// any segment has a non-zero VNI, a record set through SetRemotes must lie
// in a prefix of the segment of its key's VNI; with VNI 0 for all, any
// segment will do. NewSegments keeps its own copy of segs.
func NewSegments(segs []Segment) *DB {
	own := make([]Segment, len(segs))
	checkVNI := false
	for i, s := range segs {
		own[i] = Segment{Prefixes: append([]netip.Prefix(nil), s.Prefixes...), VNI: s.VNI}
		checkVNI = checkVNI || s.VNI != 0
	}
	return newTable(own, checkVNI)
}

// newTable returns an empty DB for segs, which it keeps.
func newTable(segs []Segment, checkVNI bool) *DB {
	db := &DB{
		segs:   segs,
		local:  make(map[string]Peer),
		fdbIdx: make([]index, len(segs)),

		wideSubnets: len(segs) > 1<<16,
	}
	if checkVNI {
		db.vnis = make([]uint32, len(segs))
		for i, s := range segs {
			db.vnis[i] = s.VNI
		}
	}
	for i, s := range segs {
		for _, p := range s.Prefixes {
			switch {
			case !p.IsValid():
			case p.Addr().Is4():
				var mask uint32
				if b := p.Bits(); b > 0 {
					mask = ^uint32(0) << (32 - b)
				}
				db.nets = append(db.nets, v4net{base: ip4(p.Addr()) & mask, mask: mask, seg: i})
			case !p.Addr().Is4In6():
				db.nets6 = append(db.nets6, v6net{prefix: p.Masked(), seg: i})
			}
		}
	}
	return db
}

// subnet4 is SubnetOf for an IPv4 address given as a uint32.
func (db *DB) subnet4(ip uint32) (int, bool) {
	for _, n := range db.nets {
		if ip&n.mask == n.base {
			return n.seg, true
		}
	}
	return 0, false
}

// subnet6 is SubnetOf for an IPv6 address (not IPv4-mapped).
func (db *DB) subnet6(ip netip.Addr) (int, bool) {
	for _, n := range db.nets6 {
		if n.prefix.Contains(ip) {
			return n.seg, true
		}
	}
	return 0, false
}

func ip4(a netip.Addr) uint32 {
	b := a.As4()
	return uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
}

func addr4(ip uint32) netip.Addr {
	return netip.AddrFrom4([4]byte{byte(ip >> 24), byte(ip >> 16), byte(ip >> 8), byte(ip)})
}

// macKey packs a MAC into a uint64 whose order is the byte order of the MAC.
func macKey(m MAC) uint64 {
	return uint64(m[0])<<40 | uint64(m[1])<<32 | uint64(m[2])<<24 | uint64(m[3])<<16 | uint64(m[4])<<8 | uint64(m[5])
}

func macOfKey(k uint64) MAC {
	return MAC{byte(k >> 40), byte(k >> 32), byte(k >> 24), byte(k >> 16), byte(k >> 8), byte(k)}
}

// claimFor returns the claim of the IPv4 address ip, creating an empty one
// if there is none.
func (db *DB) claimFor(ip uint32, sub int) int32 {
	slot, ok := db.byIP.slot(uint64(ip))
	if ok {
		return db.byIP.at(slot)
	}
	ci := db.newClaim(ip, sub)
	db.byIP.set(slot, uint64(ip), ci)
	return ci
}

// claimFor6 returns the claim of the IPv6 address a, creating an empty one
// if there is none.
func (db *DB) claimFor6(a netip.Addr, sub int) int32 {
	if ci, ok := db.byIP6[a]; ok {
		return ci
	}
	var slot uint32
	if n := len(db.free6); n > 0 {
		slot = db.free6[n-1]
		db.free6 = db.free6[:n-1]
		db.addr6[slot] = a
	} else {
		slot = uint32(len(db.addr6))
		db.addr6 = append(db.addr6, a)
	}
	ci := db.newClaim(slot, sub)
	db.claims[ci].v6 = true
	if db.byIP6 == nil {
		db.byIP6 = make(map[netip.Addr]int32)
	}
	db.byIP6[a] = ci
	return ci
}

// addr returns the address claim c claims.
func (db *DB) addr(c *claim) netip.Addr {
	if c.v6 {
		return db.addr6[c.ip]
	}
	return addr4(c.ip)
}

// compareClaims orders claims by address (netip.Addr order: IPv4 first).
func (db *DB) compareClaims(a, b int32) int {
	ca, cb := &db.claims[a], &db.claims[b]
	switch {
	case ca.v6 != cb.v6:
		if ca.v6 {
			return 1
		}
		return -1
	case ca.v6:
		return db.addr6[ca.ip].Compare(db.addr6[cb.ip])
	case ca.ip < cb.ip:
		return -1
	case ca.ip > cb.ip:
		return 1
	}
	return 0
}

// newClaim allocates an empty claim, to be indexed by the caller.
func (db *DB) newClaim(ip uint32, sub int) int32 {
	var ci int32
	if n := len(db.freeClaims); n > 0 {
		ci = db.freeClaims[n-1]
		db.freeClaims = db.freeClaims[:n-1]
		db.claims[ci] = claim{ip: ip, sub: int32(sub)}
	} else {
		ci = int32(len(db.claims))
		db.claims = append(db.claims, claim{ip: ip, sub: int32(sub)})
	}
	return ci
}

// findRemote returns where p is among the remote claimants of c: headPos,
// an index into c.x.remotes, or notFound.
func (db *DB) findRemote(c *claim, p *Peer) int {
	if c.id == p.EndpointID && c.mac == p.MAC && db.vteps.vals[c.vtep] == p.VTEP && db.otherIs(c, c.hasOther, c.other, p) {
		return headPos
	}
	if c.x != nil {
		for i := range c.x.remotes {
			r := &c.x.remotes[i]
			if r.id == p.EndpointID && r.mac == p.MAC && db.vteps.vals[r.vtep] == p.VTEP && db.otherIs(c, r.hasOther, r.other, p) {
				return i
			}
		}
	}
	return notFound
}

// otherIs reports whether a claimant of c whose other address is (hasOther,
// other) has the other address of p.
func (db *DB) otherIs(c *claim, hasOther bool, other int32, p *Peer) bool {
	want := p.IPv6
	if c.v6 {
		want = p.IP
	}
	if !hasOther || !want.IsValid() {
		return hasOther == want.IsValid()
	}
	return db.addr(&db.claims[other]) == want
}

const (
	headPos  = -1
	notFound = -2
)

// lessRemote orders remote claimants of one IP as compareRemote does.
func (db *DB) lessRemote(a, b *remote) bool {
	if a.id != b.id {
		return a.id < b.id
	}
	if a.mac != b.mac {
		return macKey(a.mac) < macKey(b.mac)
	}
	if a.vtep != b.vtep {
		return db.vteps.vals[a.vtep].Less(db.vteps.vals[b.vtep])
	}
	if a.hasOther != b.hasOther || !a.hasOther { // no other address first
		return !a.hasOther && b.hasOther
	}
	return db.compareClaims(a.other, b.other) < 0
}

func (c *claim) head() remote {
	return remote{id: c.id, mac: c.mac, vtep: c.vtep, hasOther: c.hasOther, other: c.other}
}

func (c *claim) setHead(r remote) {
	c.id, c.mac, c.vtep, c.hasOther, c.other = r.id, r.mac, r.vtep, r.hasOther, r.other
}

// swapRemove removes s[i], not keeping order, and clears the freed slot.
func swapRemove[T any](s []T, i int) []T {
	last := len(s) - 1
	s[i] = s[last]
	var zero T
	s[last] = zero
	return s[:last]
}

// tidy drops c.x when it holds nothing.
func (c *claim) tidy() {
	if c.x != nil && len(c.x.remotes) == 0 && len(c.x.locals) == 0 {
		c.x = nil
	}
}
