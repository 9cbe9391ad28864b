package peerdb

import (
	"bytes"
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/overlayd/overlayd/countmap"
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

	local  map[string]Peer   // local entries by EndpointID
	remote map[Peer]struct{} // the set of remote entries

	// byIP holds the claimants of every IP that has at least one, and the
	// cached winner (see claim.active).
	byIP map[netip.Addr]*claim
	// fdbCand holds, per FDB key, the active remote claimants proposing it
	// (IP and VTEP; one IP at most once). Usually a single one.
	fdbCand map[FDBKey][]fdbProposal
	// localMACs counts local entries per (subnet, MAC): a key with a positive
	// count is never in the desired FDB.
	localMACs countmap.Map[FDBKey]

	// The desired state, kept up to date by every mutation.
	neigh map[NeighKey]MAC
	fdb   map[FDBKey]netip.Addr
}

// claim is the set of entries claiming one IP.
type claim struct {
	subnet  int
	locals  []Peer // distinct EndpointIDs (local entries are keyed by id)
	remotes []Peer // distinct values
	// The winner as of the last refresh; its contribution (neighbour and FDB
	// proposal) is what the indexes currently hold for this IP.
	active      Peer
	activeLocal bool
	hasActive   bool
	// inline is the initial backing array of remotes, saving an allocation
	// for the usual IP with a single (remote) claimant.
	inline [1]Peer
}

// fdbProposal is an active remote claimant's bid for an FDB key.
type fdbProposal struct {
	ip, vtep netip.Addr
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
	return &DB{
		subnets: append([]netip.Prefix(nil), subnets...),
		local:   make(map[string]Peer),
		remote:  make(map[Peer]struct{}),
		byIP:    make(map[netip.Addr]*claim),
		fdbCand: make(map[FDBKey][]fdbProposal),
		neigh:   make(map[NeighKey]MAC),
		fdb:     make(map[FDBKey]netip.Addr),
	}
}

// Apply applies one remote event with set semantics, so it is idempotent:
// the entry equal to *Prev is removed if present (absent is not an error: it
// may already be gone), then *Next is inserted (already present is a no-op).
// Prev and Next are validated first; on error nothing is changed. The Delta is
// the net change of desired state across the whole event, so an update that
// moves an IP to another MAC yields a single NeighSet.
func (db *DB) Apply(ev Event) (Delta, error) {
	if err := db.validateEvent(ev); err != nil {
		return Delta{}, err
	}
	var t txn
	db.apply(&t, ev)
	return t.delta(db), nil
}

// ApplyAll applies events in order, as Apply does. Invalid events are skipped
// and reported: errs[i] is the error of events[i], nil when it was applied,
// and errs is nil when every event was applied. The Delta is the net change
// across all events: per key, the desired value before the first event is
// compared with the value after the last, and unchanged keys are omitted.
// Its cost is proportional to the number of keys the events touch.
func (db *DB) ApplyAll(events []Event) (Delta, []error) {
	var t txn
	if len(events) > 1 {
		// Most events touch one neighbour and one or two FDB keys.
		t.neigh = make(map[NeighKey]prevNeigh, len(events))
		t.fdb = make(map[FDBKey]prevFDB, len(events))
	}
	var errs []error
	for i, ev := range events {
		if err := db.validateEvent(ev); err != nil {
			if errs == nil {
				errs = make([]error, len(events))
			}
			errs[i] = fmt.Errorf("event %d: %w", i, err)
			continue
		}
		db.apply(&t, ev)
	}
	return t.delta(db), errs
}

func (db *DB) apply(t *txn, ev Event) {
	if ev.Prev != nil {
		db.removeRemote(t, *ev.Prev)
	}
	if ev.Next != nil {
		db.addRemote(t, *ev.Next)
	}
}

// AddLocal records a local endpoint (one joined on this host), replacing the
// local entry with the same EndpointID if there is one. It is validated as in
// Validate, except that VTEP is not checked (it may be zero). A local entry
// produces no kernel state of its own but shadows remote claimants of its IP
// and suppresses the FDB entry of its MAC in its subnet.
func (db *DB) AddLocal(p Peer) (Delta, error) {
	if err := db.validate(p, false); err != nil {
		return Delta{}, err
	}
	var t txn
	if old, ok := db.local[p.EndpointID]; ok {
		if old == p {
			return Delta{}, nil
		}
		db.removeLocal(&t, old)
	}
	db.addLocal(&t, p)
	return t.delta(db), nil
}

