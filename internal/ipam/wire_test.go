package ipam

import (
	"bytes"
	"encoding/binary"
	"reflect"
	"strings"
	"testing"

	"github.com/overlayd/overlayd/internal/testutil/wirecheck"
)

const testPool = "overlayd:198.51.100.0/24"

func testRing() *ring {
	r := newRing(ip("198.51.100.2"), ip("198.51.100.254"), idA)
	if err := r.donate(idA, idB, span{ip("198.51.100.100"), ip("198.51.100.199")}); err != nil {
		panic(err)
	}
	return r
}

func sampleMessages() []*message {
	addr := ip("198.51.100.7")
	other := claimID{proposer: idC, nonce: 9}
	hdr := func(m *message) *message { m.from, m.seq = idA, 42; return m }
	return []*message{
		hdr(&message{kind: kindRings, reclaimed: []reclaimEntry{{id: idC, by: idB}},
			pools: []poolView{{pool: testPool, ring: testRing(), stats: ownerStats{inUse: true, owned: 153, free: 150, used: 3}},
				{pool: "overlayd:192.0.2.0/24:192.0.2.128/25"}}}),
		hdr(&message{kind: kindRings}),
		hdr(&message{kind: kindPropose, pool: testPool, claim: claimID{proposer: idA, nonce: 7}}),
		hdr(&message{kind: kindVote, pool: testPool, claim: claimID{proposer: idA, nonce: 7}, accept: true}),
		hdr(&message{kind: kindVote, pool: testPool, claim: claimID{proposer: idA, nonce: 7}, other: &other, reason: "it accepted node-c's claim"}),
		hdr(&message{kind: kindVote, pool: testPool, claim: claimID{proposer: idA, nonce: 7}, ring: testRing(), reason: "known"}),
		hdr(&message{kind: kindCommit, pool: testPool, claim: claimID{proposer: idA, nonce: 7}, ring: testRing()}),
		hdr(&message{kind: kindAbort, pool: testPool, claim: claimID{proposer: idA, nonce: 7}}),
		hdr(&message{kind: kindQuery, pool: testPool, claim: claimID{proposer: idB, nonce: 1}}),
		hdr(&message{kind: kindDonateReq, reqID: 5, pool: testPool}),
		hdr(&message{kind: kindDonateReq, reqID: 6, pool: testPool, wantAddr: &addr}),
		hdr(&message{kind: kindDonateReply, reqID: 5, pool: testPool, result: donateOK, ring: testRing()}),
		hdr(&message{kind: kindDonateReply, reqID: 6, pool: testPool, result: donateInUse, reason: "198.51.100.7 is in use on node-a"}),
	}
}

func mustEncode(t testing.TB, m *message) []byte {
	t.Helper()
	b, err := encodeMessage(m)
	if err != nil {
		t.Fatalf("encode %s: %v", m.kind, err)
	}
	return b
}

func TestWireRoundTrip(t *testing.T) {
	for _, m := range sampleMessages() {
		b := mustEncode(t, m)
		got, err := decodeMessage(b)
		if err != nil {
			t.Fatalf("%s: %v", m.kind, err)
		}
		if !reflect.DeepEqual(got, m) {
			t.Fatalf("%s round trip:\n%+v\n%+v", m.kind, got, m)
		}
	}
}

type badCase struct {
	name string
	b    []byte
	want string
}

// rewrite encodes m after mod and returns the bytes without validating
// (encodeMessage refuses what the decoder refuses).
func rewrite(m *message, mod func(b []byte) []byte) []byte {
	b, err := encodeMessage(m)
	if err != nil {
		panic(err)
	}
	return mod(append([]byte(nil), b...))
}

// raw builds a message of kind from idA without validating it: header,
// then body.
func raw(kind msgKind, body func(e *encoder)) []byte {
	e := &encoder{}
	e.b = append(e.b, 'o', 'i', wireVersion, byte(kind))
	e.ident(idA)
	e.u64(1)
	body(e)
	return e.b
}

