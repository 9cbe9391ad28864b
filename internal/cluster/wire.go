package cluster

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"net/netip"

	"github.com/overlayd/overlayd/peerdb"
)

// Wire format, version 1. Every message is carried as a memberlist user
// message (UDP packet or TCP stream, encrypted and authenticated by the
// memberlist keyring) or as the user state of a memberlist push/pull.
//
//	message   = version:u8 (=1) type:u8 origin incarnation:u64be body
//	origin    = len:u8 (1..255) name (UTF-8)
//	body      = delta | snapshot | digest | syncRequest | leave | defs | app
//	delta     = count:uvarint record*count           (type 1)
//	snapshot  = asOf:uvarint count:uvarint record*count (type 2, live records only)
//	digest    = asOf:uvarint count:uvarint hash:u64be (type 3)
//	syncRequest = (empty)                            (type 4)
//	leave     = (empty)                              (type 5)
//	defs      = asOf:uvarint count:uvarint def*count (type 6, protocol 2: the
//	            origin's complete set of network definitions, see defs.go)
//	app       = len:uvarint (1..MaxAppPayload) payload (type 7, protocol 3:
//	            opaque to this package, see app.go)
//	record    = vni:u24be flags:u8 id version:uvarint [value]
//	flags     = bit 0 deleted, bit 1 id is hex-packed, bit 2 has IPv6,
//	            bit 3 has no IPv4 (only with bit 2), bit 4 has names;
//	            other bits zero; bits 2 to 4 only in live records, bits 2
//	            and 3 only from protocol 4 (see "IPv6" below), bit 4 only
//	            from protocol 5 (see "Names" below)
//	id        = len:u8 (1..255) bytes   (hex-packed: the bytes of a
//	            lowercase hex string of even length, the string is 2*len)
//	value     = [ip:4] mac:6 vtepFamily:u8 (4|6) vtep:4|16 [ipv6:16] [names]
//	            (absent if deleted; ip absent with bit 3, ipv6 present
//	            with bit 2, names with bit 4)
//	names     = len:u16be (1..dnsname.MaxPacked) packed (dnsname.Pack's
//	            form: canonical names, sorted, unique, comma-separated)
//
// IPv6 (protocol 4). A record without an IPv6 address is encoded exactly
// as in protocol 3, which a node of protocol 3 decodes; one with an IPv6
// address sets flags a node of protocol 3 refuses (it would drop the whole
// message as malformed). So a node sends records with IPv6 addresses only
// while every alive member speaks protocol 4 (localStore.setIPv6): while
// one does not, its records are published without their IPv6 addresses
// (IPv6-only records withdrawn), the status says so, and they are
// published again in full, with new versions, once every member speaks 4.
// Names (protocol 5) follow the same rule: the DNS names of an endpoint
// (container name, aliases) travel with its record, so they are in force
// exactly while its record is, and go with it; a node sends records with
// names only while every alive member speaks protocol 5
// (localStore.setNames), else without them (a member of protocol 4 would
// drop the message), and publishes them again once every member does.
// Nothing may follow the last field. The decoder (decode.go) validates the
// whole message before anything is applied.

const (
	wireVersion byte = 1

	msgDelta       byte = 1
	msgSnapshot    byte = 2
	msgDigest      byte = 3
	msgSyncRequest byte = 4
	msgLeave       byte = 5
	msgDefs        byte = 6 // protocol version 2 only
	msgApp         byte = 7 // protocol version 3 only

	flagDeleted byte = 1 << 0
	flagHexID   byte = 1 << 1
	flagIPv6    byte = 1 << 2 // protocol 4
	flagNoIPv4  byte = 1 << 3 // protocol 4
	flagNames   byte = 1 << 4 // protocol 5
	knownFlags       = flagDeleted | flagHexID | flagIPv6 | flagNoIPv4 | flagNames

	// maxMessageBytes bounds a decoded message (memberlist itself reads at
	// most 20 MiB of user message or push/pull state).
	maxMessageBytes = 16 << 20
	// maxRecords bounds the record count of one message.
	maxRecords = 1 << 20
	// maxNameLen and maxEndpointIDLen bound the strings of the wire format.
	maxNameLen       = 255
	maxEndpointIDLen = 255
	// MaxVNI is the largest VXLAN network identifier (24 bits).
	MaxVNI = 1<<24 - 1

	// headerFixed is version, type, name length and incarnation.
	headerFixed = 1 + 1 + 1 + 8
	// minRecordLen is the smallest encoded record (a tombstone with a
	// one-byte id and a one-byte version).
	minRecordLen = 3 + 1 + 1 + 1 + 1
)

