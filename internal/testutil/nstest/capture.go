package nstest

import (
	"encoding/binary"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
)

// Capture counts, on one link of a namespace (both directions, AF_PACKET),
// the IPv4 packets that matter to encrypted overlays: ESP packets, and
// clear-text VXLAN packets to one UDP port, per VNI, and among those the
// flooded ones (to a multicast or broadcast inner MAC).
type Capture struct {
	esp, clear, flood atomic.Int64
	mu                sync.Mutex
	byVNI             map[uint32]int
}

// ESP returns the number of ESP packets seen.
func (c *Capture) ESP() int64 { return c.esp.Load() }

// Clear returns the number of clear-text VXLAN packets seen, all VNIs.
func (c *Capture) Clear() int64 { return c.clear.Load() }

// Flooded returns the number of clear-text VXLAN packets seen whose inner
// frame goes to a group address (multicast or broadcast MAC): what a
// VXLAN link sends only when it floods.
func (c *Capture) Flooded() int64 { return c.flood.Load() }

// ClearOf returns the number of clear-text VXLAN packets of vni seen.
func (c *Capture) ClearOf(vni uint32) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.byVNI[vni]
}

// StartCapture captures on link in ns until the test ends.
func StartCapture(t testing.TB, ns *NS, link string, vxlanPort uint16) *Capture {
	t.Helper()
	l, err := ns.NL.LinkByName(link)
	if err != nil {
		t.Fatalf("capture on %s: %v", link, err)
	}
	all := htons(unix.ETH_P_ALL)
	var fd int
	err = netnsutil.DoIn(ns.Handle, func() error {
		var err error
		if fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(all)); err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: all, Ifindex: l.Attrs().Index})
	})
	if err != nil {
		t.Fatalf("capture socket on %s: %v", link, err)
	}
	tv := unix.NsecToTimeval((20 * time.Millisecond).Nanoseconds())
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	c := &Capture{byVNI: map[uint32]int{}}
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 65536)
		for {
			select {
			case <-stop:
				return
			default:
			}
			n, _, err := unix.Recvfrom(fd, buf, 0)
			if err != nil {
				if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
					continue
				}
				return
			}
			c.classify(buf[:n], vxlanPort)
		}
	}()
	t.Cleanup(func() { close(stop); <-done; unix.Close(fd) })
	return c
}

func (c *Capture) classify(p []byte, port uint16) {
	if len(p) < 14+20 || binary.BigEndian.Uint16(p[12:]) != unix.ETH_P_IP {
		return
	}
	ip := p[14:]
	ihl := int(ip[0]&0x0f) * 4
	switch ip[9] {
	case unix.IPPROTO_ESP:
		c.esp.Add(1)
	case unix.IPPROTO_UDP:
		if len(ip) < ihl+16 || binary.BigEndian.Uint16(ip[ihl+2:]) != port {
			return
		}
		c.clear.Add(1)
		vx := ip[ihl+8:]
		if len(vx) >= 8+6 && vx[8]&1 != 0 {
			c.flood.Add(1)
		}
		c.mu.Lock()
		c.byVNI[uint32(vx[4])<<16|uint32(vx[5])<<8|uint32(vx[6])]++
		c.mu.Unlock()
	}
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }
