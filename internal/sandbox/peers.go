package sandbox

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/nlbatch"
	"github.com/overlayd/overlayd/peerdb"
)

var errExist = unix.EEXIST

// ApplyDelta writes a change of desired peer state: sets with replace
// semantics, deletes naming the destination they remove. It is the fast path
// for peer events; Reconcile is the level-triggered path that does not trust
// what the kernel is believed to hold.
//
// The operations are built into the sandbox's scratch space a batch at a
// time and handed to the netlink connection batch by batch, so a change of
// any size costs no allocation and its working set stays small.
func (sb *Sandbox) ApplyDelta(d peerdb.Delta) error {
	if d.Empty() {
		return nil
	}
	// The scratch space grows to what a change needs, up to a datagram's
	// worth: a notification of one peer keeps room for two operations.
	if want := min(opChunk, len(d.NeighSet)+len(d.FDBSet)+len(d.NeighDel)+len(d.FDBDel)); cap(sb.ops) < want {
		sb.ops = make([]nlbatch.Op, 0, want)
	}
	w := opWriter{sb: sb, ops: sb.ops[:0]}
	// Neighbours and FDB entries are set alternately. The kernel gives
	// each new FDB entry per-CPU memory (dst_cache_init, a route cache for
	// its destination), and its per-CPU allocator is slow in one long run
	// of FDB sets (perf: pcpu_alloc under its lock): all FDB sets after
	// all neighbours cost about a quarter more CPU time for 100,000 new
	// peers than alternating them (BenchmarkPeers against the raw
	// reference, which alternates). Deletes go by kind, which measured no
	// worse.
	for i := range max(len(d.NeighSet), len(d.FDBSet)) {
		if i < len(d.NeighSet) {
			w.neighSet(&d.NeighSet[i])
		}
		if i < len(d.FDBSet) {
			w.fdbSet(&d.FDBSet[i])
		}
	}
	for i := range d.NeighDel {
		n := &d.NeighDel[i]
		if idx, ok := sb.vxlanIndex(n.Subnet); ok {
			w.add(nlbatch.Op{Kind: nlbatch.NeighDel, LinkIndex: idx, IP: n.IP, MAC: n.MAC})
		}
	}
	for i := range d.FDBDel {
		f := &d.FDBDel[i]
		if idx, ok := sb.vxlanIndex(f.Subnet); ok {
			w.add(nlbatch.Op{Kind: nlbatch.FDBDel, LinkIndex: idx, MAC: f.MAC, VTEP: f.VTEP})
		}
	}
	w.flush()
	sb.ops = w.ops[:0]
	// An address that moved to another MAC: tell the containers, which
	// may have the old one cached. Only those: announcing every new
	// neighbour would cost a broadcast per peer on every bulk change.
	if err := sb.announce(sb.movedNeighs(d, time.Now)); err != nil {
		w.bad = append(w.bad, err)
	}
	return errors.Join(w.bad...)
}

// opChunk is how many operations ApplyDelta builds before it sends them:
// one datagram's worth (nlbatch.DefaultBatchSize), so the scratch space
// (sb.ops) stays at a few tens of KiB.
const opChunk = nlbatch.DefaultBatchSize

// opWriter collects the operations of one ApplyDelta in sb.ops and applies
// them opChunk at a time.
type opWriter struct {
	sb  *Sandbox
	ops []nlbatch.Op
	bad []error
}

func (w *opWriter) neighSet(n *peerdb.Neigh) {
	if idx, ok := w.sb.vxlanIndex(n.Subnet); ok {
		w.add(nlbatch.Op{Kind: nlbatch.NeighSet, LinkIndex: idx, IP: n.IP, MAC: n.MAC})
	} else {
		w.bad = append(w.bad, fmt.Errorf("neighbour %s: no subnet %d in sandbox %s", n.IP, n.Subnet, w.sb.path))
	}
}

func (w *opWriter) fdbSet(f *peerdb.FDB) {
	if idx, ok := w.sb.vxlanIndex(f.Subnet); ok {
		w.add(nlbatch.Op{Kind: nlbatch.FDBSet, LinkIndex: idx, MAC: f.MAC, VTEP: f.VTEP})
	} else {
		w.bad = append(w.bad, fmt.Errorf("fdb %s: no subnet %d in sandbox %s", f.MAC, f.Subnet, w.sb.path))
	}
}

