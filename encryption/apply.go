package encryption

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/overlayd/overlayd/internal/logkeys"
)

var errNoLocal = errors.New("encryption: the local VTEP is not known yet (SetLocal not called); nothing programmed")

// applyLocked makes the kernel hold the desired state: the one path every
// change and every reconcile takes. Changes of the inputs only mark the
// tracker (dirty remotes, all of them, a resync); this asks it what may
// differ, plans the desired state of those remotes (the planner), settles
// their outbound SAs with the ledger and has the tracker apply the result:
// against its record of the kernel (no dump; the remotes marked only, when
// keys, generation and VTEP are the record's), or against dumps on a
// resync. Nothing marked and the kernel held the last apply: nothing to do.
//
// A change the kernel refused (the record was wrong, or a request failed)
// is followed at once by a resync, which decides again from the dumps what
// the attempt decided from the record (reservations, kept SAs, a vanished
// SA); a kernel found unable to install SAs is programmed without them at
// once.
func (o *Owner) applyLocked(why string) error {
	if o.prog == nil {
		return errors.New("encryption: the Owner is closed")
	}
	if !o.led.local.IsValid() {
		if o.idx.encVNIs.Len() == 0 {
			o.closedErr = nil
			return nil
		}
		o.applyErr, o.closedErr = errNoLocal, errNoLocal
		return errNoLocal
	}
	if o.noESP != nil && time.Since(o.noESPAt) > espRetry {
		o.noESP = nil // try again: a module may have been loaded
	}
	for attempt := 0; ; attempt++ {
		again, err := o.applyOnceLocked(why)
		if again == "" || attempt == 2 {
			return err
		}
		why += again
	}
}

// applyOnceLocked is one attempt of applyLocked; again is non-empty (what
// to add to why) when applyLocked must try again at once.
func (o *Owner) applyOnceLocked(why string) (again string, err error) {
	basis := o.basisLocked()
	clean := o.trk.clean(&basis)
	if clean && !o.trk.resync && o.trk.kernel != nil && o.applyErr == nil {
		// The desired state is the one the kernel was given last.
		o.closedErr = nil
		return "", o.unsupportedLocked()
	}
	// Compared whole (against the record when trusted) after an error, while
	// adopting, and until the first check of the kernel after loading.
	force := o.applyErr != nil || o.led.adopting || (!o.verified && o.led.keys.Send != 0 && o.noESP == nil)
	ax, an, dumped, err := o.trk.view(o.prog)
	if err != nil {
		o.applyErr, o.closedErr = err, err
		o.noteErrLocked(err)
		return "", err
	}
	var d Desired
	var dx *desiredXfrm
	var scope []netip.Addr
	whole, drift := false, false
	for {
		if scope, whole = o.trk.scope(&basis, force); whole {
			d = o.desiredLocked()
		} else {
			d = o.partialLocked(&basis, scope)
		}
		if whole && !o.verified && d.Send != 0 && !d.NoSAs && len(d.Remotes) > 0 {
			o.verified = true
			if !o.led.fresh && !o.anyOutboundLocked(ax) {
				o.newGenLocked("the kernel holds no outbound SA of this host (first start on this kernel, reboot, or a restored state file)")
				drift = true
				continue
			}
		}
		if !d.Empty() && d.Send != 0 && !d.NoSAs {
			// An outbound SA this Owner installed under (Send, gen) and that
			// is needed but gone (flushed, host rebooted) is never added
			// again: move to a new generation.
			if r, ok := o.vanishedLocked(&d, ax); ok {
				w, _ := outboundWant(&d, r)
				spi := uint32(0)
				if w != nil {
					spi = w.key.spi
				}
				o.newGenLocked(fmt.Sprintf("outbound SA to %v (epoch %d, spi 0x%08x) vanished from the kernel", r, d.Send, spi))
				drift = true
				continue
			}
			if whole {
				d.KeepOutbound = o.keptLocked(&d, ax)
			} else {
				for _, r := range scope {
					if _, needed := slices.BinarySearchFunc(d.Remotes, r, netip.Addr.Compare); !needed && o.keepsLocked(&d, ax, r) {
						d.KeepOutbound = append(d.KeepOutbound, r)
					}
				}
			}
		}
		if whole {
			break
		}
		// Remote by remote only when no SA of theirs collides with
		// another's: that needs the whole comparison, which decides it.
		var ok bool
		if dx, ok = o.trk.fits(&d, o.prog.derived, scope); ok {
			break
		}
		o.trk.markAll()
	}
	if !d.Empty() && d.Send != 0 && !d.NoSAs {
		// Reserve (and persist) before adding: an SA is added at most once
		// per (epoch, remote, gen). An SA the kernel holds intact under
		// (Send, gen) is ours even if the ledger missed it: remember it.
		var reserve, adopt []netip.Addr
		for _, r := range d.Remotes {
			switch installed, intact := o.led.installedFor(d.Send, r), o.outboundOK(&d, ax, r); {
			case !installed && intact:
				adopt = append(adopt, r)
			case !installed:
				reserve = append(reserve, r)
			}
		}
		if err := o.led.reserve(d.Send, reserve, !whole); err != nil {
			d.Blocked = reserve
			dx = nil // derived again: blocked remotes get no new SA
			o.noteErrLocked(fmt.Errorf("%w; outbound SAs to %v not installed (their traffic is dropped)", err, reserve))
		}
		o.led.mark(d.Send, adopt...)
	}
	before, statsBefore := o.prog.changed, o.prog.Stats()
	res, err := o.trk.apply(o.prog, &d, dx, scope, whole, ax, an, dumped)
	changes := o.prog.changed - before
	now := time.Now()
	o.reconciles++
	o.lastReconcile = now
	// The kernel never held them, so their keys were never used.
	o.led.release(d.Send, res.failedOut...)
	switch {
	case res.unsupported && o.noESP == nil:
		o.noESP, o.noESPAt = err, now
		// WARN, not ERROR: a property of the host, the same on every
		// reconcile, that overlayd cannot fix; the traffic fails closed
		// (dropped, never sent in clear), and the daemon said at start
		// that encrypted networks are unavailable here. The fail-closed
		// state without SAs is programmed at once.
		o.log.Warn(ESPUnsupportedWarning, logkeys.Event, logkeys.EncryptionUnsupported, logkeys.Error, err)
		return " (without SAs)", err
	case err != nil && !dumped && !res.unsupported:
		// The kernel refused part of the change (or the record was
		// wrong): resync at once, so the kernel is never left
		// half-programmed.
		o.deltaFailures++
		o.log.Info("an incremental encryption change failed; reconciling in full", "trigger", why, "error", err)
		return " (full reconcile after a failed change)", err
	}
	if err == nil && len(d.Blocked) > 0 {
		err = fmt.Errorf("encryption: outbound SAs to %v not installed: their reservation could not be persisted", d.Blocked)
	}
	if err == nil && len(res.collisions) == 0 && (clean || drift) && changes > 0 {
		// A repair: the kernel had to change although nothing we want
		// did (or only our generation, because the kernel lost an SA).
		kernel := o.prog.Stats().Sub(statsBefore)
		o.repairs++
		o.lastRepair = now
		o.lastRepairWhat = fmt.Sprintf("%s: %v", why, kernel)
		o.log.Info("repaired encryption state that changed behind overlayd's back", logkeys.Event, logkeys.ReconcileRepair,
			logkeys.Kind, logkeys.KindEncryption, logkeys.Trigger, why, logkeys.Count, changes, "kernel", kernel.String())
	}
	o.held = err == nil
	o.closedErr = errors.Join(res.failClosed...)
	if err == nil && len(res.collisions) > 0 {
		// A collision loses one pair's traffic in one epoch (dropped);
		// everything else is held, and keys may advance.
		err = errors.Join(res.collisions...)
	}
	if err != nil {
		if o.applyErr == nil || o.applyErr.Error() != err.Error() {
			o.log.Error("encryption state not fully programmed", "trigger", why, "error", err)
		}
		o.noteErrLocked(err)
	} else if o.applyErr != nil {
		o.log.Info("encryption state programmed again", "trigger", why)
	}
	o.applyErr = err
	if err != nil {
		// Reservations may have changed without being written: the next
		// write compares every remote's entry.
		o.led.persistAll = true
		return "", err
	}
	o.programmedLocked(&d, scope, whole)
	return "", o.unsupportedLocked()
}

