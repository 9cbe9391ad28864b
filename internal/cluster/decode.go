package cluster

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net/netip"
	"unicode/utf8"

	"github.com/overlayd/overlayd/internal/dnsname"
	"github.com/overlayd/overlayd/peerdb"
)

// DropReason names why a message from the network (or a local record) was
// refused. Status reports a counter per reason.
type DropReason string

// Reasons a message is dropped. The decoder's reasons are decided from the
// bytes alone; the others need the membership (apply time).
const (
	// Decoder.
	DropTruncated       DropReason = "truncated"        // ends before a field does
	DropMalformed       DropReason = "malformed"        // bad flags, varint, trailing bytes, duplicates, zero version/incarnation
	DropOversized       DropReason = "oversized"        // message or record count over the limits
	DropUnknownVersion  DropReason = "unknown_version"  // version byte is not 1
	DropUnknownType     DropReason = "unknown_type"     // type byte is not a known message type
	DropInvalidOrigin   DropReason = "invalid_origin"   // empty or non-UTF-8 origin name
	DropInvalidVNI      DropReason = "invalid_vni"      // VNI 0 (1..16777215 are valid)
	DropInvalidEndpoint DropReason = "invalid_endpoint" // endpoint id not printable UTF-8
	DropInvalidIP       DropReason = "invalid_ip"       // IP not a unicast IPv4 address, IPv6 not a unicast IPv6 one, or neither present
	DropInvalidMAC      DropReason = "invalid_mac"      // not a unicast MAC
	DropInvalidVTEP     DropReason = "invalid_vtep"     // not a unicast IPv4/IPv6 address
	DropInvalidNames    DropReason = "invalid_names"    // names not in dnsname.Pack's form or over its bounds
	// DropInvalidDefinition: a network definition that is not valid
	// (netdef.Definition.Validate) or does not define its own VNI.
	DropInvalidDefinition DropReason = "invalid_definition"
	// Apply time.
	DropSelfOrigin  DropReason = "self_origin"          // claims to come from this node
	DropUnknownOrig DropReason = "unknown_origin"       // origin is not an alive member
	DropBadMeta     DropReason = "bad_member_meta"      // origin's node metadata is unusable
	DropIncarnation DropReason = "incarnation_mismatch" // not the origin's current incarnation
	DropVTEPMatch   DropReason = "vtep_mismatch"        // a record's VTEP is not its origin's VTEP
	DropProtocol    DropReason = "protocol_mismatch"    // a message type the origin's advertised protocol lacks
	// Memberlist layer (counted from its log lines: it drops those itself).
	DropGossipAuth  DropReason = "gossip_auth_failed" // could not decrypt/authenticate (wrong key, plaintext)
	DropGossipLabel DropReason = "gossip_bad_label"   // another cluster label
	// Local.
	DropLocalInvalid DropReason = "local_invalid" // PublishLocalPeer got an invalid record (published as deleted)
)

// decodeError is a decoder failure with its reason.
type decodeError struct {
	Reason DropReason
	Detail string
}

func (e *decodeError) Error() string { return string(e.Reason) + ": " + e.Detail }

func derr(reason DropReason, format string, args ...any) *decodeError {
	return &decodeError{Reason: reason, Detail: fmt.Sprintf(format, args...)}
}

// reader is a bounds-checked cursor over a message.
type reader struct {
	b   []byte
	off int
}

func (r *reader) left() int { return len(r.b) - r.off }

func (r *reader) u8(what string) (byte, *decodeError) {
	if r.left() < 1 {
		return 0, derr(DropTruncated, "%s at offset %d", what, r.off)
	}
	v := r.b[r.off]
	r.off++
	return v, nil
}

func (r *reader) bytes(n int, what string) ([]byte, *decodeError) {
	if n < 0 || r.left() < n {
		return nil, derr(DropTruncated, "%s (%d bytes) at offset %d", what, n, r.off)
	}
	v := r.b[r.off : r.off+n]
	r.off += n
	return v, nil
}

// u16 reads a 16-bit big-endian number.
func (r *reader) u16(what string) (uint16, *decodeError) {
	b, err := r.bytes(2, what)
	if err != nil {
		return 0, err
	}
	return uint16(b[0])<<8 | uint16(b[1]), nil
}

