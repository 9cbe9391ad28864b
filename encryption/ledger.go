package encryption

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
)

// recordVersion is the version of the persisted record. Version 0 is the
// driver's record before the Owner existed ({"keys":…,"remotes":[…]}): its
// epochs are kept, with a new send generation. Version 2 held every
// remote's generation and reservation in the one record, rewritten whole
// on every change (65 KB and 2.3 ms per host added at 1,000 hosts); version
// 3 keeps them in an entry per remote (remoteKeyPrefix), written with the
// record in one transaction, so a change writes the entries it changes.
// A version 2 record is read and rewritten as version 3 by the next write.
const recordVersion = 3

// remoteKeyPrefix + a remote VTEP's address is the MetaStore key of its
// entry (remoteEntry) in a version 3 record.
const remoteKeyPrefix = MetaKey + "/remote/"

// remoteEntry is what the Owner persists per remote VTEP (JSON): the epochs
// for which an outbound SA to it under the record's generation was
// installed (written before the SA is added), the generation it last
// advertised, and whether the last reconcile programmed it. An entry with
// none of them is deleted.
type remoteEntry struct {
	Installed  []uint32 `json:"installed,omitempty"`
	Gen        uint64   `json:"gen,string,omitempty"`
	Programmed bool     `json:"programmed,omitempty"`
}

// record is what the Owner persists under MetaKey (JSON, never key bytes).
// In version 3, Installed, PeerGens and Programmed.Remotes are empty: the
// remotes' entries hold them.
type record struct {
	Version int        `json:"version"`
	Keys    recordKeys `json:"keys"`
	// Local is the VTEP the generation's SAs were derived for.
	Local netip.Addr `json:"local,omitzero"`
	// Gen is the send generation.
	Gen uint64 `json:"gen,string,omitempty"`
	// Installed lists, per epoch, the remotes for which an outbound SA
	// under (epoch, Gen) was installed — written before the SA is added.
	Installed []recordInstalled `json:"installed,omitempty"`
	// PeerGens are the last generations remotes advertised, so a restart
	// keeps the inbound SAs before gossip is back.
	PeerGens []recordPeerGen `json:"peer_gens,omitempty"`
	// Programmed is what the last reconcile programmed: kept after a
	// restart until the driver has registered its shares again
	// (Owner.Restored), so a restart never removes a rule, policy or SA a
	// running container needs (the old "remotes" field is read into it).
	Programmed recordProgrammed `json:"programmed"`
	Remotes    []netip.Addr     `json:"remotes,omitempty"` // version 0 only
}

type recordKeys struct {
	Accept []uint32 `json:"accept"`
	Send   uint32   `json:"send"`
	Target uint32   `json:"target"`
}

type recordInstalled struct {
	Epoch   uint32       `json:"epoch"`
	Remotes []netip.Addr `json:"remotes"`
}

type recordPeerGen struct {
	VTEP netip.Addr `json:"vtep"`
	Gen  uint64     `json:"gen,string"`
}

type recordProgrammed struct {
	Encrypted []uint32     `json:"encrypted_vnis,omitempty"`
	Clear     []uint32     `json:"clear_vnis,omitempty"`
	Remotes   []netip.Addr `json:"remotes,omitempty"`
}

