package stress

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/encryption"
)

// stressSecret is the cluster secret of the harness's driver.
var stressSecret = []byte("stress-secret-0123456789abcdef!!")

// keyStates are the key epochs probeKeys sets at quiet points: valid
// states of the rotation (encryption.Step), one that only accepts.
var keyStates = []encryption.NodeKeys{
	{Accept: []uint32{1}, Send: 1, Target: 1},
	{Accept: []uint32{1, 2}, Send: 1, Target: 2},
	{Accept: []uint32{1, 2}, Send: 2, Target: 2},
	{Accept: []uint32{2}, Send: 2, Target: 2},
	{Accept: []uint32{1}, Target: 1}, // keys not decided: no remote is ever programmed
}

type keysStats struct {
	probes, ok, unsupported int
}

func (s keysStats) String() string {
	return fmt.Sprintf("SetKeys probes %d: ok %d, failed (no ESP) %d", s.probes, s.ok, s.unsupported)
}

// encVNIs returns the VNIs of the model's encrypted networks, sorted.
func (m *model) encVNIs() []uint32 {
	var out []uint32
	for _, n := range m.nets {
		if !n.encrypted {
			continue
		}
		for _, s := range n.subnets {
			out = append(out, s.vni)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// encRemotes returns the remote VTEPs the driver must program for
// encryption: of every encrypted network with a sandbox, the VTEPs of its
// FDB entries (its active remote peers, as the driver's n.encRemotes).
func (m *model) encRemotes() map[netip.Addr]bool {
	out := map[netip.Addr]bool{}
	for _, vs := range m.encRemotesByNet() {
		for _, v := range vs {
			out[v] = true
		}
	}
	return out
}

// encRemotesByNet is encRemotes per network (for failure reports).
func (m *model) encRemotesByNet() map[string][]netip.Addr {
	out := map[string][]netip.Addr{}
	for _, n := range m.nets {
		if !n.encrypted || n.joined() == 0 {
			continue
		}
		for _, l := range n.desiredPeers() {
			// "<net> fdb <vxlan> <mac> dst <vtep> self permanent"
			f := strings.Fields(l)
			if len(f) >= 6 && f[1] == "fdb" && f[4] == "dst" {
				out[n.id] = append(out[n.id], netip.MustParseAddr(f[5]))
			}
		}
	}
	return out
}

// dumpEncryption reads the host namespace's nftables table of overlayd
// (present, and the elements of its VNI set) and its xfrm policies (as the
// destination addresses of their selectors).
func dumpEncryption(e *env) (table bool, vnis []uint32, policies []netip.Addr, err error) {
	c, err := nftables.New(nftables.WithNetNSFd(int(e.host.Handle)))
	if err != nil {
		return false, nil, nil, err
	}
	tabs, err := c.ListTables()
	if err != nil {
		return false, nil, nil, err
	}
	for _, t := range tabs {
		if t.Name != encryption.TableName || t.Family != nftables.TableFamilyINet {
			return false, nil, nil, fmt.Errorf("unexpected nft table %v %s", t.Family, t.Name)
		}
		table = true
		sets, err := c.GetSets(t)
		if err != nil {
			return false, nil, nil, err
		}
		found := false
		for _, s := range sets {
			if s.Name != encryption.SetName {
				continue
			}
			found = true
			elems, err := c.GetSetElements(s)
			if err != nil {
				return false, nil, nil, err
			}
			for _, el := range elems {
				if len(el.Key) < 3 {
					return false, nil, nil, fmt.Errorf("malformed element %x of set %s", el.Key, s.Name)
				}
				vnis = append(vnis, uint32(el.Key[0])<<16|uint32(el.Key[1])<<8|uint32(el.Key[2]))
			}
		}
		if !found {
			return false, nil, nil, fmt.Errorf("nft table %s has no set %s", t.Name, encryption.SetName)
		}
	}
	slices.Sort(vnis)
	h, err := netlink.NewHandleAt(e.host.Handle, unix.NETLINK_XFRM)
	if err != nil {
		return false, nil, nil, err
	}
	defer h.Close()
	pols, err := h.XfrmPolicyList(unix.AF_UNSPEC)
	if err != nil {
		return false, nil, nil, err
	}
	for _, p := range pols {
		a, _ := netip.AddrFromSlice(p.Dst.IP)
		policies = append(policies, a.Unmap())
	}
	slices.SortFunc(policies, func(a, b netip.Addr) int { return a.Compare(b) })
	return table, vnis, policies, nil
}

// compareEncryption checks the host namespace's encryption state against
// the model: the nft table exactly while some existing network is
// encrypted, its VNI set the encrypted networks' VNIs, and xfrm policies
// only for wantPolicies (nil: none, keys unset).
func compareEncryption(e *env, m *model, wantPolicies []netip.Addr) []string {
	table, vnis, pols, err := dumpEncryption(e)
	if err != nil {
		return []string{"dumping the encryption state: " + err.Error()}
	}
	var diffs []string
	want := m.encVNIs()
	if table != (len(want) > 0) || !slices.Equal(vnis, want) {
		var ids []string
		for id, n := range m.nets {
			if n.encrypted {
				ids = append(ids, id)
			}
		}
		slices.Sort(ids)
		diffs = append(diffs, fmt.Sprintf("encryption vs model: nft table %s present=%v with %s %v, the model's encrypted networks %v have VNIs %v",
			encryption.TableName, table, encryption.SetName, vnis, ids, want))
	}
	if !slices.Equal(pols, wantPolicies) {
		diffs = append(diffs, fmt.Sprintf("encryption vs model: xfrm policies to %v, want %v", pols, wantPolicies))
	}
	return diffs
}

// probeKeys runs at a quiet point whose checks passed (workers paused, the
// model up to date): it sets one of keyStates and asserts the exact
// outcome, then unsets the keys again, so that the workers never run with
// keys (with keys set, every operation that needs a new remote VTEP in an
// encrypted network fails on this kernel — and Apply leaves the remote in
// the driver's intent, failing every later Apply too —, which the model
// does not predict).
//
// Outcome: SetKeys succeeds iff the key state has no Send epoch or no
// remote VTEP is desired (no encrypted network with a sandbox has an active
// remote peer at a VTEP other than the host's own). Otherwise it fails with
// encryption.ErrKernelUnsupported (no ESP states here). On success the
// kernel holds no policy (none is wanted without remotes); after a failure
// driver.Keys() is the previous (empty) state and the kernel holds the
// fail-closed policy of every desired remote (the SAs could not be added;
// the policy is still installed so that marked traffic drops). The driver
// does not re-apply after reverting its keys, so Audit reports those
// policies as unexpected until the next Apply: that is not asserted (the
// policies are, from the kernel dump). Then SetKeys(NodeKeys{}) must
// succeed, remove them, and leave Audit clean.
func (h *harness) probeKeys() []string {
	e, m := h.e, h.m
	k := keyStates[h.keysRng.Intn(len(keyStates))]
	remotes := m.encRemotes()
	// A remote record claiming the host's own VTEP is no pair to encrypt:
	// the driver leaves it out.
	delete(remotes, e.vtep)
	var wantPols []netip.Addr
	for r := range remotes {
		wantPols = append(wantPols, r)
	}
	slices.SortFunc(wantPols, func(a, b netip.Addr) int { return a.Compare(b) })
	h.keysStats.probes++
	var diffs []string
	err := e.d.SetKeys(k)
	got := e.d.Keys()
	switch {
	case k.Send == 0 || len(remotes) == 0:
		if err != nil {
			return []string{fmt.Sprintf("SetKeys %+v with remote VTEPs %v desired (%v): %v, want success", k, wantPols, m.encRemotesByNet(), err)}
		}
		h.keysStats.ok++
		if got.Send != k.Send || !slices.Equal(got.Accept, k.Accept) || got.Target != k.Target {
			diffs = append(diffs, fmt.Sprintf("Keys() %+v after a successful SetKeys %+v", got, k))
		}
		diffs = append(diffs, compareEncryption(e, m, nil)...)
		if problems, err := e.d.Audit(); err != nil || len(problems) > 0 {
			diffs = append(diffs, fmt.Sprintf("driver Audit with keys %+v: %v %v", k, err, problems))
		}
	default:
		if !errors.Is(err, encryption.ErrKernelUnsupported) {
			return []string{fmt.Sprintf("SetKeys %+v with remote VTEPs %v desired (%v): %v, want ErrKernelUnsupported", k, wantPols, m.encRemotesByNet(), err)}
		}
		h.keysStats.unsupported++
		if got.Send != 0 {
			diffs = append(diffs, fmt.Sprintf("Keys() %+v after a failed SetKeys", got))
		}
		if d := compareEncryption(e, m, wantPols); len(d) > 0 {
			diffs = append(diffs, d...)
			diffs = append(diffs, fmt.Sprintf("(after the failed SetKeys %+v; the model's remote VTEPs by encrypted network with a sandbox: %v)", k, m.encRemotesByNet()))
		}
	}
	if err := e.d.SetKeys(encryption.NodeKeys{}); err != nil {
		return append(diffs, fmt.Sprintf("SetKeys({}) after probing %+v: %v", k, err))
	}
	diffs = append(diffs, compareEncryption(e, m, nil)...)
	if problems, err := e.d.Audit(); err != nil || len(problems) > 0 {
		diffs = append(diffs, fmt.Sprintf("driver Audit after unsetting the keys: %v %v", err, problems))
	}
	return diffs
}