// u24 reads a 24-bit big-endian number (a VNI).
func (r *reader) u24(what string) (uint32, *decodeError) {
	b, err := r.bytes(3, what)
	if err != nil {
		return 0, err
	}
	return uint32(b[0])<<16 | uint32(b[1])<<8 | uint32(b[2]), nil
}

func (r *reader) u64(what string) (uint64, *decodeError) {
	b, err := r.bytes(8, what)
	if err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint64(b), nil
}

func (r *reader) uvarint(what string) (uint64, *decodeError) {
	v, n := binary.Uvarint(r.b[r.off:])
	switch {
	case n == 0:
		return 0, derr(DropTruncated, "%s at offset %d", what, r.off)
	case n < 0:
		return 0, derr(DropMalformed, "%s at offset %d overflows 64 bits", what, r.off)
	}
	r.off += n
	return v, nil
}

// decodeMessage decodes and validates a whole message: on success every
// field of every record is valid (validRecord) and there are no duplicate
// keys; on failure nothing of it may be used.
func decodeMessage(b []byte) (*message, *decodeError) {
	if len(b) > maxMessageBytes {
		return nil, derr(DropOversized, "message of %d bytes (limit %d)", len(b), maxMessageBytes)
	}
	r := &reader{b: b}
	ver, err := r.u8("version")
	if err != nil {
		return nil, err
	}
	if ver != wireVersion {
		return nil, derr(DropUnknownVersion, "version %d", ver)
	}
	typ, err := r.u8("type")
	if err != nil {
		return nil, err
	}
	if typ < msgDelta || typ > msgApp {
		return nil, derr(DropUnknownType, "type %d", typ)
	}
	m := &message{Type: typ}
	nameLen, err := r.u8("origin length")
	if err != nil {
		return nil, err
	}
	name, err := r.bytes(int(nameLen), "origin")
	if err != nil {
		return nil, err
	}
	m.Origin = string(name)
	if e := checkName(m.Origin); e != nil {
		return nil, derr(DropInvalidOrigin, "%v", e)
	}
	if m.Incarnation, err = r.u64("incarnation"); err != nil {
		return nil, err
	}
	if m.Incarnation == 0 {
		return nil, derr(DropMalformed, "incarnation 0")
	}
	switch typ {
	case msgDelta, msgSnapshot:
		if typ == msgSnapshot {
			if m.AsOf, err = r.uvarint("snapshot clock"); err != nil {
				return nil, err
			}
		}
		n, err := r.uvarint("record count")
		if err != nil {
			return nil, err
		}
		if n > maxRecords {
			return nil, derr(DropOversized, "%d records (limit %d)", n, maxRecords)
		}
		if n > uint64(r.left()/minRecordLen) {
			return nil, derr(DropTruncated, "%d records in %d bytes", n, r.left())
		}
		m.Records = make([]record, n)
		seen := make(map[recKey]struct{}, n)
		for i := range m.Records {
			rec := &m.Records[i]
			if err := decodeRecord(r, rec); err != nil {
				err.Detail = fmt.Sprintf("record %d: %s", i, err.Detail)
				return nil, err
			}
			if typ == msgSnapshot && rec.Deleted {
				return nil, derr(DropMalformed, "record %d: tombstone in a snapshot", i)
			}
			if typ == msgSnapshot && rec.Version > m.AsOf {
				return nil, derr(DropMalformed, "record %d: version %d after the snapshot clock %d", i, rec.Version, m.AsOf)
			}
			k := rec.key()
			if _, dup := seen[k]; dup {
				return nil, derr(DropMalformed, "record %d: duplicate key VNI %d endpoint %q", i, k.VNI, k.EndpointID)
			}
			seen[k] = struct{}{}
		}
	case msgDigest:
		if m.AsOf, err = r.uvarint("digest clock"); err != nil {
			return nil, err
		}
		if m.Count, err = r.uvarint("digest count"); err != nil {
			return nil, err
		}
		if m.Hash, err = r.u64("digest hash"); err != nil {
			return nil, err
		}
	case msgDefs:
		if m.AsOf, err = r.uvarint("definitions clock"); err != nil {
			return nil, err
		}
		if m.AsOf == 0 {
			return nil, derr(DropMalformed, "definitions clock 0")
		}
		n, err := r.uvarint("definition count")
		if err != nil {
			return nil, err
		}
		if n > uint64(r.left()/minDefLen) {
			return nil, derr(DropTruncated, "%d definitions in %d bytes", n, r.left())
		}
		m.Defs = make([]defRecord, n)
		for i := range m.Defs {
			if err := decodeDef(r, &m.Defs[i]); err != nil {
				err.Detail = fmt.Sprintf("definition %d: %s", i, err.Detail)
				return nil, err
			}
			if i > 0 && m.Defs[i].VNI <= m.Defs[i-1].VNI {
				return nil, derr(DropMalformed, "definition %d: VNI %d not after VNI %d (sorted, no duplicates)", i, m.Defs[i].VNI, m.Defs[i-1].VNI)
			}
		}
	case msgApp:
		n, err := r.uvarint("payload length")
		if err != nil {
			return nil, err
		}
		switch {
		case n == 0:
			return nil, derr(DropMalformed, "empty application payload")
		case n > MaxAppPayload:
			return nil, derr(DropOversized, "application payload of %d bytes (limit %d)", n, MaxAppPayload)
		}
		if m.Payload, err = r.bytes(int(n), "payload"); err != nil {
			return nil, err
		}
	case msgSyncRequest, msgLeave:
	}
	if r.left() != 0 {
		return nil, derr(DropMalformed, "%d trailing bytes", r.left())
	}
	return m, nil
}