// ledger is the persisted part of the Owner's state, the small part that
// must survive a restart: the key epochs, the local VTEP and the send
// generation; which outbound SAs were installed under it (reserved and
// written before the add, so a key is never used twice); the generations
// the remotes advertised; and what the last reconcile programmed (kept
// after a restart until the driver has registered its shares again). It
// writes only what changed (see persist). It belongs to the Owner and is
// guarded by the Owner's lock: its methods expect it held.
type ledger struct {
	store MetaStore // nil: in memory only (tests)

	keys  NodeKeys   // held by the kernel (or being installed)
	local netip.Addr // the local VTEP
	gen   uint64     // send generation
	fresh bool       // gen was chosen by this process (no persisted gen)
	// installed records, per epoch, the remotes an outbound SA under
	// (epoch, gen) was installed for (reserved and persisted before the
	// add). Such an SA is never added a second time: if it vanishes, the
	// Owner moves to a new gen instead.
	installed  map[uint32]map[netip.Addr]bool
	remoteGens map[netip.Addr]uint64 // advertised generations of remotes (last known)
	programmed programmed            // what the last successful reconcile programmed
	// adopted is what the previous run programmed, kept in the desired
	// state (adopting) until Restored: a restart never removes what a
	// running container needs before the driver registered its shares.
	adopted  programmed
	adopting bool

	// savedCore and savedRemotes are the persisted record as last
	// written: its core under MetaKey and each remote's entry, so that a
	// change writes only what differs. persistAll: the next write must
	// compare every remote (loaded from an older record, or generations
	// changed by adverts).
	savedCore    string
	savedRemotes map[netip.Addr]string
	persistAll   bool
}

// installedFor reports whether an outbound SA to r under (epoch, gen) was
// installed (or reserved).
func (l *ledger) installedFor(epoch uint32, r netip.Addr) bool { return l.installed[epoch][r] }

// mark records outbound SAs to rs under (epoch, gen) as installed, without
// writing (an SA found intact in the kernel: ours even if the record
// missed it).
func (l *ledger) mark(epoch uint32, rs ...netip.Addr) {
	if len(rs) == 0 {
		return
	}
	m := l.installed[epoch]
	if m == nil {
		m = map[netip.Addr]bool{}
		l.installed[epoch] = m
	}
	for _, r := range rs {
		m[r] = true
	}
}

// release forgets the reservation of outbound SAs to rs: the kernel never
// held them, so their keys were never used.
func (l *ledger) release(epoch uint32, rs ...netip.Addr) {
	for _, r := range rs {
		delete(l.installed[epoch], r)
	}
}

// reserve records outbound SAs to rs under (epoch, gen) as installed and
// writes it, before they are added: an SA is added at most once per
// (epoch, remote, gen). With touched, only the entries of rs are compared
// (see persist). When the write fails, nothing is reserved.
func (l *ledger) reserve(epoch uint32, rs []netip.Addr, touched bool) error {
	if len(rs) == 0 {
		return nil
	}
	l.mark(epoch, rs...)
	var only []netip.Addr
	if touched {
		only = rs
	}
	if err := l.persist(only); err != nil {
		l.release(epoch, rs...)
		return err
	}
	return nil
}

// newGen moves to a new random send generation (every outbound SA is then
// re-created under it), forgetting the installed records, and writes it.
// It returns the previous generation.
func (l *ledger) newGen() (uint64, error) {
	old := l.gen
	l.gen = randomGen(old)
	l.installed = map[uint32]map[netip.Addr]bool{}
	return old, l.persist(nil)
}

// setRemoteGen records the generation remote r advertised; it reports
// whether it changed.
func (l *ledger) setRemoteGen(r netip.Addr, g uint64) bool {
	if g == 0 || l.remoteGens[r] == g {
		return false
	}
	l.remoteGens[r] = g
	l.persistAll = true
	return true
}

// forgetRemoteGen forgets r's generation (nobody needs or advertises it).
func (l *ledger) forgetRemoteGen(r netip.Addr) {
	delete(l.remoteGens, r)
	l.persistAll = true
}

// prune forgets installed records of epochs older than Send (Send never
// goes back).
func (l *ledger) prune() (pruned bool) {
	for e := range l.installed {
		if e < l.keys.Send {
			delete(l.installed, e)
			pruned = true
		}
	}
	return pruned
}

