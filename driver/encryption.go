package driver

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"

	"github.com/overlayd/overlayd/encryption"
)

// encState is the host's encryption state: which VNIs are encrypted, which
// remote VTEPs share an encrypted network with a local endpoint, the key
// epochs (advertised cluster-wide by the control plane), and the programmer
// of the xfrm states/policies and nftables rules in the host namespace. It
// is guarded by Driver.encMu, which also serialises that kernel programming
// with the peer programming that needs it: a network holds its lock, then
// takes encMu (never the reverse).
type encState struct {
	prog *encryption.Programmer // nil until first needed
	keys encryption.NodeKeys    // what the control plane decided (SetKeys)
	// Keyed by the network value, not its id: a deleted network and a new
	// one of the same id may sync in either order.
	vnis    map[*network][]uint32            // encrypted networks present here → their VNIs
	remotes map[*network]map[netip.Addr]bool // encrypted networks with a sandbox → VTEPs of their active remote peers
	applied *encryption.Desired              // what the last successful Apply programmed
	lastErr error                            // the last Apply's error, for status
	// adopted are the remote VTEPs an earlier run programmed (from the
	// state file): kept until ReconcileAll, like adopted neighbours, so a
	// restart does not cut encrypted traffic before the control plane has
	// re-delivered the peers.
	adopted map[netip.Addr]bool
	saved   string // the persisted form of the last saved encryption record
}

// encRecord is what the state file keeps of the encryption state: key
// epochs and the remote VTEPs programmed (never key bytes).
type encRecord struct {
	Keys    encryption.NodeKeys `json:"keys"`
	Remotes []netip.Addr        `json:"remotes"`
}

const encMetaKey = "encryption"

// checkEncryption verifies that encrypted networks can work on this host.
func (d *Driver) checkEncryption() error {
	if len(d.cfg.Secret) == 0 {
		return errors.New("encrypted networks need the cluster key, which this driver was started without")
	}
	check := d.cfg.CheckEncryption
	if check == nil {
		check = encryption.CheckKernelSupport
		if d.host.IPv6 {
			check = encryption.CheckKernelSupportIPv6
		}
	}
	if err := check(); err != nil {
		return fmt.Errorf("this host cannot encrypt, so encrypted networks are refused (never sent in clear): %w", err)
	}
	return nil
}

// desiredEncLocked computes the kernel encryption state; expects encMu held.
func (d *Driver) desiredEncLocked() encryption.Desired {
	want := encryption.Desired{
		Local:  d.advertiseAddr(),
		Port:   d.cfg.VXLANPort,
		Accept: slices.Clone(d.enc.keys.Accept),
		Send:   d.enc.keys.Send,
		Secret: d.cfg.Secret,
	}
	vnis := map[uint32]bool{}
	for _, vs := range d.enc.vnis {
		for _, v := range vs {
			vnis[v] = true
		}
	}
	want.VNIs = slices.Sorted(maps.Keys(vnis))
	remotes := maps.Clone(d.enc.adopted)
	if remotes == nil {
		remotes = map[netip.Addr]bool{}
	}
	for _, rs := range d.enc.remotes {
		for r := range rs {
			remotes[r] = true
		}
	}
	// A remote record claiming our own VTEP (a misconfiguration, or our own
	// endpoint seen through another network) is no pair to encrypt.
	delete(remotes, want.Local)
	if want.Send == 0 {
		// Keys not decided yet: only the fail-closed rules (encrypted VNIs
		// are dropped both ways until there is a key to send with).
		remotes = nil
	}
	want.Remotes = slices.SortedFunc(maps.Keys(remotes), func(a, b netip.Addr) int { return a.Compare(b) })
	if len(want.VNIs) == 0 {
		return encryption.Desired{}
	}
	return want
}

// applyEncLocked programs the desired encryption state; expects encMu held.
func (d *Driver) applyEncLocked() error {
	want := d.desiredEncLocked()
	if d.enc.prog == nil {
		if want.Empty() {
			return nil // nothing of ours can be in the kernel yet
		}
		p, err := encryption.NewProgrammer(d.hostNS)
		if err != nil {
			return err
		}
		d.enc.prog = p
	}
	err := d.enc.prog.Apply(want)
	d.enc.lastErr = err
	if err == nil {
		d.enc.applied = &want
		d.saveEncLocked(want)
	}
	return err
}

// saveEncLocked persists the keys and programmed remotes when they changed;
// expects encMu held.
func (d *Driver) saveEncLocked(want encryption.Desired) {
	if d.cfg.Store == nil {
		return
	}
	raw, _ := json.Marshal(encRecord{Keys: d.enc.keys, Remotes: want.Remotes})
	if string(raw) == d.enc.saved {
		return
	}
	if err := d.cfg.Store.PutMeta(encMetaKey, raw); err != nil {
		d.log.Warn("failed to save the encryption state", "error", err)
		return
	}
	d.enc.saved = string(raw)
}

// restoreEnc loads the persisted keys and remotes; called from restore.
func (d *Driver) restoreEnc() error {
	raw, err := d.cfg.Store.GetMeta(encMetaKey)
	if err != nil || raw == nil {
		return err
	}
	var rec encRecord
	if err := json.Unmarshal(raw, &rec); err != nil {
		return fmt.Errorf("encryption record: %w", err)
	}
	d.encMu.Lock()
	defer d.encMu.Unlock()
	d.enc.keys = rec.Keys
	d.enc.adopted = map[netip.Addr]bool{}
	for _, r := range rec.Remotes {
		d.enc.adopted[r] = true
	}
	d.enc.saved = string(raw)
	return nil
}

// dropAdoptedEnc forgets the remotes adopted at start-up and programs the
// exact state; called by ReconcileAll.
func (d *Driver) dropAdoptedEnc() error {
	d.encMu.Lock()
	defer d.encMu.Unlock()
	if d.enc.adopted == nil {
		return nil
	}
	d.enc.adopted = nil
	return d.applyEncLocked()
}

// encRemotes returns the VTEPs of n's active remote peers; expects n.mu held.
func (n *network) encRemotes() map[netip.Addr]bool {
	out := map[netip.Addr]bool{}
	for _, vtep := range n.peers.Desired().FDB {
		out[vtep] = true
	}
	return out
}

// syncEnc updates n's share of the encryption state and programs it; expects
// n.mu held. With widen, VTEPs n no longer needs are kept for now: it is
// called before peers are programmed (SAs and policies must exist before
// traffic is sent to a new VTEP) and again, without widen, after (state for
// VTEPs that went away is removed once their neighbours are gone).
func (d *Driver) syncEnc(n *network, widen bool) error {
	if !n.encrypted {
		return nil
	}
	var remotes map[netip.Addr]bool
	if n.sb != nil && !n.deleted {
		remotes = n.encRemotes()
	}
	d.encMu.Lock()
	defer d.encMu.Unlock()
	if d.enc.vnis == nil {
		d.enc.vnis, d.enc.remotes = map[*network][]uint32{}, map[*network]map[netip.Addr]bool{}
	}
	old := d.enc.remotes[n]
	if widen {
		for r := range old {
			if remotes == nil {
				remotes = map[netip.Addr]bool{}
			}
			remotes[r] = true
		}
	}
	_, registered := d.enc.vnis[n]
	if registered != n.deleted && maps.Equal(old, remotes) && d.enc.lastErr == nil {
		// Nothing of n's share changed (the common peer event: a VTEP that
		// already has its SAs) and the last Apply succeeded: skip the
		// kernel dumps.
		return nil
	}
	if n.deleted {
		delete(d.enc.vnis, n)
	} else {
		d.enc.vnis[n] = n.vnis()
	}
	if len(remotes) == 0 {
		delete(d.enc.remotes, n)
	} else {
		d.enc.remotes[n] = remotes
	}
	if err := d.applyEncLocked(); err != nil {
		return fmt.Errorf("encryption for network %q: %w", n.id, err)
	}
	return nil
}

// SetKeys installs the key epochs the control plane decided (see
// encryption.Step). It returns nil only once the kernel holds them: the
// control plane must not advertise keys before that.
func (d *Driver) SetKeys(k encryption.NodeKeys) error {
	d.encMu.Lock()
	defer d.encMu.Unlock()
	prev := d.enc.keys
	d.enc.keys = k.Clone()
	if err := d.applyEncLocked(); err != nil {
		d.enc.keys = prev
		return err
	}
	return nil
}

// Keys returns the key epochs last installed with SetKeys.
func (d *Driver) Keys() encryption.NodeKeys {
	d.encMu.Lock()
	defer d.encMu.Unlock()
	return d.enc.keys.Clone()
}

// EncryptionStatus is the encryption part of the driver's status: per remote
// VTEP the key epochs and SA state (never key bytes).
type EncryptionStatus struct {
	Accept []uint32                `json:"accept"`
	Send   uint32                  `json:"send"`
	Target uint32                  `json:"target"`
	VNIs   []uint32                `json:"encrypted_vnis"`
	Pairs  []encryption.PairStatus `json:"pairs"`
	Error  string                  `json:"error,omitempty"`
}

func (d *Driver) encryptionStatus() *EncryptionStatus {
	d.encMu.Lock()
	defer d.encMu.Unlock()
	want := d.desiredEncLocked()
	if want.Empty() && d.enc.keys.Send == 0 && len(d.enc.keys.Accept) == 0 {
		return nil
	}
	st := &EncryptionStatus{Accept: d.enc.keys.Accept, Send: d.enc.keys.Send, Target: d.enc.keys.Target, VNIs: want.VNIs}
	if d.enc.lastErr != nil {
		st.Error = d.enc.lastErr.Error()
	}
	if d.enc.prog != nil && !want.Empty() {
		pairs, err := d.enc.prog.Status(want)
		if err != nil && st.Error == "" {
			st.Error = err.Error()
		}
		st.Pairs = pairs
	}
	return st
}

// auditEnc compares the kernel's encryption state with the desired one.
func (d *Driver) auditEnc() []string {
	d.encMu.Lock()
	defer d.encMu.Unlock()
	want := d.desiredEncLocked()
	if d.enc.prog == nil {
		if want.Empty() {
			return nil
		}
		return []string{"encryption: wanted but never programmed"}
	}
	return d.enc.prog.Audit(want)
}
