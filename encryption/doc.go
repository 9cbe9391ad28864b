// Package encryption is everything overlayd's encrypted networks
// (`-o encrypted`) need on a host: keys and SPIs derived from the cluster
// secret, the rotation state machine, and the xfrm (IPsec ESP) and nftables
// state of the host namespace, held level-triggered and failing closed by
// one owner, Owner.
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
// # One owner
//
// Owner is the only holder of this host's encryption state: the key epochs
// (NodeKeys) and the send generation, every network's Share (by ShareID,
// chosen by the driver), the Programmer, the rotation state machine and
// their persistence, all under one lock at lockorder.LevelEncryption. A
// network contributes its share with Update (under its own lock, which is
// above the Owner's) and withdraws it with Remove; the Owner counts
// (countmap) how many shares need each remote VTEP and have each VNI, so
// the desired state is a pure function of the shares, keys and
// generations. The driver, the daemon and the control plane ask the Owner;
// none of them keeps a copy.
//
// The Owner reconciles the kernel unconditionally every Tick (500 ms) and at
// once on kernel notifications: a NETLINK_XFRM socket in the namespace
// subscribed to XFRMNLGRP_SA and XFRMNLGRP_POLICY, and google/nftables'
// Monitor. A notification starts a reconcile after 20 ms (debounce), so a
// burst costs one. Our own changes are echoed back too; the reconcile they
// cause finds nothing to do, changes nothing and is echoed no further, so
// nothing loops. "Nothing changed on our side" is never a reason to skip:
// a flushed table, a deleted policy or SA is back within a reconcile
// (measured on a real kernel: 4–20 ms after the notification, one Tick
// without notifications; under the VM's software emulation 60–340 ms, and
// 0.2–0.65 s until both hosts hold a new generation's SAs). A
// reconcile that changes the kernel although the desired state did not
// change is a repair; Status counts them and says what the last one did.
//
// # Keys are never sent
//
// Every host derives the key of the SA from src to dst in epoch E created
// under src's send generation G as HKDF-SHA256(secret = cluster secret (the
// memberlist gossip key), salt = "overlayd ipsec v2", info = "esp key" 0 E
// src dst G 0), 20 bytes (key then salt), see SAKey; the SPI is the first 4
// bytes of the same HKDF with info "esp spi" (see SPI: never in 0..255,
// collisions detected and reported, the pair's traffic dropped, never
// clear). The trust boundary is the cluster: whoever has the cluster secret
// can derive every key (as in swarm, where every node holds the keys). A
// key "tag" is the epoch number (uint32, from 1).
//
// # Send generations: no (key, IV) pair is ever used twice
//
// rfc4106 ESP uses the seqiv IV generator: the IV of a packet is derived
// from its sequence number, and an SA's sequence numbers start at 1 when
// the SA is created. Re-creating an SA with the same key would therefore
// reuse (key, IV) pairs — fatal for GCM — and its restarted sequence
// numbers would be dropped as replays by the peer's inbound SA until they
// pass where the old SA stopped (32 s measured; hours on a busy link after
// a reboot). So a key is only ever used by one SA instance:
//
//   - Each host has a send generation G: a random 64-bit number, part of the
//     derivation of every outbound key and SPI, advertised in its Advert and
//     persisted. Inbound SAs from remote R use R's advertised generation.
//   - An outbound SA is installed at most once per (epoch, remote, G): the
//     Owner records the remote under (epoch, G) and persists the record
//     BEFORE adding the SA. An add the kernel refused never used its key and
//     may be retried.
//   - The outbound SA of a remote no longer needed is kept (no policy, no
//     inbound SAs) until the epoch or G changes, so a remote that comes back
//     reuses the live SA: nothing is re-created.
//   - When the Owner finds an outbound SA it recorded missing from the
//     kernel (flush, reboot, anything), it picks a new random G, re-creates
//     every outbound SA under it (new keys, new SPIs, policies updated
//     atomically to them) and advertises G. A fresh state (nothing
//     persisted), a new local VTEP, and a kernel holding no outbound SA of
//     this host at the first reconcile after start (reboot, or a state file
//     restored from a backup) all start a new G too.
//
// A re-created SA is therefore a new SA at the peer as well: its SPI is new,
// so the peer installs a new inbound SA for it (when it sees the new G),
// whose replay window starts empty: the first packet is accepted at once,
// with no integrity failure and no replay drop. Until the peer has seen the
// advert, packets under the new G find no SA there and are dropped (never
// clear); with the control plane's gossip that is well under a second. Two
// hosts picking the same G is a 2^-64 event, and even then their keys
// differ (src and dst are in the derivation). An inbound SA that vanished
// is simply re-added: receiving never encrypts, and the sender's SA (and
// its sequence numbers) goes on; its replay window restarts, so packets of
// that SA captured earlier could be replayed once until the next real packet
// moves the window past them.
//
// # Rotation (Step)
//
// Each host advertises Advert{NodeKeys{Accept, Send, Target}, Gen} through
// the control plane's gossip (small integers, never key bytes; Encode, at
// most 277 bytes). Step is a pure function of a host's state and what the
// alive others advertise: accept the newest target and whatever anyone
// sends with; switch Send to an epoch only when every alive host accepts
// it; retire an epoch only when every alive host sends with a newer one.
// Send never goes backwards. So no host sends with an epoch that some alive
// host does not accept, and the old key is retired only after all send with
// the new one; overlapping rotations, hosts that missed steps, restarted or
// joined mid-rotation all converge (see Step and the simulation in the
// tests). The Owner runs it once AttachGossip is called: it reads the
// adverts (without its lock), computes the next state and installs it
// (under its lock), then advertises what the kernel holds (without its
// lock). A failed install puts the kernel back on the previous keys — the
// SAs those need are still there, because SAs no longer desired are only
// deleted after everything else applied — and the error is returned and
// shown in Status. StartRotation (Owner.Rotate) asks for a new epoch.
//
// # Kernel state (Desired, Programmer)
//
// In the host namespace (where the VXLAN UDP socket lives), for local VTEP
// L, VXLAN port P and each remote VTEP R sharing an encrypted network:
//
//   - inbound SAs R→L, one per accepted epoch, under R's generation;
//   - one outbound SA L→R for the Send epoch under L's generation;
//   - one outbound policy: dir out, src any (0.0.0.0/0 or ::/0), dst R,
//     udp dport P, NO mark, priority 1000, template ESP transport L→R reqid
//     ReqID spi SPI(L, R, Send, G). Switching Send or G is one
//     XfrmPolicyUpdate of the template SPI (atomic); the old SA is deleted
//     afterwards. Before keys exist the template points at SPI 0xff, which
//     no SA has: the policy drops.
//
// and one clear policy: dir out, src any, dst any, udp dport P, mark
// ClearMark/0xffffffff, action allow, no template, priority 900 (lower wins).
//
// So by default every VXLAN packet to a remote that shares an encrypted
// network takes that remote's policy and is encrypted, or dropped when its
// SA is missing. The only way out in clear is the clear policy, which
// selects packets nftables marked ClearMark, and nftables marks only VXLAN
// packets whose VNI is in the set clear_vnis (the host's unencrypted VNIs,
// from the shares). Whatever removes the table, the rule or a set element
// (nft flush ruleset, a firewall reload) makes traffic encrypted or
// dropped, never clear; clear VNIs between two hosts that share an encrypted
// network are then encrypted too, and still arrive. A VNI the shares do not
// know is treated the same way (encrypted or dropped).
//
// SAs carry a selector (src, dst, udp dport P) that the kernel checks, so an
// inbound SA delivers nothing but that VXLAN and an outbound SA carries
// nothing but L's. Every SA and policy template overlayd installs has reqid
// ReqID ("ovld"); with the clear policy's mark that is how Programmer
// recognises its own and removes what is no longer desired.
//
// No inbound (dir in) policy is installed: the kernel checks inbound
// policies on UDP sockets, VXLAN's included, and a policy can only select
// on addresses, ports and marks, so a policy requiring ESP from R to L:P
// would also drop the clear-text VXLAN of unencrypted VNIs between the same
// hosts (TestFailClosedDatapath demonstrates it). Only nftables can look at
// the VNI; it does, with the secpath rule below. While the table is missing
// (until the next reconcile), injected clear text of an encrypted VNI is not
// dropped on the way in; nothing is ever sent in clear.
//
// nftables, table inet "overlayd" (only while some VNI is encrypted):
//
//	table inet overlayd {
//		set encrypted_vnis { type integer (3 bytes, the VXLAN VNI) }
//		set clear_vnis { type integer (3 bytes) }
//		chain clear_mark {
//			type route hook output priority mangle; policy accept;
//			udp dport P @th,96,24 @clear_vnis meta mark set 0x6f766c63 counter
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
// where the clear policy applies. The outbound drop is a second line: an
// encrypted VNI's packet whose route carries no xfrm transform (no policy,
// no SA, a clear mark set by someone else) is dropped. The inbound drop
// removes encrypted VNIs' VXLAN that was not decrypted by xfrm, before the
// VXLAN socket sees it. A VNI claimed both encrypted and clear is encrypted
// only. Rules carry a comment ("overlayd v2 <role> port=…") by which Audit
// recognises them.
//
// # Apply order (fail closed, hitless)
//
// Programmer.Apply dumps our SAs, policies and table (the Owner plans a
// change against its tracker's record instead, see below), diffs against
// the Desired and changes only the difference, in this order: (1) nftables
// widened first, in one atomic transaction; (2) the clear policy; (3)
// inbound SAs; (4) per remote the outbound SA, then the policy pointing at
// it, then kept outbound SAs; (5) policies no longer desired, the clear
// policy last; (6) SAs no longer desired, only if everything before
// succeeded; (7) nftables narrowed last. Removing any xfrm object only ever
// drops packets. On a kernel that cannot install ESP states, Apply returns
// an error wrapping ErrKernelUnsupported and leaves rules and policies in
// place: encrypted VNIs are dropped both ways, which is the only safe
// state; the Owner then programs without SAs (Desired.NoSAs), reports it in
// Status and Update, and tries SAs again every minute. CheckKernelSupport
// tests all of it in a throwaway namespace.
//
// # Persistence and restarts
//
// The Owner persists one JSON record under MetaKey ("encryption"): version
// 2, the NodeKeys, the local VTEP, the generation, the (epoch, remotes)
// whose outbound SAs were installed, the remotes' last advertised
// generations, and what the last reconcile programmed (VNIs and remotes).
// Never key bytes. After a restart the Owner keeps what the previous run
// programmed until the driver calls Restored (it has registered every
// share again), so a restart never removes a rule, policy or SA a running
// container needs; the generation and SAs are kept, so peers notice
// nothing. The driver's older record ({"keys":…,"remotes":…}) is read as
// version 0: its epochs are kept, with a new generation.
//
// # Integration
//
// The daemon makes one Owner for the host namespace (NewOwner), calls
// SetLocal with the settled VTEP (and again when it changes), Start, and
// Restored once the driver has restored its networks; AttachGossip when the
// control plane runs (adverts travel as Advert.Encode in the member's
// application state; DecodeAdvert on the way in), and Poke when members or
// their application states change. The driver gives a network's whole
// share with Update (at creation, Join, Leave and restore; widening at a
// Join, before the known peers are programmed); on a peer change it calls
// AddRemotes with the VTEPs of the new FDB entries before programming the
// peers, and Update(id, share, false) after (which drops the VTEPs no
// longer used). It calls Remove when the network goes, CheckSupport before
// accepting an encrypted network, and shows Status and Audit. `overlayd keys rotate`
// calls Rotate; OwnerConfig.RotateEvery rotates periodically.
//
// # Changes mark, one apply programs
//
// Every input change only marks the tracker: a share's remotes that came
// or went (their need crossed zero; an Update's list is compared with the
// share's by one merge, no map), a remote's advertised generation, a VNI
// that came or went, the whole state (a new generation or VTEP), or a
// resync (the tick, kernel notifications, SetLocal, Restored, any
// failure). Then one apply (Owner.applyLocked, apply.go) programs what is
// marked, the same way for every caller:
//
//   - Nothing marked, and the last apply succeeded: nothing to do.
//   - A resync dumps the kernel (three xfrm dumps, the nftables list
//     requests) and compares every remote: what changed behind overlayd's
//     back is repaired here, level-triggered, within a tick or a
//     notification's debounce. An apply that changes the kernel although
//     nothing was marked is a repair (Status counts them).
//   - Otherwise the apply plans against the tracker's record of the kernel
//     (the dumps of the last resync, with every request the kernel
//     accepted since applied to them), without a dump: every remote when
//     the keys, the generation or the VTEP differ from the last apply's
//     (or after an error, while adopting, until the first check of the
//     kernel, after an SPI collision), else the marked remotes alone —
//     their desired state, their SAs and policy derived (a cache) and
//     compared through an index of the record by remote, and the record's
//     copy of the last Desired patched for them. The table is compared
//     every time (its sets are small). So a change of one remote costs
//     that remote, whatever the number of remotes of the host: nothing
//     else is built, sorted or compared (BenchmarkOwnerRemotes).
//
// Either way the remotes compared are settled with the ledger the same
// way: an outbound SA installed under (Send, gen) but not held intact
// moves the host to a new generation (against the record this only
// happens if the record says so; a dump is what finds a flushed SA); a new
// one is reserved and written before it is added (a write that fails
// blocks it: its traffic is dropped, and it is tried again at the next
// apply); one held intact that the ledger missed is adopted; one no longer
// needed is kept. Any error forgets the record and the apply resyncs at
// once, deciding again from the dumps what the attempt decided from the
// record, so a refused request never leaves the kernel half-programmed. A
// change made between a change behind overlayd's back and the next resync
// plans against a record that misses it: at worst it drops traffic (a
// policy whose SA was flushed), never sends clear text, and the resync
// repairs it. TestApplyDeltaMatchesFull and
// TestOwnerIncrementalMatchesScratch check, after every step of random
// sequences, that what the record-planned applies leave equals what full
// reconciles leave, and that the tracker's state equals the one computed
// from scratch.
//
// # Cost
//
// Per remote: accepting an epoch is one SA add, switching Send (or the
// generation) is an SA add, a policy update and an SA delete, retiring is
// one SA delete (TestRotationOps; measured on a real kernel by test/vm).
// A resync adds three xfrm dumps and eight nftables list requests. A
// change of one remote is its own requests only (an inbound and an
// outbound SA and a policy to add; the policy and the inbound SA to
// delete, the outbound SA being kept until the epoch or generation
// changes), no dump (BenchmarkOwnerRemotes).
//
// The xfrm requests of an apply are not sent one by one: they are queued
// and sent together (internal/nlbatch: one netlink datagram per 128
// requests on a NETLINK_XFRM socket of their own, only the last
// acknowledged, the kernel's error replies mapped back to their requests
// by sequence number), in at most three rounds that keep the order above:
// (A) the clear policy, the SAs, the policies whose installation does not
// depend on an SA's outcome, then the policies no longer desired; (B) the
// policy updates that must not happen if their remote's new SA was
// refused (the remote stays on its old SA), adds refused because the
// policy exists retried as updates; (C) only when everything before
// succeeded, the SAs no longer desired. Adding a remote is one round trip
// (three requests), removing one two. A refused request is reported
// naming its object (SA spi, source and destination; policy selector),
// and fails the apply like any refusal: the Owner resyncs. Until the
// kernel has accepted one SA, the first SA add of an apply goes alone, so
// that a kernel without ESP is asked once.
package encryption
