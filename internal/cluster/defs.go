package cluster

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"

	"github.com/overlayd/overlayd/internal/netdef"
)

// Network definitions: each node gossips, per VNI it has a network for,
// that network's definition (netdef.Definition). They are a record kind of
// their own, owned by their node, replicated like the peer records but as
// one set per node: a defs message (type 6, protocol version 2) carries the
// node's complete set as of its clock, and a receiver keeps the newest set
// of each origin's current incarnation (a last-writer-wins register per
// origin, ordered by the origin's clock). So a deleted network's
// definition needs no tombstone: the next set lacks it.
//
// The set is sent to every member that speaks protocol 2 whenever it
// changes, with every snapshot (so on every join, return and restart, which
// all ask for one) and with every digest (at most DigestMaxInterval apart):
// a lost packet is repaired by the next digest, about a second after a
// change. Members of protocol 1 are never sent one (they would drop it as
// an unknown type).
//
// A node's definitions are in force exactly when its records are (alive,
// or dead within FailedGrace; see inForce), and a restarted node's former
// set stays in force until its new incarnation sends its own. Every change
// of what is in force for a VNI is reported to the Watcher as
// PeersChanged(vni, nil): the driver re-checks the VNI's definitions and
// pulls its records.

// defRecord is one VNI's definition on the wire.
type defRecord struct {
	VNI uint32
	Def netdef.Definition
}

// protoDefs is the first protocol version that carries definitions.
const protoDefs byte = 2

// protoDefs6 is the first protocol version whose definitions may have IPv6
// subnets (subnet flags beyond the gateway bit). A member of an older
// version would drop the whole set as malformed, so it is sent the set
// without the definitions that have IPv6: it cannot have a network that
// agrees with them anyway, and it holds our records of those VNIs back as
// it does for any VNI whose definition it lacks.
const protoDefs6 byte = 4

// defFlag bits of an encoded definition.
const (
	defEncrypted byte = 1 << 0
	defInternal  byte = 1 << 1
	knownDefBits      = defEncrypted | defInternal
)

// Subnet flags of an encoded definition. Protocol 2 and 3 know only
// subGateway (and refuse any other bit).
const (
	subGateway   byte = 1 << 0 // an IPv4 gateway follows
	subNoIPv4    byte = 1 << 1 // the segment has no IPv4 pool (pool and bits are zero)
	subIPv6      byte = 1 << 2 // IPv6 subnets follow (protocol 4)
	knownSubBits      = subGateway | subNoIPv4 | subIPv6
)

// appendDef appends a definition (valid, see validDef):
//
//	def    = vni:u24be flags:u8 mtu:u16be nsub:u8 subnet*nsub
//	subnet = vni:u24be pool:4 bits:u8 subFlags:u8 [gateway:4] [n6:u8 subnet6*n6]
//	subnet6 = pool:16 bits:u8 gwFlag:u8 (0|1) [gateway:16]
//
// A definition without IPv6 encodes exactly as in protocol 2.
func appendDef(b []byte, r *defRecord) []byte {
	b = append(b, byte(r.VNI>>16), byte(r.VNI>>8), byte(r.VNI))
	var flags byte
	if r.Def.Encrypted {
		flags |= defEncrypted
	}
	if r.Def.Internal {
		flags |= defInternal
	}
	b = append(b, flags)
	b = binary.BigEndian.AppendUint16(b, uint16(r.Def.MTU))
	b = append(b, byte(len(r.Def.Subnets)))
	for _, s := range r.Def.Subnets {
		b = append(b, byte(s.VNI>>16), byte(s.VNI>>8), byte(s.VNI))
		var sf byte
		if s.Pool.IsValid() {
			p := s.Pool.Addr().As4()
			b = append(b, p[:]...)
			b = append(b, byte(s.Pool.Bits()))
		} else {
			b = append(b, 0, 0, 0, 0, 0)
			sf |= subNoIPv4
		}
		if s.Gateway.IsValid() {
			sf |= subGateway
		}
		if len(s.IPv6) > 0 {
			sf |= subIPv6
		}
		b = append(b, sf)
		if s.Gateway.IsValid() {
			g := s.Gateway.Addr().As4()
			b = append(b, g[:]...)
		}
		if len(s.IPv6) > 0 {
			b = append(b, byte(len(s.IPv6)))
			for _, v := range s.IPv6 {
				p := v.Pool.Addr().As16()
				b = append(b, p[:]...)
				b = append(b, byte(v.Pool.Bits()))
				if v.Gateway.IsValid() {
					g := v.Gateway.Addr().As16()
					b = append(b, 1)
					b = append(b, g[:]...)
				} else {
					b = append(b, 0)
				}
			}
		}
	}
	return b
}

