package ipam

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"unicode/utf8"
)

// The allocator's messages travel as the payload of the cluster's app
// messages (authenticated and encrypted by the cluster). Every message is
// decoded and fully validated before any of it is used: lengths, counts,
// pool IDs, rings (order, bounds, versions), names and addresses. A message
// that fails is dropped whole.
//
// Layout (big endian): "oi", version (1 byte), kind (1 byte), the sender's
// identity (name: 1-byte length and bytes; host id: 8 bytes), the sender's
// message sequence number (8 bytes), then the kind's body.

const (
	wireVersion = 1
	// maxMessage is the cluster's limit for an app message's payload.
	maxMessage = 1 << 20
	// maxWireTokens: a ring on the wire may hold more tokens than one host
	// makes (maxTokens): views of several hosts merge.
	maxWireTokens = 4 * maxTokens
	maxWirePools  = 4096
	maxWireIdents = 4096
	maxReason     = 1024
	// packTarget: anti-entropy packs pools into messages up to this size.
	packTarget = maxMessage / 2
)

type msgKind uint8

const (
	kindRings       msgKind = 1 // rings, their owners' figures, reclaimed identities
	kindPropose     msgKind = 2 // a claim of a pool's ring, to every voter
	kindVote        msgKind = 3 // a voter's answer to a proposal
	kindCommit      msgKind = 4 // the claim won: here is the ring
	kindAbort       msgKind = 5 // the claim lost or was given up
	kindQuery       msgKind = 6 // a voter asks a proposer what became of its claim
	kindDonateReq   msgKind = 7 // give me free space (or one address)
	kindDonateReply msgKind = 8 // the donation (in the ring) or why not
)

func (k msgKind) String() string {
	switch k {
	case kindRings:
		return "rings"
	case kindPropose:
		return "propose"
	case kindVote:
		return "vote"
	case kindCommit:
		return "commit"
	case kindAbort:
		return "abort"
	case kindQuery:
		return "query"
	case kindDonateReq:
		return "donate-request"
	case kindDonateReply:
		return "donate-reply"
	}
	return fmt.Sprintf("kind %d", uint8(k))
}

// donateResult is a donor's answer.
type donateResult uint8

const (
	donateOK          donateResult = 1 // the ring carries the donation
	donateNoneFree    donateResult = 2 // the donor has no free address
	donateInUse       donateResult = 3 // the address asked for is allocated on the donor
	donateNotOwner    donateResult = 4 // the donor does not own the address (its ring says who does)
	donateUnknownPool donateResult = 5 // the donor does not know the pool's ring
	donateRefused     donateResult = 6 // anything else; the reason says what
	donateMax                      = donateRefused
)

// claimID names one attempt to claim a pool's ring.
type claimID struct {
	proposer Identity
	nonce    uint64
}

func (c claimID) String() string { return fmt.Sprintf("%s#%016x", c.proposer, c.nonce) }

// ownerStats are an owner's own figures for a pool, sent with its rings.
type ownerStats struct {
	inUse             bool // a network of this host uses the pool
	owned, free, used uint64
}

// poolView is one pool in a rings message.
type poolView struct {
	pool  string // PoolID
	ring  *ring  // nil: the sender does not know the ring
	stats ownerStats
}

// reclaimEntry says identity id was reclaimed by by.
type reclaimEntry struct {
	id, by Identity
}

// message is any message, decoded; which fields are set depends on kind.
type message struct {
	kind msgKind
	from Identity
	seq  uint64

	// kindRings
	pools     []poolView
	reclaimed []reclaimEntry

	// claim kinds, donations
	pool  string // PoolID
	claim claimID
	// kindVote
	accept   bool
	other    *claimID // the claim the voter accepted instead
	reason   string   // kindVote, kindDonateReply
	ring     *ring    // kindVote, kindCommit (required), kindDonateReply
	reqID    uint64   // donations
	wantAddr *uint32  // kindDonateReq: one address, not any space
	result   donateResult
}

type encoder struct{ b []byte }