// load reads the persisted record; called by NewOwner.
func (l *ledger) load() error {
	l.installed = map[uint32]map[netip.Addr]bool{}
	l.remoteGens = map[netip.Addr]uint64{}
	var raw []byte
	if l.store != nil {
		var err error
		if raw, err = l.store.GetMeta(MetaKey); err != nil {
			return fmt.Errorf("encryption owner: reading the persisted state (key %q): %w", MetaKey, err)
		}
	}
	l.savedRemotes = map[netip.Addr]string{}
	if raw == nil {
		l.gen, l.fresh = randomGen(0), true
		l.persistAll = true
		return nil
	}
	var rec record
	if err := json.Unmarshal(raw, &rec); err != nil {
		return fmt.Errorf("encryption owner: the persisted state (key %q) is corrupt: %w", MetaKey, err)
	}
	switch {
	case rec.Version > recordVersion:
		return fmt.Errorf("encryption owner: the persisted state (key %q) has version %d, written by a newer overlayd (this one reads up to %d)", MetaKey, rec.Version, recordVersion)
	case rec.Version < 2:
		rec.Gen, rec.Installed, rec.PeerGens = 0, nil, nil
		rec.Programmed.Remotes = rec.Remotes
	case rec.Version == recordVersion:
		if err := l.loadRemotes(&rec); err != nil {
			return err
		}
	}
	l.keys = NodeKeys{Accept: normAccept(rec.Keys.Accept), Send: rec.Keys.Send, Target: rec.Keys.Target}
	l.local = rec.Local.Unmap()
	if rec.Gen == 0 {
		l.gen, l.fresh = randomGen(0), true
	} else {
		l.gen = rec.Gen
		for _, in := range rec.Installed {
			m := l.installed[in.Epoch]
			if m == nil {
				m = map[netip.Addr]bool{}
				l.installed[in.Epoch] = m
			}
			for _, r := range in.Remotes {
				m[r.Unmap()] = true
			}
		}
	}
	for _, pg := range rec.PeerGens {
		if pg.VTEP.IsValid() && pg.Gen != 0 {
			l.remoteGens[pg.VTEP.Unmap()] = pg.Gen
		}
	}
	l.adopted = programmed{
		enc:   sortedVNIs(rec.Programmed.Encrypted),
		clear: sortedVNIs(rec.Programmed.Clear),
	}
	for _, r := range rec.Programmed.Remotes {
		if r.IsValid() {
			l.adopted.remotes = append(l.adopted.remotes, r.Unmap())
		}
	}
	l.adopted.remotes = sortedAddrs(l.adopted.remotes)
	l.adopting = len(l.adopted.enc)+len(l.adopted.clear)+len(l.adopted.remotes) > 0
	if rec.Version == recordVersion {
		l.savedCore = string(raw)
	} else {
		// Rewritten whole, as version 3, by the next write.
		l.persistAll = true
	}
	return nil
}

// loadRemotes reads the remotes' entries of a version 3 record into rec's
// version 2 fields, and remembers them as saved.
func (l *ledger) loadRemotes(rec *record) error {
	entries, err := l.store.ListMeta(remoteKeyPrefix)
	if err != nil {
		return fmt.Errorf("encryption owner: reading the persisted state's remotes (keys %q…): %w", remoteKeyPrefix, err)
	}
	byEpoch := map[uint32][]netip.Addr{}
	for _, key := range slices.Sorted(maps.Keys(entries)) {
		raw := entries[key]
		r, err := netip.ParseAddr(strings.TrimPrefix(key, remoteKeyPrefix))
		var e remoteEntry
		if err == nil {
			err = json.Unmarshal(raw, &e)
		}
		if err != nil {
			return fmt.Errorf("encryption owner: the persisted state (key %q) is corrupt: %w", key, err)
		}
		r = r.Unmap()
		for _, ep := range e.Installed {
			byEpoch[ep] = append(byEpoch[ep], r)
		}
		if e.Gen != 0 {
			rec.PeerGens = append(rec.PeerGens, recordPeerGen{VTEP: r, Gen: e.Gen})
		}
		if e.Programmed {
			rec.Programmed.Remotes = append(rec.Programmed.Remotes, r)
		}
		l.savedRemotes[r] = string(raw)
	}
	for _, ep := range slices.Sorted(maps.Keys(byEpoch)) {
		rec.Installed = append(rec.Installed, recordInstalled{Epoch: ep, Remotes: byEpoch[ep]})
	}
	return nil
}