// minDefLen is the smallest encoded definition (one subnet, no gateway).
const minDefLen = 3 + 1 + 2 + 1 + (3 + 4 + 1 + 1)

func decodeDef(r *reader, d *defRecord) *decodeError {
	var err *decodeError
	if d.VNI, err = r.u24("definition VNI"); err != nil {
		return err
	}
	flags, err := r.u8("definition flags")
	if err != nil {
		return err
	}
	if flags&^knownDefBits != 0 {
		return derr(DropMalformed, "definition of VNI %d: unknown flags %#x", d.VNI, flags)
	}
	d.Def.Encrypted, d.Def.Internal = flags&defEncrypted != 0, flags&defInternal != 0
	mtu, err := r.bytes(2, "definition MTU")
	if err != nil {
		return err
	}
	d.Def.MTU = int(binary.BigEndian.Uint16(mtu))
	n, err := r.u8("definition subnet count")
	if err != nil {
		return err
	}
	d.Def.Subnets = make([]netdef.Subnet, n)
	for i := range d.Def.Subnets {
		s := &d.Def.Subnets[i]
		var err *decodeError
		if s.VNI, err = r.u24("subnet VNI"); err != nil {
			return err
		}
		pool, err := r.bytes(4, "subnet pool")
		if err != nil {
			return err
		}
		bits, err := r.u8("subnet prefix length")
		if err != nil {
			return err
		}
		if bits > 32 {
			return derr(DropInvalidDefinition, "definition of VNI %d: subnet %d prefix length %d", d.VNI, i, bits)
		}
		sf, err := r.u8("subnet flags")
		if err != nil {
			return err
		}
		if sf&^knownSubBits != 0 || sf&(subNoIPv4|subGateway) == subNoIPv4|subGateway {
			return derr(DropMalformed, "definition of VNI %d: subnet %d flags %#x", d.VNI, i, sf)
		}
		switch {
		case sf&subNoIPv4 == 0:
			s.Pool = netip.PrefixFrom(netip.AddrFrom4([4]byte(pool)), int(bits))
		case bits != 0 || [4]byte(pool) != [4]byte{}:
			return derr(DropMalformed, "definition of VNI %d: subnet %d has no IPv4 pool but pool bytes %v/%d", d.VNI, i, pool, bits)
		}
		if sf&subGateway != 0 {
			g, err := r.bytes(4, "subnet gateway")
			if err != nil {
				return err
			}
			s.Gateway = netip.PrefixFrom(netip.AddrFrom4([4]byte(g)), int(bits))
		}
		if sf&subIPv6 != 0 {
			if err := decodeSubnets6(r, d.VNI, i, s); err != nil {
				return err
			}
		}
	}
	if e := validDef(d); e != nil {
		return derr(DropInvalidDefinition, "definition of VNI %d: %v", d.VNI, e)
	}
	return nil
}

// decodeSubnets6 reads the IPv6 subnets of subnet i of the definition of
// vni into s.
func decodeSubnets6(r *reader, vni uint32, i int, s *netdef.Subnet) *decodeError {
	n, err := r.u8("IPv6 subnet count")
	if err != nil {
		return err
	}
	if n == 0 {
		return derr(DropMalformed, "definition of VNI %d: subnet %d announces IPv6 subnets but has none", vni, i)
	}
	s.IPv6 = make([]netdef.Subnet6, n)
	for k := range s.IPv6 {
		v := &s.IPv6[k]
		pool, err := r.bytes(16, "IPv6 subnet pool")
		if err != nil {
			return err
		}
		bits, err := r.u8("IPv6 subnet prefix length")
		if err != nil {
			return err
		}
		if bits > 128 {
			return derr(DropInvalidDefinition, "definition of VNI %d: subnet %d IPv6 subnet %d prefix length %d", vni, i, k, bits)
		}
		v.Pool = netip.PrefixFrom(netip.AddrFrom16([16]byte(pool)), int(bits))
		gw, err := r.u8("IPv6 subnet gateway flag")
		if err != nil {
			return err
		}
		switch gw {
		case 0:
		case 1:
			g, err := r.bytes(16, "IPv6 subnet gateway")
			if err != nil {
				return err
			}
			v.Gateway = netip.PrefixFrom(netip.AddrFrom16([16]byte(g)), int(bits))
		default:
			return derr(DropMalformed, "definition of VNI %d: subnet %d IPv6 subnet %d gateway flag %d", vni, i, k, gw)
		}
	}
	return nil
}

