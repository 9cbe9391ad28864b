package daemon

import (
	"errors"
	"net/netip"

	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/internal/cluster"
)

// keyGossip carries the encryption owner's adverts in the cluster's
// application state (opaque to the cluster): it implements
// encryption.KeyGossip.
type keyGossip struct{ c *cluster.Cluster }

// Adverts returns what every other alive member advertises, by VTEP.
// Members with no (or an unreadable) advert are left out: they accept and
// send nothing yet, or run a version that speaks another format.
func (g keyGossip) Adverts() map[netip.Addr]encryption.Advert {
	out := map[netip.Addr]encryption.Advert{}
	for _, m := range g.c.MemberApps() {
		if a, err := encryption.DecodeAdvert(m.App); err == nil {
			out[m.VTEP] = a
		}
	}
	return out
}

// Advertise gossips this host's advert (blocks up to the cluster's TCP
// timeout; the owner calls it without its lock).
func (g keyGossip) Advertise(a encryption.Advert) error { return g.c.SetAppState(a.Encode()) }

// memberKeys returns the key epochs every alive member (this one included)
// advertises, by name, for status; "none" for a member without an advert.
func memberKeys(c *cluster.Cluster) map[string]string {
	out := map[string]string{}
	for name, raw := range c.AppStates() {
		if a, err := encryption.DecodeAdvert(raw); err == nil {
			out[name] = a.Keys.String()
		} else {
			out[name] = "none"
		}
	}
	return out
}

// canRotate says why a key rotation cannot run now (nil: it can): it is
// carried by the cluster's gossip, which must be running (the encryption
// owner keeps its gossip after `overlayd leave`, so it cannot tell).
// `overlayd keys rotate` exits non-zero with this reason instead of
// reporting a rotation started that nothing would carry.
func (cp *controlPlane) canRotate() error {
	l := cp.link
	l.mu.Lock()
	left, closed := l.left, l.closed
	l.mu.Unlock()
	switch {
	case left:
		return errors.New("key rotation cannot run: this host left the cluster (overlayd leave); restart overlayd to rejoin")
	case closed:
		return errShuttingDown
	case l.c.Load() == nil:
		return errors.New("key rotation cannot run: the control plane has not started (this host's address is not known yet; see the log)")
	}
	// A host that cannot encrypt itself may still start one: the epochs
	// are cluster-wide, and the hosts that encrypt carry it.
	return nil
}
