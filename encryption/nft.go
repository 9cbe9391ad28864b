package encryption

import (
	"encoding/binary"
	"fmt"
	"reflect"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"golang.org/x/sys/unix"
)

// The nftables objects overlayd owns: one table, family inet (IPv4 and IPv6
// underlays alike), created only while some VNI is encrypted.
const (
	TableName     = "overlayd"
	SetName       = "encrypted_vnis" // VNIs dropped when they would cross without ESP
	ClearSetName  = "clear_vnis"     // VNIs marked ClearMark: let out in clear by the clear policy
	ChainMark     = "clear_mark"     // type route, hook output: mark unencrypted VXLAN
	ChainOutDrop  = "encrypt_out"    // hook postrouting: drop encrypted VXLAN that xfrm did not transform
	ChainInDrop   = "encrypt_in"     // hook input: drop encrypted VXLAN that did not arrive through ESP
	rulePrefixTag = "overlayd v2 "
)

// Kernel constants golang.org/x/sys does not name.
const (
	nftMetaSecpath = 25 // NFT_META_SECPATH: 1 if the packet was decrypted by xfrm
	nftRtXfrm      = 4  // NFT_RT_XFRM: 1 if the route (dst) carries an xfrm bundle
)

// vniType is a 3-byte big-endian integer: the VNI field of the VXLAN header.
var vniType = func() nftables.SetDatatype {
	t := nftables.SetDatatype{Name: "integer", Bytes: 3}
	t.SetNFTMagic(nftables.TypeInteger.GetNFTMagic())
	return t
}()

func vniKey(v uint32) []byte { return []byte{byte(v >> 16), byte(v >> 8), byte(v)} }

func vniFromKey(b []byte) (uint32, bool) {
	if len(b) != 3 {
		return 0, false
	}
	return uint32(b[0])<<16 | uint32(b[1])<<8 | uint32(b[2]), true
}

// nftDesired is the nftables part of a Desired.
type nftDesired struct {
	port  int
	vnis  []uint32 // encrypted, sorted, unique
	clear []uint32 // unencrypted, sorted, unique, none in vnis
}

func sortedVNIs(in []uint32) []uint32 {
	v := slices.Clone(in)
	slices.Sort(v)
	return slices.Compact(v)
}

func nftOf(d *Desired) *nftDesired {
	if d.Empty() {
		return nil
	}
	return &nftDesired{port: d.Port, vnis: sortedVNIs(d.VNIs), clear: sortedVNIs(d.ClearVNIs)}
}

var table = &nftables.Table{Name: TableName, Family: nftables.TableFamilyINet}

type chainSpec struct {
	name  string
	typ   nftables.ChainType
	hook  *nftables.ChainHook
	prio  *nftables.ChainPriority
	role  string
	exprs func(n *nftDesired) []expr.Any
}

// matchVXLAN loads and compares "meta l4proto udp udp dport PORT".
func matchVXLAN(port int) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_UDP}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(uint16(port))},
	}
}

// matchVNIIn: "@th,96,24 @set" — the VNI is bytes 4..6 of the VXLAN
// header, which follows the 8-byte UDP header.
func matchVNIIn(set string) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 8 + 4, Len: 3},
		&expr.Lookup{SourceRegister: 1, SetName: set},
	}
}

var chains = []chainSpec{
	{
		// Marking must happen in a route chain: the kernel re-routes the
		// packet when the chain changed its mark, and that route lookup is
		// where the clear policy (selected by the mark) applies. Only
		// clear VNIs are marked; without the mark a packet to a remote with
		// a policy is encrypted.
		name: ChainMark, typ: nftables.ChainTypeRoute, hook: nftables.ChainHookOutput, prio: nftables.ChainPriorityMangle,
		role: "clear-mark",
		exprs: func(n *nftDesired) []expr.Any {
			e := matchVXLAN(n.port)
			e = append(e, matchVNIIn(ClearSetName)...)
			val := make([]byte, 4)
			binary.NativeEndian.PutUint32(val, ClearMark)
			// meta mark set CLEAR (the mask is the whole mark)
			return append(e,
				&expr.Immediate{Register: 1, Data: val},
				&expr.Meta{Key: expr.MetaKeyMARK, SourceRegister: true, Register: 1},
				&expr.Counter{},
			)
		},
	},
	{
		// Fail closed on the way out: encrypted VXLAN whose route carries no
		// xfrm transform is dropped, whatever its mark (a missing SA, a
		// mark set by someone else). Transformed packets pass here in clear
		// with the xfrm route and leave as ESP.
		name: ChainOutDrop, typ: nftables.ChainTypeFilter, hook: nftables.ChainHookPostrouting, prio: nftables.ChainPriorityFilter,
		role: "out-drop",
		exprs: func(n *nftDesired) []expr.Any {
			e := matchVXLAN(n.port)
			e = append(e, matchVNIIn(SetName)...)
			return append(e,
				&expr.Rt{Register: 1, Key: expr.RtKey(nftRtXfrm)},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{0}},
				&expr.Counter{},
				&expr.Verdict{Kind: expr.VerdictDrop},
			)
		},
	},
	{
		// Fail closed on the way in: encrypted VXLAN that was not decrypted
		// by xfrm (no secpath) is dropped before the VXLAN socket sees it.
		name: ChainInDrop, typ: nftables.ChainTypeFilter, hook: nftables.ChainHookInput, prio: nftables.ChainPriorityFilter,
		role: "in-drop",
		exprs: func(n *nftDesired) []expr.Any {
			e := matchVXLAN(n.port)
			e = append(e, matchVNIIn(SetName)...)
			return append(e,
				&expr.Meta{Key: expr.MetaKey(nftMetaSecpath), Register: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{0}},
				&expr.Counter{},
				&expr.Verdict{Kind: expr.VerdictDrop},
			)
		},
	},
}

