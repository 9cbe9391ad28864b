package encryption

import (
	"net/netip"
	"slices"
	"time"
)

// Audit compares the kernel with the desired state, one line per
// difference; empty means the kernel holds exactly what the shares, keys
// and generations ask for.
func (o *Owner) Audit() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.prog == nil {
		return []string{"encryption: Audit on a closed Owner"}
	}
	if !o.led.local.IsValid() {
		if o.idx.encVNIs.Len() > 0 {
			return []string{"encryption: encrypted VNIs but no local VTEP yet (SetLocal not called)"}
		}
		return nil
	}
	ax, err := o.prog.xfrmDump()
	if err != nil {
		return []string{err.Error()}
	}
	d := o.desiredLocked()
	d.KeepOutbound = o.keptLocked(&d, ax)
	return o.prog.Audit(d)
}

// Status is the Owner's state for `overlayd status` (JSON-able, never key
// bytes).
type Status struct {
	Local         netip.Addr   `json:"local"`
	Port          int          `json:"port"`
	Accept        []uint32     `json:"accept"`
	Send          uint32       `json:"send"`
	Target        uint32       `json:"target"`
	Gen           uint64       `json:"gen,string"`
	GenChanges    int          `json:"gen_changes"`          // new generations chosen by this process
	GenReason     string       `json:"gen_reason,omitempty"` // why the last one was chosen
	EncryptedVNIs []uint32     `json:"encrypted_vnis"`
	ClearVNIs     []uint32     `json:"clear_vnis"`
	Shares        int          `json:"shares"`
	Pairs         []PairStatus `json:"pairs"`
	// ESPUnsupported: the kernel cannot install ESP states; encrypted VNIs
	// are dropped both ways.
	ESPUnsupported bool `json:"esp_unsupported,omitempty"`
	GossipAttached bool `json:"gossip_attached"`
	Advertised     bool `json:"advertised"` // the current keys and generation are gossiped
	Rotating       bool `json:"rotating"`   // a rotation was asked and is not installed yet
	// Error is the error of the last reconcile ("": the kernel holds the
	// desired state); LastError the last error of any kind and when.
	Error         string    `json:"error,omitempty"`
	LastError     string    `json:"last_error,omitempty"`
	LastErrorAt   time.Time `json:"last_error_at,omitzero"`
	Repairs       int       `json:"repairs"` // reconciles that found and fixed drift
	LastRepair    time.Time `json:"last_repair,omitzero"`
	LastRepairWas string    `json:"last_repair_was,omitempty"`
	Reconciles    int       `json:"reconciles"`
	LastReconcile time.Time `json:"last_reconcile,omitzero"`
	// DeltaFailures counts incremental changes (Update, Remove) the kernel
	// refused; each was followed at once by a full reconcile.
	DeltaFailures int `json:"delta_failures,omitempty"`
}

// Status returns the Owner's state, with SA counters read from the kernel.
func (o *Owner) Status() Status {
	o.mu.Lock()
	defer o.mu.Unlock()
	d := o.desiredLocked()
	st := Status{
		Local: o.led.local, Port: o.cfg.Port,
		Accept: slices.Clone(o.led.keys.Accept), Send: o.led.keys.Send, Target: o.led.keys.Target,
		Gen: o.led.gen, GenChanges: o.genChanges, GenReason: o.genReason,
		EncryptedVNIs: d.VNIs, ClearVNIs: d.ClearVNIs, Shares: len(o.idx.shares),
		ESPUnsupported: o.noESP != nil,
		GossipAttached: o.gossip != nil,
		Advertised:     o.published && o.advertised.Equal(Advert{Keys: o.led.keys, Gen: o.led.gen}),
		Rotating:       o.rotate,
		Repairs:        o.repairs, LastRepair: o.lastRepair, LastRepairWas: o.lastRepairWhat,
		Reconciles: o.reconciles, LastReconcile: o.lastReconcile,
		DeltaFailures: o.deltaFailures,
	}
	if st.EncryptedVNIs == nil {
		st.EncryptedVNIs = sortedVNIs(o.idx.encVNIs.Keys())
	}
	if st.ClearVNIs == nil {
		st.ClearVNIs = minus(sortedVNIs(o.idx.clearVNIs.Keys()), st.EncryptedVNIs)
	}
	if o.applyErr != nil {
		st.Error = o.applyErr.Error()
	} else if err := o.unsupportedFor(&d); err != nil {
		st.Error = err.Error()
	}
	if o.lastErr != nil {
		st.LastError, st.LastErrorAt = o.lastErr.Error(), o.lastErrAt
	}
	if st.Accept == nil {
		st.Accept = []uint32{}
	}
	if st.ClearVNIs == nil {
		st.ClearVNIs = []uint32{}
	}
	if st.EncryptedVNIs == nil {
		st.EncryptedVNIs = []uint32{}
	}
	st.Pairs = []PairStatus{}
	if o.prog != nil && o.led.local.IsValid() && !d.Empty() {
		if ax, err := o.prog.xfrmDump(); err == nil {
			d.KeepOutbound = o.keptLocked(&d, ax)
		}
		pairs, err := o.prog.Status(d)
		if err != nil && st.Error == "" {
			st.Error = err.Error()
		}
		for i := range pairs {
			pairs[i].Shares = o.idx.need.Get(pairs[i].Remote)
		}
		if pairs != nil {
			st.Pairs = pairs
		}
	}
	return st
}
