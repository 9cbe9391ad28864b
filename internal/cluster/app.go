package cluster

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/hashicorp/memberlist"
)

// Application messages: the cluster carries opaque messages between
// members for another part of overlayd (the cluster address management,
// internal/ipam, which cannot be imported here: the daemon adapts). An
// application message (type 7, protocol version 3) is sent reliably, over
// a memberlist TCP stream encrypted and authenticated with the cluster key,
// straight from its origin to one member; nothing relays it. It carries
// the origin's name and incarnation like every message and is accepted
// only from an alive member's current incarnation that advertises
// protocol 3, with a payload of 1..MaxAppPayload bytes; anything else is
// dropped and counted (Status().Dropped) before the application sees it.
//
// Delivery is at most once: a stream that fails, a member that has not
// learnt the sender's current incarnation yet (it drops the message as
// incarnation_mismatch) or one that dies loses the message, and SendApp
// may return nil all the same (the message was written to the stream).
// The application repeats what needs an answer (its requests have
// deadlines).

// ProtocolApp is the first protocol version that carries application
// messages; members of versions 1 and 2 are never sent one.
const ProtocolApp byte = 3

// MaxAppPayload is the largest application payload (1 MiB).
const MaxAppPayload = 1 << 20

// ErrNotReachable is wrapped by SendApp's errors when the destination is
// not an alive member that can take application messages (nothing was
// sent).
var ErrNotReachable = errors.New("not an alive member that takes application messages")

// AppMember is a member as the application sees it: never this node, never
// a member that left.
type AppMember struct {
	Name string
	// State is StateAlive, StateSuspect (alive, but this node's last
	// probe of it failed; see MemberState) or StateDead.
	State MemberState
	// App: it advertises ProtocolApp or later with usable metadata, so
	// SendApp can reach it while it is alive. A member without (an
	// overlayd from before application messages) takes no part.
	App bool
}

// SendApp sends payload (1..MaxAppPayload bytes) to the member named node,
// reliably (a memberlist TCP stream). It fails, wrapping ErrNotReachable
// and sending nothing, if node is not an alive member speaking
// ProtocolApp, and fails if the stream cannot be written. It blocks up to
// the cluster's TCPTimeout: never call it holding a lock, nor from
// Config.OnAppMessage or OnMembersChange.
func (c *Cluster) SendApp(node string, payload []byte) error {
	if len(payload) == 0 || len(payload) > MaxAppPayload {
		return fmt.Errorf("cluster: application message of %d bytes to %s: must be 1..%d bytes", len(payload), node, MaxAppPayload)
	}
	if c.closed.Load() {
		return fmt.Errorf("cluster: node %s cannot send to %s: shut down", c.cfg.NodeName, node)
	}
	if node == c.cfg.NodeName {
		return fmt.Errorf("cluster: application message to %s: %w (it is this node)", node, ErrNotReachable)
	}
	target, err := c.appTarget(node)
	if err != nil {
		return err
	}
	b, err := encodeMessage(&message{Type: msgApp, Origin: c.cfg.NodeName, Incarnation: c.inc, Payload: payload})
	if err != nil {
		return fmt.Errorf("cluster: application message to %s: %w", node, err)
	}
	if err := c.ml.SendReliable(&target, b); err != nil {
		c.sendErrors.Add(1)
		c.appSendErrors.Add(1)
		return fmt.Errorf("cluster: sending an application message to %s: %w", node, err)
	}
	c.msgsSent.Add(1)
	c.bytesSent.Add(uint64(len(b)))
	c.appSent.Add(1)
	return nil
}

// appTarget returns the memberlist node to send an application message to.
func (c *Cluster) appTarget(node string) (memberlist.Node, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := c.replica.members[node]
	switch {
	case m == nil:
		return memberlist.Node{}, fmt.Errorf("cluster: application message to %s: %w (no such member)", node, ErrNotReachable)
	case m.state != StateAlive:
		return memberlist.Node{}, fmt.Errorf("cluster: application message to %s: %w (it is %s)", node, ErrNotReachable, m.state)
	case m.metaErr != nil:
		return memberlist.Node{}, fmt.Errorf("cluster: application message to %s: %w (its metadata is unusable: %v)", node, ErrNotReachable, m.metaErr)
	case m.meta.ProtoMax < ProtocolApp:
		return memberlist.Node{}, fmt.Errorf("cluster: application message to %s: %w (it speaks protocol %d, application messages need %d: upgrade it)",
			node, ErrNotReachable, m.meta.ProtoMax, ProtocolApp)
	}
	n := m.node
	n.Meta = nil
	return n, nil
}

// AppMembers lists every member this node knows other than itself that
// has not left, with its state, sorted by name. Members gone for longer
// than ReconnectTimeout are forgotten and not listed.
func (c *Cluster) AppMembers() []AppMember {
	now := c.now()
	c.mu.Lock()
	defer c.mu.Unlock()
	smax := c.suspicionMaxLocked()
	var out []AppMember
	for name, m := range c.replica.members {
		if name == c.cfg.NodeName || m.state == StateLeft {
			continue
		}
		am := AppMember{Name: name, State: m.state, App: m.metaErr == nil && m.meta.ProtoMax >= ProtocolApp}
		if m.suspected(now, smax) {
			am.State = StateSuspect
		}
		out = append(out, am)
	}
	slices.SortFunc(out, func(a, b AppMember) int { return cmp.Compare(a.Name, b.Name) })
	return out
}

// Joined reports whether this node may act on its view of the membership:
// true once another member has been alive here in this process, or while
// it was given no seed at all (the first host of a cluster, or a single
// one). A node with seeds that has not reached any of them yet is not
// joined: it may be the far side of a partition at start, or its seeds may
// be down, and what it does not know of the cluster it must not decide
// alone.
func (c *Cluster) Joined() bool {
	if c.joinedOnce.Load() {
		return true
	}
	c.joiner.mu.Lock()
	defer c.joiner.mu.Unlock()
	return len(c.joiner.seed) == 0
}

// suspicionMaxLocked is the longest a suspicion lasts: memberlist declares
// a suspect dead or hears it refute within it, so an older failed probe
// means nothing.
func (c *Cluster) suspicionMaxLocked() time.Duration {
	alive := 0
	for _, m := range c.replica.members {
		if m.state == StateAlive {
			alive++
		}
	}
	return time.Duration(float64(c.cfg.SuspicionMaxTimeoutMult*c.cfg.SuspicionMult) *
		max(1, math.Log10(float64(alive))) * float64(c.cfg.ProbeInterval))
}

// suspected reports whether m is alive but suspected by this node (its
// last probe here failed within the longest suspicion, smax).
func (m *member) suspected(now time.Time, smax time.Duration) bool {
	return m.state == StateAlive && !m.suspectSince.IsZero() && now.Sub(m.suspectSince) < smax
}

// deliverApp hands an accepted application message to OnAppMessage (no
// lock held). The payload is copied: memberlist reuses its buffers.
func (c *Cluster) deliverApp(m *message) {
	c.appReceived.Add(1)
	if f := c.cfg.OnAppMessage; f != nil {
		f(m.Origin, append([]byte(nil), m.Payload...))
	}
}
