package cluster

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/overlayd/overlayd/internal/netdef"
	"github.com/overlayd/overlayd/internal/testutil/wirecheck"
	"github.com/overlayd/overlayd/peerdb"
)

const dockerID = "4f3c2a9d8e7b6a5f4e3d2c1b0a9f8e7d6c5b4a3f2e1d0c9b8a7f6e5d4c3b2a19"

func liveRec(vni uint32, id, ip, vtep string, ver uint64) record {
	a := netip.MustParseAddr(ip)
	return record{VNI: vni, EndpointID: id, Version: ver, IP: a, MAC: peerdb.MACFromIP(a), VTEP: netip.MustParseAddr(vtep)}
}

// dualRec is liveRec with an IPv6 address too ("" for ip: IPv6 only).
func dualRec(vni uint32, id, ip, ip6, vtep string, ver uint64) record {
	a6 := netip.MustParseAddr(ip6)
	r := record{VNI: vni, EndpointID: id, Version: ver, MAC: peerdb.MACFromIP(a6), VTEP: netip.MustParseAddr(vtep), IPv6: a6}
	if ip != "" {
		r.IP = netip.MustParseAddr(ip)
	}
	return r
}

func sampleMessages() []*message {
	return []*message{
		{Type: msgDelta, Origin: "host-6", Incarnation: 3, Records: []record{
			dualRec(4096, dockerID, "10.0.0.2", "2001:db8::2", "192.168.1.10", 5),
			dualRec(4096, "v6only", "", "2001:db8::3", "192.168.1.10", 6),
			dualRec(4097, "v6vtep", "", "2001:db8:1::3", "2001:db8:ffff::1", 7),
			{VNI: 4096, EndpointID: "gone", Version: 9, Deleted: true},
		}},
		{Type: msgSnapshot, Origin: "host-6", Incarnation: 3, AsOf: 100, Records: []record{
			dualRec(10, "a", "10.0.0.2", "fd00:1::2", "192.168.1.11", 100),
			dualRec(10, "b", "", "fd00:1::3", "192.168.1.11", 99),
		}},
		{Type: msgDelta, Origin: "host-a", Incarnation: 1700000000000000000, Records: []record{
			liveRec(4096, dockerID, "10.0.0.2", "192.168.1.10", 1700000000000000001),
			liveRec(MaxVNI, "ep-1", "10.0.0.3", "192.168.1.10", 7),
			{VNI: 1, EndpointID: "gone", Version: 9, Deleted: true},
			liveRec(77, "ABCDEF", "10.1.0.3", "fd00::1", 12), // upper case: not packed
			liveRec(77, "abc", "10.1.0.4", "fd00::1", 13),    // odd length: not packed
		}},
		{Type: msgDelta, Origin: "h", Incarnation: 1, Records: []record{}},
		{Type: msgSnapshot, Origin: "host-b", Incarnation: 42, AsOf: 100, Records: []record{
			liveRec(10, dockerID, "10.0.0.2", "192.168.1.11", 100),
			liveRec(11, "x", "10.0.0.2", "192.168.1.11", 3),
		}},
		{Type: msgSnapshot, Origin: "host-b", Incarnation: 42, AsOf: 0, Records: []record{}},
		{Type: msgDigest, Origin: "host-c", Incarnation: 5, AsOf: 1 << 62, Count: 1000, Hash: 0xdeadbeefcafef00d},
		{Type: msgSyncRequest, Origin: "host-d", Incarnation: 6},
		{Type: msgLeave, Origin: "ünïcode-host", Incarnation: 7},
		{Type: msgDefs, Origin: "host-e", Incarnation: 8, AsOf: 1 << 40, Defs: []defRecord{
			{VNI: 300, Def: sampleDef(1450, false, 300)},
			{VNI: 301, Def: sampleDef(1416, true, 300, 301)},
			{VNI: MaxVNI, Def: netdef.Definition{MTU: 9000, Internal: true, Subnets: []netdef.Subnet{
				{VNI: MaxVNI, Pool: netip.MustParsePrefix("203.0.113.0/30")}}}},
		}},
		{Type: msgDefs, Origin: "host-e", Incarnation: 8, AsOf: 1, Defs: []defRecord{}},
		{Type: msgApp, Origin: "host-f", Incarnation: 9, Payload: []byte{0}},
		{Type: msgApp, Origin: "host-f", Incarnation: 9, Payload: bytes.Repeat([]byte("ipam"), MaxAppPayload/4)},
	}
}

