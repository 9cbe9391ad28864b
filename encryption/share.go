package encryption

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/overlayd/overlayd/countmap"
)

// ShareID identifies one network's share of the encryption state. The
// driver chooses it, one per network instance (a network deleted and
// created again under the same id gets a new ShareID), so a late update of
// a deleted network can never touch its successor's share.
type ShareID uint64

// Share is what one network contributes to the host's desired encryption
// state.
type Share struct {
	// VNIs of the network.
	VNIs []uint32
	// Encrypted networks' VNIs are encrypted between hosts and dropped when
	// they would cross in clear; the others are let through in clear.
	Encrypted bool
	// Remotes are the VTEPs of the network's active remote peers: the hosts
	// it needs SAs and policies with. Only meaningful for an encrypted
	// network with a sandbox; nil otherwise.
	Remotes []netip.Addr
}

// share is one network's registered share.
type share struct {
	vnis      []uint32 // sorted, unique
	encrypted bool
	// remotes the share counts in shareIndex.need, sorted and unique: its
	// Share.Remotes, plus those kept by a widening Update or added by
	// AddRemotes.
	remotes []netip.Addr
}

// shareIndex is the planner's input from the networks: every share, and
// what the desired state needs from them, kept incrementally so that a
// change costs what it changes. It belongs to the Owner and is guarded by
// the Owner's lock.
type shareIndex struct {
	shares map[ShareID]*share
	// need counts, for every remote VTEP, the shares that need it;
	// encVNIs and clearVNIs count the shares that have each VNI.
	need countmap.Map[netip.Addr]
	// needSorted is need's keys, sorted: an index kept with need, so that
	// the desired state of thousands of remotes is not sorted again on
	// every change.
	needSorted []netip.Addr
	encVNIs    countmap.Map[uint32]
	clearVNIs  countmap.Map[uint32]
}

func newShareIndex() shareIndex { return shareIndex{shares: map[ShareID]*share{}} }

func normShare(id ShareID, s Share) (*share, error) {
	sh := &share{encrypted: s.Encrypted}
	for _, v := range s.VNIs {
		if v == 0 || v > 1<<24-1 {
			return nil, fmt.Errorf("encryption: share %d: invalid VNI %d", id, v)
		}
	}
	sh.vnis = sortedVNIs(s.VNIs)
	if !s.Encrypted {
		return sh, nil
	}
	// Room to grow: AddRemotes inserts in place.
	sh.remotes = make([]netip.Addr, 0, len(s.Remotes)+len(s.Remotes)/8+4)
	for _, r := range s.Remotes {
		if err := checkRemote(id, r); err != nil {
			return nil, err
		}
		sh.remotes = append(sh.remotes, r.Unmap())
	}
	sh.remotes = sortedUnique(sh.remotes)
	return sh, nil
}

func checkRemote(id ShareID, r netip.Addr) error {
	r = r.Unmap()
	if !r.IsValid() || r.IsUnspecified() || r.Zone() != "" || r.IsMulticast() {
		return fmt.Errorf("encryption: share %d: invalid remote VTEP address %v", id, r)
	}
	return nil
}

// sortedUnique sorts l in place (unless it is sorted already, as the
// driver passes it) and drops duplicates.
func sortedUnique(l []netip.Addr) []netip.Addr {
	if !slices.IsSortedFunc(l, netip.Addr.Compare) {
		slices.SortFunc(l, netip.Addr.Compare)
	}
	return slices.Compact(l)
}

// unionSorted merges two sorted, unique lists into a new one.
func unionSorted(a, b []netip.Addr) []netip.Addr {
	out := make([]netip.Addr, 0, max(len(a), len(b)))
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		switch {
		case j == len(b) || (i < len(a) && a[i].Compare(b[j]) < 0):
			out = append(out, a[i])
			i++
		case i == len(a) || b[j].Compare(a[i]) < 0:
			out = append(out, b[j])
			j++
		default:
			out = append(out, a[i])
			i, j = i+1, j+1
		}
	}
	return out
}

