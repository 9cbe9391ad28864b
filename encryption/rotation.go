package encryption

import (
	"fmt"
	"math"
	"slices"
	"strings"
)

// NodeKeys is what one host advertises about its keys (never key bytes):
// the epochs it accepts inbound, the epoch it sends with, and the newest
// epoch anyone asked for. Epoch 0 means "none"; epochs start at 1.
//
// A host advertises a NodeKeys only once its kernel holds it: Accept only
// after the inbound SAs of those epochs are installed, Send only after its
// outbound policies point at that epoch (Programmer.Apply returned nil).
type NodeKeys struct {
	Accept []uint32 // sorted, without duplicates or 0
	Send   uint32   // 0 before the host has chosen one
	Target uint32   // 0 before anything was asked for
}

// String renders k as "accept=[1 2] send=1 target=2".
func (k NodeKeys) String() string {
	var b strings.Builder
	b.WriteString("accept=[")
	for i, e := range k.Accept {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprint(&b, e)
	}
	fmt.Fprintf(&b, "] send=%d target=%d", k.Send, k.Target)
	return b.String()
}

// Accepts reports whether k accepts epoch e inbound.
func (k NodeKeys) Accepts(e uint32) bool {
	_, ok := slices.BinarySearch(k.Accept, e)
	return ok && e != 0
}

// Equal reports whether a and b advertise the same state.
func (a NodeKeys) Equal(b NodeKeys) bool {
	return a.Send == b.Send && a.Target == b.Target && slices.Equal(normAccept(a.Accept), normAccept(b.Accept))
}

// Clone returns a copy of k that shares no memory with it.
func (k NodeKeys) Clone() NodeKeys {
	k.Accept = slices.Clone(k.Accept)
	return k
}

func normAccept(a []uint32) []uint32 {
	out := make([]uint32, 0, len(a))
	for _, e := range a {
		if e != 0 {
			out = append(out, e)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// StartRotation asks for a new epoch: it returns self with Target set past
// every epoch self knows of. Step then carries the rotation through the
// cluster. Two hosts starting a rotation at once ask for the same epoch and
// the rotations merge. At the last epoch (2^32-1) it returns self unchanged.
func StartRotation(self NodeKeys) NodeKeys {
	next := self.Clone()
	newest := max(self.Target, self.Send)
	for _, e := range self.Accept {
		newest = max(newest, e)
	}
	if newest == math.MaxUint32 {
		return next
	}
	next.Target = newest + 1
	return next
}

// Step computes the next state of one host from its own state and what the
// other alive members advertise (dead members must not be passed: only
// alive members count). It is a pure, level-triggered function: applying it
// repeatedly converges, and a host that missed steps, restarted with an old
// state or joined mid-rotation catches up from what it sees.
//
// Rules, in order:
//
//  0. Target becomes the newest epoch anyone asked for or sends with (at
//     least 1: a lone first host bootstraps epoch 1).
//  1. Accept everything an alive member sends with (a host that joins or
//     restarts must be able to decrypt what is being sent now), and our own
//     Send; when Target is newer than every accepted epoch, accept Target.
//  2. Switch Send to the newest epoch E > Send that every alive member
//     (self included) advertises in Accept. Send never goes backwards.
//  3. Drop X from Accept only when X is not our Send and every alive member
//     (self included) sends with an epoch newer than X. Because Send never
//     goes backwards, nobody sends X again: the old key is retired only
//     after all send with a newer one.
//
// Safety (hitless): a host sends with E only after seeing E in every alive
// host's Accept, and a host drops X only after seeing every Send newer than
// X, so with monotone Sends no host ever sends with an epoch some alive host
// does not accept — even when views are stale, as long as each host
// advertises only what its kernel holds.
func Step(self NodeKeys, others []NodeKeys) NodeKeys {
	next := NodeKeys{Accept: normAccept(self.Accept), Send: self.Send, Target: self.Target}

	// Rule 0.
	next.Target = max(next.Target, next.Send)
	for _, o := range others {
		next.Target = max(next.Target, o.Target, o.Send)
	}
	if next.Target == 0 {
		next.Target = 1
	}

	// Rule 1.
	add := func(e uint32) {
		if e == 0 {
			return
		}
		if i, ok := slices.BinarySearch(next.Accept, e); !ok {
			next.Accept = slices.Insert(next.Accept, i, e)
		}
	}
	add(next.Send)
	for _, o := range others {
		add(o.Send)
	}
	if len(next.Accept) == 0 || next.Target > next.Accept[len(next.Accept)-1] {
		add(next.Target)
	}

	// Rule 2.
	for i := len(next.Accept) - 1; i >= 0; i-- {
		e := next.Accept[i]
		if e <= next.Send {
			break
		}
		all := true
		for _, o := range others {
			if !o.Accepts(e) {
				all = false
				break
			}
		}
		if all {
			next.Send = e
			break
		}
	}

	// Rule 3.
	kept := next.Accept[:0]
	for _, x := range next.Accept {
		retire := x != next.Send && next.Send > x
		for _, o := range others {
			if retire && o.Send <= x {
				retire = false
			}
		}
		if !retire {
			kept = append(kept, x)
		}
	}
	next.Accept = kept
	return next
}