// sampleDef is a definition of vnis with subnets 198.51.100.0/26,
// 198.51.100.64/26, … and gateways at .1 of each.
func sampleDef(mtu int, encrypted bool, vnis ...uint32) netdef.Definition {
	d := netdef.Definition{MTU: mtu, Encrypted: encrypted}
	for i, v := range vnis {
		pool := netip.PrefixFrom(netip.AddrFrom4([4]byte{198, 51, 100, byte(64 * i)}), 26)
		d.Subnets = append(d.Subnets, netdef.Subnet{VNI: v, Pool: pool, Gateway: netip.PrefixFrom(pool.Addr().Next(), 26)})
	}
	return d
}

func mustEncode(t testing.TB, m *message) []byte {
	t.Helper()
	b, err := encodeMessage(m)
	if err != nil {
		t.Fatalf("encode %+v: %v", m, err)
	}
	return b
}

func TestWireRoundTrip(t *testing.T) {
	for _, m := range sampleMessages() {
		b := mustEncode(t, m)
		got, err := decodeMessage(b)
		if err != nil {
			t.Fatalf("decode type %d: %v", m.Type, err)
		}
		if !reflect.DeepEqual(got, m) {
			t.Errorf("round trip:\n got %+v\nwant %+v", got, m)
		}
	}
	// Docker's 64-digit ids travel packed.
	m := &message{Type: msgDelta, Origin: "a", Incarnation: 1, Records: []record{liveRec(1, dockerID, "10.0.0.1", "10.9.0.1", 1)}}
	if n := len(mustEncode(t, m)); n > 70 {
		t.Errorf("one record with a Docker id takes %d bytes, want <= 70", n)
	}
}

func TestDeltaEncoderSplits(t *testing.T) {
	var recs []record
	for i := range 1000 {
		recs = append(recs, liveRec(100, fmt.Sprintf("%s%04x", dockerID[:60], i),
			netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i + 1)}).String(), "10.9.0.1", uint64(i+1)))
	}
	for _, limit := range []int{1300, largeChunk} {
		e := newDeltaEncoder("node", 1, limit)
		for i := range recs {
			e.add(&recs[i])
		}
		got := 0
		msgs := e.messages()
		for _, b := range msgs {
			if len(b) > limit {
				t.Errorf("message of %d bytes over limit %d", len(b), limit)
			}
			m, err := decodeMessage(b)
			if err != nil {
				t.Fatal(err)
			}
			got += len(m.Records)
		}
		if got != len(recs) {
			t.Errorf("limit %d: %d records in %d messages, want %d", limit, got, len(msgs), len(recs))
		}
		t.Logf("limit %d: 1000 records in %d messages", limit, len(msgs))
	}
}

// badCase mutates a valid encoding.
type badCase struct {
	name   string
	b      []byte
	reason DropReason
}

