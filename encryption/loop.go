package encryption

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/overlayd/overlayd/internal/latency"
	"github.com/overlayd/overlayd/internal/logkeys"
)

// loop runs the reconcile and the key rotation.
func (o *Owner) loop() {
	defer o.done.Done()
	tick := time.NewTicker(o.cfg.Tick)
	defer tick.Stop()
	var rotate <-chan time.Time
	if o.cfg.RotateEvery > 0 {
		t := time.NewTicker(o.cfg.RotateEvery)
		defer t.Stop()
		rotate = t.C
	}
	var deb *time.Timer
	var debC <-chan time.Time
	defer func() {
		if deb != nil {
			deb.Stop()
		}
	}()
	o.cycle("start")
	for {
		select {
		case <-o.stop:
			return
		case <-tick.C:
			o.cycle("tick")
		case <-o.wake:
			o.cycle("poke")
		case <-o.kev:
			if debC == nil {
				deb = time.NewTimer(debounce)
				debC = deb.C
			}
		case <-debC:
			debC = nil
			o.cycle("kernel notification")
		case <-rotate:
			o.mu.Lock()
			if o.gossip != nil && o.led.keys.Send != 0 {
				o.rotate = true
				o.log.Info("periodic key rotation")
			}
			o.mu.Unlock()
			o.cycle("periodic rotation")
		}
	}
}

// cycle is one turn of the loop: read the adverts (without the lock), step
// the keys and reconcile the kernel (under the lock), then advertise what
// the kernel holds (without the lock).
func (o *Owner) cycle(why string) {
	o.mu.Lock()
	g := o.gossip
	o.mu.Unlock()
	var adverts map[netip.Addr]Advert
	if g != nil {
		adverts = g.Adverts()
	}
	o.mu.Lock()
	if o.prog == nil {
		o.mu.Unlock()
		return
	}
	// The loop's turn is a resync: what changed behind overlayd's back
	// is repaired here, level-triggered.
	o.trk.markResync()
	if g != nil {
		o.stepLocked(adverts, why)
	} else {
		o.applyLocked(why)
	}
	adv := Advert{Keys: o.led.keys.Clone(), Gen: o.led.gen}
	send := g != nil && o.advertStaleLocked()
	o.mu.Unlock()
	if !send {
		return
	}
	err := g.Advertise(adv)
	o.mu.Lock()
	defer o.mu.Unlock()
	if err != nil {
		o.noteErrLocked(fmt.Errorf("encryption: advertising %v: %w", adv, err))
		o.log.Warn("advertising the key state", "advert", adv.String(), "error", err)
		return
	}
	if !o.published || !o.advertised.Equal(adv) {
		o.log.Info("advertised key state", "accept", adv.Keys.Accept, "send", adv.Keys.Send, "target", adv.Keys.Target, "gen", fmt.Sprintf("%016x", adv.Gen))
	}
	o.advertised, o.published = adv, true
}

// stepLocked takes one step of the rotation state machine with what the
// others advertise and installs the result; when that fails, the kernel
// goes back to the previous keys.
func (o *Owner) stepLocked(adverts map[netip.Addr]Advert, why string) {
	var others []NodeKeys
	seen := map[netip.Addr]bool{}
	for vtep, a := range adverts {
		vtep = vtep.Unmap()
		if vtep == o.led.local || !vtep.IsValid() {
			continue
		}
		seen[vtep] = true
		others = append(others, a.Keys)
		if o.led.setRemoteGen(vtep, a.Gen) {
			o.markLocked(vtep)
		}
	}
	for r := range o.led.remoteGens {
		if !seen[r] && o.idx.need.Get(r) == 0 && !(o.led.adopting && slices.Contains(o.led.adopted.remotes, r)) {
			o.led.forgetRemoteGen(r)
			o.markLocked(r)
		}
	}
	prev := o.led.keys
	self := prev.Clone()
	rotating := o.rotate && self.Send != 0
	if rotating {
		self = StartRotation(self)
	}
	next := Step(self, others)
	o.led.keys = next
	err := o.applyLocked(why)
	if err != nil && !o.held && !next.Equal(prev) {
		// Try the part of the step that needs no new outbound SA: accept
		// (and retire) as Step says but keep sending with the previous
		// epoch — always safe, and it lets the others go on (a switch
		// fails, e.g., when the record of a new SA cannot be persisted).
		if next.Send != prev.Send && prev.Send != 0 {
			part := next.Clone()
			part.Send = prev.Send
			if !part.Accepts(prev.Send) {
				part.Accept = normAccept(append(part.Accept, prev.Send))
			}
			o.led.keys = part
			if perr := o.applyLocked(why + " (keeping the send epoch)"); perr == nil || o.held {
				err = fmt.Errorf("encryption: cannot switch to send epoch %d, still sending with %d (%v): %w", next.Send, prev.Send, part, err)
				o.applyErr = err
				o.noteErrLocked(err)
				o.logStep(prev, part)
				return
			}
		}
		o.led.keys = prev
		rerr := o.applyLocked("restore previous keys")
		err = fmt.Errorf("encryption: installing key epochs %v failed, kept %v: %w", next, prev, err)
		if rerr != nil {
			err = fmt.Errorf("%w; restoring them: %w", err, rerr)
		}
		o.applyErr = err
		o.noteErrLocked(err)
		return
	}
	if rotating && next.Target > prev.Target {
		o.rotate = false
	}
	o.timeRotationLocked(prev, next)
	o.logStep(prev, next)
}

// logStep logs the change of this host's key epochs from prev to next, if
// any, as one rotation step naming what changed (see logkeys).
func (o *Owner) logStep(prev, next NodeKeys) {
	if prev.Equal(next) {
		return
	}
	o.log.Info("key epochs", logkeys.Event, logkeys.RotationStep, logkeys.Step, rotationStep(prev, next),
		"accept", next.Accept, "send", next.Send, "target", next.Target)
}

// rotationStep names what changed from prev to next: "target" (a newer
// epoch was asked for), "accept" (an epoch is accepted that was not),
// "send", "retire" (an epoch is no longer accepted), joined by "+".
func rotationStep(prev, next NodeKeys) string {
	var steps []string
	if next.Target != prev.Target {
		steps = append(steps, logkeys.StepTarget)
	}
	if slices.ContainsFunc(next.Accept, func(e uint32) bool { return !prev.Accepts(e) }) {
		steps = append(steps, logkeys.StepAccept)
	}
	if next.Send != prev.Send {
		steps = append(steps, logkeys.StepSend)
	}
	if slices.ContainsFunc(prev.Accept, func(e uint32) bool { return !next.Accepts(e) }) {
		steps = append(steps, logkeys.StepRetire)
	}
	return strings.Join(steps, "+")
}

// timeRotationLocked follows a rotation's steps: it starts when the target
// rises above an established one (here or on another host) and is over
// when this host accepts and sends only the target epoch.
func (o *Owner) timeRotationLocked(prev, next NodeKeys) {
	if o.rotStart.IsZero() && prev.Target != 0 && next.Target > prev.Target {
		o.rotStart = time.Now()
	}
	if !o.rotStart.IsZero() && next.Send == next.Target && len(next.Accept) == 1 && next.Accept[0] == next.Target {
		o.rotations.Observe(time.Since(o.rotStart))
		o.rotStart = time.Time{}
	}
}

// RotationDurations returns how long the completed key rotations took;
// its count is the number of rotations. It takes no lock.
func (o *Owner) RotationDurations() latency.Snapshot { return o.rotations.Snapshot() }