// ruleTag identifies one of our rules and everything it depends on; it is
// stored as the rule's comment, so `nft list` shows it.
func ruleTag(role string, n *nftDesired) string {
	return fmt.Sprintf("%s%s port=%d clear-mark=%#x", rulePrefixTag, role, n.port, ClearMark)
}

func vniSet(name string) *nftables.Set {
	return &nftables.Set{
		Table:        table,
		Name:         name,
		KeyType:      vniType,
		KeyByteOrder: binaryutil.BigEndian,
	}
}

// nftActual is what the kernel holds of our table.
type nftActual struct {
	exists bool
	// ok is true when the table has exactly our sets and chains, each chain
	// exactly its one rule with the tag and expressions desired: then only
	// set elements need to change.
	ok       bool
	problems []string
	vnis     []uint32                // encrypted_vnis
	clear    []uint32                // clear_vnis
	counters map[string]expr.Counter // by chain name
}

func (p *Programmer) nftDump(n *nftDesired) (*nftActual, error) {
	a := &nftActual{counters: map[string]expr.Counter{}}
	p.stats.NftDumps++
	tables, err := p.nft.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return nil, fmt.Errorf("failed to list nftables tables: %w", err)
	}
	for _, t := range tables {
		if t.Name == TableName {
			a.exists = true
		}
	}
	if !a.exists {
		return a, nil
	}
	problem := func(f string, args ...any) { a.problems = append(a.problems, fmt.Sprintf(f, args...)) }

	p.stats.NftDumps++
	sets, err := p.nft.GetSets(table)
	if err != nil {
		return nil, fmt.Errorf("failed to list sets of table inet %s: %w", TableName, err)
	}
	found := map[string]bool{}
	for _, set := range sets {
		var dst *[]uint32
		switch set.Name {
		case SetName:
			dst = &a.vnis
		case ClearSetName:
			dst = &a.clear
		default:
			problem("nft: unexpected set %s in table inet %s", set.Name, TableName)
			continue
		}
		found[set.Name] = true
		if set.KeyType.Bytes != vniType.Bytes || set.Interval || set.IsMap || set.HasTimeout || set.Constant {
			problem("nft: set %s has the wrong type", set.Name)
		}
		p.stats.NftDumps++
		elems, err := p.nft.GetSetElements(set)
		if err != nil {
			return nil, fmt.Errorf("failed to list elements of set %s: %w", set.Name, err)
		}
		for _, e := range elems {
			v, ok := vniFromKey(e.Key)
			if !ok {
				problem("nft: set %s holds a malformed element %x", set.Name, e.Key)
				continue
			}
			*dst = append(*dst, v)
		}
		slices.Sort(*dst)
	}
	for _, name := range []string{SetName, ClearSetName} {
		if !found[name] {
			problem("nft: set %s missing", name)
		}
	}

	p.stats.NftDumps++
	allChains, err := p.nft.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return nil, fmt.Errorf("failed to list chains of table inet %s: %w", TableName, err)
	}
	got := map[string]*nftables.Chain{}
	for _, c := range allChains {
		if c.Table != nil && c.Table.Name == TableName {
			got[c.Name] = c
		}
	}
	for _, spec := range chains {
		c, ok := got[spec.name]
		if !ok {
			problem("nft: chain %s missing", spec.name)
			continue
		}
		delete(got, spec.name)
		if c.Type != spec.typ || c.Hooknum == nil || *c.Hooknum != *spec.hook || c.Priority == nil || *c.Priority != *spec.prio {
			problem("nft: chain %s has the wrong type, hook or priority", spec.name)
		}
		if c.Policy != nil && *c.Policy != nftables.ChainPolicyAccept {
			problem("nft: chain %s has policy drop", spec.name)
		}
		p.stats.NftDumps++
		rules, err := p.nft.GetRules(table, c)
		if err != nil {
			return nil, fmt.Errorf("failed to list rules of chain %s: %w", spec.name, err)
		}
		if n == nil {
			continue
		}
		want := ruleTag(spec.role, n)
		if len(rules) != 1 {
			problem("nft: chain %s has %d rules, want 1", spec.name, len(rules))
		}
		for _, r := range rules {
			tag, _ := userdata.GetString(r.UserData, userdata.TypeComment)
			if tag != want {
				problem("nft: chain %s: rule %q, want %q", spec.name, tag, want)
				continue
			}
			if d := diffExprs(r.Exprs, spec.exprs(n)); d != "" {
				problem("nft: chain %s: rule %q differs: %s", spec.name, tag, d)
			}
			for _, e := range r.Exprs {
				if c, ok := e.(*expr.Counter); ok {
					a.counters[spec.name] = *c
				}
			}
		}
	}
	for name := range got {
		problem("nft: unexpected chain %s in table inet %s", name, TableName)
	}
	a.ok = n != nil && len(a.problems) == 0
	return a, nil
}

