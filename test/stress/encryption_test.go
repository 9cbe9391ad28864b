//go:build testhooks

package stress

import (
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/encryption"
)

// The encryption side of the oracle: the host namespace's nftables table
// and xfrm state against the model, and the encryption owner's own views
// (Status, Audit) against both.

// stressSecret is the cluster secret of the harness's encryption owner.
var stressSecret = []byte("stress-secret-0123456789abcdef!!")

// espKernel reports whether this kernel can install ESP states (the VM's
// can; this machine's cannot): only then may SAs exist.
var espKernel = sync.OnceValue(func() bool { return encryption.CheckKernelSupport() == nil })

type encStats struct {
	checks         int // quiet points whose kernel encryption state was compared
	withTable      int // ... at which some VNI was encrypted (table, sets and clear policy checked)
	remotes        int // remote VTEPs whose outbound policy was checked, summed over quiet points
	maxRemotes     int // the most at one quiet point
	ownerChecks    int // quiet points whose owner Status and Audit were compared
	espUnsupported int // ... at which the owner reported ESPUnsupported
	saMissing      int // owner Audit lines of SAs this kernel cannot hold (tolerated)
}

func (s encStats) String() string {
	return fmt.Sprintf("kernel state checked at %d quiet points (%d with encrypted VNIs), outbound policies of %d remote VTEPs checked (at most %d at once); "+
		"owner Status/Audit checked at %d quiet points (ESPUnsupported at %d), %d Audit lines of SAs this kernel cannot hold tolerated",
		s.checks, s.withTable, s.remotes, s.maxRemotes, s.ownerChecks, s.espUnsupported, s.saMissing)
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

// clearVNIs returns the VNIs of the model's unencrypted networks (let out
// in clear by name), sorted.
func (m *model) clearVNIs() []uint32 {
	var out []uint32
	for _, n := range m.nets {
		if n.encrypted {
			continue
		}
		for _, s := range n.subnets {
			out = append(out, s.vni)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// encNeeds returns, per remote VTEP, how many encrypted networks with a
// sandbox need it: the VTEPs of their FDB entries (the active remote peers
// that traffic is sent to, as the driver's network.encShareLocked).
func (m *model) encNeeds() map[netip.Addr]int {
	out := map[netip.Addr]int{}
	for _, vs := range m.encRemotesByNet() {
		for _, v := range vs {
			out[v]++
		}
	}
	return out
}

// wantRemotes returns the remote VTEPs that need an outbound policy: those
// of encNeeds but the local VTEP (a record claiming it is no pair to
// encrypt), sorted.
func (m *model) wantRemotes(local netip.Addr) []netip.Addr {
	var out []netip.Addr
	for v := range m.encNeeds() {
		if v != local {
			out = append(out, v)
		}
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}

// encRemotesByNet is, per encrypted network with a sandbox, the distinct
// VTEPs of its FDB entries.
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
				v := netip.MustParseAddr(f[5])
				if !slices.Contains(out[n.id], v) {
					out[n.id] = append(out[n.id], v)
				}
			}
		}
	}
	return out
}

// encDump is the encryption state of the host namespace.
type encDump struct {
	table        bool
	enc, clear   []uint32 // the elements of encrypted_vnis and clear_vnis
	clearPolicy  bool
	policies     []espPolicy // outbound ESP policies, by destination
	states       int         // xfrm states (SAs), all of them
	unrecognised []string    // policies of no shape overlayd installs
}

// espPolicy is an outbound policy with an ESP template: the remote VTEP it
// selects and its template.
type espPolicy struct {
	remote             netip.Addr
	tmplSrc, tmplDst   netip.Addr
	spi                uint32
	reqid              int
	transport, markSet bool
}

// dumpEncryption reads the host namespace's nftables table of overlayd
// (present, and the elements of its two VNI sets) and its xfrm policies
// and states.
func dumpEncryption(e *env) (*encDump, error) {
	out := &encDump{}
	c, err := nftables.New(nftables.WithNetNSFd(int(e.host.Handle)))
	if err != nil {
		return nil, err
	}
	tabs, err := c.ListTables()
	if err != nil {
		return nil, err
	}
	for _, t := range tabs {
		if t.Name != encryption.TableName || t.Family != nftables.TableFamilyINet {
			return nil, fmt.Errorf("unexpected nft table %v %s", t.Family, t.Name)
		}
		out.table = true
		sets, err := c.GetSets(t)
		if err != nil {
			return nil, err
		}
		found := map[string]bool{}
		for _, s := range sets {
			var dst *[]uint32
			switch s.Name {
			case encryption.SetName:
				dst = &out.enc
			case encryption.ClearSetName:
				dst = &out.clear
			default:
				return nil, fmt.Errorf("unexpected set %s in nft table %s", s.Name, t.Name)
			}
			found[s.Name] = true
			elems, err := c.GetSetElements(s)
			if err != nil {
				return nil, err
			}
			for _, el := range elems {
				if len(el.Key) < 3 {
					return nil, fmt.Errorf("malformed element %x of set %s", el.Key, s.Name)
				}
				*dst = append(*dst, uint32(el.Key[0])<<16|uint32(el.Key[1])<<8|uint32(el.Key[2]))
			}
			slices.Sort(*dst)
		}
		for _, name := range []string{encryption.SetName, encryption.ClearSetName} {
			if !found[name] {
				return nil, fmt.Errorf("nft table %s has no set %s", t.Name, name)
			}
		}
	}
	h, err := netlink.NewHandleAt(e.host.Handle, unix.NETLINK_XFRM)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	states, err := retry(func() ([]netlink.XfrmState, error) { return h.XfrmStateList(netlink.FAMILY_ALL) })
	if err != nil {
		return nil, err
	}
	out.states = len(states)
	pols, err := retry(func() ([]netlink.XfrmPolicy, error) { return h.XfrmPolicyList(netlink.FAMILY_V4) })
	if err != nil {
		return nil, err
	}
	for _, p := range pols {
		dport := p.DstPort == driver.DefaultVXLANPort && p.Proto == netlink.Proto(unix.IPPROTO_UDP) && p.Dir == netlink.XFRM_DIR_OUT
		marked := p.Mark != nil && (p.Mark.Value != 0 || p.Mark.Mask != 0)
		switch {
		case dport && len(p.Tmpls) == 0 && marked && p.Mark.Value == encryption.ClearMark && p.Mark.Mask == encryption.ClearMarkMask:
			out.clearPolicy = true
		case dport && len(p.Tmpls) == 1 && p.Dst != nil:
			r, _ := netip.AddrFromSlice(p.Dst.IP)
			ones, bits := p.Dst.Mask.Size()
			t := p.Tmpls[0]
			src, _ := netip.AddrFromSlice(t.Src)
			dst, _ := netip.AddrFromSlice(t.Dst)
			if ones != bits || t.Proto != netlink.XFRM_PROTO_ESP {
				out.unrecognised = append(out.unrecognised, p.String())
				continue
			}
			out.policies = append(out.policies, espPolicy{remote: r.Unmap(), tmplSrc: src.Unmap(), tmplDst: dst.Unmap(), spi: uint32(t.Spi),
				reqid: t.Reqid, transport: t.Mode == netlink.XFRM_MODE_TRANSPORT, markSet: marked})
		default:
			out.unrecognised = append(out.unrecognised, p.String())
		}
	}
	slices.SortFunc(out.policies, func(a, b espPolicy) int { return a.remote.Compare(b.remote) })
	return out, nil
}

// compareEncryption checks the host namespace's encryption state against
// the model (local: the driver's VTEP, which the owner follows):
//   - the nftables table inet overlayd exists exactly while some network
//     is encrypted, its set encrypted_vnis holds exactly the encrypted
//     networks' VNIs and clear_vnis the other networks' VNIs;
//   - the clear policy (mark ClearMark, no template) exists exactly with
//     the table;
//   - an outbound ESP policy without mark (so that an unmarked packet
//     fails closed) exists for exactly the remote VTEPs some encrypted
//     network with a sandbox needs (encNeeds, without the local VTEP), its
//     template ESP in transport mode from the local VTEP to the remote,
//     with overlayd's reqid; no other policy exists;
//   - without keys, the templates point at a reserved SPI no SA can have
//     (with keys, compareOwner checks the derived SPI);
//   - on this kernel, which cannot hold ESP states, no SA exists.
func compareEncryption(e *env, m *model, local netip.Addr, es *encStats) []string {
	got, err := dumpEncryption(e)
	if err != nil {
		return []string{"dumping the encryption state: " + err.Error()}
	}
	var diffs []string
	bad := func(format string, args ...any) {
		diffs = append(diffs, "encryption vs model: "+fmt.Sprintf(format, args...))
	}
	wantEnc := m.encVNIs()
	wantClear := minusVNIs(m.clearVNIs(), wantEnc)
	wantTable := len(wantEnc) > 0
	var wantRemotes []netip.Addr
	if wantTable {
		wantRemotes = m.wantRemotes(local)
	}
	if got.table != wantTable {
		bad("nft table %s present=%v, the model's encrypted networks %v have VNIs %v", encryption.TableName, got.table, m.encNets(), wantEnc)
	}
	if got.table && (!slices.Equal(got.enc, wantEnc) || !slices.Equal(got.clear, wantClear)) {
		bad("nft sets %s %v and %s %v, the model's encrypted networks %v have VNIs %v, the others %v",
			encryption.SetName, got.enc, encryption.ClearSetName, got.clear, m.encNets(), wantEnc, wantClear)
	}
	if got.clearPolicy != wantTable {
		bad("clear policy (mark %#x) present=%v, want %v", encryption.ClearMark, got.clearPolicy, wantTable)
	}
	var remotes []netip.Addr
	for _, p := range got.policies {
		remotes = append(remotes, p.remote)
		if p.tmplSrc != local || p.tmplDst != p.remote || p.reqid != encryption.ReqID || !p.transport || p.markSet {
			bad("outbound policy to %v: template %v→%v reqid %#x transport=%v mark=%v, want %v→%v reqid %#x transport without mark",
				p.remote, p.tmplSrc, p.tmplDst, p.reqid, p.transport, p.markSet, local, p.remote, encryption.ReqID)
		}
		if !e.keys && (p.spi == 0 || p.spi > 255) {
			// Without keys the policy must point at an SPI in the reserved
			// range, which no SA ever has: it drops.
			bad("outbound policy to %v points at spi %#x without keys, want one in the reserved range 1..255", p.remote, p.spi)
		}
	}
	if !slices.Equal(remotes, wantRemotes) {
		bad("outbound ESP policies to %v, want %v (remote VTEPs by encrypted network with a sandbox: %v; local VTEP %v)",
			remotes, wantRemotes, m.encRemotesByNet(), local)
	}
	for _, u := range got.unrecognised {
		bad("unexpected xfrm policy %s", u)
	}
	if !espKernel() && got.states != 0 {
		bad("%d xfrm states on a kernel that cannot install ESP states", got.states)
	}
	if es != nil {
		es.checks++
		if wantTable {
			es.withTable++
		}
		es.remotes += len(wantRemotes)
		es.maxRemotes = max(es.maxRemotes, len(wantRemotes))
	}
	return diffs
}

// compareOwner checks the encryption owner's own views against the model:
// its Status (local VTEP, keys, VNIs, one share per network, a pair per
// needed remote with the count of networks that need it and the policy
// pointing at the SA of the current epoch and generation, no repair since
// nobody changes the kernel behind its back, an error only for the missing
// ESP support) and its Audit.
func compareOwner(e *env, m *model, local netip.Addr, es *encStats) []string {
	var diffs []string
	bad := func(format string, args ...any) {
		diffs = append(diffs, "encryption owner vs model: "+fmt.Sprintf(format, args...))
	}
	if e.keys && local.IsValid() {
		// Attached to the hub when the VTEP was first known (maybe during
		// the last phase): its loop establishes the keys on its own.
		if err := e.waitKeys(5 * time.Second); err != nil {
			bad("%v", err)
		}
	}
	st := e.owner.Status()
	wantEnc := m.encVNIs()
	wantClear := minusVNIs(m.clearVNIs(), wantEnc)
	if st.Local != local {
		bad("local VTEP %v, the driver's is %v", st.Local, local)
	}
	switch {
	case e.keys && local.IsValid():
		if st.Rotating || !st.GossipAttached {
			bad("rotating %v gossip attached %v: want epoch 1 established, no rotation", st.Rotating, st.GossipAttached)
		}
	case st.Send != 0 && !local.IsValid() || !e.keys && (st.Send != 0 || st.GossipAttached):
		bad("keys send %d accept %v gossip attached %v, want none (no gossip attached yet)", st.Send, st.Accept, st.GossipAttached)
	}
	if !slices.Equal(st.EncryptedVNIs, wantEnc) || !slices.Equal(orEmpty(st.ClearVNIs), orEmpty(wantClear)) {
		bad("encrypted VNIs %v clear VNIs %v, the model's %v and %v", st.EncryptedVNIs, st.ClearVNIs, wantEnc, wantClear)
	}
	if st.Shares != len(m.nets) {
		bad("%d shares, the model has %d networks (every network has one)", st.Shares, len(m.nets))
	}
	var wantRemotes []netip.Addr
	if len(wantEnc) > 0 {
		wantRemotes = m.wantRemotes(local)
	}
	needs := m.encNeeds()
	var pairs []netip.Addr
	for _, p := range st.Pairs {
		pairs = append(pairs, p.Remote)
		if p.Shares != needs[p.Remote] {
			bad("pair %v: needed by %d shares, the model's encrypted networks with a sandbox that need it: %d (%v)", p.Remote, p.Shares, needs[p.Remote], m.encRemotesByNet())
		}
		if !p.PolicyFound {
			bad("pair %v: no policy found", p.Remote)
		}
		if e.keys && p.SendEpoch != st.Send {
			spi, _ := encryption.SPI(stressSecret, local, p.Remote, st.Send, st.Gen)
			bad("pair %v: policy points at epoch %d, want %d (spi %#x of generation %016x)", p.Remote, p.SendEpoch, st.Send, spi, st.Gen)
		}
		if !espKernel() && (p.SendSA.Installed || len(p.Inbound) != 0) {
			bad("pair %v: SAs %+v %+v on a kernel that cannot install them", p.Remote, p.SendSA, p.Inbound)
		}
	}
	if !slices.Equal(pairs, wantRemotes) {
		bad("pairs %v, want %v", pairs, wantRemotes)
	}
	// The policies point at the SA of the current epoch and generation
	// (derived: the same SPI as the owner's), also on this kernel where
	// the SA itself cannot exist.
	if got, err := dumpEncryption(e); err == nil && e.keys {
		for _, p := range got.policies {
			if spi, err := encryption.SPI(stressSecret, local, p.remote, st.Send, st.Gen); err != nil || p.spi != spi {
				bad("policy to %v has template spi %#x, want %#x (epoch %d, generation %016x) %v", p.remote, p.spi, spi, st.Send, st.Gen, err)
			}
		}
	}
	if st.ESPUnsupported {
		es.espUnsupported++
	}
	if e.keys && !espKernel() && len(wantRemotes) > 0 && !st.ESPUnsupported {
		bad("remote VTEPs %v need SAs this kernel cannot install, but the owner does not report ESPUnsupported", wantRemotes)
	}
	if st.Error != "" && !(st.ESPUnsupported && strings.Contains(st.Error, encryption.ErrKernelUnsupported.Error())) {
		bad("status error %q", st.Error)
	}
	if st.Repairs != 0 {
		bad("%d repairs (last: %s): nothing changes the kernel behind the owner's back here", st.Repairs, st.LastRepairWas)
	}
	for _, p := range filterAudit(e, "", e.owner.Audit(), es) {
		bad("Audit: %s", p)
	}
	es.ownerChecks++
	return diffs
}

// saMissing is how the owner's Audit reports an SA the kernel does not
// hold: tolerated (and counted) on a kernel that cannot install ESP
// states, for a remote that needs one; never seen so far, since the owner
// leaves SAs out of its desired state once it knows (ESPUnsupported).
var saMissing = regexp.MustCompile(`^xfrm: (in|out)bound SA .* \(epoch \d+\) missing$`)

// filterAudit returns the Audit lines (after prefix) that are differences
// on this kernel: every line but the SAs this kernel cannot hold.
func filterAudit(e *env, prefix string, lines []string, es *encStats) []string {
	var out []string
	for _, l := range lines {
		rest, ours := strings.CutPrefix(l, prefix)
		if ours && e.keys && !espKernel() && saMissing.MatchString(rest) {
			if es != nil {
				es.saMissing++
			}
			continue
		}
		out = append(out, l)
	}
	return out
}

func (m *model) encNets() []string {
	var ids []string
	for id, n := range m.nets {
		if n.encrypted {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return ids
}

func minusVNIs(a, b []uint32) []uint32 {
	var out []uint32
	for _, v := range a {
		if !slices.Contains(b, v) {
			out = append(out, v)
		}
	}
	return out
}

func orEmpty(s []uint32) []uint32 {
	if s == nil {
		return []uint32{}
	}
	return s
}
