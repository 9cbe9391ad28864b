package config

import (
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"

	"github.com/overlayd/overlayd/internal/nlwrap"
)

// CheckHost checks the settings that must fit this host, in the network
// namespace of the calling thread (the daemon's host namespace), before
// anything is created:
//
//   - an explicitly given secret file exists: only the default
//     <state-dir>/cluster.key is generated, because a typo in an explicit
//     path would otherwise silently make a separate cluster;
//   - the advertise and gossip addresses are assigned to an interface here:
//     the VXLAN devices take the advertise address as their source and
//     memberlist binds the gossip address, so an address of another host
//     can never work (retrying a bind forever hides the typo).
//
// Every problem is reported in one *Invalid, one line.
func (s *Settings) CheckHost() error {
	var errs []error
	if s.SecretFile != "" {
		if err := checkSecretFile(s.SecretFile); err != nil {
			errs = append(errs, fmt.Errorf("%s %q: %v", s.Source("secret-file"), s.SecretFile, err))
		}
	}
	check := []struct {
		name string
		addr netip.Addr
	}{{"advertise-addr", s.AdvertiseAddr}, {"gossip-addr", s.GossipAddr}}
	var have []netip.Addr
	var listErr error
	listed := false
	for _, c := range check {
		if !c.addr.IsValid() || c.addr.IsUnspecified() { // unspecified gossip: bind every address
			continue
		}
		if !listed {
			have, listErr = hostAddrs()
			listed = true
		}
		if listErr != nil {
			errs = append(errs, fmt.Errorf("%s %s: cannot list this host's addresses to check it: %v", s.Source(c.name), c.addr, listErr))
			continue
		}
		if !slices.Contains(have, c.addr) {
			errs = append(errs, fmt.Errorf("%s %s: not an address of this host (assigned here: %s); give one of those, or leave it unset to %s",
				s.Source(c.name), c.addr, formatAddrs(have), unsetMeans(c.name)))
		}
	}
	if len(errs) > 0 {
		return &Invalid{oneLine(errs)}
	}
	return nil
}

func unsetMeans(name string) string {
	if name == "gossip-addr" {
		return "bind the advertise address"
	}
	return "learn it (swarm's DiscoverNew, else the default route's device)"
}

func checkSecretFile(path string) error {
	fi, err := os.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return errors.New("no such file: an explicitly given key file must exist (only the default <state-dir>/cluster.key is generated); copy the cluster key from a host of the cluster, or leave the setting unset on the first host to generate one")
	case err != nil:
		return err
	case !fi.Mode().IsRegular():
		return fmt.Errorf("not a regular file (%s)", fi.Mode().Type())
	}
	return nil
}

// hostAddrs lists the addresses assigned to the interfaces of the current
// network namespace.
func hostAddrs() ([]netip.Addr, error) {
	list, err := nlwrap.Retry(func() ([]netlink.Addr, error) { return netlink.AddrList(nil, netlink.FAMILY_ALL) })
	if err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, a := range list {
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			out = append(out, ip.Unmap())
		}
	}
	return out, nil
}

// formatAddrs lists addresses for an error, at most 8, leaving out
// loopback and link-local ones (they are never what was meant).
func formatAddrs(addrs []netip.Addr) string {
	var useful []string
	for _, a := range addrs {
		if !a.IsLoopback() && !a.IsLinkLocalUnicast() {
			useful = append(useful, a.String())
		}
	}
	if len(useful) == 0 {
		return "none but loopback and link-local"
	}
	if len(useful) > 8 {
		useful = append(useful[:8], fmt.Sprintf("and %d more", len(useful)-8))
	}
	return strings.Join(useful, ", ")
}
