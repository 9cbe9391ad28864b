package peerdb

import (
	"bytes"
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strings"
)

// DB is one network's peer table: its remote and local entries, indexes over
// them, and the desired kernel state derived from them (see the package
// documentation for the rules).
//
// A DB is not safe for concurrent use: it is owned by one network and every
// call, reads included, must be made with that network's lock held. Create
// one with New.
type DB struct {
	subnets []netip.Prefix
	nets    []v4net // subnets in a form cheap to match (see subnet4)

	local map[string]Peer // local entries by EndpointID

	// byIP maps every claimed IP (IPv4 as a big-endian uint32) to its claim
	// in claims. Slots of freed claims are listed in freeClaims.
	byIP       index
	claims     []claim
	freeClaims []int32

	// fdbIdx[s] maps a MAC (see macKey) to the FDB record of (subnet s,
	// MAC) in fdbs. A record exists while the key has an FDB proposal or a
	// local entry. Slots of freed records are listed in freeFDB.
	fdbIdx  []index
	fdbs    []fdbRec
	freeFDB []int32
	// fdbMore holds the proposers of an FDB record beyond its first one
	// (fdbRec.one), for the rare MAC proposed by several IPs.
	fdbMore map[int32][]int32

	vteps vtepTable

	// wideSubnets is set when subnet indexes do not fit in 16 bits (see
	// fdbNoteKey).
	wideSubnets bool

	nRemote int // number of remote entries
	nNeigh  int // number of desired neighbour entries
	nFDB    int // number of desired FDB entries

	tx txn
}

// v4net is a subnet as an IPv4 base and mask; ok is false for a prefix that
// contains no plain IPv4 address (invalid or IPv6).
type v4net struct {
	base, mask uint32
	ok         bool
}

// claim is the set of entries claiming one IP.
//
// The remote claimants are kept with the smallest one (the remote winner,
// see compareRemote) inline as the head; the others and the local claimants
// live in x, which is nil when there are none. A claim is empty when it has
// no head and no x.
type claim struct {
	id   string // EndpointID of the head; "" when there is no remote claimant
	mac  MAC    // of the head
	vtep uint32 // of the head, interned in DB.vteps
	ip   uint32
	sub  int32  // index of the subnet of ip
	mark uint32 // txn.id of the last transaction that noted this claim
	x    *claimExtra
}

type claimExtra struct {
	remotes []remote // the remote claimants other than the head, unordered
	locals  []Peer   // local claimants; locals[0] has the smallest EndpointID
}