func decodeRecord(r *reader, rec *record) *decodeError {
	var err *decodeError
	if rec.VNI, err = r.u24("VNI"); err != nil {
		return err
	}
	flags, err := r.u8("flags")
	if err != nil {
		return err
	}
	if flags&^knownFlags != 0 {
		return derr(DropMalformed, "unknown flags %#x", flags)
	}
	rec.Deleted = flags&flagDeleted != 0
	has6, no4 := flags&flagIPv6 != 0, flags&flagNoIPv4 != 0
	switch {
	case rec.Deleted && (has6 || no4 || flags&flagNames != 0):
		return derr(DropMalformed, "value flags %#x on a deleted record", flags)
	case no4 && !has6:
		return derr(DropMalformed, "flags %#x: a record without IPv4 must have IPv6", flags)
	}
	idLen, err := r.u8("endpoint id length")
	if err != nil {
		return err
	}
	id, err := r.bytes(int(idLen), "endpoint id")
	if err != nil {
		return err
	}
	if flags&flagHexID != 0 {
		rec.EndpointID = hex.EncodeToString(id)
	} else {
		rec.EndpointID = string(id)
	}
	if rec.Version, err = r.uvarint("version"); err != nil {
		return err
	}
	if !rec.Deleted {
		if !no4 {
			ip, err := r.bytes(4, "IP")
			if err != nil {
				return err
			}
			rec.IP = netip.AddrFrom4([4]byte(ip))
		}
		mac, err := r.bytes(6, "MAC")
		if err != nil {
			return err
		}
		rec.MAC = peerdb.MAC(mac)
		fam, err := r.u8("VTEP family")
		if err != nil {
			return err
		}
		switch fam {
		case 4:
			v, err := r.bytes(4, "VTEP")
			if err != nil {
				return err
			}
			rec.VTEP = netip.AddrFrom4([4]byte(v))
		case 6:
			v, err := r.bytes(16, "VTEP")
			if err != nil {
				return err
			}
			rec.VTEP = netip.AddrFrom16([16]byte(v))
		default:
			return derr(DropInvalidVTEP, "VTEP family %d", fam)
		}
		if has6 {
			v, err := r.bytes(16, "IPv6")
			if err != nil {
				return err
			}
			rec.IPv6 = netip.AddrFrom16([16]byte(v))
		}
		if flags&flagNames != 0 {
			n, err := r.u16("names length")
			if err != nil {
				return err
			}
			if n == 0 || int(n) > dnsname.MaxPacked {
				return derr(DropInvalidNames, "VNI %d endpoint %q: names of %d bytes, must be 1..%d", rec.VNI, rec.EndpointID, n, dnsname.MaxPacked)
			}
			b, err := r.bytes(int(n), "names")
			if err != nil {
				return err
			}
			rec.Names = string(b)
		}
	}
	if reason := validRecord(rec); reason != "" {
		return derr(reason, "VNI %d endpoint %q: %s", rec.VNI, rec.EndpointID, describeInvalid(rec, reason))
	}
	return nil
}