func badCases(t testing.TB) []badCase {
	base := mustEncode(t, &message{Type: msgDelta, Origin: "ab", Incarnation: 9,
		Records: []record{liveRec(300, "ep", "10.0.0.2", "192.168.0.1", 5)}})
	// Offsets in base: 0 version, 1 type, 2 name len, 3-4 name, 5-12 inc,
	// 13 count, 14-16 VNI, 17 flags, 18 id len, 19-20 id, 21 version,
	// 22-25 IP, 26-31 MAC, 32 VTEP family, 33-36 VTEP.
	mut := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), base...)) }
	set := func(off int, v ...byte) []byte {
		return mut(func(b []byte) []byte { copy(b[off:], v); return b })
	}
	rec2 := func(r record) []byte {
		return mut(func(b []byte) []byte {
			b[13] = 2
			return appendRecord(b, &r)
		})
	}
	var huge []byte
	huge = appendHeader(huge, msgDelta, "ab", 9)
	huge = binary.AppendUvarint(huge, maxRecords+1)
	overflow := appendHeader(nil, msgSnapshot, "ab", 9)
	overflow = append(overflow, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01)
	snapTomb := appendHeader(nil, msgSnapshot, "ab", 9)
	snapTomb = append(snapTomb, 10, 1)
	snapTomb = appendRecord(snapTomb, &record{VNI: 1, EndpointID: "x", Version: 3, Deleted: true})
	snapFuture := appendHeader(nil, msgSnapshot, "ab", 9)
	snapFuture = append(snapFuture, 10, 1)
	r := liveRec(1, "x", "10.0.0.9", "192.168.0.1", 11)
	snapFuture = appendRecord(snapFuture, &r)
	// Offsets in defsBase: 0-12 header (origin "ab"), 13 asOf, 14 count,
	// 15-17 VNI, 18 flags, 19-20 MTU, 21 subnet count, 22-24 subnet VNI,
	// 25-28 pool, 29 prefix length, 30 gateway flag, 31-34 gateway.
	defsBase := mustEncode(t, &message{Type: msgDefs, Origin: "ab", Incarnation: 9, AsOf: 5,
		Defs: []defRecord{{VNI: 300, Def: sampleDef(1450, false, 300)}}})
	defsSet := func(off int, v ...byte) []byte {
		b := append([]byte(nil), defsBase...)
		copy(b[off:], v)
		return b
	}
	defsTwice := append(append([]byte(nil), defsBase...), defsBase[15:]...)
	defsTwice[14] = 2
	// Offsets in appBase: 0-12 header (origin "ab"), 13 payload length,
	// 14-16 payload.
	appBase := mustEncode(t, &message{Type: msgApp, Origin: "ab", Incarnation: 9, Payload: []byte("abc")})
	appLen := func(n uint64) []byte {
		return binary.AppendUvarint(append([]byte(nil), appBase[:13]...), n)
	}
	// Offsets in base6 (a dual-stack record): 17 flags, 22-25 IP,
	// 26-31 MAC, 32 VTEP family, 33-36 VTEP, 37-52 IPv6.
	base6 := mustEncode(t, &message{Type: msgDelta, Origin: "ab", Incarnation: 9,
		Records: []record{dualRec(300, "ep", "10.0.0.2", "2001:db8::2", "192.168.0.1", 5)}})
	set6 := func(off int, v ...byte) []byte {
		b := append([]byte(nil), base6...)
		copy(b[off:], v)
		return b
	}
	mapped := netip.MustParseAddr("::ffff:10.0.0.2").As16()
	linkLocal := netip.MustParseAddr("fe80::2").As16()
	multicast6 := netip.MustParseAddr("ff02::1").As16()
	return []badCase{
		{"IPv6 v4-mapped", set6(37, mapped[:]...), DropInvalidIP},
		{"IPv6 link-local", set6(37, linkLocal[:]...), DropInvalidIP},
		{"IPv6 multicast", set6(37, multicast6[:]...), DropInvalidIP},
		{"IPv6 unspecified", set6(37, make([]byte, 16)...), DropInvalidIP},
		{"IPv6 truncated", base6[:len(base6)-1], DropTruncated},
		{"IPv6 flag on a tombstone", mut(func(b []byte) []byte {
			b = appendRecord(append(b[:13:13], 1), &record{VNI: 1, EndpointID: "x", Version: 3, Deleted: true})
			b[17] |= flagIPv6
			return b
		}), DropMalformed},
		{"no IPv4 without IPv6", set(17, flagNoIPv4), DropMalformed},
		{"IPv6 flag without the address", set(17, flagIPv6), DropTruncated},
		{"application payload empty", appLen(0), DropMalformed},
		{"application payload over 1 MiB", append(appLen(MaxAppPayload+1), make([]byte, MaxAppPayload+1)...), DropOversized},
		{"application payload truncated", appBase[:len(appBase)-1], DropTruncated},
		{"application payload length missing", appBase[:13], DropTruncated},
		{"application trailing byte", append(append([]byte(nil), appBase...), 0), DropMalformed},
		{"definitions clock zero", defsSet(13, 0), DropMalformed},
		{"definition count over bytes", defsSet(14, 9), DropTruncated},
		{"definition unknown flag", defsSet(18, 0x04), DropMalformed},
		{"definition MTU zero", defsSet(19, 0, 0), DropInvalidDefinition},
		{"definition without subnets", defsSet(21, 0), DropInvalidDefinition},
		{"definition not of its VNI", defsSet(22, 0, 1, 0x2d), DropInvalidDefinition},
		{"definition pool not masked", defsSet(28, 7), DropInvalidDefinition},
		{"definition prefix length 33", defsSet(29, 33), DropInvalidDefinition},
		{"definition gateway flag 2", defsSet(30, 2), DropMalformed},
		{"definition gateway outside", defsSet(31, 10, 0, 0, 1), DropInvalidDefinition},
		{"definition truncated", defsBase[:len(defsBase)-1], DropTruncated},
		{"definition duplicate VNI", defsTwice, DropMalformed},
		{"empty", nil, DropTruncated},
		{"version only", base[:1], DropTruncated},
		{"unknown version", set(0, 2), DropUnknownVersion},
		{"version zero", set(0, 0), DropUnknownVersion},
		{"unknown type", set(1, 9), DropUnknownType},
		{"type zero", set(1, 0), DropUnknownType},
		{"empty origin", mut(func(b []byte) []byte { return append(b[:2:2], append([]byte{0}, b[5:]...)...) }), DropInvalidOrigin},
		{"non-UTF-8 origin", set(3, 0xff, 0xfe), DropInvalidOrigin},
		{"origin past end", base[:4], DropTruncated},
		{"incarnation truncated", base[:9], DropTruncated},
		{"incarnation zero", set(5, 0, 0, 0, 0, 0, 0, 0, 0), DropMalformed},
		{"count missing", base[:13], DropTruncated},
		{"count over limit", huge, DropOversized},
		{"count over bytes", set(13, 50), DropTruncated},
		{"VNI zero", set(14, 0, 0, 0), DropInvalidVNI},
		{"unknown flag", set(17, 0x80), DropMalformed},
		{"empty endpoint id", mut(func(b []byte) []byte { return append(b[:18:18], append([]byte{0}, b[21:]...)...) }), DropInvalidEndpoint},
		{"control char in id", set(19, 0x07), DropInvalidEndpoint},
		{"version zero", set(21, 0), DropMalformed},
		{"version overflow", overflow, DropMalformed},
		{"IP unspecified", set(22, 0, 0, 0, 0), DropInvalidIP},
		{"IP multicast", set(22, 224, 0, 0, 1), DropInvalidIP},
		{"IP broadcast", set(22, 255, 255, 255, 255), DropInvalidIP},
		{"MAC multicast", set(26, 0x01), DropInvalidMAC},
		{"MAC zero", set(26, 0, 0, 0, 0, 0, 0), DropInvalidMAC},
		{"VTEP family", set(32, 5), DropInvalidVTEP},
		{"VTEP unspecified", set(33, 0, 0, 0, 0), DropInvalidVTEP},
		{"VTEP multicast", set(33, 239, 1, 1, 1), DropInvalidVTEP},
		{"VTEP v4-mapped", mut(func(b []byte) []byte {
			b = append(b[:32:32], 6)
			return append(b, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 168, 0, 1)
		}), DropInvalidVTEP},
		{"record truncated", base[:len(base)-1], DropTruncated},
		{"trailing byte", append(append([]byte(nil), base...), 0), DropMalformed},
		{"duplicate key", rec2(liveRec(300, "ep", "10.0.0.3", "192.168.0.1", 6)), DropMalformed},
		{"tombstone in snapshot", snapTomb, DropMalformed},
		{"snapshot record newer than snapshot", snapFuture, DropMalformed},
		{"oversized", make([]byte, maxMessageBytes+1), DropOversized},
		{"digest truncated", mustEncode(t, &message{Type: msgDigest, Origin: "ab", Incarnation: 9, Count: 1})[:20], DropTruncated},
		{"sync request with body", append(mustEncode(t, &message{Type: msgSyncRequest, Origin: "ab", Incarnation: 9}), 1), DropMalformed},
	}
}

