package sandbox

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"time"

	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/peerdb"
)

// goneMemory is how long a deleted neighbour's MAC is remembered: longer
// than a container keeps an unconfirmed neighbour entry in use
// (base_reachable_time 30 s, then probes), so that a move is announced
// while a stale MAC can still be cached.
const goneMemory = 60 * time.Second

type goneNeigh struct {
	mac peerdb.MAC
	at  time.Duration // since Sandbox.born
}

// goneKey is the key of a neighbour in Sandbox.gone: for IPv4 its subnet
// and address in one word (a bulk delete records every neighbour it
// removes), for IPv6 a hash of them. Two neighbours with one key cost at
// most an announcement too many, never a wrong one: an announcement says
// where an address is now. ok is false for what is neither.
func goneKey(n *peerdb.Neigh) (uint64, bool) {
	if !n.IP.IsValid() || n.Subnet < 0 || n.Subnet > math.MaxUint32 {
		return 0, false
	}
	if n.IP.Is4() {
		b := n.IP.As4()
		return uint64(n.Subnet)<<32 | uint64(binary.BigEndian.Uint32(b[:])), true
	}
	b := n.IP.As16()
	h := fnv.New64a()
	h.Write(binary.BigEndian.AppendUint32(b[:], uint32(n.Subnet)))
	return h.Sum64(), true
}

// movedNeighs returns the neighbours of d set to a MAC other than the one
// their address had just before: those peerdb reports as moved in place
// (d.NeighMoved) and those deleted by an earlier change within goneMemory
// with another MAC. It records d's deletions for later changes. Called
// with the network's lock held, as every Sandbox method.
func (sb *Sandbox) movedNeighs(d peerdb.Delta, clock func() time.Time) []peerdb.Neigh {
	if sb.fresh {
		return nil // no container has anything cached
	}
	if len(sb.gone) == 0 && len(d.NeighDel) == 0 {
		// Nothing remembered to compare with, nothing to remember: the
		// clock is not read (this runs once per peer notification).
		return d.NeighMoved
	}
	now := clock().Sub(sb.born)
	moved := d.NeighMoved
	if len(sb.gone) > 0 {
		for i := range d.NeighSet {
			n := &d.NeighSet[i]
			k, ok := goneKey(n)
			if !ok {
				continue
			}
			if g, ok := sb.gone[k]; ok {
				delete(sb.gone, k)
				if g.mac != n.MAC && now-g.at < goneMemory {
					moved = append(moved[:len(moved):len(moved)], *n)
				}
			}
		}
		if now >= sb.pruneAt {
			for k, g := range sb.gone {
				if now-g.at >= goneMemory {
					delete(sb.gone, k)
				}
			}
			sb.pruneAt = now + goneMemory/2
		}
		if len(sb.gone) == 0 {
			sb.gone = nil // a map keeps the room of its largest size
		}
	}
	if len(d.NeighDel) > 0 && sb.gone == nil {
		sb.gone = make(map[uint64]goneNeigh, len(d.NeighDel))
		sb.pruneAt = now + goneMemory
	}
	for i := range d.NeighDel {
		if k, ok := goneKey(&d.NeighDel[i]); ok {
			sb.gone[k] = goneNeigh{mac: d.NeighDel[i].MAC, at: now}
		}
	}
	return moved
}

// announce tells the local endpoints of each neighbour's new MAC with a
// gratuitous ARP reply (IPv4), or an unsolicited Neighbour Advertisement
// with the override flag to all nodes (IPv6), on its subnet's bridge as if
// from the remote endpoint. Endpoint MACs are unique (not derived from the IP), so
// when an address moves to another endpoint (another host, or the winner of
// a conflict changes) its MAC changes, and a container that still has the
// old one cached would send into the void until its neighbour entry expires
// (tens of seconds). Linux updates an existing entry from such a reply or
// advertisement (and never creates one from it), so the announcement only
// corrects what is cached. The VXLAN link does not forward it: broadcasts
// and multicasts have no FDB entry.
func (sb *Sandbox) announce(neighs []peerdb.Neigh) error {
	if len(neighs) == 0 || sb.fresh {
		return nil
	}
	if sb.arp < 0 {
		// Protocol 0: the socket only sends, it never queues what it sees.
		fd, err := netnsutil.Socket(sb.ns, unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("failed to open a packet socket in sandbox %s to announce moved addresses: %w", sb.path, err)
		}
		sb.arp = fd
	}
	var frame [42]byte
	var frame6 [naFrameLen]byte
	bcast := [6]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
	var failed int
	var first error
	for _, n := range neighs {
		if n.Subnet < 0 || n.Subnet >= len(sb.subnets) || !n.IP.IsValid() {
			continue
		}
		sa := &unix.SockaddrLinklayer{Ifindex: sb.subnets[n.Subnet].bridge, Halen: 6}
		f := frame[:]
		if n.IP.Is4() {
			garp(&frame, bcast, n)
			sa.Protocol = htons(unix.ETH_P_ARP)
			copy(sa.Addr[:], bcast[:])
		} else {
			unsolicitedNA(&frame6, n)
			sa.Protocol = htons(unix.ETH_P_IPV6)
			copy(sa.Addr[:], frame6[:6])
			f = frame6[:]
		}
		if err := unix.Sendto(sb.arp, f, 0, sa); err != nil {
			if failed++; first == nil {
				first = fmt.Errorf("%s is at %s: %w", n.IP, n.MAC, err)
			}
		}
	}
	if failed > 0 {
		return fmt.Errorf("failed to announce %d of %d moved addresses in sandbox %s (containers relearn them when their neighbour entries expire): %w",
			failed, len(neighs), sb.path, first)
	}
	return nil
}