func (e *encoder) u8(v uint8)   { e.b = append(e.b, v) }
func (e *encoder) u16(v uint16) { e.b = binary.BigEndian.AppendUint16(e.b, v) }
func (e *encoder) u32(v uint32) { e.b = binary.BigEndian.AppendUint32(e.b, v) }
func (e *encoder) u64(v uint64) { e.b = binary.BigEndian.AppendUint64(e.b, v) }
func (e *encoder) bool(v bool) {
	if v {
		e.u8(1)
	} else {
		e.u8(0)
	}
}
func (e *encoder) str8(s string)  { e.u8(uint8(len(s))); e.b = append(e.b, s...) }
func (e *encoder) str16(s string) { e.u16(uint16(len(s))); e.b = append(e.b, s...) }
func (e *encoder) ident(i Identity) {
	e.str8(i.Name)
	e.u64(i.ID)
}
func (e *encoder) claim(c claimID) { e.ident(c.proposer); e.u64(c.nonce) }

func (e *encoder) ring(r *ring) {
	idx := map[Identity]uint16{}
	var owners []Identity
	for _, t := range r.tokens {
		if _, ok := idx[t.owner]; !ok {
			idx[t.owner] = uint16(len(owners))
			owners = append(owners, t.owner)
		}
	}
	e.u16(uint16(len(owners)))
	for _, o := range owners {
		e.ident(o)
	}
	e.u32(uint32(len(r.tokens)))
	for _, t := range r.tokens {
		e.u32(t.start)
		e.u16(idx[t.owner])
		e.u32(t.version)
	}
}

func (e *encoder) optRing(r *ring) {
	e.bool(r != nil)
	if r != nil {
		e.ring(r)
	}
}

// encodeMessage encodes m. It refuses what the decoder would refuse, so a
// bug shows here rather than as messages dropped by every receiver.
func encodeMessage(m *message) ([]byte, error) {
	e := &encoder{b: make([]byte, 0, 128)}
	e.b = append(e.b, 'o', 'i', wireVersion, byte(m.kind))
	e.ident(m.from)
	e.u64(m.seq)
	switch m.kind {
	case kindRings:
		e.u16(uint16(len(m.reclaimed)))
		for _, r := range m.reclaimed {
			e.ident(r.id)
			e.ident(r.by)
		}
		e.u16(uint16(len(m.pools)))
		for _, p := range m.pools {
			e.str8(p.pool)
			e.bool(p.stats.inUse)
			e.u64(p.stats.owned)
			e.u64(p.stats.free)
			e.u64(p.stats.used)
			e.optRing(p.ring)
		}
	case kindPropose, kindAbort, kindQuery:
		e.str8(m.pool)
		e.claim(m.claim)
	case kindVote:
		e.str8(m.pool)
		e.claim(m.claim)
		e.bool(m.accept)
		e.bool(m.other != nil)
		if m.other != nil {
			e.claim(*m.other)
		}
		e.str16(m.reason)
		e.optRing(m.ring)
	case kindCommit:
		e.str8(m.pool)
		e.claim(m.claim)
		if m.ring == nil {
			return nil, errors.New("a commit without its ring")
		}
		e.ring(m.ring)
	case kindDonateReq:
		e.u64(m.reqID)
		e.str8(m.pool)
		e.bool(m.wantAddr != nil)
		if m.wantAddr != nil {
			e.u32(*m.wantAddr)
		}
	case kindDonateReply:
		e.u64(m.reqID)
		e.str8(m.pool)
		e.u8(uint8(m.result))
		e.str16(m.reason)
		e.optRing(m.ring)
	default:
		return nil, fmt.Errorf("unknown message kind %d", m.kind)
	}
	if _, err := decodeMessage(e.b); err != nil {
		return nil, fmt.Errorf("encoded %s message does not validate: %w", m.kind, err)
	}
	return e.b, nil
}

// decoder reads a message; the first failure sticks and names what was
// being read.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf(format, args...)
	}
}

func (d *decoder) take(n int, what string) []byte {
	if d.err != nil {
		return nil
	}
	if len(d.b) < n {
		d.fail("truncated at %s (%d bytes left, %d needed)", what, len(d.b), n)
		return nil
	}
	v := d.b[:n]
	d.b = d.b[n:]
	return v
}

func (d *decoder) u8(what string) uint8 {
	if v := d.take(1, what); v != nil {
		return v[0]
	}
	return 0
}

