package encryption

import (
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

// load reads the persisted record; called by NewOwner.
func (o *Owner) load() error {
	var raw []byte
	if o.cfg.Store != nil {
		var err error
		if raw, err = o.cfg.Store.GetMeta(MetaKey); err != nil {
			return fmt.Errorf("encryption owner: reading the persisted state (key %q): %w", MetaKey, err)
		}
	}
	o.savedRemotes = map[netip.Addr]string{}
	if raw == nil {
		o.gen, o.fresh = randomGen(0), true
		o.persistAll = true
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
		if err := o.loadRemotes(&rec); err != nil {
			return err
		}
	}
	o.keys = NodeKeys{Accept: normAccept(rec.Keys.Accept), Send: rec.Keys.Send, Target: rec.Keys.Target}
	o.local = rec.Local.Unmap()
	if rec.Gen == 0 {
		o.gen, o.fresh = randomGen(0), true
	} else {
		o.gen = rec.Gen
		for _, in := range rec.Installed {
			m := o.installed[in.Epoch]
			if m == nil {
				m = map[netip.Addr]bool{}
				o.installed[in.Epoch] = m
			}
			for _, r := range in.Remotes {
				m[r.Unmap()] = true
			}
		}
	}
	for _, pg := range rec.PeerGens {
		if pg.VTEP.IsValid() && pg.Gen != 0 {
			o.remoteGens[pg.VTEP.Unmap()] = pg.Gen
		}
	}
	o.adopted = programmed{
		enc:   sortedVNIs(rec.Programmed.Encrypted),
		clear: sortedVNIs(rec.Programmed.Clear),
	}
	for _, r := range rec.Programmed.Remotes {
		if r.IsValid() {
			o.adopted.remotes = append(o.adopted.remotes, r.Unmap())
		}
	}
	o.adopted.remotes = sortedAddrs(o.adopted.remotes)
	o.adopting = len(o.adopted.enc)+len(o.adopted.clear)+len(o.adopted.remotes) > 0
	if rec.Version == recordVersion {
		o.savedCore = string(raw)
	} else {
		// Rewritten whole, as version 3, by the next write.
		o.persistAll = true
	}
	return nil
}

// loadRemotes reads the remotes' entries of a version 3 record into rec's
// version 2 fields, and remembers them as saved.
func (o *Owner) loadRemotes(rec *record) error {
	entries, err := o.cfg.Store.ListMeta(remoteKeyPrefix)
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
		o.savedRemotes[r] = string(raw)
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

// persistLocked writes what changed in the record since the last write,
// comparing every remote's entry. It must succeed before an outbound SA is
// added (the record says which were).
func (o *Owner) persistLocked() error {
	return o.persistRemotesLocked(nil)
}

// persistRemotesLocked is persistLocked comparing only the entries of the
// remotes in touched (nil: every remote), unless persistAll says every
// remote's may have changed: the core and the entries that differ from
// what was last written go to the store in one transaction.
func (o *Owner) persistRemotesLocked(touched []netip.Addr) error {
	if o.cfg.Store == nil {
		return nil
	}
	all := touched == nil || o.persistAll
	core, err := json.Marshal(record{
		Version:    recordVersion,
		Keys:       recordKeys{Accept: normAccept(o.keys.Accept), Send: o.keys.Send, Target: o.keys.Target},
		Local:      o.local,
		Gen:        o.gen,
		Programmed: recordProgrammed{Encrypted: o.programmed.enc, Clear: o.programmed.clear},
	})
	if err != nil {
		return fmt.Errorf("encryption: encoding the persisted state: %w", err)
	}
	puts := map[string][]byte{}
	if string(core) != o.savedCore {
		puts[MetaKey] = core
	}
	entries := map[netip.Addr][]byte{}
	check := func(r netip.Addr) error {
		if _, done := entries[r]; done {
			return nil
		}
		e, err := o.remoteEntryLocked(r)
		if err != nil {
			return err
		}
		entries[r] = e
		if string(e) != o.savedRemotes[r] {
			puts[remoteKeyPrefix+r.String()] = e // nil: delete
		}
		return nil
	}
	if all {
		for r := range o.savedRemotes {
			if err := check(r); err != nil {
				return err
			}
		}
		for _, in := range o.installed {
			for r := range in {
				if err := check(r); err != nil {
					return err
				}
			}
		}
		for r := range o.remoteGens {
			if err := check(r); err != nil {
				return err
			}
		}
		for _, r := range o.programmed.remotes {
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
		if err := o.cfg.Store.UpdateMeta(puts); err != nil {
			// What was not written is compared again, whole, next time.
			o.persistAll = true
			return fmt.Errorf("encryption: persisting the key state (key %q, generation %016x, %d remotes' entries): %w", MetaKey, o.gen, len(puts), err)
		}
	}
	if _, ok := puts[MetaKey]; ok {
		o.savedCore = string(core)
	}
	for r, e := range entries {
		if e == nil {
			delete(o.savedRemotes, r)
		} else {
			o.savedRemotes[r] = string(e)
		}
	}
	if all {
		o.persistAll = false
	}
	return nil
}

// remoteEntryLocked is r's entry as the Owner's state has it now, encoded;
// nil when there is nothing to keep for r.
func (o *Owner) remoteEntryLocked(r netip.Addr) ([]byte, error) {
	var e remoteEntry
	for ep, in := range o.installed {
		if in[r] {
			e.Installed = append(e.Installed, ep)
		}
	}
	slices.Sort(e.Installed)
	e.Gen = o.remoteGens[r]
	_, e.Programmed = slices.BinarySearchFunc(o.programmed.remotes, r, netip.Addr.Compare)
	if len(e.Installed) == 0 && e.Gen == 0 && !e.Programmed {
		return nil, nil
	}
	raw, err := json.Marshal(e)
	if err != nil {
		return nil, fmt.Errorf("encryption: encoding the persisted state of remote %v: %w", r, err)
	}
	return raw, nil
}
