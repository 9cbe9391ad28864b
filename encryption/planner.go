package encryption

import (
	"net/netip"
	"slices"
)

// The planner: the desired state as a pure function of the Owner's inputs
// — the shares (shareIndex), the keys, the generations and the VTEP
// (ledger), the port, the secret and whether the kernel can hold SAs. It
// reads the kernel for nothing; desired.go and nft.go turn a Desired into
// the SAs, policies and set elements it asks for. What depends on the
// kernel (an outbound SA kept for a remote no longer needed, one blocked
// because its reservation could not be written) is decided by
// applyLocked with the ledger.

// vnisLocked returns the encrypted VNIs and the clear VNIs (none of them
// encrypted), sorted: from the shares, and while adopting from what the
// previous run programmed. They are computed again only when a share's VNI
// came or went.
func (o *Owner) vnisLocked() (enc, clear []uint32) {
	if o.vnisStale {
		enc, clear := o.idx.encVNIs.Keys(), o.idx.clearVNIs.Keys()
		if o.led.adopting {
			enc = append(enc, o.led.adopted.enc...)
			clear = append(clear, o.led.adopted.clear...)
		}
		o.wantEnc = sortedVNIs(enc)
		o.wantClear = minus(sortedVNIs(clear), o.wantEnc)
		o.vnisStale = false
	}
	return o.wantEnc, o.wantClear
}

// basisLocked is the desired state without its remotes: what every
// remote's SAs and policy derive from, and the VNIs. Empty when no VNI is
// encrypted or the local VTEP is not known.
func (o *Owner) basisLocked() Desired {
	enc, clear := o.vnisLocked()
	if len(enc) == 0 || !o.led.local.IsValid() {
		return Desired{}
	}
	return Desired{
		Local: o.led.local, Port: o.cfg.Port,
		VNIs: enc, ClearVNIs: clear,
		Accept: slices.Clone(o.led.keys.Accept), Send: o.led.keys.Send, Gen: o.led.gen,
		Secret: o.cfg.Secret, NoSAs: o.noESP != nil,
	}
}

// pairLocked reports whether remote r can be a pair of this host: not our
// own VTEP (our own endpoint seen through another network) and of its
// family (one of the other family was refused by Update).
func (o *Owner) pairLocked(r netip.Addr) bool {
	return r != o.led.local && r.Is4() == o.led.local.Is4()
}

// neededLocked reports whether the desired state has remote r: a pair that
// a share needs, or that the previous run programmed while adopting.
func (o *Owner) neededLocked(r netip.Addr) bool {
	if !o.pairLocked(r) {
		return false
	}
	if o.idx.need.Get(r) > 0 {
		return true
	}
	if o.led.adopting {
		_, ok := slices.BinarySearchFunc(o.led.adopted.remotes, r, netip.Addr.Compare)
		return ok
	}
	return false
}

// desiredLocked is the kernel state the shares, keys and generations ask
// for, every remote, without KeepOutbound and Blocked (which depend on
// what the kernel and the store do).
func (o *Owner) desiredLocked() Desired {
	d := o.basisLocked()
	if d.Empty() {
		return d
	}
	remotes := o.idx.needSorted
	if o.led.adopting {
		remotes = sortedAddrs(slices.Concat(remotes, o.led.adopted.remotes))
	}
	d.Remotes = make([]netip.Addr, 0, len(remotes))
	d.RemoteGens = make(map[netip.Addr]uint64, len(remotes))
	// remotes is sorted, and so d.Remotes.
	for _, r := range remotes {
		if o.pairLocked(r) {
			o.addRemoteLocked(&d, r)
		}
	}
	return d
}

// partialLocked is desiredLocked for the remotes in scope alone (sorted):
// basis, with those of them that are needed in Remotes.
func (o *Owner) partialLocked(basis *Desired, scope []netip.Addr) Desired {
	d := *basis
	d.RemoteGens = make(map[netip.Addr]uint64, len(scope))
	for _, r := range scope {
		if o.neededLocked(r) {
			o.addRemoteLocked(&d, r)
		}
	}
	return d
}

// addRemoteLocked appends remote r to d's remotes, with the generation it
// advertised if any.
func (o *Owner) addRemoteLocked(d *Desired, r netip.Addr) {
	d.Remotes = append(d.Remotes, r)
	if g, ok := o.led.remoteGens[r]; ok {
		d.RemoteGens[r] = g
	}
}

// outboundOK reports whether the kernel (as ax has it) holds, intact, the
// outbound SA to r for (d.Send, d.Gen).
func (o *Owner) outboundOK(d *Desired, ax *actualXfrm, r netip.Addr) bool {
	var cache *deriveCache
	if o.prog != nil {
		cache = o.prog.derived
	}
	w, err := outboundWantCached(d, r, cache)
	if err != nil {
		return false
	}
	got, ok := ax.states[w.key]
	return ok && stateDiff(&got, w, d.Port) == ""
}

func outboundWant(d *Desired, r netip.Addr) (*wantState, error) { return outboundWantCached(d, r, nil) }

// outboundWantCached is outboundWant with the SPI and key from cache (nil:
// derived).
func outboundWantCached(d *Desired, r netip.Addr, cache *deriveCache) (*wantState, error) {
	spi, k, err := cache.derive(d.Secret, d.Local, r, d.Send, d.Gen)
	if err != nil {
		return nil, err
	}
	return &wantState{key: stateKey{r, spi}, src: d.Local, epoch: d.Send, gen: d.Gen, remote: r, outbound: true, aeadKey: k}, nil
}

// keepsLocked reports whether the outbound SA to r, a remote d does not
// have, is kept: this Owner installed it for (Send, gen) and the kernel
// still holds it. It is kept (never re-created) until the epoch or
// generation changes.
func (o *Owner) keepsLocked(d *Desired, ax *actualXfrm, r netip.Addr) bool {
	return o.pairLocked(r) && o.led.installedFor(d.Send, r) && o.outboundOK(d, ax, r)
}

// keptLocked returns the remotes no longer needed whose outbound SA is kept
// (keepsLocked), for d, the whole desired state.
func (o *Owner) keptLocked(d *Desired, ax *actualXfrm) []netip.Addr {
	if d.Empty() || d.Send == 0 || d.NoSAs {
		return nil
	}
	var keep []netip.Addr
	for r := range o.led.installed[d.Send] {
		// d.Remotes is sorted (desiredLocked): no quadratic scan with
		// thousands of remotes.
		if _, needed := slices.BinarySearchFunc(d.Remotes, r, netip.Addr.Compare); !needed && o.keepsLocked(d, ax, r) {
			keep = append(keep, r)
		}
	}
	slices.SortFunc(keep, netip.Addr.Compare)
	return keep
}