// garp writes into f the Ethernet frame of a gratuitous ARP reply: n.IP is
// at n.MAC, sender and target alike (which Linux takes as gratuitous).
func garp(f *[42]byte, bcast [6]byte, n peerdb.Neigh) {
	copy(f[0:6], bcast[:])
	copy(f[6:12], n.MAC[:])
	binary.BigEndian.PutUint16(f[12:], unix.ETH_P_ARP)
	binary.BigEndian.PutUint16(f[14:], 1)             // hardware: Ethernet
	binary.BigEndian.PutUint16(f[16:], unix.ETH_P_IP) // protocol: IPv4
	f[18], f[19] = 6, 4                               // address lengths
	binary.BigEndian.PutUint16(f[20:], 2)             // reply
	ip := n.IP.As4()
	copy(f[22:28], n.MAC[:]) // sender
	copy(f[28:32], ip[:])
	copy(f[32:38], n.MAC[:]) // target: the same, as a gratuitous reply wants
	copy(f[38:42], ip[:])
}

// naFrameLen is the length of an unsolicited Neighbour Advertisement frame:
// Ethernet, IPv6 header, NA with one target link-layer address option.
const naFrameLen = 14 + 40 + 24 + 8

// unsolicitedNA writes into f the Ethernet frame of an unsolicited
// Neighbour Advertisement (RFC 4861 7.2.6) from n.IP at n.MAC to all nodes
// (ff02::1), with the override flag, so that a cached entry takes the new
// MAC. Hop limit 255: receivers drop NDP that crossed a router.
func unsolicitedNA(f *[naFrameLen]byte, n peerdb.Neigh) {
	*f = [naFrameLen]byte{}
	allNodes := [16]byte{0: 0xff, 1: 0x02, 15: 1}
	copy(f[0:6], []byte{0x33, 0x33, 0, 0, 0, 1}) // all-nodes multicast MAC
	copy(f[6:12], n.MAC[:])
	binary.BigEndian.PutUint16(f[12:], unix.ETH_P_IPV6)
	ip := f[14:54]
	ip[0] = 6 << 4
	binary.BigEndian.PutUint16(ip[4:], 32) // payload: NA and its option
	ip[6], ip[7] = unix.IPPROTO_ICMPV6, 255
	src := n.IP.As16()
	copy(ip[8:24], src[:])
	copy(ip[24:40], allNodes[:])
	na := f[54:]
	na[0] = 136  // Neighbour Advertisement
	na[4] = 0x20 // override; not solicited, not a router
	copy(na[8:24], src[:])
	na[24], na[25] = 2, 1 // target link-layer address, 8 bytes
	copy(na[26:32], n.MAC[:])
	binary.BigEndian.PutUint16(na[2:], icmp6Checksum(src, allNodes, na))
}

// icmp6Checksum is the ICMPv6 checksum of msg from src to dst (RFC 4443
// 2.3: over the IPv6 pseudo-header and the message).
func icmp6Checksum(src, dst [16]byte, msg []byte) uint16 {
	var sum uint32
	add := func(b []byte) {
		for i := 0; i+1 < len(b); i += 2 {
			sum += uint32(binary.BigEndian.Uint16(b[i:]))
		}
		if len(b)%2 == 1 {
			sum += uint32(b[len(b)-1]) << 8
		}
	}
	add(src[:])
	add(dst[:])
	sum += uint32(len(msg)) + unix.IPPROTO_ICMPV6
	add(msg)
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}

// htons converts to network byte order, as sockaddr_ll wants its protocol.
func htons(v uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], v)
	return binary.NativeEndian.Uint16(b[:])
}

// closeARP closes the announcement socket, if open.
func (sb *Sandbox) closeARP() error {
	if sb.arp < 0 {
		return nil
	}
	err := unix.Close(sb.arp)
	sb.arp = -1
	if err != nil && !errors.Is(err, unix.EBADF) {
		return fmt.Errorf("failed to close the packet socket of sandbox %s: %w", sb.path, err)
	}
	return nil
}