func badCases(t testing.TB) []badCase {
	s := sampleMessages()
	rings := mustEncode(t, s[0])
	// Offsets inside the first rings message: header 4, sender name
	// 1+6, id 8, seq 8 = 27; reclaimed count 2 at 27.
	const body = 27
	bigRing := &ring{lo: ip("198.51.100.2"), hi: ip("198.51.100.254")}
	for i := range 3 {
		bigRing.tokens = append(bigRing.tokens, token{start: ip("198.51.100.2") + uint32(i), owner: idA, version: 1})
	}
	outOfOrder := func() []byte {
		return raw(kindCommit, func(e *encoder) {
			e.str8(testPool)
			e.claim(claimID{proposer: idA, nonce: 1})
			r := bigRing.clone()
			r.tokens[1].start, r.tokens[2].start = r.tokens[2].start, r.tokens[1].start
			e.ring(r)
		})
	}()
	withPool := func(pool string) []byte {
		return raw(kindAbort, func(e *encoder) {
			e.str8(pool)
			e.claim(claimID{proposer: idA, nonce: 1})
		})
	}
	statsMsg := func(owned, free, used uint64) []byte {
		return raw(kindRings, func(e *encoder) {
			e.u16(0)
			e.u16(1)
			e.str8(testPool)
			e.bool(false)
			e.u64(owned)
			e.u64(free)
			e.u64(used)
			e.bool(false)
		})
	}
	return []badCase{
		{"empty", nil, "truncated at header"},
		{"magic", []byte("xx\x01\x01"), "bad magic"},
		{"version", []byte("oi\x09\x01"), "version 9"},
		{"kind", rewrite(s[1], func(b []byte) []byte { b[3] = 99; return b }), "unknown message kind 99"},
		{"truncated", rings[:len(rings)-3], "truncated"},
		{"trailing", append(append([]byte(nil), rings...), 0), "1 bytes after"},
		{"too big", make([]byte, maxMessage+1), "more than"},
		{"empty name", rewrite(s[1], func(b []byte) []byte { return append(b[:4], append([]byte{0}, b[11:]...)...) }), "node name is empty"},
		{"control in name", rewrite(s[1], func(b []byte) []byte { b[6] = '\n'; return b }), "control character"},
		{"reclaimed count", rewrite(s[1], func(b []byte) []byte { binary.BigEndian.PutUint16(b[body:], maxWireIdents+1); return b }), "reclaimed identities, more than"},
		{"pool count", rewrite(s[1], func(b []byte) []byte { binary.BigEndian.PutUint16(b[body+2:], maxWirePools+1); return b }), "pools, more than"},
		{"pool id not ours", withPool("default:198.51.100.0/24"), "is not one of overlayd's"},
		{"pool id v6", withPool("overlayd:2001:db8::/64"), "PoolID"},
		{"pool id too small", withPool("overlayd:192.0.2.0/31"), "too small"},
		{"pool id not canonical", withPool("overlayd:192.0.2.0/24:192.0.2.0/24"), "equals the subnet"},
		{"figures", statsMsg(10, 8, 3), "do not fit"},
		{"figures above size", statsMsg(1000, 0, 0), "do not fit"},
		{"token order", outOfOrder, "out of order"},
		{"bool", rewrite(s[3], func(b []byte) []byte {
			i := bytes.Index(b, []byte(testPool)) + len(testPool) + 1 + len(idA.Name) + 8 + 8
			b[i] = 7
			return b
		}), "not 0 or 1"},
		{"accept with ring", raw(kindVote, func(e *encoder) {
			e.str8(testPool)
			e.claim(claimID{proposer: idA, nonce: 1})
			e.bool(true)
			e.bool(false)
			e.str16("")
			e.optRing(testRing())
		}), "accepting vote carries"},
		{"donation outside range", raw(kindDonateReq, func(e *encoder) {
			e.u64(1)
			e.str8(testPool)
			e.bool(true)
			e.u32(ip("198.51.100.255"))
		}), "not in " + testPool + "'s range"},
		{"donation result", rewrite(s[12], func(b []byte) []byte {
			i := bytes.Index(b, []byte(testPool)) + len(testPool)
			b[i] = 0
			return b
		}), "unknown donation result 0"},
		{"ok without ring", raw(kindDonateReply, func(e *encoder) {
			e.u64(1)
			e.str8(testPool)
			e.u8(uint8(donateOK))
			e.str16("")
			e.bool(false)
		}), "donation without its ring"},
		{"reason too long", raw(kindDonateReply, func(e *encoder) {
			e.u64(1)
			e.str8(testPool)
			e.u8(uint8(donateRefused))
			e.str16(strings.Repeat("x", maxReason+1))
			e.bool(false)
		}), "reason is 1025 bytes"},
		{"owner index", rewrite(s[6], func(b []byte) []byte {
			// The last token's owner index (2 bytes before its version).
			binary.BigEndian.PutUint16(b[len(b)-6:], 9)
			return b
		}), "names owner 9 of 2"},
		{"token count", rewrite(s[6], func(b []byte) []byte {
			i := len(b) - 3*10 - 4
			binary.BigEndian.PutUint32(b[i:], maxWireTokens+1)
			return b
		}), "tokens (1 to"},
		{"version 0", rewrite(s[6], func(b []byte) []byte { binary.BigEndian.PutUint32(b[len(b)-4:], 0); return b }), "version 0"},
	}
}

func TestWireRejectsBadInput(t *testing.T) {
	for _, tc := range badCases(t) {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decodeMessage(tc.b)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error with %q", err, tc.want)
			}
		})
	}
}

// An encoder bug shows at the sender, not as messages every receiver drops.
func TestEncodeRefusesInvalid(t *testing.T) {
	m := &message{kind: kindCommit, from: idA, pool: testPool, claim: claimID{proposer: idA}}
	if _, err := encodeMessage(m); err == nil {
		t.Fatal("a commit without a ring was encoded")
	}
	m.ring = &ring{lo: 1, hi: 2, tokens: []token{{1, idA, 1}}} // not the pool's ring
	if _, err := encodeMessage(m); err == nil {
		t.Fatal("a ring of other bounds was encoded")
	}
}

// FuzzDecode: no input makes the decoder panic; whatever it accepts
// re-encodes to bytes that decode to the same message, stably.
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
		wirecheck.RoundTrip(t, b, decodeMessage, encodeMessage)
	})
}
