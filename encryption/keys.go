package encryption

import (
	"bytes"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"net/netip"
)

const (
	// AEADName is the kernel's name of the ESP transform: AES-GCM as
	// specified for ESP by RFC 4106.
	AEADName = "rfc4106(gcm(aes))"
	// AESKeyLen and SaltLen make up the key material of one SA: a 128-bit
	// AES key followed by the 4-byte nonce salt RFC 4106 requires.
	AESKeyLen = 16
	SaltLen   = 4
	// KeyLen is the length of the key material handed to the kernel.
	KeyLen = AESKeyLen + SaltLen
	// ICVBits is the length of the integrity check value (GCM tag). 128 bits:
	// RFC 8221 makes ENCR_AES_GCM_16 the MUST for ESP and classifies the
	// 8-octet tag as SHOULD NOT, because the forgery bound of GCM degrades
	// with short tags (an attacker who can submit many forgeries learns the
	// authentication key faster with 64-bit tags). The kernel accepts 64, 96
	// and 128 for rfc4106; the cost of 128 over 64 is 8 bytes per packet.
	ICVBits = 128

	// MinSecretLen is the shortest cluster secret accepted (memberlist keys
	// are 16, 24 or 32 bytes).
	MinSecretLen = 16

	// spiReserved: SPIs 1..255 are reserved by IANA and 0 means "none".
	spiReserved = 0x100
)

// Domain-separation labels. Changing any of them changes every key and SPI,
// so they are versioned.
const (
	hkdfSalt = "overlayd ipsec v2"
	infoKey  = "esp key"
	infoSPI  = "esp spi"
)

// ErrBadSecret is returned when the cluster secret is missing or too short.
var ErrBadSecret = errors.New("cluster secret must be at least 16 bytes")

// SAKey derives the ESP key material (16-byte AES key then 4-byte salt) of
// the SA that carries traffic from src to dst with epoch's key, created by
// src under its send generation gen (see Advert.Gen and doc.go). Both ends
// compute it from the cluster secret; keys are never sent anywhere. Each
// direction of each pair of hosts, each epoch and each send generation gets
// its own key, so no two SA instances ever share a (key, nonce) space.
func SAKey(secret []byte, src, dst netip.Addr, epoch uint32, gen uint64) ([]byte, error) {
	d, err := newDeriver(secret)
	if err != nil {
		return nil, err
	}
	return d.saKey(src, dst, epoch, gen)
}

// SPI derives the Security Parameter Index of the SA from src to dst for
// epoch and src's send generation gen. It is keyed by the cluster secret
// (an HKDF output, like the key), so SPIs are not predictable without the
// secret and change when the secret does. The result is never in the
// reserved range 0..255: an output below 256 is re-derived with a counter
// appended, deterministically, so both ends agree.
//
// Collisions: the kernel identifies an SA by (destination, SPI, protocol),
// so two SPIs only conflict when they are inbound SAs of the same host (same
// destination), or two epochs of one direction of one pair. Programmer
// detects such a conflict before touching the kernel, installs the SA of the
// lower (source, epoch) and reports the other as an error; the affected pair
// then drops (never leaks) traffic in that epoch until the next rotation or
// generation, which re-derives the SPIs (a repeat collision has probability
// 2^-32).
func SPI(secret []byte, src, dst netip.Addr, epoch uint32, gen uint64) (uint32, error) {
	d, err := newDeriver(secret)
	if err != nil {
		return 0, err
	}
	return d.spi(src, dst, epoch, gen)
}

// deriver derives SPIs and keys under one cluster secret. Both are HKDF
// outputs (RFC 5869) with a fixed salt, so the extraction step — the
// pseudorandom key PRK, one HMAC of the secret — is the same for every SA
// and is done once, in newDeriver. Every output is at most one hash long,
// so its expansion is the first block alone, T(1) = HMAC(PRK, info | 0x01),
// computed with an HMAC keyed once (crypto/hmac keeps the keyed inner and
// outer states, so a use hashes the info and the inner digest only: 2
// SHA-256 blocks instead of the 8 of a one-shot hkdf.Key). The outputs are
// hkdf.Key's exactly (TestDerivationIsOneShotHKDF).
//
// A deriver is not safe for concurrent use (its HMAC is reused); the
// Programmer's cache uses one under the Owner's lock.
type deriver struct {
	mac  hash.Hash // HMAC-SHA-256 keyed with the PRK
	info []byte    // scratch for the HKDF info
	out  []byte    // scratch for the HMAC's output
}

