// Package keyhub is an in-memory stand-in for the control plane's key
// gossip between the encryption owners of test hosts: adverts travel
// encoded, as the cluster's application state carries them, and every
// Advertise pokes the other owners, as the daemon's member-change callback
// does. The cluster's own tests cover the gossip itself; with keyhub, tests
// of the driver, the stress harness and the VM suite exercise the owners'
// protocol without a cluster. (The encryption package's own tests keep a
// copy: they cannot import a package that imports theirs.)
package keyhub

import (
	"net/netip"
	"sync"

	"github.com/overlayd/overlayd/encryption"
)

// Hub connects owners, one per VTEP. Safe for concurrent use; its lock is
// never held while calling an owner.
type Hub struct {
	mu      sync.Mutex
	adverts map[netip.Addr][]byte // encoded
	owners  map[netip.Addr]*encryption.Owner
}

// New returns an empty hub.
func New() *Hub {
	return &Hub{adverts: map[netip.Addr][]byte{}, owners: map[netip.Addr]*encryption.Owner{}}
}

// Attach connects o, the owner of the host whose VTEP is self.
func (h *Hub) Attach(self netip.Addr, o *encryption.Owner) {
	h.mu.Lock()
	h.owners[self] = o
	h.mu.Unlock()
	o.AttachGossip(member{h: h, self: self})
}

// member is one owner's view of the hub (encryption.KeyGossip).
type member struct {
	h    *Hub
	self netip.Addr
}

func (m member) Adverts() map[netip.Addr]encryption.Advert {
	m.h.mu.Lock()
	defer m.h.mu.Unlock()
	out := map[netip.Addr]encryption.Advert{}
	for v, b := range m.h.adverts {
		if v == m.self {
			continue
		}
		if a, err := encryption.DecodeAdvert(b); err == nil {
			out[v] = a
		}
	}
	return out
}

func (m member) Advertise(a encryption.Advert) error {
	m.h.mu.Lock()
	m.h.adverts[m.self] = a.Encode()
	var others []*encryption.Owner
	for v, o := range m.h.owners {
		if v != m.self {
			others = append(others, o)
		}
	}
	m.h.mu.Unlock()
	for _, o := range others {
		o.Poke()
	}
	return nil
}

// Advert returns what the host with VTEP v last advertised.
func (h *Hub) Advert(v netip.Addr) (encryption.Advert, error) {
	h.mu.Lock()
	b := h.adverts[v]
	h.mu.Unlock()
	return encryption.DecodeAdvert(b)
}