// RemoveLocal removes the local entry of endpointID; ok is false (and d
// empty) if there was none.
func (db *DB) RemoveLocal(endpointID string) (d Delta, ok bool) {
	p, ok := db.local[endpointID]
	if !ok {
		return Delta{}, false
	}
	var t txn
	db.removeLocal(&t, p)
	return t.delta(db), true
}

func (db *DB) claimOf(ip netip.Addr) *claim {
	c := db.byIP[ip]
	if c == nil {
		subnet, ok := db.SubnetOf(ip)
		if !ok {
			panic(fmt.Sprintf("peerdb: internal error: unvalidated IP %s", ip))
		}
		c = &claim{subnet: subnet}
		c.remotes = c.inline[:0]
		db.byIP[ip] = c
	}
	return c
}

func (db *DB) addRemote(t *txn, p Peer) {
	if _, ok := db.remote[p]; ok {
		return
	}
	db.remote[p] = struct{}{}
	c := db.claimOf(p.IP)
	c.remotes = append(c.remotes, p)
	db.refreshIP(t, p.IP, c)
}

func (db *DB) removeRemote(t *txn, p Peer) {
	if _, ok := db.remote[p]; !ok {
		return
	}
	delete(db.remote, p)
	c := db.byIP[p.IP]
	c.remotes = removePeer(c.remotes, p)
	db.refreshIP(t, p.IP, c)
}

func (db *DB) addLocal(t *txn, p Peer) {
	db.local[p.EndpointID] = p
	c := db.claimOf(p.IP)
	c.locals = append(c.locals, p)
	k := FDBKey{Subnet: c.subnet, MAC: p.MAC}
	db.localMACs.Add(k, 1)
	db.refreshIP(t, p.IP, c)
	db.refreshFDB(t, k)
}

func (db *DB) removeLocal(t *txn, p Peer) {
	delete(db.local, p.EndpointID)
	c := db.byIP[p.IP]
	c.locals = removePeer(c.locals, p)
	k := FDBKey{Subnet: c.subnet, MAC: p.MAC}
	db.localMACs.Add(k, -1)
	db.refreshIP(t, p.IP, c)
	db.refreshFDB(t, k)
}

// removePeer removes p (which must be present) from s, not keeping order.
func removePeer(s []Peer, p Peer) []Peer {
	i := slices.Index(s, p)
	if i < 0 {
		panic(fmt.Sprintf("peerdb: internal error: %v missing from its claim", p))
	}
	last := len(s) - 1
	s[i] = s[last]
	s[last] = Peer{}
	return s[:last]
}

