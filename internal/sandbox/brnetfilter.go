package sandbox

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/overlayd/overlayd/internal/netnsutil"
)

// Bridged traffic and the sandbox's netfilter hooks.
//
// Once br_netfilter is in the kernel (dockerd loads it; some kernels build
// it in), every namespace that holds a bridge gets its hooks, and a new
// namespace starts with net.bridge.bridge-nf-call-iptables,
// -ip6tables and -arptables at 1: every frame the sandbox's bridge forwards
// between a container's veth and the VXLAN link is then passed through the
// namespace's IPv4, IPv6 or ARP hooks as if it were routed (an skb
// extension allocated, the IP header checked, each netfilter hook point run
// and the frame handed back to the bridge). The sandbox has no netfilter
// rules of its own (encryption's nftables table is in the host namespace,
// on the outer packets), so all of that is pure cost: measured with make
// bench-dataplane, 1–3% of the throughput per CPU-second of overlayd's
// path and 5–6% (about 1 µs) of its request/response latency
// (docs/performance.md). A per-bridge nf_call_iptables does not help: the
// kernel runs the hooks when either the bridge's option or the namespace's
// sysctl is on.
//
// These sysctls exist only in /proc/sys (no netlink attribute); the file
// is opened on a thread in the sandbox's namespace, where /proc/sys/net is
// the namespace's. A managed plugin's /proc/sys is read-only: there the
// hooks stay and bridgeNetfilterOff returns why.

// bridgeNetfilterSysctls are the switches of br_netfilter in
// /proc/sys/net/bridge, one per family of hooks.
var bridgeNetfilterSysctls = []string{"bridge-nf-call-iptables", "bridge-nf-call-ip6tables", "bridge-nf-call-arptables"}

// bridgeNetfilterOff sets every br_netfilter switch of the sandbox's
// namespace to 0. Without br_netfilter in the kernel there is nothing to
// do (and nothing to pay).
func (sb *Sandbox) bridgeNetfilterOff() error {
	return netnsutil.DoIn(sb.ns, func() error {
		var errs []error
		for _, name := range bridgeNetfilterSysctls {
			path := filepath.Join("/proc/sys/net/bridge", name)
			b, err := os.ReadFile(path)
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("failed to read %s in sandbox %s: %w", path, sb.path, err))
				continue
			}
			if strings.TrimSpace(string(b)) == "0" {
				continue
			}
			if err := os.WriteFile(path, []byte("0"), 0); err != nil {
				errs = append(errs, fmt.Errorf("failed to set %s to 0 in sandbox %s: %w", path, sb.path, err))
			}
		}
		return errors.Join(errs...)
	})
}

// BridgeNetfilter reports why the sandbox's bridged traffic still passes
// through its netfilter hooks (nil when it does not; see
// bridgeNetfilterOff). Not an error of the sandbox: it works either way,
// only slower.
func (sb *Sandbox) BridgeNetfilter() error { return sb.brnf }