func (w *opWriter) add(op nlbatch.Op) {
	w.ops = append(w.ops, op)
	if len(w.ops) == opChunk {
		w.flush()
	}
}

func (w *opWriter) flush() {
	if len(w.ops) == 0 {
		return
	}
	if err := w.sb.batch.Apply(w.ops); err != nil {
		w.bad = append(w.bad, fmt.Errorf("sandbox %s: %w", w.sb.path, err))
	}
	clear(w.ops) // nothing kept alive by the scratch space
	w.ops = w.ops[:0]
}

func (sb *Sandbox) vxlanIndex(subnet int) (int, bool) {
	if subnet < 0 || subnet >= len(sb.subnets) {
		return 0, false
	}
	return sb.subnets[subnet].vxlan, true
}

// Kernel is what the kernel holds of a network's peer state: permanent
// neighbours and FDB self entries on the sandbox's VXLAN links.
type Kernel struct {
	Neigh map[peerdb.NeighKey]peerdb.MAC
	FDB   map[peerdb.FDBKey]netip.Addr
	// Foreign counts entries on our links that we cannot map to a subnet
	// (for example an FDB entry with several destinations).
	Foreign []string
}

// Dump reads the peer state of the sandbox from the kernel.
func (sb *Sandbox) Dump() (Kernel, error) {
	k := Kernel{Neigh: map[peerdb.NeighKey]peerdb.MAC{}, FDB: map[peerdb.FDBKey]netip.Addr{}}
	for i, sl := range sb.subnets {
		neighs, err := sb.h.NeighList(sl.vxlan, unix.AF_INET)
		if err != nil {
			return k, fmt.Errorf("failed to dump neighbours of %s in sandbox %s: %w", VXLANName(sl.VNI), sb.path, err)
		}
		// IPv6 neighbours of every segment, not only of those with IPv6:
		// an entry nobody wants is reported and removed wherever it is.
		neighs6, err := sb.h.NeighList(sl.vxlan, unix.AF_INET6)
		if err != nil {
			return k, fmt.Errorf("failed to dump IPv6 neighbours of %s in sandbox %s: %w", VXLANName(sl.VNI), sb.path, err)
		}
		neighs = append(neighs, neighs6...)
		for _, n := range neighs {
			if n.State&netlink.NUD_PERMANENT == 0 {
				continue
			}
			ip, ok := netip.AddrFromSlice(n.IP)
			if !ok || len(n.HardwareAddr) != 6 {
				k.Foreign = append(k.Foreign, fmt.Sprintf("neigh %v lladdr %v on %s", n.IP, n.HardwareAddr, VXLANName(sl.VNI)))
				continue
			}
			k.Neigh[peerdb.NeighKey{Subnet: i, IP: ip.Unmap()}] = peerdb.MAC(n.HardwareAddr)
		}
		fdbs, err := sb.h.NeighList(sl.vxlan, unix.AF_BRIDGE)
		if err != nil {
			return k, fmt.Errorf("failed to dump fdb of %s in sandbox %s: %w", VXLANName(sl.VNI), sb.path, err)
		}
		for _, f := range fdbs {
			if f.Flags&netlink.NTF_SELF == 0 || f.Flags&netlink.NTF_MASTER != 0 || f.LinkIndex != sl.vxlan {
				continue
			}
			var mac peerdb.MAC
			if len(f.HardwareAddr) == 6 {
				mac = peerdb.MAC(f.HardwareAddr)
			}
			dst, ok := netip.AddrFromSlice(f.IP)
			key := peerdb.FDBKey{Subnet: i, MAC: mac}
			if _, dup := k.FDB[key]; dup || !ok || mac.IsZero() {
				k.Foreign = append(k.Foreign, fmt.Sprintf("fdb %v dst %v on %s", f.HardwareAddr, f.IP, VXLANName(sl.VNI)))
				continue
			}
			k.FDB[key] = dst.Unmap()
		}
	}
	return k, nil
}