// winner applies the precedence rule to the claimants of one IP.
func (c *claim) winner() (p Peer, local, ok bool) {
	if len(c.locals) > 0 {
		best := c.locals[0]
		for _, q := range c.locals[1:] {
			if q.EndpointID < best.EndpointID {
				best = q
			}
		}
		return best, true, true
	}
	if len(c.remotes) > 0 {
		best := c.remotes[0]
		for _, q := range c.remotes[1:] {
			if compareRemote(q, best) < 0 {
				best = q
			}
		}
		return best, false, true
	}
	return Peer{}, false, false
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

// refreshIP recomputes the winner of ip after its claimants changed and
// brings the neighbour entry and the FDB proposals up to date. It drops the
// claim when no claimant is left.
func (db *DB) refreshIP(t *txn, ip netip.Addr, c *claim) {
	p, local, ok := c.winner()
	if !ok {
		delete(db.byIP, ip)
	}
	if p == c.active && local == c.activeLocal && ok == c.hasActive {
		return
	}
	if c.hasActive && !c.activeLocal {
		k := FDBKey{Subnet: c.subnet, MAC: c.active.MAC}
		cands := db.fdbCand[k]
		i := slices.IndexFunc(cands, func(f fdbProposal) bool { return f.ip == ip })
		if i < 0 {
			panic(fmt.Sprintf("peerdb: internal error: no FDB proposal of %s for %v", ip, k))
		}
		if last := len(cands) - 1; last == 0 {
			delete(db.fdbCand, k)
		} else {
			cands[i] = cands[last]
			db.fdbCand[k] = cands[:last]
		}
		db.refreshFDB(t, k)
	}
	c.active, c.activeLocal, c.hasActive = p, local, ok

	nk := NeighKey{Subnet: c.subnet, IP: ip}
	t.noteNeigh(db, nk)
	if !ok || local {
		delete(db.neigh, nk)
		return
	}
	db.neigh[nk] = p.MAC
	k := FDBKey{Subnet: c.subnet, MAC: p.MAC}
	db.fdbCand[k] = append(db.fdbCand[k], fdbProposal{ip: ip, vtep: p.VTEP})
	db.refreshFDB(t, k)
}

// refreshFDB recomputes the desired FDB entry of k from the proposals and the
// local MACs.
func (db *DB) refreshFDB(t *txn, k FDBKey) {
	t.noteFDB(db, k)
	cands := db.fdbCand[k]
	if db.localMACs.Get(k) > 0 || len(cands) == 0 {
		delete(db.fdb, k)
		return
	}
	best := cands[0]
	for _, f := range cands[1:] {
		if f.ip.Less(best.ip) {
			best = f
		}
	}
	db.fdb[k] = best.vtep
}

// txn remembers the desired value of every key a mutation touched, as it was
// before the first touch, so the net Delta can be computed at the end in time
// proportional to the touched keys.
type txn struct {
	neigh map[NeighKey]prevNeigh
	fdb   map[FDBKey]prevFDB
}

type prevNeigh struct {
	mac MAC
	ok  bool
}

type prevFDB struct {
	vtep netip.Addr
	ok   bool
}

func (t *txn) noteNeigh(db *DB, k NeighKey) {
	if _, seen := t.neigh[k]; seen {
		return
	}
	if t.neigh == nil {
		t.neigh = make(map[NeighKey]prevNeigh)
	}
	mac, ok := db.neigh[k]
	t.neigh[k] = prevNeigh{mac, ok}
}

func (t *txn) noteFDB(db *DB, k FDBKey) {
	if _, seen := t.fdb[k]; seen {
		return
	}
	if t.fdb == nil {
		t.fdb = make(map[FDBKey]prevFDB)
	}
	vtep, ok := db.fdb[k]
	t.fdb[k] = prevFDB{vtep, ok}
}

func (t *txn) delta(db *DB) Delta {
	var d Delta
	for k, old := range t.neigh {
		cur, ok := db.neigh[k]
		switch {
		case ok && (!old.ok || old.mac != cur):
			d.NeighSet = append(d.NeighSet, Neigh{Subnet: k.Subnet, IP: k.IP, MAC: cur})
		case !ok && old.ok:
			d.NeighDel = append(d.NeighDel, Neigh{Subnet: k.Subnet, IP: k.IP, MAC: old.mac})
		}
	}
	for k, old := range t.fdb {
		cur, ok := db.fdb[k]
		switch {
		case ok && (!old.ok || old.vtep != cur):
			d.FDBSet = append(d.FDBSet, FDB{Subnet: k.Subnet, MAC: k.MAC, VTEP: cur})
		case !ok && old.ok:
			d.FDBDel = append(d.FDBDel, FDB{Subnet: k.Subnet, MAC: k.MAC, VTEP: old.vtep})
		}
	}
	d.Sort()
	return d
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
		Neigh: make(map[NeighKey]MAC, len(db.neigh)),
		FDB:   make(map[FDBKey]netip.Addr, len(db.fdb)),
	}
	for k, v := range db.neigh {
		s.Neigh[k] = v
	}
	for k, v := range db.fdb {
		s.FDB[k] = v
	}
	return s
}

// Remote returns all remote entries, sorted by IP, then EndpointID, MAC and
// VTEP.
func (db *DB) Remote() []Peer {
	out := make([]Peer, 0, len(db.remote))
	for p := range db.remote {
		out = append(out, p)
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
	c := db.byIP[ip]
	if c == nil {
		return Peer{}, false, false
	}
	return c.active, c.activeLocal, c.hasActive
}

// Conflicts returns the IPs claimed by more than one entry, sorted by IP, each
// with its winner and the shadowed claimants in precedence order.
func (db *DB) Conflicts() []Conflict {
	var out []Conflict
	for ip, c := range db.byIP {
		if len(c.locals)+len(c.remotes) < 2 {
			continue
		}
		locals := slices.SortedFunc(slices.Values(c.locals), func(a, b Peer) int {
			return strings.Compare(a.EndpointID, b.EndpointID)
		})
		remotes := slices.SortedFunc(slices.Values(c.remotes), compareRemote)
		all := append(locals, remotes...)
		out = append(out, Conflict{
			IP:          ip,
			Active:      c.active,
			ActiveLocal: c.activeLocal,
			Shadowed:    all[1:],
		})
	}
	slices.SortFunc(out, func(a, b Conflict) int { return a.IP.Compare(b.IP) })
	return out
}

// Len returns the number of local and remote entries.
func (db *DB) Len() (local, remote int) {
	return len(db.local), len(db.remote)
}