// programmed is the VNIs and remotes a reconcile programmed.
type programmed struct {
	enc, clear []uint32
	remotes    []netip.Addr
}

// persist writes what changed in the record since the last write,
// comparing the entries of the remotes in touched (nil: every remote),
// unless persistAll says every remote's may have changed: the core and the
// entries that differ from what was last written go to the store in one
// transaction. It must succeed before an outbound SA is added (the record
// says which were).
func (l *ledger) persist(touched []netip.Addr) error {
	if l.store == nil {
		return nil
	}
	all := touched == nil || l.persistAll
	core, err := json.Marshal(record{
		Version:    recordVersion,
		Keys:       recordKeys{Accept: normAccept(l.keys.Accept), Send: l.keys.Send, Target: l.keys.Target},
		Local:      l.local,
		Gen:        l.gen,
		Programmed: recordProgrammed{Encrypted: l.programmed.enc, Clear: l.programmed.clear},
	})
	if err != nil {
		return fmt.Errorf("encryption: encoding the persisted state: %w", err)
	}
	puts := map[string][]byte{}
	if string(core) != l.savedCore {
		puts[MetaKey] = core
	}
	entries := map[netip.Addr][]byte{}
	check := func(r netip.Addr) error {
		if _, done := entries[r]; done {
			return nil
		}
		e, err := l.remoteEntry(r)
		if err != nil {
			return err
		}
		entries[r] = e
		if string(e) != l.savedRemotes[r] {
			puts[remoteKeyPrefix+r.String()] = e // nil: delete
		}
		return nil
	}
	if all {
		for r := range l.savedRemotes {
			if err := check(r); err != nil {
				return err
			}
		}
		for _, in := range l.installed {
			for r := range in {
				if err := check(r); err != nil {
					return err
				}
			}
		}
		for r := range l.remoteGens {
			if err := check(r); err != nil {
				return err
			}
		}
		for _, r := range l.programmed.remotes {
			if err := check(r); err != nil {
				return err
			}
		}
	} else {
		for _, r := range touched {
			if err := check(r.Unmap()); err != nil {
				return err
			}
		}
	}
	if len(puts) > 0 {
		if err := l.store.UpdateMeta(puts); err != nil {
			// What was not written is compared again, whole, next time.
			l.persistAll = true
			return fmt.Errorf("encryption: persisting the key state (key %q, generation %016x, %d remotes' entries): %w", MetaKey, l.gen, len(puts), err)
		}
	}
	if _, ok := puts[MetaKey]; ok {
		l.savedCore = string(core)
	}
	for r, e := range entries {
		if e == nil {
			delete(l.savedRemotes, r)
		} else {
			l.savedRemotes[r] = string(e)
		}
	}
	if all {
		l.persistAll = false
	}
	return nil
}

// remoteEntryLocked is r's entry as the Owner's state has it now, encoded;
// nil when there is nothing to keep for r.
func (l *ledger) remoteEntry(r netip.Addr) ([]byte, error) {
	var e remoteEntry
	for ep, in := range l.installed {
		if in[r] {
			e.Installed = append(e.Installed, ep)
		}
	}
	slices.Sort(e.Installed)
	e.Gen = l.remoteGens[r]
	_, e.Programmed = slices.BinarySearchFunc(l.programmed.remotes, r, netip.Addr.Compare)
	if len(e.Installed) == 0 && e.Gen == 0 && !e.Programmed {
		return nil, nil
	}
	raw, err := json.Marshal(e)
	if err != nil {
		return nil, fmt.Errorf("encryption: encoding the persisted state of remote %v: %w", r, err)
	}
	return raw, nil
}

// randomGen returns a random send generation, neither 0 nor not.
func randomGen(not uint64) uint64 {
	var b [8]byte
	for {
		if _, err := rand.Read(b[:]); err != nil {
			// crypto/rand does not fail on Linux; never fall back to
			// something predictable.
			panic(fmt.Sprintf("encryption: no randomness for a send generation: %v", err))
		}
		if g := binary.BigEndian.Uint64(b[:]); g != 0 && g != not {
			return g
		}
	}
}