func TestDecodeBadInput(t *testing.T) {
	// The base case must be valid, or every case passes for the wrong reason.
	base := mustEncode(t, &message{Type: msgDelta, Origin: "ab", Incarnation: 9,
		Records: []record{liveRec(300, "ep", "10.0.0.2", "192.168.0.1", 5)}})
	if _, err := decodeMessage(base); err != nil {
		t.Fatalf("base: %v", err)
	}
	for _, tc := range badCases(t) {
		t.Run(tc.name, func(t *testing.T) {
			m, err := decodeMessage(tc.b)
			if err == nil {
				t.Fatalf("decoded %+v, want drop %s", m, tc.reason)
			}
			if err.Reason != tc.reason {
				t.Fatalf("reason %s (%v), want %s", err.Reason, err, tc.reason)
			}
		})
	}
}

func TestEncodeRefusesInvalid(t *testing.T) {
	for _, m := range []*message{
		{Type: msgDelta, Origin: "", Incarnation: 1},
		{Type: msgDelta, Origin: strings.Repeat("n", 256), Incarnation: 1},
		{Type: msgDelta, Origin: "a", Incarnation: 0},
		{Type: msgDelta, Origin: "a", Incarnation: 1, Records: []record{{VNI: 0, EndpointID: "x", Version: 1, Deleted: true}}},
		{Type: msgDelta, Origin: "a", Incarnation: 1, Records: []record{liveRec(1, "x", "10.0.0.1", "0.0.0.0", 1)}},
		{Type: msgSnapshot, Origin: "a", Incarnation: 1, Records: []record{{VNI: 1, EndpointID: "x", Version: 1, Deleted: true}}},
		{Type: 99, Origin: "a", Incarnation: 1},
		{Type: msgApp, Origin: "a", Incarnation: 1},
		{Type: msgApp, Origin: "a", Incarnation: 1, Payload: make([]byte, MaxAppPayload+1)},
		{Type: msgDelta, Origin: "a", Incarnation: 1, Payload: []byte{1}},
		{Type: msgApp, Origin: "a", Incarnation: 1, Payload: []byte{1}, Records: []record{{VNI: 1, EndpointID: "x", Version: 1, Deleted: true}}},
	} {
		if b, err := encodeMessage(m); err == nil {
			t.Errorf("encoded invalid %+v as %x", m, b)
		}
	}
}