// diffSorted returns what is in b and not in a (added) and what is in a
// and not in b (gone), for sorted, unique lists: one merge, no map.
func diffSorted(a, b []netip.Addr) (added, gone []netip.Addr) {
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		switch {
		case j == len(b) || (i < len(a) && a[i].Compare(b[j]) < 0):
			gone = append(gone, a[i])
			i++
		case i == len(a) || b[j].Compare(a[i]) < 0:
			added = append(added, b[j])
			j++
		default:
			i, j = i+1, j+1
		}
	}
	return added, gone
}

// count counts remote r as needed by one share more (delta +1) or fewer
// (-1), keeping needSorted when index is set, and reports whether r's need
// crossed zero (it is needed now and was not, or the reverse).
func (x *shareIndex) count(r netip.Addr, delta int, index bool) bool {
	before := x.need.Get(r)
	n := x.need.Add(r, delta)
	if (before == 0) == (n == 0) {
		return false
	}
	if index {
		i, found := slices.BinarySearchFunc(x.needSorted, r, netip.Addr.Compare)
		if n > 0 && !found {
			x.needSorted = slices.Insert(x.needSorted, i, r)
		} else if n == 0 && found {
			x.needSorted = slices.Delete(x.needSorted, i, i+1)
		}
	}
	return true
}

// set registers sh as the share of id (nil: removes it) and returns, sorted,
// the remotes whose need crossed zero, and whether the set of encrypted or
// clear VNIs changed. Only the remotes that differ between the old share
// and sh are counted again (found by merging the sorted lists), so a
// network of 1,000 remotes gaining one costs one count.
func (x *shareIndex) set(id ShareID, sh *share) (crossed []netip.Addr, vnis bool) {
	old := x.shares[id]
	if sh == nil {
		delete(x.shares, id)
	} else {
		x.shares[id] = sh
	}
	for _, c := range []struct {
		sh    *share
		delta int
	}{{old, -1}, {sh, +1}} {
		if c.sh == nil {
			continue
		}
		m := &x.clearVNIs
		if c.sh.encrypted {
			m = &x.encVNIs
		}
		for _, v := range c.sh.vnis {
			before := m.Get(v)
			if n := m.Add(v, c.delta); (before == 0) != (n == 0) {
				vnis = true
			}
		}
	}
	var before, after []netip.Addr
	if old != nil {
		before = old.remotes
	}
	if sh != nil {
		after = sh.remotes
	}
	added, gone := diffSorted(before, after)
	// Many changes at once (a network gone): re-sort the index once
	// rather than move it for each.
	bulk := len(gone)+len(added) > 16
	for _, r := range gone {
		if x.count(r, -1, !bulk) {
			crossed = append(crossed, r)
		}
	}
	for _, r := range added {
		if x.count(r, +1, !bulk) {
			crossed = append(crossed, r)
		}
	}
	if bulk {
		x.needSorted = slices.SortedFunc(func(yield func(netip.Addr) bool) {
			x.need.Range(func(r netip.Addr, _ int) bool { return yield(r) })
		}, netip.Addr.Compare)
	}
	slices.SortFunc(crossed, netip.Addr.Compare)
	return crossed, vnis
}

// changeRemotes adds (sign +1) or removes (-1) the sorted remotes in to the
// encrypted share sh and returns those whose need crossed zero; remotes
// the share has already (or has not) are ignored.
func (x *shareIndex) changeRemotes(sh *share, in []netip.Addr, sign int) []netip.Addr {
	var crossed []netip.Addr
	for _, r := range in {
		i, has := slices.BinarySearchFunc(sh.remotes, r, netip.Addr.Compare)
		switch {
		case sign > 0 && !has:
			sh.remotes = slices.Insert(sh.remotes, i, r)
		case sign < 0 && has:
			sh.remotes = slices.Delete(sh.remotes, i, i+1)
		default:
			continue
		}
		if x.count(r, sign, true) {
			crossed = append(crossed, r)
		}
	}
	return crossed
}
