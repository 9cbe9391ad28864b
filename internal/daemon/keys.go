package daemon

import (
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