// validDef checks a definition record: a valid definition that defines
// its own VNI.
func validDef(d *defRecord) error {
	if d.VNI == 0 || d.VNI > MaxVNI {
		return fmt.Errorf("VNI %d out of 1..%d", d.VNI, MaxVNI)
	}
	if err := d.Def.Validate(); err != nil {
		return err
	}
	if !d.Def.Has(d.VNI) {
		return fmt.Errorf("none of its subnets has VNI %d", d.VNI)
	}
	return nil
}

// sortedDefs returns the definitions of m as records sorted by VNI.
func sortedDefs(m map[uint32]netdef.Definition) []defRecord {
	out := make([]defRecord, 0, len(m))
	for vni, d := range m {
		out = append(out, defRecord{VNI: vni, Def: d})
	}
	slices.SortFunc(out, func(a, b defRecord) int { return cmp.Compare(a.VNI, b.VNI) })
	return out
}

// --- this node's definitions (localStore) ---

// setDef sets (def non-nil) or withdraws (nil) this node's definition of
// vni and reports whether anything changed. An invalid definition is
// refused with the reason and withdrawn.
func (l *localStore) setDef(vni uint32, def *netdef.Definition) (bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.setDefLocked(vni, def)
}

// setDefLocked is setDef.
func (l *localStore) setDefLocked(vni uint32, def *netdef.Definition) (bool, error) {
	var invalid error
	if def != nil {
		r := defRecord{VNI: vni, Def: *def}
		if invalid = validDef(&r); invalid != nil {
			def = nil
		}
	}
	cur, had := l.defs[vni]
	switch {
	case def == nil && !had:
		return false, invalid
	case def == nil:
		delete(l.defs, vni)
	case had && netdef.Equal(&cur, def):
		return false, nil
	default:
		l.defs[vni] = cloneDef(*def)
	}
	l.defsVer = l.tickLocked()
	l.defChanged[vni] = l.defsVer
	return true, invalid
}

// syncDefs makes this node's definitions exactly defs, a list taken after
// mark (level-triggered repair, like sync for records): VNIs changed after
// mark are left as they are (a publication newer than the list wins). It
// returns the refusals and whether anything changed.
func (l *localStore) syncDefs(mark uint64, defs map[uint32]netdef.Definition) (map[uint32]error, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var errs map[uint32]error
	changed := false
	for vni, at := range l.defChanged {
		if at <= mark {
			delete(l.defChanged, vni) // older than the list: the list decides
		}
	}
	for vni, d := range defs {
		if _, newer := l.defChanged[vni]; newer {
			continue
		}
		ch, err := l.setDefLocked(vni, &d)
		changed = changed || ch
		if err != nil {
			if errs == nil {
				errs = map[uint32]error{}
			}
			errs[vni] = err
		}
	}
	for vni := range l.defs {
		if _, newer := l.defChanged[vni]; newer {
			continue
		}
		if _, ok := defs[vni]; !ok {
			ch, _ := l.setDefLocked(vni, nil)
			changed = changed || ch
		}
	}
	return errs, changed
}

// defsMessage returns this node's complete set of definitions; without
// withIPv6 (a member older than protoDefs6), those that have IPv6 subnets
// are left out.
func (l *localStore) defsMessage(withIPv6 bool) *message {
	l.mu.Lock()
	defer l.mu.Unlock()
	defs := sortedDefs(l.defs)
	if !withIPv6 {
		defs = slices.DeleteFunc(defs, func(r defRecord) bool { return r.Def.HasIPv6() })
	}
	return &message{Type: msgDefs, Origin: l.name, Incarnation: l.inc, AsOf: max(l.defsVer, 1), Defs: defs}
}

func cloneDef(d netdef.Definition) netdef.Definition {
	d.Subnets = slices.Clone(d.Subnets)
	for i := range d.Subnets {
		d.Subnets[i].IPv6 = slices.Clone(d.Subnets[i].IPv6)
	}
	return d
}

// --- remote definitions (replica; Cluster.mu held) ---

// applyDefs keeps the origin's set m if it is newer than the one held;
// VNIs whose definition changed are reported.
func (s *replica) applyDefs(name string, o *origin, m *message) {
	if m.AsOf <= o.defsVer {
		s.stats.StaleDefs++
		return
	}
	s.stats.Defs++
	nu := make(map[uint32]netdef.Definition, len(m.Defs))
	for _, d := range m.Defs {
		nu[d.VNI] = d.Def
	}
	s.gained(name, o, nu) // before o.defs is replaced: it compares with it
	for vni, d := range o.defs {
		if n, ok := nu[vni]; !ok || !netdef.Equal(&d, &n) {
			s.dirtyVNI(vni)
		}
	}
	for vni := range nu {
		if _, ok := o.defs[vni]; !ok {
			s.dirtyVNI(vni)
		}
	}
	// Replaced whole, never modified in place: interestOf hands the map
	// out beyond Cluster.mu.
	o.defs, o.defsVer = nu, m.AsOf
}