func newDeriver(secret []byte) (*deriver, error) {
	if len(secret) < MinSecretLen {
		return nil, ErrBadSecret
	}
	prk, err := hkdf.Extract(sha256.New, secret, []byte(hkdfSalt))
	if err != nil {
		return nil, err
	}
	return &deriver{mac: hmac.New(sha256.New, prk)}, nil
}

// expand is HKDF-Expand(PRK, info, n) for n up to one SHA-256 output.
func (d *deriver) expand(label string, src, dst netip.Addr, epoch uint32, gen uint64, counter uint32, n int) []byte {
	d.info = appendSAInfo(d.info[:0], label, src, dst, epoch, gen, counter)
	d.info = append(d.info, 1) // the block counter of T(1)
	d.mac.Reset()
	d.mac.Write(d.info)
	d.out = d.mac.Sum(d.out[:0])
	return d.out[:n]
}

// saKey is SAKey under the deriver's secret.
func (d *deriver) saKey(src, dst netip.Addr, epoch uint32, gen uint64) ([]byte, error) {
	if !src.IsValid() || !dst.IsValid() {
		return nil, fmt.Errorf("invalid address in key derivation: src %v dst %v", src, dst)
	}
	return bytes.Clone(d.expand(infoKey, src, dst, epoch, gen, 0, KeyLen)), nil
}

// spi is SPI under the deriver's secret.
func (d *deriver) spi(src, dst netip.Addr, epoch uint32, gen uint64) (uint32, error) {
	if !src.IsValid() || !dst.IsValid() {
		return 0, fmt.Errorf("invalid address in SPI derivation: src %v dst %v", src, dst)
	}
	for i := uint32(0); ; i++ {
		if spi := binary.BigEndian.Uint32(d.expand(infoSPI, src, dst, epoch, gen, i, 4)); spi >= spiReserved {
			return spi, nil
		}
	}
}

// saInfo is the HKDF info: label, epoch, both addresses as 16 bytes (IPv4 in
// its IPv6-mapped form, so an address has one encoding), the sender's send
// generation and a counter.
func saInfo(label string, src, dst netip.Addr, epoch uint32, gen uint64, counter uint32) []byte {
	return appendSAInfo(make([]byte, 0, len(label)+1+4+16+16+8+4), label, src, dst, epoch, gen, counter)
}

func appendSAInfo(b []byte, label string, src, dst netip.Addr, epoch uint32, gen uint64, counter uint32) []byte {
	b = append(b, label...)
	b = append(b, 0)
	b = binary.BigEndian.AppendUint32(b, epoch)
	s, d := src.Unmap().As16(), dst.Unmap().As16()
	b = append(b, s[:]...)
	b = append(b, d[:]...)
	b = binary.BigEndian.AppendUint64(b, gen)
	b = binary.BigEndian.AppendUint32(b, counter)
	return b
}

// ESPOverhead is the worst-case number of bytes ESP transport mode with
// rfc4106(gcm(aes)) and a 128-bit ICV adds to a packet: 8 (SPI, sequence) +
// 8 (IV) + 16 (ICV) + 2 (pad length, next header) + up to 3 bytes of padding
// (the ESP payload plus trailer is aligned to 4 bytes).
const ESPOverhead = 8 + 8 + ICVBits/8 + 2 + 3

// InnerMTU returns the MTU of the links of an encrypted VXLAN network whose
// underlay has MTU underlayMTU (IPv6 when ipv6), such that a full-size inner
// packet encapsulated in VXLAN and ESP fits the underlay without
// fragmentation. The ESP alignment is computed exactly, not with the
// worst-case padding: for a 1500-byte IPv4 underlay it is 1416 (1450 without
// encryption), for IPv6 1396 (1430).
func InnerMTU(underlayMTU int, ipv6 bool) int {
	ipHdr := 20
	if ipv6 {
		ipHdr = 40
	}
	const (
		espHdr   = 8 + 8       // SPI + sequence number, IV
		icv      = ICVBits / 8 // GCM tag
		trailer  = 2           // pad length, next header
		vxlanEnc = 8 + 8 + 14  // UDP + VXLAN + inner Ethernet header
		align    = 4           // ESP payload+trailer alignment
	)
	room := underlayMTU - ipHdr - espHdr - icv // for payload + padding + trailer
	room -= room % align
	m := room - trailer - vxlanEnc
	if m < 0 {
		return 0
	}
	return m
}
