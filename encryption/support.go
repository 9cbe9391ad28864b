package encryption

import (
	"errors"
	"fmt"
	"net/netip"

	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/nlwrap"
)

// CheckKernelSupport reports whether this kernel can do what encrypted
// networks need, by doing it in a throwaway network namespace that is
// removed afterwards: install an ESP transport state with
// rfc4106(gcm(aes)) and a 128-bit ICV (IPv4), an outbound policy, and
// overlayd's nftables table with its rt-ipsec and secpath rules. It returns
// nil, or an error wrapping ErrKernelUnsupported that says what is missing.
// Never fall back to clear text when it fails.
func CheckKernelSupport() error {
	return checkKernelSupport(netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("192.0.2.2"))
}

// CheckKernelSupportIPv6 is CheckKernelSupport for an IPv6 underlay (it also
// needs esp6).
func CheckKernelSupportIPv6() error {
	return checkKernelSupport(netip.MustParseAddr("2001:db8::1"), netip.MustParseAddr("2001:db8::2"))
}

// ESPUnsupportedWarning is the message of the WARN line the Owner logs
// when it finds that this kernel cannot install ESP states (once, and again
// after each retry a minute later).
const ESPUnsupportedWarning = "this kernel cannot install ESP states: encrypted networks' traffic is dropped both ways"

const supportHint = " — encrypted networks need the esp4 (esp6 for an IPv6 underlay) and AEAD GCM modules " +
	"(xfrm_user, esp4, gcm, ghash, ctr, aes, seqiv) and a working kernel crypto RNG (drbg, jitterentropy_rng); " +
	"load them (modprobe) or use a kernel that has them"

func checkKernelSupport(local, remote netip.Addr) (err error) {
	ns, err := netnsutil.New()
	if err != nil {
		return fmt.Errorf("encryption support check: %w", err)
	}
	defer ns.Close()
	nl, err := nlwrap.NewHandleAt(ns, unix.NETLINK_XFRM)
	if err != nil {
		return fmt.Errorf("%w: no xfrm netlink (xfrm_user): %w%s", ErrKernelUnsupported, err, supportHint)
	}
	defer nl.Close()
	secret := []byte("overlayd kernel support check!!")
	const gen = 1
	w := &wantState{src: local, epoch: 1, gen: gen, remote: remote, outbound: true}
	if w.key.spi, err = SPI(secret, local, remote, 1, gen); err != nil {
		return err
	}
	w.key.dst = remote
	if w.aeadKey, err = SAKey(secret, local, remote, 1, gen); err != nil {
		return err
	}
	if err := nl.XfrmStateAdd(w.netlink(4799)); err != nil {
		return fmt.Errorf("%w: %w%s", ErrKernelUnsupported, err, supportHint)
	}
	for _, pk := range []polKey{remoteKey(local, remote, 4799), clearKey(local, 4799)} {
		wp := &wantPolicy{remote: remote, spi: w.key.spi, epoch: 1, clear: pk.mark == ClearMark}
		if err := nl.XfrmPolicyAdd(pk.netlink(wp, local)); err != nil {
			return fmt.Errorf("kernel cannot install xfrm policies (%v): %w", pk, err)
		}
	}
	p, err := NewProgrammer(ns)
	if err != nil {
		return fmt.Errorf("encryption support check: %w", err)
	}
	defer p.Close()
	n := &nftDesired{port: 4799, vnis: []uint32{1}, clear: []uint32{2}}
	if err := p.nftBuild(n, false, n.vnis, n.clear); err != nil {
		return err
	}
	if err := p.nftFlush("install test rules"); err != nil {
		return fmt.Errorf("kernel cannot install overlayd's nftables rules (nf_tables with inet family, rt and meta secpath, route chains): %w", err)
	}
	if a, err := p.nftDump(n); err != nil || !a.ok {
		if err == nil {
			err = errors.New(fmt.Sprint(a.problems))
		}
		return fmt.Errorf("kernel does not hold overlayd's nftables rules as installed: %w", err)
	}
	return nil
}