// validRecord checks every field of a record (wire or local) and returns
// the reason it is invalid, or "".
func validRecord(r *record) DropReason {
	switch {
	case r.VNI == 0 || r.VNI > MaxVNI:
		return DropInvalidVNI
	case !validEndpointID(r.EndpointID):
		return DropInvalidEndpoint
	case r.Version == 0:
		return DropMalformed
	case r.Deleted:
		return ""
	case !r.IP.IsValid() && !r.IPv6.IsValid(),
		r.IP.IsValid() && !validPeerIP(r.IP),
		r.IPv6.IsValid() && !validPeerIPv6(r.IPv6):
		return DropInvalidIP
	case !r.MAC.IsUnicast():
		return DropInvalidMAC
	case !validVTEP(r.VTEP):
		return DropInvalidVTEP
	case dnsname.ValidPacked(r.Names) != nil:
		return DropInvalidNames
	}
	return ""
}

func describeInvalid(r *record, reason DropReason) string {
	switch reason {
	case DropInvalidVNI:
		return fmt.Sprintf("VNI %d out of 1..%d", r.VNI, MaxVNI)
	case DropInvalidEndpoint:
		return "endpoint id must be 1..255 bytes of printable UTF-8"
	case DropMalformed:
		return "version 0"
	case DropInvalidIP:
		switch {
		case !r.IP.IsValid() && !r.IPv6.IsValid():
			return "the record has neither an IPv4 nor an IPv6 address"
		case r.IP.IsValid() && !validPeerIP(r.IP):
			return fmt.Sprintf("IP %v is not a unicast IPv4 address", r.IP)
		}
		return fmt.Sprintf("IPv6 %v is not a unicast IPv6 address (nor IPv4-mapped, link-local, loopback or zoned)", r.IPv6)
	case DropInvalidMAC:
		return fmt.Sprintf("MAC %v is not unicast", r.MAC)
	case DropInvalidVTEP:
		return fmt.Sprintf("VTEP %v is not a unicast address", r.VTEP)
	case DropInvalidNames:
		return fmt.Sprintf("names %.60q: %v", r.Names, dnsname.ValidPacked(r.Names))
	}
	return string(reason)
}

func validEndpointID(id string) bool {
	if len(id) == 0 || len(id) > maxEndpointIDLen || !utf8.ValidString(id) {
		return false
	}
	for _, c := range id {
		if c < 0x20 || c == 0x7f {
			return false
		}
	}
	return true
}

// validPeerIP: an endpoint's address is a unicast IPv4 address.
func validPeerIP(a netip.Addr) bool {
	return a.Is4() && !a.IsUnspecified() && !a.IsMulticast() && a != netip.AddrFrom4([4]byte{255, 255, 255, 255})
}

// validPeerIPv6: an endpoint's IPv6 address is a unicast IPv6 address
// that can be on an overlay segment: not IPv4-mapped, unspecified,
// loopback, multicast, link-local (the segment's own) or zoned.
func validPeerIPv6(a netip.Addr) bool {
	return a.Is6() && !a.Is4In6() && a.Zone() == "" && !a.IsUnspecified() && !a.IsLoopback() &&
		!a.IsMulticast() && !a.IsLinkLocalUnicast()
}

// validVTEP: a tunnel endpoint is a unicast IPv4 or (non-mapped) IPv6
// address.
func validVTEP(a netip.Addr) bool {
	if !a.IsValid() || a.IsUnspecified() || a.IsMulticast() || a.Is4In6() || a.Zone() != "" {
		return false
	}
	return !a.Is4() || a != netip.AddrFrom4([4]byte{255, 255, 255, 255})
}

func checkName(n string) error {
	switch {
	case n == "":
		return fmt.Errorf("empty node name")
	case len(n) > maxNameLen:
		return fmt.Errorf("node name longer than %d bytes", maxNameLen)
	case !utf8.ValidString(n):
		return fmt.Errorf("node name is not UTF-8")
	}
	return nil
}