func (d *decoder) u16(what string) uint16 {
	if v := d.take(2, what); v != nil {
		return binary.BigEndian.Uint16(v)
	}
	return 0
}

func (d *decoder) u32(what string) uint32 {
	if v := d.take(4, what); v != nil {
		return binary.BigEndian.Uint32(v)
	}
	return 0
}

func (d *decoder) u64(what string) uint64 {
	if v := d.take(8, what); v != nil {
		return binary.BigEndian.Uint64(v)
	}
	return 0
}

func (d *decoder) bool(what string) bool {
	switch v := d.u8(what); v {
	case 0:
		return false
	case 1:
		return true
	default:
		d.fail("%s is %d, not 0 or 1", what, v)
		return false
	}
}

func (d *decoder) str(n int, what string) string {
	v := d.take(n, what)
	if v == nil {
		return ""
	}
	if !utf8.Valid(v) {
		d.fail("%s is not UTF-8", what)
	}
	return string(v)
}

func (d *decoder) ident(what string) Identity {
	n := int(d.u8(what + " name length"))
	i := Identity{Name: d.str(n, what+" name")}
	i.ID = d.u64(what + " host id")
	if d.err == nil {
		if err := checkName(i.Name); err != nil {
			d.fail("%s: %v", what, err)
		}
	}
	return i
}

func (d *decoder) claim(what string) claimID {
	return claimID{proposer: d.ident(what + " proposer"), nonce: d.u64(what + " nonce")}
}

// poolID reads a PoolID and returns it with its spec.
func (d *decoder) poolID() (string, poolSpec) {
	n := int(d.u8("PoolID length"))
	id := d.str(n, "PoolID")
	if d.err != nil {
		return "", poolSpec{}
	}
	s, err := parsePoolID(id)
	if err != nil {
		d.fail("%v", err)
	}
	return id, s
}

func (d *decoder) ring(s poolSpec, what string) *ring {
	nOwners := int(d.u16(what + " owner count"))
	if d.err == nil && nOwners == 0 {
		d.fail("%s has no owner", what)
	}
	if d.err == nil && nOwners > maxWireIdents {
		d.fail("%s has %d owners, more than %d", what, nOwners, maxWireIdents)
	}
	owners := make([]Identity, 0, min(nOwners, 64))
	for i := 0; i < nOwners && d.err == nil; i++ {
		owners = append(owners, d.ident(what+" owner"))
	}
	nTokens := int(d.u32(what + " token count"))
	if d.err != nil {
		return nil
	}
	if nTokens == 0 || nTokens > maxWireTokens {
		d.fail("%s has %d tokens (1 to %d allowed)", what, nTokens, maxWireTokens)
		return nil
	}
	if len(d.b) < nTokens*10 {
		d.fail("truncated in %s's %d tokens", what, nTokens)
		return nil
	}
	r := &ring{lo: s.lo, hi: s.hi, tokens: make([]token, nTokens)}
	for i := range r.tokens {
		t := &r.tokens[i]
		t.start = d.u32(what + " token start")
		o := int(d.u16(what + " token owner"))
		t.version = d.u32(what + " token version")
		if o >= len(owners) {
			d.fail("%s token %d names owner %d of %d", what, i, o, len(owners))
			return nil
		}
		t.owner = owners[o]
	}
	if err := r.checkLimit(maxWireTokens); err != nil {
		d.fail("%s of %s: %v", what, s.id(), err)
		return nil
	}
	return r
}

func (d *decoder) optRing(s poolSpec, what string) *ring {
	if d.bool(what + " flag") {
		return d.ring(s, what)
	}
	return nil
}

func (d *decoder) reason() string {
	n := int(d.u16("reason length"))
	if d.err == nil && n > maxReason {
		d.fail("reason is %d bytes, more than %d", n, maxReason)
		return ""
	}
	return d.str(n, "reason")
}

