package netnsutil

import (
	"fmt"
	"net"
	"net/netip"
	"os"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// ListenPair opens a UDP socket and a listening TCP socket, both bound
// to ap, in ns (a server of both transports on one port, as DNS is),
// without switching the caller's thread.
func ListenPair(ns netns.NsHandle, ap netip.AddrPort) (net.PacketConn, net.Listener, error) {
	sa := &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	open := func(typ int) (*os.File, error) {
		fd, err := Socket(ns, unix.AF_INET, typ|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		if err != nil {
			return nil, err
		}
		unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
		if err := unix.Bind(fd, sa); err != nil {
			unix.Close(fd)
			return nil, fmt.Errorf("failed to bind %s: %w", ap, err)
		}
		if typ == unix.SOCK_STREAM {
			if err := unix.Listen(fd, 128); err != nil {
				unix.Close(fd)
				return nil, fmt.Errorf("failed to listen on tcp %s: %w", ap, err)
			}
		}
		return os.NewFile(uintptr(fd), ap.String()), nil
	}
	uf, err := open(unix.SOCK_DGRAM)
	if err != nil {
		return nil, nil, err
	}
	defer uf.Close()
	tf, err := open(unix.SOCK_STREAM)
	if err != nil {
		return nil, nil, err
	}
	defer tf.Close()
	pc, err := net.FilePacketConn(uf)
	if err != nil {
		return nil, nil, err
	}
	ln, err := net.FileListener(tf)
	if err != nil {
		pc.Close()
		return nil, nil, err
	}
	return pc, ln, nil
}
