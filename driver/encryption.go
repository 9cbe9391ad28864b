package driver

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/peerdb"
)

// EncryptionOwner is the host's one owner of encryption state
// (encryption.Owner): keys, each network's share, SAs, policies and the
// nftables table, reconciled by its own loop. Every network registers its
// share (encrypted or not: the clear VNIs are let through in clear by
// name, everything else to a host sharing an encrypted network is
// encrypted or dropped).
//
// Thread safety: Update and Remove are called with the network's lock held
// (lockorder.LevelNetwork above the owner's LevelEncryption); they program
// the kernel before returning and must not call into the Driver.
type EncryptionOwner interface {
	Update(id encryption.ShareID, s encryption.Share, widen bool) error
	// AddRemotes adds VTEPs to a registered encrypted share: its cost is
	// the change's, whatever the number of remotes.
	AddRemotes(id encryption.ShareID, remotes ...netip.Addr) error
	Remove(id encryption.ShareID) error
	// CheckSupport reports whether encrypted networks can work here.
	CheckSupport() error
	// Restored ends the adoption of an earlier run's state (Settle).
	Restored() error
	Audit() []string
	Status() encryption.Status
}

var errNoEncryption = errors.New("this host has no encryption owner (overlayd was started without its cluster key), so encrypted networks are refused")

// checkEncryption verifies that encrypted networks can work on this host.
func (d *Driver) checkEncryption() error {
	if d.cfg.Encryption == nil {
		return errNoEncryption
	}
	return d.cfg.Encryption.CheckSupport()
}

// encShareLocked returns n's share of the encryption state.
// Only an encrypted network with a sandbox needs remotes: the VTEPs of its
// active remote peers.
func (n *network) encShareLocked() encryption.Share {
	s := encryption.Share{VNIs: n.vnis(), Encrypted: n.encrypted}
	if n.encrypted && n.sb != nil && !n.deleted {
		s.Remotes = n.peers.VTEPs(nil) // distinct and sorted
	}
	return s
}

// syncEncLocked gives the encryption owner n's current share and programs
// it. With widen, VTEPs n no longer needs are kept for now:
// it is called before peers are programmed (SAs and policies must exist
// before traffic is sent to a new VTEP) and again, without widen, after
// (state for VTEPs that went away is removed once their neighbours are
// gone). The owner keeps trying what fails; the error is also in its
// status.
func (d *Driver) syncEncLocked(n *network, widen bool) error {
	if d.cfg.Encryption == nil {
		return nil
	}
	if err := d.cfg.Encryption.Update(n.share, n.encShareLocked(), widen); err != nil {
		return fmt.Errorf("encryption for network %q: %w", n.id, err)
	}
	return nil
}

// widenEncLocked gives the encryption owner the VTEPs of the FDB entries delta
// sets, before the peers are programmed (SAs and policies must exist
// before traffic is sent to a new VTEP), as a delta: the owner's cost is
// that of the VTEPs new to the host, not of all it has. VTEPs the share
// has already cost nothing. Without a sandbox (no remotes) it is
// syncEncLocked.
func (d *Driver) widenEncLocked(n *network, delta peerdb.Delta) error {
	if d.cfg.Encryption == nil {
		return nil
	}
	if n.sb == nil || n.deleted {
		return d.syncEncLocked(n, true)
	}
	if len(delta.FDBSet) == 0 {
		return nil
	}
	vteps := make([]netip.Addr, 0, len(delta.FDBSet))
	for _, f := range delta.FDBSet {
		vteps = append(vteps, f.VTEP)
	}
	if err := d.cfg.Encryption.AddRemotes(n.share, vteps...); err != nil {
		return fmt.Errorf("encryption for network %q: %w", n.id, err)
	}
	return nil
}

// dropEncLocked removes n's share of the encryption state; n is deleted.
func (d *Driver) dropEncLocked(n *network) error {
	if d.cfg.Encryption == nil {
		return nil
	}
	if err := d.cfg.Encryption.Remove(n.share); err != nil {
		return fmt.Errorf("encryption for deleted network %q: %w", n.id, err)
	}
	return nil
}

func (d *Driver) encryptionStatus() *encryption.Status {
	if d.cfg.Encryption == nil {
		return nil
	}
	st := d.cfg.Encryption.Status()
	return &st
}

func (d *Driver) auditEnc() []string {
	if d.cfg.Encryption == nil {
		return nil
	}
	return d.cfg.Encryption.Audit()
}