// markDefs reports every VNI o defines (its definitions' being in force
// may have changed).
func (s *replica) markDefs(o *origin) {
	for vni := range o.defs {
		s.dirtyVNI(vni)
	}
}

// definitions returns the definitions of vni in force, by host name
// order, and as Pending every member in force that speaks protocolDefs
// but has none of vni in force (it has no network of vni, or its set has
// not arrived yet). It visits the members, not the records.
//
// The names are sorted, not the entries: moving whole entries (with their
// pointers) about cost most of the time at 100 members.
func (s *replica) definitions(vni uint32) []netdef.Remote {
	names := make([]string, 0, len(s.members))
	for name, m := range s.members {
		if s.inForce(name, m) && m.meta.ProtoMax >= protoDefs {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		return nil
	}
	slices.Sort(names)
	out := make([]netdef.Remote, 0, len(names))
	for _, name := range names {
		r, _ := s.definitionOf(vni, name, s.members[name])
		r.Def = cloneDef(r.Def)
		out = append(out, r)
	}
	return out
}

// definitionOf is member m's (named name) entry in definitions(vni), if it
// has one (it is in force and speaks protocolDefs). The definition is the
// origin's own, not a copy: read it under Cluster.mu, or copy it.
func (s *replica) definitionOf(vni uint32, name string, m *member) (netdef.Remote, bool) {
	if !s.inForce(name, m) || m.meta.ProtoMax < protoDefs {
		return netdef.Remote{}, false
	}
	r := netdef.Remote{Host: name, VTEP: m.meta.VTEP, Pending: true}
	if o := s.origins[name]; o != nil && o.inc == m.meta.Incarnation {
		if d, ok := o.defs[vni]; ok {
			r.Def, r.Pending = d, false
		}
	}
	return r, true
}

// --- API ---

// PublishDefinition sets (def non-nil) or withdraws (nil) this node's
// definition of the network that has vni; every member is sent the new set.
// Like PublishLocalPeer it never blocks and never calls back, so it may be
// called under the caller's network lock. An invalid definition is
// withdrawn and the reason returned.
func (c *Cluster) PublishDefinition(vni uint32, def *netdef.Definition) error {
	changed, err := c.local.setDef(vni, def)
	if changed {
		c.defsChanged.Store(true)
		c.wakePublisher()
	}
	if err != nil {
		return fmt.Errorf("cluster: definition of VNI %d: %w", vni, err)
	}
	return nil
}

// SyncDefinitions makes this node's definitions exactly defs, one per VNI
// of every local network, listed after mark (LocalMark): VNIs published
// after mark stay as they are (a network created or deleted while the list
// was taken wins). The daemon runs it periodically: level-triggered
// repair; unchanged ones cost nothing. It never blocks. Invalid ones are
// withdrawn, counted and logged.
func (c *Cluster) SyncDefinitions(mark uint64, defs map[uint32]netdef.Definition) {
	errs, changed := c.local.syncDefs(mark, defs)
	for vni, err := range errs {
		c.countDrop(DropLocalInvalid)
		c.logLimited(slog.LevelWarn, fmt.Sprintf("localdef:%d", vni), "refusing to publish an invalid network definition", "vni", vni, "error", err)
	}
	if changed {
		c.defsChanged.Store(true)
		c.wakePublisher()
	}
}

// Definitions returns the definitions other nodes have in force for vni
// (never this node's), sorted by node name, with every other member that
// speaks definitions but has none of vni in force as Pending (members of
// protocol 1 are not listed). Safe for concurrent use; it
// takes only Cluster.mu briefly, so callers may hold a network lock.
func (c *Cluster) Definitions(vni uint32) []netdef.Remote {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.replica.definitions(vni)
}

// DefinitionOf returns host's entry in Definitions(vni) without listing the
// others: ok is false when host has none (not a member in force, this
// node, or of protocol 1). It costs a few map lookups, not a visit of
// every member: a pull of some hosts' records asks only about them. Def
// shares memory with the cluster's (which replaces a host's definitions
// whole, never in place): read it, never modify it. Safe for concurrent
// use; it takes only Cluster.mu briefly, so callers may hold a network
// lock.
func (c *Cluster) DefinitionOf(vni uint32, host string) (r netdef.Remote, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.replica.definitionOf(vni, host, c.replica.members[host])
}