// Diff compares what the kernel holds with the desired state. The result's
// Delta turns the kernel into the desired state, its slices sorted as a
// DB's (peerdb.Delta.Sort); the problems describe each difference, naming
// the object, sorted.
func Diff(want peerdb.State, have Kernel) (peerdb.Delta, []string) {
	var d peerdb.Delta
	var problems []string
	for k, mac := range want.Neigh {
		if got, ok := have.Neigh[k]; !ok {
			problems = append(problems, fmt.Sprintf("neighbour %s (subnet %d): missing, want lladdr %s", k.IP, k.Subnet, mac))
			d.NeighSet = append(d.NeighSet, peerdb.Neigh{Subnet: k.Subnet, IP: k.IP, MAC: mac})
		} else if got != mac {
			problems = append(problems, fmt.Sprintf("neighbour %s (subnet %d): lladdr %s, want %s", k.IP, k.Subnet, got, mac))
			d.NeighSet = append(d.NeighSet, peerdb.Neigh{Subnet: k.Subnet, IP: k.IP, MAC: mac})
			d.NeighMoved = append(d.NeighMoved, peerdb.Neigh{Subnet: k.Subnet, IP: k.IP, MAC: mac})
		}
	}
	for k, mac := range have.Neigh {
		if _, ok := want.Neigh[k]; !ok {
			problems = append(problems, fmt.Sprintf("neighbour %s lladdr %s (subnet %d): not desired", k.IP, mac, k.Subnet))
			d.NeighDel = append(d.NeighDel, peerdb.Neigh{Subnet: k.Subnet, IP: k.IP, MAC: mac})
		}
	}
	for k, vtep := range want.FDB {
		if got, ok := have.FDB[k]; !ok {
			problems = append(problems, fmt.Sprintf("fdb %s (subnet %d): missing, want dst %s", k.MAC, k.Subnet, vtep))
			d.FDBSet = append(d.FDBSet, peerdb.FDB{Subnet: k.Subnet, MAC: k.MAC, VTEP: vtep})
		} else if got != vtep {
			problems = append(problems, fmt.Sprintf("fdb %s (subnet %d): dst %s, want %s", k.MAC, k.Subnet, got, vtep))
			d.FDBSet = append(d.FDBSet, peerdb.FDB{Subnet: k.Subnet, MAC: k.MAC, VTEP: vtep})
		}
	}
	for k, vtep := range have.FDB {
		if _, ok := want.FDB[k]; !ok {
			problems = append(problems, fmt.Sprintf("fdb %s dst %s (subnet %d): not desired", k.MAC, vtep, k.Subnet))
			d.FDBDel = append(d.FDBDel, peerdb.FDB{Subnet: k.Subnet, MAC: k.MAC, VTEP: vtep})
		}
	}
	problems = append(problems, have.Foreign...)
	sort.Strings(problems)
	// In key order, as a DB's deltas are: what is programmed, and in what
	// order, does not depend on map iteration.
	d.Sort()
	slices.SortFunc(d.NeighMoved, func(a, b peerdb.Neigh) int { return cmp.Or(cmp.Compare(a.Subnet, b.Subnet), a.IP.Compare(b.IP)) })
	return d, problems
}

// Reconcile makes the kernel hold exactly the desired peer state: it dumps,
// diffs and applies the difference. It returns the differences it found.
func (sb *Sandbox) Reconcile(want peerdb.State) ([]string, error) {
	have, err := sb.Dump()
	if err != nil {
		return nil, err
	}
	d, problems := Diff(want, have)
	return problems, sb.ApplyDelta(d)
}

// Populate programs want into a sandbox that Create has just built and no
// endpoint has joined yet: it holds no peer entries, so unlike Reconcile
// nothing is dumped and compared first (two dumps per subnet saved on
// every first Join; the kernel serves dumps under its RTNL lock, which
// every network's kernel work shares). On any other sandbox it reconciles.
func (sb *Sandbox) Populate(want peerdb.State) error {
	if !sb.fresh {
		_, err := sb.Reconcile(want)
		return err
	}
	d := peerdb.Delta{
		NeighSet: make([]peerdb.Neigh, 0, len(want.Neigh)),
		FDBSet:   make([]peerdb.FDB, 0, len(want.FDB)),
	}
	for k, mac := range want.Neigh {
		d.NeighSet = append(d.NeighSet, peerdb.Neigh{Subnet: k.Subnet, IP: k.IP, MAC: mac})
	}
	for k, vtep := range want.FDB {
		d.FDBSet = append(d.FDBSet, peerdb.FDB{Subnet: k.Subnet, MAC: k.MAC, VTEP: vtep})
	}
	return sb.ApplyDelta(d)
}
