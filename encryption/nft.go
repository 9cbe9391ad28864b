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
	SetName       = "encrypted_vnis"
	ChainMark     = "encrypt_mark" // type route, hook output: mark encrypted VXLAN
	ChainOutDrop  = "encrypt_out"  // hook postrouting: drop encrypted VXLAN that xfrm did not transform
	ChainInDrop   = "encrypt_in"   // hook input: drop encrypted VXLAN that did not arrive through ESP
	rulePrefixTag = "overlayd v1 "
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
	port       int
	mark, mask uint32
	vnis       []uint32 // sorted, unique
}

func nftOf(d *Desired) *nftDesired {
	if d.Empty() {
		return nil
	}
	m, mask := d.mark()
	v := slices.Clone(d.VNIs)
	slices.Sort(v)
	return &nftDesired{port: d.Port, mark: m, mask: mask, vnis: slices.Compact(v)}
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

// matchEncryptedVNI: "@th,96,24 @encrypted_vnis" — the VNI is bytes 4..6 of
// the VXLAN header, which follows the 8-byte UDP header.
func matchEncryptedVNI() []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 8 + 4, Len: 3},
		&expr.Lookup{SourceRegister: 1, SetName: SetName},
	}
}

var chains = []chainSpec{
	{
		// Marking must happen in a route chain: the kernel re-routes the
		// packet when the chain changed its mark, and that route lookup is
		// where the xfrm policy (selected by the mark) applies.
		name: ChainMark, typ: nftables.ChainTypeRoute, hook: nftables.ChainHookOutput, prio: nftables.ChainPriorityMangle,
		role: "mark",
		exprs: func(n *nftDesired) []expr.Any {
			e := matchVXLAN(n.port)
			e = append(e, matchEncryptedVNI()...)
			val := make([]byte, 4)
			binary.NativeEndian.PutUint32(val, n.mark)
			if n.mask == 0xffffffff {
				// meta mark set MARK
				e = append(e, &expr.Immediate{Register: 1, Data: val})
			} else {
				// meta mark set meta mark & ~MASK | MARK
				mask := make([]byte, 4)
				binary.NativeEndian.PutUint32(mask, ^n.mask)
				e = append(e,
					&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
					&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: val},
				)
			}
			return append(e,
				&expr.Meta{Key: expr.MetaKeyMARK, SourceRegister: true, Register: 1},
				&expr.Counter{},
			)
		},
	},
	{
		// Fail closed on the way out: encrypted VXLAN whose route carries no
		// xfrm transform is dropped, whatever its mark (a missing policy or
		// SA, a mark rewritten by someone else, a rule missing). Transformed
		// packets pass here in clear with the xfrm route and leave as ESP.
		name: ChainOutDrop, typ: nftables.ChainTypeFilter, hook: nftables.ChainHookPostrouting, prio: nftables.ChainPriorityFilter,
		role: "out-drop",
		exprs: func(n *nftDesired) []expr.Any {
			e := matchVXLAN(n.port)
			e = append(e, matchEncryptedVNI()...)
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
			e = append(e, matchEncryptedVNI()...)
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
	return fmt.Sprintf("%s%s port=%d mark=%#x/%#x", rulePrefixTag, role, n.port, n.mark, n.mask)
}

func vniSet() *nftables.Set {
	return &nftables.Set{
		Table:        table,
		Name:         SetName,
		KeyType:      vniType,
		KeyByteOrder: binaryutil.BigEndian,
	}
}

// nftActual is what the kernel holds of our table.
type nftActual struct {
	exists bool
	// ok is true when the table has exactly our set and chains, each chain
	// exactly its one rule with the tag and expressions desired: then only
	// set elements need to change.
	ok       bool
	problems []string
	vnis     []uint32
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
	var set *nftables.Set
	for _, s := range sets {
		if s.Name == SetName {
			set = s
		} else {
			problem("nft: unexpected set %s in table inet %s", s.Name, TableName)
		}
	}
	if set == nil {
		problem("nft: set %s missing", SetName)
	} else {
		if set.KeyType.Bytes != vniType.Bytes || set.Interval || set.IsMap || set.HasTimeout || set.Constant {
			problem("nft: set %s has the wrong type", SetName)
		}
		p.stats.NftDumps++
		elems, err := p.nft.GetSetElements(set)
		if err != nil {
			return nil, fmt.Errorf("failed to list elements of set %s: %w", SetName, err)
		}
		for _, e := range elems {
			v, ok := vniFromKey(e.Key)
			if !ok {
				problem("nft: set %s holds a malformed element %x", SetName, e.Key)
				continue
			}
			a.vnis = append(a.vnis, v)
		}
		slices.Sort(a.vnis)
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

// nftBuild queues, on p.nft, the creation of the whole table holding vnis.
// If the table exists it is deleted first in the same batch: the batch is
// one nftables transaction, so packets see either the old table or the new
// one, never none.
func (p *Programmer) nftBuild(n *nftDesired, exists bool, vnis []uint32) error {
	if exists {
		p.nft.DelTable(table)
	}
	p.nft.AddTable(table)
	set := vniSet()
	elems := make([]nftables.SetElement, 0, len(vnis))
	for _, v := range vnis {
		elems = append(elems, nftables.SetElement{Key: vniKey(v)})
	}
	if err := p.nft.AddSet(set, elems); err != nil {
		return fmt.Errorf("failed to queue nftables set %s: %w", SetName, err)
	}
	policy := nftables.ChainPolicyAccept
	for _, spec := range chains {
		c := p.nft.AddChain(&nftables.Chain{Name: spec.name, Table: table, Type: spec.typ, Hooknum: spec.hook, Priority: spec.prio, Policy: &policy})
		exprs := spec.exprs(n)
		for _, e := range exprs {
			if l, ok := e.(*expr.Lookup); ok {
				l.SetID = set.ID
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
	return nil
}

// nftWiden makes the table exist with its rules and at least the desired
// VNIs (more VNIs than desired only means more is encrypted): the first step
// of Apply, before any xfrm change.
func (p *Programmer) nftWiden(n *nftDesired, a *nftActual) error {
	if n == nil {
		return nil
	}
	if !a.ok {
		union := slices.Clone(a.vnis)
		union = append(union, n.vnis...)
		slices.Sort(union)
		union = slices.Compact(union)
		if err := p.nftBuild(n, a.exists, union); err != nil {
			return err
		}
		if err := p.nftFlush("install encryption rules"); err != nil {
			return err
		}
		p.stats.NftRebuilds++
		a.exists, a.ok, a.vnis, a.problems = true, true, union, nil
		return nil
	}
	var add []nftables.SetElement
	for _, v := range n.vnis {
		if _, ok := slices.BinarySearch(a.vnis, v); !ok {
			add = append(add, nftables.SetElement{Key: vniKey(v)})
		}
	}
	if len(add) == 0 {
		return nil
	}
	if err := p.nft.SetAddElements(vniSet(), add); err != nil {
		return fmt.Errorf("failed to queue VNIs for set %s: %w", SetName, err)
	}
	if err := p.nftFlush(fmt.Sprintf("add %d encrypted VNIs", len(add))); err != nil {
		return err
	}
	p.stats.NftElements += len(add)
	for _, e := range add {
		v, _ := vniFromKey(e.Key)
		a.vnis = append(a.vnis, v)
	}
	slices.Sort(a.vnis)
	return nil
}

// nftNarrow removes VNIs no longer encrypted, or the whole table when none
// is: the last step of Apply, after xfrm state no longer needs them.
func (p *Programmer) nftNarrow(n *nftDesired, a *nftActual) error {
	if !a.exists {
		return nil
	}
	if n == nil {
		p.nft.DelTable(table)
		if err := p.nftFlush("remove encryption rules"); err != nil {
			return err
		}
		a.exists, a.vnis = false, nil
		return nil
	}
	var del []nftables.SetElement
	for _, v := range a.vnis {
		if _, ok := slices.BinarySearch(n.vnis, v); !ok {
			del = append(del, nftables.SetElement{Key: vniKey(v)})
		}
	}
	if len(del) == 0 {
		return nil
	}
	if err := p.nft.SetDeleteElements(vniSet(), del); err != nil {
		return fmt.Errorf("failed to queue VNI removal from set %s: %w", SetName, err)
	}
	if err := p.nftFlush(fmt.Sprintf("remove %d VNIs from the encrypted set", len(del))); err != nil {
		return err
	}
	p.stats.NftElements += len(del)
	a.vnis = slices.Clone(n.vnis)
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
	for _, v := range n.vnis {
		if _, ok := slices.BinarySearch(a.vnis, v); !ok {
			out = append(out, fmt.Sprintf("nft: VNI %d missing from set %s", v, SetName))
		}
	}
	for _, v := range a.vnis {
		if _, ok := slices.BinarySearch(n.vnis, v); !ok {
			out = append(out, fmt.Sprintf("nft: VNI %d in set %s but not encrypted", v, SetName))
		}
	}
	return out
}
