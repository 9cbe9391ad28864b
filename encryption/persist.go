package encryption

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/netip"
	"slices"
)

// recordVersion is the version of the persisted record. Version 0 is the
// driver's record before the Owner existed ({"keys":…,"remotes":[…]}): its
// epochs are kept, with a new send generation.
const recordVersion = 2

// record is what the Owner persists under MetaKey (JSON, never key bytes).
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
	if raw == nil {
		o.gen, o.fresh = randomGen(0), true
		return nil
	}
	var rec record
	if err := json.Unmarshal(raw, &rec); err != nil {
		return fmt.Errorf("encryption owner: the persisted state (key %q) is corrupt: %w", MetaKey, err)
	}
	switch {
	case rec.Version > recordVersion:
		return fmt.Errorf("encryption owner: the persisted state (key %q) has version %d, written by a newer overlayd (this one reads up to %d)", MetaKey, rec.Version, recordVersion)
	case rec.Version < recordVersion:
		rec.Gen, rec.Installed, rec.PeerGens = 0, nil, nil
		rec.Programmed.Remotes = rec.Remotes
	}
	o.keys = NodeKeys{Accept: normAccept(rec.Keys.Accept), Send: rec.Keys.Send, Target: rec.Keys.Target}
	o.local = rec.Local.Unmap()
	if rec.Gen == 0 {
		o.gen, o.fresh = randomGen(0), true
	} else {
		o.gen = rec.Gen
		for _, in := range rec.Installed {
			m := map[netip.Addr]bool{}
			for _, r := range in.Remotes {
				m[r.Unmap()] = true
			}
			o.installed[in.Epoch] = m
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
		o.saved = string(raw)
	}
	return nil
}

// programmed is the VNIs and remotes a reconcile programmed.
type programmed struct {
	enc, clear []uint32
	remotes    []netip.Addr
}

// persistLocked writes the record when it changed. It must succeed before
// an outbound SA is added (the record says which were).
func (o *Owner) persistLocked() error {
	if o.cfg.Store == nil {
		return nil
	}
	rec := record{
		Version:    recordVersion,
		Keys:       recordKeys{Accept: normAccept(o.keys.Accept), Send: o.keys.Send, Target: o.keys.Target},
		Local:      o.local,
		Gen:        o.gen,
		Programmed: recordProgrammed{Encrypted: o.programmed.enc, Clear: o.programmed.clear, Remotes: o.programmed.remotes},
	}
	for _, e := range slices.Sorted(maps.Keys(o.installed)) {
		if len(o.installed[e]) == 0 {
			continue
		}
		rec.Installed = append(rec.Installed, recordInstalled{Epoch: e, Remotes: slices.SortedFunc(maps.Keys(o.installed[e]), netip.Addr.Compare)})
	}
	for _, r := range slices.SortedFunc(maps.Keys(o.remoteGens), netip.Addr.Compare) {
		rec.PeerGens = append(rec.PeerGens, recordPeerGen{VTEP: r, Gen: o.remoteGens[r]})
	}
	raw, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("encryption: encoding the persisted state: %w", err)
	}
	if string(raw) == o.saved {
		return nil
	}
	if err := o.cfg.Store.PutMeta(MetaKey, raw); err != nil {
		return fmt.Errorf("encryption: persisting the key state (key %q, generation %016x): %w", MetaKey, o.gen, err)
	}
	o.saved = string(raw)
	return nil
}