// decodeMessage decodes and validates one message.
func decodeMessage(b []byte) (*message, error) {
	if len(b) > maxMessage {
		return nil, fmt.Errorf("message of %d bytes, more than %d", len(b), maxMessage)
	}
	d := &decoder{b: b}
	hdr := d.take(4, "header")
	if d.err != nil {
		return nil, d.err
	}
	if hdr[0] != 'o' || hdr[1] != 'i' {
		return nil, errors.New("not an overlayd IPAM message (bad magic)")
	}
	if hdr[2] != wireVersion {
		return nil, fmt.Errorf("message version %d, this host speaks %d", hdr[2], wireVersion)
	}
	m := &message{kind: msgKind(hdr[3])}
	m.from = d.ident("sender")
	m.seq = d.u64("sequence number")
	switch m.kind {
	case kindRings:
		n := int(d.u16("reclaimed count"))
		if d.err == nil && n > maxWireIdents {
			d.fail("%d reclaimed identities, more than %d", n, maxWireIdents)
		}
		for i := 0; i < n && d.err == nil; i++ {
			m.reclaimed = append(m.reclaimed, reclaimEntry{id: d.ident("reclaimed identity"), by: d.ident("reclaimer")})
		}
		n = int(d.u16("pool count"))
		if d.err == nil && n > maxWirePools {
			d.fail("%d pools, more than %d", n, maxWirePools)
		}
		seen := map[string]bool{}
		for i := 0; i < n && d.err == nil; i++ {
			var p poolView
			var s poolSpec
			p.pool, s = d.poolID()
			p.stats.inUse = d.bool("in-use flag")
			p.stats.owned = d.u64("owned count")
			p.stats.free = d.u64("free count")
			p.stats.used = d.u64("used count")
			if d.err == nil && (p.stats.owned > s.size() || p.stats.free > p.stats.owned || p.stats.used > p.stats.owned || p.stats.free+p.stats.used > p.stats.owned) {
				d.fail("figures of %s (owned %d, free %d, used %d) do not fit its %d addresses", p.pool, p.stats.owned, p.stats.free, p.stats.used, s.size())
			}
			p.ring = d.optRing(s, "ring")
			if d.err == nil && seen[p.pool] {
				d.fail("pool %s twice", p.pool)
			}
			seen[p.pool] = true
			m.pools = append(m.pools, p)
		}
	case kindPropose, kindAbort, kindQuery:
		m.pool, _ = d.poolID()
		m.claim = d.claim("claim")
	case kindVote:
		var s poolSpec
		m.pool, s = d.poolID()
		m.claim = d.claim("claim")
		m.accept = d.bool("accept flag")
		if d.bool("other-claim flag") {
			o := d.claim("other claim")
			m.other = &o
		}
		m.reason = d.reason()
		m.ring = d.optRing(s, "ring")
		if d.err == nil && m.accept && (m.other != nil || m.ring != nil) {
			d.fail("an accepting vote carries another claim or a ring")
		}
	case kindCommit:
		var s poolSpec
		m.pool, s = d.poolID()
		m.claim = d.claim("claim")
		m.ring = d.ring(s, "ring")
	case kindDonateReq:
		var s poolSpec
		m.reqID = d.u64("request id")
		m.pool, s = d.poolID()
		if d.bool("address flag") {
			a := d.u32("address")
			if d.err == nil && (a < s.lo || a > s.hi) {
				d.fail("address %s is not in %s's range %s-%s", addrOf(a), m.pool, addrOf(s.lo), addrOf(s.hi))
			}
			m.wantAddr = &a
		}
	case kindDonateReply:
		var s poolSpec
		m.reqID = d.u64("request id")
		m.pool, s = d.poolID()
		m.result = donateResult(d.u8("result"))
		if d.err == nil && (m.result == 0 || m.result > donateMax) {
			d.fail("unknown donation result %d", m.result)
		}
		m.reason = d.reason()
		m.ring = d.optRing(s, "ring")
		if d.err == nil && m.result == donateOK && m.ring == nil {
			d.fail("a donation without its ring")
		}
	default:
		d.fail("unknown message kind %d", hdr[3])
	}
	if d.err == nil && len(d.b) != 0 {
		d.fail("%d bytes after the %s message", len(d.b), m.kind)
	}
	if d.err != nil {
		return nil, d.err
	}
	return m, nil
}

// seqStart makes the sequence numbers of a process larger than those of
// the processes before it on the same host (for the figures' versions).
func seqStart(nowNanos int64) uint64 {
	if nowNanos < 0 {
		return 0
	}
	return uint64(nowNanos) & (math.MaxUint64 >> 1)
}