// diffExprs compares the expressions the kernel returned with the desired
// ones, ignoring what a dump cannot reproduce: counter values, set ids, and
// expressions the library does not parse (rt), which it leaves out.
func diffExprs(got, want []expr.Any) string {
	norm := func(in []expr.Any) []expr.Any {
		var out []expr.Any
		for _, e := range in {
			switch v := e.(type) {
			case *expr.Rt:
				continue
			case *expr.Counter:
				out = append(out, &expr.Counter{})
			case *expr.Lookup:
				c := *v
				c.SetID = 0
				out = append(out, &c)
			default:
				out = append(out, e)
			}
		}
		return out
	}
	g, w := norm(got), norm(want)
	if len(g) != len(w) {
		return fmt.Sprintf("%d expressions, want %d", len(g), len(w))
	}
	for i := range g {
		if !reflect.DeepEqual(g[i], w[i]) {
			return fmt.Sprintf("expression %d is %T %+v, want %+v", i, g[i], g[i], w[i])
		}
	}
	return ""
}

func elements(vnis []uint32) []nftables.SetElement {
	out := make([]nftables.SetElement, 0, len(vnis))
	for _, v := range vnis {
		out = append(out, nftables.SetElement{Key: vniKey(v)})
	}
	return out
}

// nftBuild queues, on p.nft, the creation of the whole table holding vnis
// (encrypted) and clear. If the table exists it is deleted first in the
// same batch: the batch is one nftables transaction, so packets see either
// the old table or the new one, never none.
func (p *Programmer) nftBuild(n *nftDesired, exists bool, vnis, clear []uint32) error {
	if exists {
		p.nft.DelTable(table)
	}
	p.nft.AddTable(table)
	sets := map[string]*nftables.Set{}
	for name, elems := range map[string][]uint32{SetName: vnis, ClearSetName: clear} {
		set := vniSet(name)
		if err := p.nft.AddSet(set, elements(elems)); err != nil {
			return fmt.Errorf("failed to queue nftables set %s: %w", name, err)
		}
		sets[name] = set
	}
	policy := nftables.ChainPolicyAccept
	for _, spec := range chains {
		c := p.nft.AddChain(&nftables.Chain{Name: spec.name, Table: table, Type: spec.typ, Hooknum: spec.hook, Priority: spec.prio, Policy: &policy})
		exprs := spec.exprs(n)
		for _, e := range exprs {
			if l, ok := e.(*expr.Lookup); ok {
				l.SetID = sets[l.SetName].ID
			}
		}
		p.nft.AddRule(&nftables.Rule{
			Table:    table,
			Chain:    c,
			Exprs:    exprs,
			UserData: userdata.AppendString(nil, userdata.TypeComment, ruleTag(spec.role, n)),
		})
	}
	return nil
}

func (p *Programmer) nftFlush(what string) error {
	p.stats.NftBatches++
	if err := p.nft.Flush(); err != nil {
		return fmt.Errorf("failed to %s (nftables table inet %s): %w", what, TableName, err)
	}
	p.changed++
	return nil
}

// minus returns the elements of a (sorted) not in b (sorted).
func minus(a, b []uint32) []uint32 {
	var out []uint32
	for _, v := range a {
		if _, ok := slices.BinarySearch(b, v); !ok {
			out = append(out, v)
		}
	}
	return out
}