// remote is a remote claimant of a known IP.
type remote struct {
	id   string
	mac  MAC
	vtep uint32
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

// Event is a remote peer change as delivered by the cluster layer:
// create (nil, next), update (prev, next) or delete (prev, nil).
type Event struct{ Prev, Next *Peer }

// Conflict describes an IP claimed by more than one entry.
type Conflict struct {
	IP          netip.Addr
	Active      Peer
	ActiveLocal bool
	// Shadowed are the other claimants in precedence order: local entries
	// (by EndpointID) before remote ones (by EndpointID, MAC, VTEP).
	Shadowed []Peer
}

// New returns an empty DB for a network with these IPv4 subnets (index =
// subnet index used in Neigh/FDB). Subnets are disjoint (the caller
// validates); New keeps its own copy of the slice.
func New(subnets []netip.Prefix) *DB {
	db := &DB{
		subnets: append([]netip.Prefix(nil), subnets...),
		nets:    make([]v4net, len(subnets)),
		local:   make(map[string]Peer),
		fdbIdx:  make([]index, len(subnets)),

		wideSubnets: len(subnets) > 1<<16,
	}
	for i, p := range subnets {
		if !p.IsValid() || !p.Addr().Is4() {
			continue
		}
		var mask uint32
		if b := p.Bits(); b > 0 {
			mask = ^uint32(0) << (32 - b)
		}
		db.nets[i] = v4net{base: ip4(p.Addr()) & mask, mask: mask, ok: true}
	}
	return db
}

// subnet4 is SubnetOf for an IPv4 address given as a uint32.
func (db *DB) subnet4(ip uint32) (int, bool) {
	for i, n := range db.nets {
		if n.ok && ip&n.mask == n.base {
			return i, true
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

// Apply applies one remote event with set semantics, so it is idempotent:
// the entry equal to *Prev is removed if present (absent is not an error: it
// may already be gone), then *Next is inserted (already present is a no-op).
// Prev and Next are validated first; on error nothing is changed. The Delta is
// the net change of desired state across the whole event, so an update that
// moves an IP to another MAC yields a single NeighSet.
func (db *DB) Apply(ev Event) (Delta, error) {
	sub, ok := db.checkEvent(&ev)
	if !ok {
		return Delta{}, db.eventError(ev)
	}
	db.begin()
	db.apply(&ev, sub)
	return db.finish(), nil
}

// ApplyAll applies events in order, as Apply does. Invalid events are skipped
// and reported: errs[i] is the error of events[i], nil when it was applied,
// and errs is nil when every event was applied. The Delta is the net change
// across all events: per key, the desired value before the first event is
// compared with the value after the last, and unchanged keys are omitted.
// Its cost is proportional to the number of keys the events touch.
func (db *DB) ApplyAll(events []Event) (Delta, []error) {
	db.begin()
	if len(events) > 1 {
		db.reserve(events)
	}
	var errs []error
	for i := range events {
		ev := &events[i]
		sub, ok := db.checkEvent(ev)
		if !ok {
			if errs == nil {
				errs = make([]error, len(events))
			}
			errs[i] = fmt.Errorf("event %d: %w", i, db.eventError(*ev))
			continue
		}
		db.apply(ev, sub)
	}
	return db.finish(), errs
}

// reserve makes room for a batch of events. Every event touches about one
// neighbour and one FDB key; a batch loaded into an empty DB also sizes the
// indexes for its creates, saving their incremental growth.
func (db *DB) reserve(events []Event) {
	db.tx.neigh = slices.Grow(db.tx.neigh, len(events))
	db.tx.fdb = slices.Grow(db.tx.fdb, len(events))
	if db.byIP.len() != 0 || len(events) < 64 {
		return
	}
	perSubnet := make([]int, len(db.subnets))
	total := 0
	for i := range events {
		if p := events[i].Next; p != nil && p.IP.Is4() {
			if s, ok := db.subnet4(ip4(p.IP)); ok {
				perSubnet[s]++
				total++
			}
		}
	}
	if total == 0 {
		return
	}
	db.byIP.reserve(total)
	if len(db.claims) == 0 {
		db.claims = make([]claim, 0, total)
	}
	if len(db.fdbs) == 0 {
		db.fdbs = make([]fdbRec, 0, total)
	}
	for s, n := range perSubnet {
		if n > 0 {
			db.fdbIdx[s].reserve(db.fdbIdx[s].len() + n)
		}
	}
}

// checkEvent reports whether ev is valid and the subnet of Next's IP.
func (db *DB) checkEvent(ev *Event) (nextSubnet int, ok bool) {
	if ev.Prev == nil && ev.Next == nil {
		return 0, false
	}
	if ev.Prev != nil {
		if _, ok := db.check(ev.Prev, true); !ok {
			return 0, false
		}
	}
	if ev.Next != nil {
		return db.check(ev.Next, true)
	}
	return 0, true
}

// eventError is validateEvent for an event that checkEvent rejected.
func (db *DB) eventError(ev Event) error {
	err := db.validateEvent(ev)
	if err == nil {
		panic("peerdb: internal error: check and validateEvent disagree")
	}
	return err
}

func (db *DB) apply(ev *Event, nextSubnet int) {
	if ev.Prev != nil {
		db.removeRemote(ev.Prev)
	}
	if ev.Next != nil {
		db.addRemote(ev.Next, nextSubnet)
	}
}

// AddLocal records a local endpoint (one joined on this host), replacing the
// local entry with the same EndpointID if there is one. It is validated as in
// Validate, except that VTEP is not checked (it may be zero). A local entry
// produces no kernel state of its own but shadows remote claimants of its IP
// and suppresses the FDB entry of its MAC in its subnet.
func (db *DB) AddLocal(p Peer) (Delta, error) {
	sub, ok := db.check(&p, false)
	if !ok {
		return Delta{}, db.validate(p, false)
	}
	old, exists := db.local[p.EndpointID]
	if exists && old == p {
		return Delta{}, nil
	}
	db.begin()
	if exists {
		db.removeLocal(old)
	}
	db.addLocal(p, sub)
	return db.finish(), nil
}

// RemoveLocal removes the local entry of endpointID; ok is false (and d
// empty) if there was none.
func (db *DB) RemoveLocal(endpointID string) (d Delta, ok bool) {
	p, ok := db.local[endpointID]
	if !ok {
		return Delta{}, false
	}
	db.begin()
	db.removeLocal(p)
	return db.finish(), true
}

// claimFor returns the claim of ip, creating an empty one if there is none.
func (db *DB) claimFor(ip uint32, sub int) int32 {
	slot, ok := db.byIP.slot(uint64(ip))
	if ok {
		return db.byIP.at(slot)
	}
	ci := db.newClaim(ip, sub)
	db.byIP.set(slot, uint64(ip), ci)
	return ci
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
	if c.id == p.EndpointID && c.mac == p.MAC && db.vteps.addr[c.vtep] == p.VTEP {
		return headPos
	}
	if c.x != nil {
		for i := range c.x.remotes {
			r := &c.x.remotes[i]
			if r.id == p.EndpointID && r.mac == p.MAC && db.vteps.addr[r.vtep] == p.VTEP {
				return i
			}
		}
	}
	return notFound
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
	return db.vteps.addr[a.vtep].Less(db.vteps.addr[b.vtep])
}

func (c *claim) head() remote { return remote{id: c.id, mac: c.mac, vtep: c.vtep} }

func (c *claim) setHead(r remote) { c.id, c.mac, c.vtep = r.id, r.mac, r.vtep }

func (db *DB) addRemote(p *Peer, sub int) {
	ip := ip4(p.IP)
	slot, ok := db.byIP.slot(uint64(ip))
	var ci int32
	if ok {
		ci = db.byIP.at(slot)
		if db.findRemote(&db.claims[ci], p) != notFound {
			return
		}
	} else {
		ci = db.newClaim(ip, sub)
		db.byIP.set(slot, uint64(ip), ci)
	}
	db.nRemote++
	db.noteNeigh(ci)
	c := &db.claims[ci]
	old := c.contrib()
	r := remote{id: p.EndpointID, mac: p.MAC, vtep: db.vteps.ref(p.VTEP)}
	switch {
	case c.id == "":
		c.setHead(r)
	default:
		if c.x == nil {
			c.x = new(claimExtra)
		}
		if h := c.head(); db.lessRemote(&r, &h) {
			c.x.remotes = append(c.x.remotes, h)
			c.setHead(r)
		} else {
			c.x.remotes = append(c.x.remotes, r)
		}
	}
	db.refreshClaim(ci, old)
}

func (db *DB) removeRemote(p *Peer) {
	ci, ok := db.byIP.get(uint64(ip4(p.IP)))
	if !ok {
		return
	}
	c := &db.claims[ci]
	pos := db.findRemote(c, p)
	if pos == notFound {
		return
	}
	db.nRemote--
	db.noteNeigh(ci)
	old := c.contrib()
	var gone uint32
	if pos == headPos {
		gone = c.vtep
		if c.x == nil || len(c.x.remotes) == 0 {
			c.setHead(remote{})
		} else {
			// Promote the smallest of the others.
			rs := c.x.remotes
			best := 0
			for i := 1; i < len(rs); i++ {
				if db.lessRemote(&rs[i], &rs[best]) {
					best = i
				}
			}
			c.setHead(rs[best])
			c.x.remotes = swapRemove(rs, best)
		}
	} else {
		gone = c.x.remotes[pos].vtep
		c.x.remotes = swapRemove(c.x.remotes, pos)
	}
	c.tidy()
	db.vteps.unref(gone)
	db.refreshClaim(ci, old)
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

func (db *DB) addLocal(p Peer, sub int) {
	db.local[p.EndpointID] = p
	ip := ip4(p.IP)
	ci := db.claimFor(ip, sub)
	db.noteNeigh(ci)
	c := &db.claims[ci]
	old := c.contrib()
	if c.x == nil {
		c.x = new(claimExtra)
	}
	ls := append(c.x.locals, p)
	if last := len(ls) - 1; last > 0 && p.EndpointID < ls[0].EndpointID {
		ls[0], ls[last] = ls[last], ls[0]
	}
	c.x.locals = ls
	db.refreshClaim(ci, old)

	fi := db.fdbFor(sub, p.MAC)
	db.noteFDB(fi, sub, p.MAC)
	db.fdbs[fi].local++
	db.recomputeFDB(fi)
}

func (db *DB) removeLocal(p Peer) {
	delete(db.local, p.EndpointID)
	ci, ok := db.byIP.get(uint64(ip4(p.IP)))
	if !ok {
		panic(fmt.Sprintf("peerdb: internal error: local %v has no claim", p))
	}
	db.noteNeigh(ci)
	c := &db.claims[ci]
	old := c.contrib()
	ls := c.x.locals
	i := slices.IndexFunc(ls, func(q Peer) bool { return q.EndpointID == p.EndpointID })
	if i < 0 {
		panic(fmt.Sprintf("peerdb: internal error: %v missing from its claim", p))
	}
	ls = swapRemove(ls, i)
	if i == 0 && len(ls) > 1 {
		best := 0
		for j := 1; j < len(ls); j++ {
			if ls[j].EndpointID < ls[best].EndpointID {
				best = j
			}
		}
		ls[0], ls[best] = ls[best], ls[0]
	}
	c.x.locals = ls
	c.tidy()
	sub := int(c.sub)
	db.refreshClaim(ci, old)

	fi, ok := db.fdbIdx[sub].get(macKey(p.MAC))
	if !ok {
		panic(fmt.Sprintf("peerdb: internal error: local %v has no FDB record", p))
	}
	db.noteFDB(fi, sub, p.MAC)
	db.fdbs[fi].local--
	db.recomputeFDB(fi)
}

// refreshClaim brings the FDB proposals up to date after the claimants of
// claim ci changed; old is what the claim contributed before. (The neighbour
// entry of a claim is derived from the claim itself.)
func (db *DB) refreshClaim(ci int32, old contrib) {
	c := &db.claims[ci]
	cur := c.contrib()
	if cur == old {
		return
	}
	sub := int(c.sub)
	if old.ok {
		fi, ok := db.fdbIdx[sub].get(macKey(old.mac))
		if !ok {
			panic(fmt.Sprintf("peerdb: internal error: no FDB record for the proposal of %s", addr4(c.ip)))
		}
		db.noteFDB(fi, sub, old.mac)
		if cur.ok && cur.mac == old.mac {
			// Same key, another VTEP.
			db.recomputeFDB(fi)
			return
		}
		db.removeProposer(fi, ci)
		db.recomputeFDB(fi)
	}
	if cur.ok {
		fi := db.fdbFor(sub, cur.mac)
		db.noteFDB(fi, sub, cur.mac)
		db.addProposer(fi, ci)
		db.recomputeFDB(fi)
	}
}

// fdbFor returns the FDB record of (sub, mac), creating an empty one if there
// is none.
func (db *DB) fdbFor(sub int, mac MAC) int32 {
	x := &db.fdbIdx[sub]
	k := macKey(mac)
	slot, ok := x.slot(k)
	if ok {
		return x.at(slot)
	}
	var fi int32
	if n := len(db.freeFDB); n > 0 {
		fi = db.freeFDB[n-1]
		db.freeFDB = db.freeFDB[:n-1]
		db.fdbs[fi] = fdbRec{one: -1}
	} else {
		fi = int32(len(db.fdbs))
		db.fdbs = append(db.fdbs, fdbRec{one: -1})
	}
	x.set(slot, k, fi)
	return fi
}

func (db *DB) addProposer(fi, ci int32) {
	r := &db.fdbs[fi]
	if r.one < 0 {
		r.one = ci
		return
	}
	if db.fdbMore == nil {
		db.fdbMore = make(map[int32][]int32)
	}
	db.fdbMore[fi] = append(db.fdbMore[fi], ci)
	r.multi = true
}

func (db *DB) removeProposer(fi, ci int32) {
	r := &db.fdbs[fi]
	if r.one == ci && !r.multi {
		r.one = -1
		return
	}
	more := db.fdbMore[fi]
	if r.one == ci {
		r.one = more[len(more)-1]
		more = more[:len(more)-1]
	} else {
		i := slices.Index(more, ci)
		if i < 0 {
			panic(fmt.Sprintf("peerdb: internal error: no FDB proposal of %s", addr4(db.claims[ci].ip)))
		}
		more = swapRemove(more, i)
	}
	if len(more) == 0 {
		delete(db.fdbMore, fi)
		r.multi = false
	} else {
		db.fdbMore[fi] = more
	}
}

// recomputeFDB recomputes the desired value of FDB record fi: the VTEP of the
// proposer with the smallest IP, unless a local entry has the MAC.
func (db *DB) recomputeFDB(fi int32) {
	r := &db.fdbs[fi]
	if r.local > 0 || r.one < 0 {
		r.cur, r.ok = 0, false
		return
	}
	best := r.one
	if r.multi {
		for _, ci := range db.fdbMore[fi] {
			if db.claims[ci].ip < db.claims[best].ip {
				best = ci
			}
		}
	}
	r.cur, r.ok = db.claims[best].vtep, true
}

// compareRemote orders remote claimants of one IP: EndpointID, MAC, VTEP
// (IP last, so the order is total even across IPs).
func compareRemote(a, b Peer) int {
	if c := strings.Compare(a.EndpointID, b.EndpointID); c != 0 {
		return c
	}
	if c := bytes.Compare(a.MAC[:], b.MAC[:]); c != 0 {
		return c
	}
	if c := a.VTEP.Compare(b.VTEP); c != 0 {
		return c
	}
	return a.IP.Compare(b.IP)
}

// txn records, for one mutation (one call of Apply, ApplyAll, AddLocal or
// RemoveLocal), the desired value of every neighbour and FDB key it touched
// as it was before the first touch, so the net Delta can be computed at the
// end in time proportional to the touched keys. A claim or FDB record is
// noted once per transaction (its mark is the transaction's id). Its slices
// are scratch space reused by the next transaction.
//
// Claims, FDB records and interned VTEPs that become unused are only freed
// when the transaction ends, so the indexes noted stay valid throughout.
type txn struct {
	id    uint32
	neigh []note
	fdb   []note
}

// note records a neighbour or FDB key touched by a transaction and its
// value before the transaction; finish replaces the value with the one to
// report.
type note struct {
	// key orders the Delta: subnet<<32 | IP for a neighbour, and for an
	// FDB key subnet<<48 | MAC, or just the subnet when subnet indexes do
	// not fit in 16 bits (see DB.fdbNoteKey).
	key  uint64
	idx  int32  // the claim or FDB record
	vtep uint32 // FDB: the value (interned VTEP)
	mac  MAC    // neighbour: the value; FDB: the MAC of the key
	ok   bool   // the value is valid
	set  bool   // set by finish: the key is Set (rather than Del)
}

func (db *DB) begin() {
	t := &db.tx
	t.id++
	if t.id == 0 { // wrapped: forget every mark
		for i := range db.claims {
			db.claims[i].mark = 0
		}
		for i := range db.fdbs {
			db.fdbs[i].mark = 0
		}
		t.id = 1
	}
	t.neigh = t.neigh[:0]
	t.fdb = t.fdb[:0]
}

func (db *DB) noteNeigh(ci int32) {
	c := &db.claims[ci]
	if c.mark == db.tx.id {
		return
	}
	c.mark = db.tx.id
	k := c.contrib()
	db.tx.neigh = append(db.tx.neigh, note{key: uint64(c.sub)<<32 | uint64(c.ip), idx: ci, mac: k.mac, ok: k.ok})
}

func (db *DB) noteFDB(fi int32, sub int, mac MAC) {
	r := &db.fdbs[fi]
	if r.mark == db.tx.id {
		return
	}
	r.mark = db.tx.id
	db.tx.fdb = append(db.tx.fdb, note{key: db.fdbNoteKey(sub, mac), idx: fi, mac: mac, vtep: r.cur, ok: r.ok})
}

// fdbNoteKey returns the sort key of the note of FDB key (sub, mac): the
// whole order when subnet indexes fit in 16 bits, else only the subnet.
func (db *DB) fdbNoteKey(sub int, mac MAC) uint64 {
	if db.wideSubnets {
		return uint64(sub)
	}
	return uint64(sub)<<48 | macKey(mac)
}

// fdbNoteSubnet returns the subnet of an FDB note.
func (db *DB) fdbNoteSubnet(n *note) int {
	if db.wideSubnets {
		return int(n.key)
	}
	return int(n.key >> 48)
}

// finish ends the transaction and returns its Delta. It compares each noted
// key with its current value, keeping only the changed ones, and frees the
// claims and FDB records left unused (in note order, which is mostly the
// order in which they were allocated); then it sorts what changed and
// builds the Delta.
func (db *DB) finish() Delta {
	t := &db.tx
	// When no entry is left, everything is dropped at once below.
	keep := db.nRemote != 0 || len(db.local) != 0

	var nSet, nDel int
	out := t.neigh[:0]
	for _, n := range t.neigh {
		c := &db.claims[n.idx]
		k := c.contrib()
		switch {
		case k.ok && (!n.ok || n.mac != k.mac):
			if !n.ok {
				db.nNeigh++
			}
			n.mac, n.set = k.mac, true
			out = append(out, n)
			nSet++
		case !k.ok && n.ok:
			db.nNeigh--
			out = append(out, n)
			nDel++
		}
		if keep && c.empty() {
			db.byIP.del(uint64(c.ip))
			*c = claim{}
			db.freeClaims = append(db.freeClaims, n.idx)
		}
	}
	t.neigh = out

	var fSet, fDel int
	fout := t.fdb[:0]
	for _, f := range t.fdb {
		r := &db.fdbs[f.idx]
		switch {
		case r.ok && (!f.ok || f.vtep != r.cur):
			if !f.ok {
				db.nFDB++
			}
			f.vtep, f.set = r.cur, true
			fout = append(fout, f)
			fSet++
		case !r.ok && f.ok:
			db.nFDB--
			fout = append(fout, f)
			fDel++
		}
		if keep && r.one < 0 && r.local == 0 {
			db.fdbIdx[db.fdbNoteSubnet(&f)].del(macKey(f.mac))
			*r = fdbRec{}
			db.freeFDB = append(db.freeFDB, f.idx)
		}
	}
	t.fdb = fout

	var d Delta
	if nSet+nDel > 0 {
		sortNotes(t.neigh)
		if nSet > 0 {
			d.NeighSet = make([]Neigh, 0, nSet)
		}
		if nDel > 0 {
			d.NeighDel = make([]Neigh, 0, nDel)
		}
		for i := range t.neigh {
			n := &t.neigh[i]
			e := Neigh{Subnet: int(n.key >> 32), IP: addr4(uint32(n.key)), MAC: n.mac}
			if n.set {
				d.NeighSet = append(d.NeighSet, e)
			} else {
				d.NeighDel = append(d.NeighDel, e)
			}
		}
	}
	if fSet+fDel > 0 {
		if db.wideSubnets {
			slices.SortFunc(t.fdb, func(a, b note) int {
				return cmp.Or(cmp.Compare(a.key, b.key), cmp.Compare(macKey(a.mac), macKey(b.mac)))
			})
		} else {
			sortNotes(t.fdb)
		}
		if fSet > 0 {
			d.FDBSet = make([]FDB, 0, fSet)
		}
		if fDel > 0 {
			d.FDBDel = make([]FDB, 0, fDel)
		}
		vt := db.vteps.addr
		for i := range t.fdb {
			f := &t.fdb[i]
			e := FDB{Subnet: db.fdbNoteSubnet(f), MAC: f.mac, VTEP: vt[f.vtep]}
			if f.set {
				d.FDBSet = append(d.FDBSet, e)
			} else {
				d.FDBDel = append(d.FDBDel, e)
			}
		}
	}

	if keep {
		db.vteps.sweep()
	} else {
		// Start afresh, returning the memory of large indexes.
		db.reset()
	}
	// Drop scratch space much larger than the DB.
	const small = 1024
	if cap(t.neigh) > small && cap(t.neigh) > 4*db.byIP.len() {
		t.neigh = nil
	}
	if live := len(db.fdbs) - len(db.freeFDB); cap(t.fdb) > small && cap(t.fdb) > 4*live {
		t.fdb = nil
	}
	return d
}

// reset empties the indexes of a DB that holds no entry.
func (db *DB) reset() {
	const small = 256
	db.byIP.clear()
	if len(db.claims) > small {
		db.claims, db.freeClaims = nil, nil
	} else {
		clear(db.claims)
		db.claims, db.freeClaims = db.claims[:0], db.freeClaims[:0]
	}
	for s := range db.fdbIdx {
		db.fdbIdx[s].clear()
	}
	big := len(db.fdbs) > small
	if big {
		db.fdbs, db.freeFDB = nil, nil
	} else {
		db.fdbs, db.freeFDB = db.fdbs[:0], db.freeFDB[:0]
	}
	db.fdbMore = nil
	db.vteps = vtepTable{}
	db.nNeigh, db.nFDB = 0, 0
}

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

// Sort sorts the slices of d: neighbours by Subnet then IP, FDB entries by
// Subnet then MAC bytes. Deltas returned by a DB are already sorted.
func (d *Delta) Sort() {
	slices.SortFunc(d.NeighSet, compareNeigh)
	slices.SortFunc(d.NeighDel, compareNeigh)
	slices.SortFunc(d.FDBSet, compareFDB)
	slices.SortFunc(d.FDBDel, compareFDB)
}

func compareNeigh(a, b Neigh) int {
	return cmp.Or(cmp.Compare(a.Subnet, b.Subnet), a.IP.Compare(b.IP))
}

func compareFDB(a, b FDB) int {
	return cmp.Or(cmp.Compare(a.Subnet, b.Subnet), bytes.Compare(a.MAC[:], b.MAC[:]))
}

// Desired returns the complete desired kernel state, in fresh maps the caller
// owns (never nil).
func (db *DB) Desired() State {
	s := State{
		Neigh: make(map[NeighKey]MAC, db.nNeigh),
		FDB:   make(map[FDBKey]netip.Addr, db.nFDB),
	}
	for i := range db.claims {
		c := &db.claims[i]
		if k := c.contrib(); k.ok {
			s.Neigh[NeighKey{Subnet: int(c.sub), IP: addr4(c.ip)}] = k.mac
		}
	}
	for sub := range db.fdbIdx {
		x := &db.fdbIdx[sub]
		if x.len() == 0 {
			continue
		}
		for _, slot := range x.slots {
			if slot.val == 0 {
				continue
			}
			if r := &db.fdbs[slot.val-1]; r.ok {
				s.FDB[FDBKey{Subnet: sub, MAC: macOfKey(slot.key())}] = db.vteps.addr[r.cur]
			}
		}
	}
	return s
}

func (db *DB) peer(ip uint32, r remote) Peer {
	return Peer{EndpointID: r.id, IP: addr4(ip), MAC: r.mac, VTEP: db.vteps.addr[r.vtep]}
}

// Remote returns all remote entries, sorted by IP, then EndpointID, MAC and
// VTEP.
func (db *DB) Remote() []Peer {
	out := make([]Peer, 0, db.nRemote)
	for i := range db.claims {
		c := &db.claims[i]
		if c.id != "" {
			out = append(out, db.peer(c.ip, c.head()))
		}
		if c.x != nil {
			for _, r := range c.x.remotes {
				out = append(out, db.peer(c.ip, r))
			}
		}
	}
	slices.SortFunc(out, func(a, b Peer) int {
		return cmp.Or(a.IP.Compare(b.IP), compareRemote(a, b))
	})
	return out
}

// Local returns the local entries, sorted by IP then EndpointID.
func (db *DB) Local() []Peer {
	out := make([]Peer, 0, len(db.local))
	for _, p := range db.local {
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b Peer) int {
		return cmp.Or(a.IP.Compare(b.IP), strings.Compare(a.EndpointID, b.EndpointID))
	})
	return out
}

// Active returns the winning claimant of ip and whether it is a local entry;
// ok is false if no entry claims ip.
func (db *DB) Active(ip netip.Addr) (p Peer, local bool, ok bool) {
	if !ip.Is4() {
		return Peer{}, false, false
	}
	ci, ok := db.byIP.get(uint64(ip4(ip)))
	if !ok {
		return Peer{}, false, false
	}
	c := &db.claims[ci]
	switch {
	case c.hasLocal():
		return c.x.locals[0], true, true
	case c.id != "":
		return db.peer(c.ip, c.head()), false, true
	}
	return Peer{}, false, false
}

// Conflicts returns the IPs claimed by more than one entry, sorted by IP, each
// with its winner and the shadowed claimants in precedence order.
func (db *DB) Conflicts() []Conflict {
	var out []Conflict
	for i := range db.claims {
		c := &db.claims[i]
		if c.claimants() < 2 {
			continue
		}
		all := slices.SortedFunc(slices.Values(c.x.locals), func(a, b Peer) int {
			return strings.Compare(a.EndpointID, b.EndpointID)
		})
		nLocal := len(all)
		if c.id != "" {
			all = append(all, db.peer(c.ip, c.head()))
			for _, r := range c.x.remotes {
				all = append(all, db.peer(c.ip, r))
			}
			slices.SortFunc(all[nLocal:], compareRemote)
		}
		out = append(out, Conflict{
			IP:          addr4(c.ip),
			Active:      all[0],
			ActiveLocal: nLocal > 0,
			Shadowed:    all[1:],
		})
	}
	slices.SortFunc(out, func(a, b Conflict) int { return a.IP.Compare(b.IP) })
	return out
}

// Len returns the number of local and remote entries.
func (db *DB) Len() (local, remote int) {
	return len(db.local), db.nRemote
}