// vanishedLocked returns a remote of d whose outbound SA under (Send, gen)
// was installed but the kernel (as ax has it) does not hold intact.
func (o *Owner) vanishedLocked(d *Desired, ax *actualXfrm) (netip.Addr, bool) {
	for _, r := range d.Remotes {
		if o.led.installedFor(d.Send, r) && !o.outboundOK(d, ax, r) {
			return r, true
		}
	}
	return netip.Addr{}, false
}

// programmedLocked records in the ledger what an apply of d programmed
// (the remotes in scope, or all of them when whole) and writes what
// changed: a change writes its own remotes' entries, not one per remote of
// the host.
func (o *Owner) programmedLocked(d *Desired, scope []netip.Addr, whole bool) {
	p := &o.led.programmed
	p.enc, p.clear = d.VNIs, d.ClearVNIs
	touched := scope
	if whole {
		p.remotes, touched = withRoom(d.Remotes), nil
	} else {
		for _, r := range scope {
			_, in := slices.BinarySearchFunc(d.Remotes, r, netip.Addr.Compare)
			p.remotes = setMember(p.remotes, r, in)
		}
	}
	if o.led.prune() {
		o.led.persistAll = true // every remote's entry may have lost an epoch
	}
	if err := o.led.persist(touched); err != nil {
		o.noteErrLocked(err)
	}
}

// unsupportedLocked returns the kernel's inability to encrypt when the
// desired state last applied needs it.
func (o *Owner) unsupportedLocked() error {
	if l := o.trk.last; o.noESP != nil && l != nil {
		return o.unsupportedFor(l)
	}
	return nil
}

// unsupportedFor returns the kernel's inability to encrypt when d needs it.
func (o *Owner) unsupportedFor(d *Desired) error {
	if o.noESP != nil && !d.Empty() && len(d.Remotes) > 0 {
		return o.noESP
	}
	return nil
}

// anyOutboundLocked reports whether the kernel holds any SA of ours from
// the local VTEP.
func (o *Owner) anyOutboundLocked(ax *actualXfrm) bool {
	for _, s := range ax.states {
		if addrOf(s.Src) == o.led.local {
			return true
		}
	}
	return false
}