func union(a, b []uint32) []uint32 { return sortedVNIs(slices.Concat(a, b)) }

// nftWiden makes the table exist with its rules, at least the desired
// encrypted VNIs (more VNIs encrypted than desired only means more is
// dropped) and the desired clear VNIs, none of them encrypted: the first
// step of Apply, before any xfrm change, in one transaction.
func (p *Programmer) nftWiden(n *nftDesired, a *nftActual) error {
	if n == nil {
		return nil
	}
	vnis := union(a.vnis, n.vnis)
	clear := minus(union(a.clear, n.clear), n.vnis)
	if !a.ok {
		if err := p.nftBuild(n, a.exists, vnis, clear); err != nil {
			return err
		}
		if err := p.nftFlush("install encryption rules"); err != nil {
			return err
		}
		p.stats.NftRebuilds++
		a.exists, a.ok, a.vnis, a.clear, a.problems = true, true, vnis, clear, nil
		return nil
	}
	addEnc, addClear, delClear := minus(vnis, a.vnis), minus(clear, a.clear), minus(a.clear, clear)
	if len(addEnc)+len(addClear)+len(delClear) == 0 {
		return nil
	}
	// Encrypted first: a VNI moving from clear to encrypted is in both sets
	// for no packet's time (one transaction), and in both it is dropped.
	for _, op := range []struct {
		set  string
		vnis []uint32
		add  bool
	}{{SetName, addEnc, true}, {ClearSetName, delClear, false}, {ClearSetName, addClear, true}} {
		if len(op.vnis) == 0 {
			continue
		}
		var err error
		if op.add {
			err = p.nft.SetAddElements(vniSet(op.set), elements(op.vnis))
		} else {
			err = p.nft.SetDeleteElements(vniSet(op.set), elements(op.vnis))
		}
		if err != nil {
			return fmt.Errorf("failed to queue VNIs %v for set %s: %w", op.vnis, op.set, err)
		}
	}
	if err := p.nftFlush(fmt.Sprintf("add encrypted VNIs %v, clear VNIs %v, remove clear VNIs %v", addEnc, addClear, delClear)); err != nil {
		return err
	}
	p.stats.NftElements += len(addEnc) + len(addClear) + len(delClear)
	a.vnis, a.clear = vnis, clear
	return nil
}

// nftNarrow removes VNIs no longer encrypted or clear, or the whole table
// when no VNI is encrypted: the last step of Apply, after xfrm state no
// longer needs them.
func (p *Programmer) nftNarrow(n *nftDesired, a *nftActual) error {
	if !a.exists {
		return nil
	}
	if n == nil {
		p.nft.DelTable(table)
		if err := p.nftFlush("remove encryption rules"); err != nil {
			return err
		}
		a.exists, a.vnis, a.clear = false, nil, nil
		return nil
	}
	delEnc, delClear := minus(a.vnis, n.vnis), minus(a.clear, n.clear)
	if len(delEnc)+len(delClear) == 0 {
		return nil
	}
	for set, vnis := range map[string][]uint32{SetName: delEnc, ClearSetName: delClear} {
		if len(vnis) == 0 {
			continue
		}
		if err := p.nft.SetDeleteElements(vniSet(set), elements(vnis)); err != nil {
			return fmt.Errorf("failed to queue removal of VNIs %v from set %s: %w", vnis, set, err)
		}
	}
	if err := p.nftFlush(fmt.Sprintf("remove VNIs %v (encrypted) and %v (clear)", delEnc, delClear)); err != nil {
		return err
	}
	p.stats.NftElements += len(delEnc) + len(delClear)
	a.vnis, a.clear = slices.Clone(n.vnis), slices.Clone(n.clear)
	return nil
}

// nftAudit lists the differences between the table and n.
func nftAudit(n *nftDesired, a *nftActual) []string {
	if n == nil {
		if a.exists {
			return []string{fmt.Sprintf("nft: table inet %s exists but no VNI is encrypted", TableName)}
		}
		return nil
	}
	if !a.exists {
		return []string{fmt.Sprintf("nft: table inet %s missing", TableName)}
	}
	out := slices.Clone(a.problems)
	for _, s := range []struct {
		name      string
		want, got []uint32
	}{{SetName, n.vnis, a.vnis}, {ClearSetName, n.clear, a.clear}} {
		for _, v := range minus(s.want, s.got) {
			out = append(out, fmt.Sprintf("nft: VNI %d missing from set %s", v, s.name))
		}
		for _, v := range minus(s.got, s.want) {
			out = append(out, fmt.Sprintf("nft: VNI %d in set %s but not desired there", v, s.name))
		}
	}
	return out
}