func TestMetaRoundTrip(t *testing.T) {
	for _, v := range []string{"10.0.0.1", "fd00::7"} {
		m := nodeMeta{ProtoMin: 1, ProtoMax: 1, Incarnation: 99, VTEP: netip.MustParseAddr(v)}
		got, err := decodeMeta(encodeMeta(m))
		if err != nil || !eqMeta(got, m) {
			t.Errorf("meta %v: got %+v, %v", m, got, err)
		}
		withApp := m
		withApp.App = []byte("accept=1 send=1")
		if got, err := decodeMeta(encodeMeta(withApp)); err != nil || !eqMeta(got, withApp) {
			t.Errorf("meta with app state %v: got %+v, %v", withApp, got, err)
		}
		// Forward compatible: a later version may append fields.
		b := append(encodeMeta(withApp), 0xaa, 0xbb)
		b[0] = 3
		if got, err := decodeMeta(b); err != nil || !eqMeta(got, withApp) {
			t.Errorf("meta v3 %v: got %+v, %v", m, got, err)
		}
		// Backward compatible: a version 1 node has no application state.
		v1 := encodeMeta(m)[:len(encodeMeta(m))-2]
		v1[0] = 1
		if got, err := decodeMeta(v1); err != nil || !eqMeta(got, m) {
			t.Errorf("meta v1 %v: got %+v, %v", m, got, err)
		}
	}
	for _, b := range [][]byte{nil, {1}, encodeMeta(nodeMeta{ProtoMin: ProtocolVersion + 1, ProtoMax: ProtocolVersion + 2, Incarnation: 1, VTEP: netip.MustParseAddr("10.0.0.1")}),
		encodeMeta(nodeMeta{ProtoMin: 1, ProtoMax: 1, Incarnation: 0, VTEP: netip.MustParseAddr("10.0.0.1")}),
		encodeMeta(nodeMeta{ProtoMin: 1, ProtoMax: 1, Incarnation: 1, VTEP: netip.MustParseAddr("0.0.0.0")})} {
		if m, err := decodeMeta(b); err == nil {
			t.Errorf("decodeMeta(%x) = %+v, want error", b, m)
		}
	}
}

// FuzzDecode: the decoder never panics, and whatever it accepts re-encodes
// to a message that decodes to the same value (and the same bytes again).
func FuzzDecode(f *testing.F) {
	for _, m := range sampleMessages() {
		f.Add(mustEncode(f, m))
	}
	for _, tc := range badCases(f) {
		if len(tc.b) < 1<<16 {
			f.Add(tc.b)
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		decode := func(b []byte) (*message, error) {
			m, derr := decodeMessage(b)
			if derr != nil {
				if derr.Reason == "" {
					t.Fatalf("error without a reason: %v", derr)
				}
				return nil, derr
			}
			return m, nil
		}
		wirecheck.RoundTrip(t, b, decode, encodeMessage)
	})
}

func eqMeta(a, b nodeMeta) bool { return sameMeta(a, b) && bytes.Equal(a.App, b.App) }