// record is one peer record of an origin node on the wire and in the
// stores. VTEP, IP, IPv6 and MAC are meaningful only if !Deleted; a live
// record has IP, IPv6 or both.
type record struct {
	VNI        uint32
	EndpointID string
	Version    uint64
	Deleted    bool
	IP         netip.Addr // the zero Addr when the endpoint has no IPv4 address
	MAC        peerdb.MAC
	VTEP       netip.Addr
	IPv6       netip.Addr // the zero Addr when the endpoint has no IPv6 address
	// Names: the endpoint's DNS names, packed (dnsname.Pack), "" for
	// none; only in live records.
	Names string
}

func (r *record) key() recKey { return recKey{VNI: r.VNI, EndpointID: r.EndpointID} }

func (r *record) peer() peerdb.Peer {
	return peerdb.Peer{EndpointID: r.EndpointID, IP: r.IP, MAC: r.MAC, VTEP: r.VTEP, IPv6: r.IPv6}
}

// hasIPv6 reports whether r is a live record with an IPv6 address: one a
// node of protocol 3 cannot decode.
func (r *record) hasIPv6() bool { return !r.Deleted && r.IPv6.IsValid() }

// needs returns the lowest protocol version that decodes r.
func (r *record) needs() byte {
	switch {
	case r.Deleted:
		return protocolVersionMin
	case r.Names != "":
		return ProtocolNames
	case r.IPv6.IsValid():
		return ProtocolIPv6
	}
	return protocolVersionMin
}

// downgrade returns recs in the form a member speaking protocol proto
// decodes: names dropped below ProtocolNames; IPv6 addresses dropped,
// and IPv6-only records left out, below ProtocolIPv6. The local store
// publishes that form itself while such a member is alive
// (localStore.setGates); this covers the moment in between. recs is
// reused.
func downgrade(recs []record, proto byte) []record {
	out := recs[:0]
	for _, r := range recs {
		if r.Deleted {
			out = append(out, r)
			continue
		}
		if proto < ProtocolNames {
			r.Names = ""
		}
		if proto < ProtocolIPv6 && r.IPv6.IsValid() {
			if !r.IP.IsValid() {
				continue
			}
			r.IPv6 = netip.Addr{}
		}
		out = append(out, r)
	}
	return out
}

// recKey identifies a record within its origin.
type recKey struct {
	VNI        uint32
	EndpointID string
}

// message is a decoded wire message.
type message struct {
	Type        byte
	Origin      string
	Incarnation uint64
	AsOf        uint64 // snapshot, digest: the origin's clock when built
	Count       uint64 // digest: number of live records
	Hash        uint64 // digest: sum of the live records' hashes
	Records     []record
	Defs        []defRecord // defs: by VNI, no duplicates
	Payload     []byte      // app: 1..MaxAppPayload bytes (aliases the decoded buffer)
}

var errEncode = errors.New("cluster: message cannot be encoded")

