// Package encryption is the kernel-facing half of overlayd's encrypted
// networks (`-o encrypted`): keys and SPIs derived from the cluster secret,
// the rotation state machine, and the xfrm (IPsec ESP) and nftables state
// of the host namespace, programmed level-triggered and failing closed.
//
// # What is encrypted
//
// The VXLAN traffic of encrypted VNIs between each pair of hosts, as ESP in
// transport mode (IP protocol 50) between the VTEP addresses, with AEAD
// rfc4106(gcm(aes)): a 128-bit AES key, a 4-byte salt and a 128-bit ICV
// (see ICVBits for why 128). Unencrypted VNIs share the VXLAN port and stay
// in clear. Hosts must let IP protocol 50 through between each other.
// Encrypted links need a smaller MTU: InnerMTU (1416 on a 1500-byte IPv4
// underlay).
//
// # Keys are never sent
//
// Every host derives the key of the SA from src to dst in epoch E as
// HKDF-SHA256(secret = cluster secret (the memberlist gossip key),
// salt = "overlayd ipsec v1", info = "esp key" 0 E src dst 0), 20 bytes (key
// then salt), see SAKey. Each direction, pair and epoch has its own key, so
// no two SAs share a GCM key. The trust boundary is the cluster: whoever has
// the cluster secret can derive every key (as in swarm, where every node
// holds the keys). A key "tag" is the epoch number (uint32, from 1).
//
// # SPIs are derived, not signalled
//
// SPI(src, dst, E) is the first 4 bytes of HKDF with info "esp spi" over the
// same inputs (keyed by the secret, so not predictable from outside), never
// in 0..255 (re-derived with a counter when it is). The kernel identifies an
// SA by (dst, SPI, protocol), so SPIs only collide among the inbound SAs of
// one host or the epochs of one direction of one pair; a collision is
// detected before programming, the lower (source, epoch) wins, the other is
// reported by Apply and Audit, and that pair's traffic in that epoch is
// dropped (never in clear) until the next rotation re-derives every SPI.
//
// # Rotation (Step)
//
// Each host advertises NodeKeys{Accept, Send, Target} through the control
// plane's gossip (small integers, never key bytes). Step is a pure function
// of a host's state and what the alive others advertise: accept the newest
// target and whatever anyone sends with; switch Send to an epoch only when
// every alive host accepts it; retire an epoch only when every alive host
// sends with a newer one. Send never goes backwards. So no host sends with
// an epoch that some alive host does not accept, and the old key is retired
// only after all send with the new one; overlapping rotations, hosts that
// missed steps, restarted or joined mid-rotation all converge (see Step and
// the simulation in the tests). A host advertises a state only after Apply
// made its kernel hold it. StartRotation asks for a new epoch.
//
// # Kernel state (Desired, Programmer)
//
// In the host namespace (where the VXLAN UDP socket lives), for local VTEP
// L, VXLAN port P and each remote VTEP R sharing an encrypted network:
//
//   - inbound SAs R→L, one per accepted epoch, no mark;
//   - one outbound SA L→R for the Send epoch;
//   - one outbound policy: dir out, src L dst R, udp dport P, mark M
//     (DefaultMark), template ESP transport L→R reqid ReqID spi
//     SPI(L, R, Send). Switching Send is one XfrmPolicyUpdate of the
//     template SPI (atomic); the old SA is deleted afterwards.
//
// SAs carry a selector (src R dst L udp dport P) that the kernel checks on
// every decrypted packet, so an SA delivers nothing but that VXLAN. Every SA
// and policy template overlayd installs has reqid ReqID ("ovld"); that is
// how Programmer recognises its own and removes what is no longer desired.
//
// No inbound (dir in) policy is installed: the kernel checks inbound
// policies on UDP sockets, VXLAN's included, and a policy can only select
// on addresses and ports, so a policy requiring ESP from R to L:P would
// also drop the clear-text VXLAN of unencrypted VNIs between the same hosts
// (TestFailClosedDatapath demonstrates it). Only nftables can look at the
// VNI; it does, with the secpath rule below.
//
// nftables, table inet "overlayd" (only while some VNI is encrypted), with
// a set of encrypted VNIs and three chains:
//
//	table inet overlayd {
//		set encrypted_vnis { type integer (3 bytes, the VXLAN VNI) }
//		chain encrypt_mark {
//			type route hook output priority mangle; policy accept;
//			udp dport P @th,96,24 @encrypted_vnis meta mark set M counter
//		}
//		chain encrypt_out {
//			type filter hook postrouting priority filter; policy accept;
//			udp dport P @th,96,24 @encrypted_vnis rt ipsec missing counter drop
//		}
//		chain encrypt_in {
//			type filter hook input priority filter; policy accept;
//			udp dport P @th,96,24 @encrypted_vnis meta ipsec missing counter drop
//		}
//	}
//
// @th,96,24 is the VNI: bytes 4..6 of the VXLAN header, which follows the
// 8-byte UDP header. The mark is set in a route chain because the kernel
// re-routes a packet whose mark a route chain changed, and that lookup is
// where the mark-selected policy applies. The outbound drop matches on the
// VNI, not on the mark: an encrypted VNI's packet whose route carries no
// xfrm transform is dropped whatever happened to its mark (no policy, no SA,
// a mark rewritten by another program). The inbound drop removes encrypted
// VNIs' VXLAN that was not decrypted by xfrm, before the VXLAN socket sees
// it. Rules carry a comment ("overlayd v1 <role> port=… mark=…") by which
// Audit recognises them.
//
// # Apply order (fail closed, hitless)
//
// Apply dumps our SAs, policies and table, diffs against the Desired and
// changes only the difference, in this order: (1) nftables widened first
// (rules, new VNIs), in one atomic transaction, so from then on nothing of
// an encrypted VNI crosses in clear whatever xfrm holds; (2) inbound SAs;
// (3) per remote the outbound SA, then the policy pointing at it; (4)
// policies no longer desired; (5) SAs no longer desired; (6) nftables
// narrowed last (VNIs no longer encrypted, or the table when none is).
// Policies exist before SAs disappear and SAs before policies point at them;
// removing any xfrm object only ever drops packets. On a kernel that cannot
// install ESP states, Apply returns an error wrapping ErrKernelUnsupported
// and leaves rules and policies in place: encrypted VNIs are dropped both
// ways, which is the only safe state. CheckKernelSupport tests all of it in
// a throwaway namespace.
//
// # Cost of a rotation
//
// Per remote: accepting an epoch is one SA add, switching Send is an SA
// add, a policy update and an SA delete, retiring is one SA delete (so 10
// and 30 and 10 operations for 10 remotes, 100, 300, 100 for 100), plus two
// xfrm dumps and a few nftables list requests per Apply (TestRotationOps;
// measured on a real kernel by test/vm).
//
// # Integration
//
// The driver keeps, under the encryption lock of DESIGN.md, the union of
// its encrypted networks' VNIs and remote VTEPs, this host's NodeKeys and
// the cluster secret, builds a Desired from them and calls Apply after any
// change (peer added or removed, network created or deleted, NodeKeys
// changed) and at start-up; Audit is for `overlayd status` and checks. The
// control plane gossips each host's NodeKeys, calls Step with the alive
// members' states whenever they change, and advertises the result only
// after Apply returned nil. A Programmer is not safe for concurrent use.
package encryption