// hexID reports whether id is packed as hex on the wire: a lowercase hex
// string of even length (Docker's 64-digit ids travel as 32 bytes).
func hexID(id string) bool {
	if len(id) == 0 || len(id)%2 != 0 || len(id) > maxEndpointIDLen {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// recordSize is the encoded size of r.
func recordSize(r *record) int {
	n := 3 + 1 + 1 + uvarintLen(r.Version)
	if hexID(r.EndpointID) {
		n += len(r.EndpointID) / 2
	} else {
		n += len(r.EndpointID)
	}
	if !r.Deleted {
		n += 6 + 1
		if r.IP.IsValid() {
			n += 4
		}
		if r.VTEP.Is4() {
			n += 4
		} else {
			n += 16
		}
		if r.IPv6.IsValid() {
			n += 16
		}
		if r.Names != "" {
			n += 2 + len(r.Names)
		}
	}
	return n
}

func uvarintLen(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}

// appendHeader appends version, type, origin and incarnation.
func appendHeader(b []byte, typ byte, origin string, inc uint64) []byte {
	b = append(b, wireVersion, typ, byte(len(origin)))
	b = append(b, origin...)
	return binary.BigEndian.AppendUint64(b, inc)
}

// appendRecord appends r; r must be valid (see validRecordValue).
func appendRecord(b []byte, r *record) []byte {
	b = append(b, byte(r.VNI>>16), byte(r.VNI>>8), byte(r.VNI))
	var flags byte
	if r.Deleted {
		flags |= flagDeleted
	}
	packed := hexID(r.EndpointID)
	if packed {
		flags |= flagHexID
	}
	if !r.Deleted && r.IPv6.IsValid() {
		flags |= flagIPv6
		if !r.IP.IsValid() {
			flags |= flagNoIPv4
		}
	}
	if !r.Deleted && r.Names != "" {
		flags |= flagNames
	}
	b = append(b, flags)
	if packed {
		b = append(b, byte(len(r.EndpointID)/2))
		b, _ = hex.AppendDecode(b, []byte(r.EndpointID)) // hexID checked the digits
	} else {
		b = append(b, byte(len(r.EndpointID)))
		b = append(b, r.EndpointID...)
	}
	b = binary.AppendUvarint(b, r.Version)
	if !r.Deleted {
		if r.IP.IsValid() {
			ip := r.IP.As4()
			b = append(b, ip[:]...)
		}
		b = append(b, r.MAC[:]...)
		if r.VTEP.Is4() {
			v := r.VTEP.As4()
			b = append(b, 4)
			b = append(b, v[:]...)
		} else {
			v := r.VTEP.As16()
			b = append(b, 6)
			b = append(b, v[:]...)
		}
		if r.IPv6.IsValid() {
			v := r.IPv6.As16()
			b = append(b, v[:]...)
		}
		if r.Names != "" {
			b = binary.BigEndian.AppendUint16(b, uint16(len(r.Names)))
			b = append(b, r.Names...)
		}
	}
	return b
}

// encodeMessage encodes m. It fails only for a message the decoder would
// reject (bad strings or records, too large): the encoder never produces
// what the decoder refuses.
func encodeMessage(m *message) ([]byte, error) {
	if err := checkName(m.Origin); err != nil || m.Incarnation == 0 {
		return nil, errEncode
	}
	size := headerFixed + len(m.Origin) + 3*binary.MaxVarintLen64 + 8 + len(m.Payload)
	for i := range m.Records {
		r := &m.Records[i]
		if reason := validRecord(r); reason != "" {
			return nil, errEncode
		}
		if m.Type == msgSnapshot && r.Deleted {
			return nil, errEncode
		}
		size += recordSize(r)
	}
	if len(m.Records) > maxRecords {
		return nil, errEncode
	}
	b := make([]byte, 0, size)
	b = appendHeader(b, m.Type, m.Origin, m.Incarnation)
	switch m.Type {
	case msgDelta:
		b = binary.AppendUvarint(b, uint64(len(m.Records)))
		for i := range m.Records {
			b = appendRecord(b, &m.Records[i])
		}
	case msgSnapshot:
		b = binary.AppendUvarint(b, m.AsOf)
		b = binary.AppendUvarint(b, uint64(len(m.Records)))
		for i := range m.Records {
			b = appendRecord(b, &m.Records[i])
		}
	case msgDigest:
		if len(m.Records) != 0 {
			return nil, errEncode
		}
		b = binary.AppendUvarint(b, m.AsOf)
		b = binary.AppendUvarint(b, m.Count)
		b = binary.BigEndian.AppendUint64(b, m.Hash)
	case msgSyncRequest, msgLeave:
		if len(m.Records) != 0 {
			return nil, errEncode
		}
	case msgDefs:
		if len(m.Records) != 0 || len(m.Defs) > maxRecords || m.AsOf == 0 {
			return nil, errEncode
		}
		b = binary.AppendUvarint(b, m.AsOf)
		b = binary.AppendUvarint(b, uint64(len(m.Defs)))
		for i := range m.Defs {
			if validDef(&m.Defs[i]) != nil || i > 0 && m.Defs[i].VNI <= m.Defs[i-1].VNI {
				return nil, errEncode
			}
			b = appendDef(b, &m.Defs[i])
		}
	case msgApp:
		if len(m.Records) != 0 || len(m.Payload) == 0 || len(m.Payload) > MaxAppPayload {
			return nil, errEncode
		}
		b = binary.AppendUvarint(b, uint64(len(m.Payload)))
		b = append(b, m.Payload...)
	default:
		return nil, errEncode
	}
	if m.Type != msgDefs && len(m.Defs) != 0 || m.Type != msgApp && len(m.Payload) != 0 || len(b) > maxMessageBytes {
		return nil, errEncode
	}
	return b, nil
}

// deltaEncoder packs records into delta messages of at most limit bytes.
type deltaEncoder struct {
	origin string
	inc    uint64
	limit  int
	out    [][]byte
	count  int
	recs   []byte
}

func newDeltaEncoder(origin string, inc uint64, limit int) *deltaEncoder {
	return &deltaEncoder{origin: origin, inc: inc, limit: limit}
}

func (e *deltaEncoder) headerLen() int {
	return headerFixed + len(e.origin) + binary.MaxVarintLen32
}

// add appends r (valid) to the current message, starting a new one when
// the limit would be exceeded.
func (e *deltaEncoder) add(r *record) {
	if e.count > 0 && e.headerLen()+len(e.recs)+recordSize(r) > e.limit {
		e.flush()
	}
	e.recs = appendRecord(e.recs, r)
	e.count++
}

func (e *deltaEncoder) flush() {
	if e.count == 0 {
		return
	}
	b := make([]byte, 0, headerFixed+len(e.origin)+binary.MaxVarintLen32+len(e.recs))
	b = appendHeader(b, msgDelta, e.origin, e.inc)
	b = binary.AppendUvarint(b, uint64(e.count))
	b = append(b, e.recs...)
	e.out = append(e.out, b)
	e.recs = e.recs[:0]
	e.count = 0
}

// messages flushes and returns the encoded messages.
func (e *deltaEncoder) messages() [][]byte {
	e.flush()
	return e.out
}
