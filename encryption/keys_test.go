package encryption

import (
	"bytes"
	"crypto/hkdf"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"net/netip"
	"testing"
)

var (
	testSecret = []byte("0123456789abcdef0123456789abcdef")
	hostA      = netip.MustParseAddr("192.0.2.10")
	hostB      = netip.MustParseAddr("192.0.2.11")
	hostC      = netip.MustParseAddr("192.0.2.12")
	testGen    = uint64(0x0123456789abcdef)
)

// TestHKDFVector pins the stdlib HKDF to RFC 5869's test case 1, so a
// change in the primitive would show here rather than as hosts that cannot
// talk to hosts running an older build.
func TestHKDFVector(t *testing.T) {
	ikm, _ := hex.DecodeString("0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b")
	salt, _ := hex.DecodeString("000102030405060708090a0b0c")
	info, _ := hex.DecodeString("f0f1f2f3f4f5f6f7f8f9")
	okm, err := hkdf.Key(sha256.New, ikm, salt, string(info), 42)
	if err != nil {
		t.Fatal(err)
	}
	want := "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
	if hex.EncodeToString(okm) != want {
		t.Fatalf("HKDF-SHA256 = %x, want %s", okm, want)
	}
}

// TestDerivationPinned pins overlayd's own derivation: hosts of different
// builds must derive the same keys and SPIs, so any change to labels or
// encoding must be deliberate (and versioned).
func TestDerivationPinned(t *testing.T) {
	k, err := SAKey(testSecret, hostA, hostB, 1, testGen)
	if err != nil {
		t.Fatal(err)
	}
	spi, err := SPI(testSecret, hostA, hostB, 1, testGen)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("key(A->B, 1, gen) = %x, spi = 0x%08x", k, spi)
	if got, want := hex.EncodeToString(k), pinnedKey; got != want {
		t.Errorf("key(A->B, epoch 1, testGen) = %s, want %s", got, want)
	}
	if spi != pinnedSPI {
		t.Errorf("spi(A->B, epoch 1, testGen) = 0x%08x, want 0x%08x", spi, pinnedSPI)
	}
}

func TestKeysAgreeAndDiffer(t *testing.T) {
	// Both ends compute the same values: derivation is a function of
	// (secret, src, dst, epoch, gen) only; IPv4-mapped IPv6 is the same
	// host.
	k1, _ := SAKey(testSecret, hostA, hostB, 7, testGen)
	k2, _ := SAKey(bytes.Clone(testSecret), netip.AddrFrom16(hostA.As16()), hostB, 7, testGen)
	if !bytes.Equal(k1, k2) || len(k1) != KeyLen {
		t.Fatalf("the two ends disagree: %x vs %x", k1, k2)
	}
	s1, _ := SPI(testSecret, hostA, hostB, 7, testGen)
	s2, _ := SPI(testSecret, netip.AddrFrom16(hostA.As16()), hostB, 7, testGen)
	if s1 != s2 {
		t.Fatalf("SPIs disagree: %x vs %x", s1, s2)
	}
	// Distinct per direction, per epoch, per pair, per generation and per
	// secret.
	other := []byte("another secret, sixteen+ bytes!!")
	seen := map[string]string{}
	spis := map[uint32]string{}
	for _, c := range []struct {
		name     string
		secret   []byte
		src, dst netip.Addr
		epoch    uint32
		gen      uint64
	}{
		{"A->B 1", testSecret, hostA, hostB, 1, testGen},
		{"B->A 1", testSecret, hostB, hostA, 1, testGen},
		{"A->B 2", testSecret, hostA, hostB, 2, testGen},
		{"A->C 1", testSecret, hostA, hostC, 1, testGen},
		{"C->B 1", testSecret, hostC, hostB, 1, testGen},
		{"A->B 1 next generation", testSecret, hostA, hostB, 1, testGen + 1},
		{"A->B 1 generation 1", testSecret, hostA, hostB, 1, 1},
		{"A->B 1 other secret", other, hostA, hostB, 1, testGen},
	} {
		k, err := SAKey(c.secret, c.src, c.dst, c.epoch, c.gen)
		if err != nil {
			t.Fatal(err)
		}
		s, err := SPI(c.secret, c.src, c.dst, c.epoch, c.gen)
		if err != nil {
			t.Fatal(err)
		}
		if s < 256 {
			t.Errorf("%s: spi %d in the reserved range", c.name, s)
		}
		if prev, ok := seen[string(k)]; ok {
			t.Errorf("%s has the key of %s", c.name, prev)
		}
		if prev, ok := spis[s]; ok {
			t.Errorf("%s has the SPI of %s", c.name, prev)
		}
		seen[string(k)], spis[s] = c.name, c.name
		// The key is not the SPI's bytes, nor the secret.
		if bytes.Contains(k, c.secret[:8]) {
			t.Errorf("%s: key contains the secret", c.name)
		}
	}
}

func TestDerivationRejectsBadInput(t *testing.T) {
	if _, err := SAKey([]byte("short"), hostA, hostB, 1, 1); err == nil {
		t.Error("short secret accepted")
	}
	if _, err := SPI(nil, hostA, hostB, 1, 1); err == nil {
		t.Error("nil secret accepted")
	}
	if _, err := SAKey(testSecret, netip.Addr{}, hostB, 1, 1); err == nil {
		t.Error("invalid address accepted")
	}
	if _, err := SPI(testSecret, hostA, netip.Addr{}, 1, 1); err == nil {
		t.Error("invalid address accepted")
	}
}

// TestSPIReservedRange: over many derivations none falls in 0..255 and the
// distribution is not degenerate (the re-derivation path is deterministic).
func TestSPIReservedRange(t *testing.T) {
	seen := map[uint32]bool{}
	for e := uint32(1); e <= 5000; e++ {
		s, err := SPI(testSecret, hostA, hostB, e, testGen)
		if err != nil {
			t.Fatal(err)
		}
		if s < 256 {
			t.Fatalf("epoch %d: spi %d", e, s)
		}
		seen[s] = true
	}
	if len(seen) < 4990 {
		t.Fatalf("only %d distinct SPIs over 5000 epochs", len(seen))
	}
}

func TestInnerMTU(t *testing.T) {
	for _, c := range []struct {
		underlay int
		v6       bool
		want     int
	}{
		{1500, false, 1416}, {1500, true, 1396}, {9000, false, 8916}, {1400, false, 1316}, {1501, false, 1416}, {1503, false, 1416}, {1504, false, 1420}, {40, false, 0},
	} {
		got := InnerMTU(c.underlay, c.v6)
		if got != c.want {
			t.Errorf("InnerMTU(%d, v6=%v) = %d, want %d", c.underlay, c.v6, got, c.want)
		}
		if got == 0 {
			continue
		}
		// Check by construction: the ESP packet of a full-size inner frame
		// fits, and one more byte would not.
		ip := 20
		if c.v6 {
			ip = 40
		}
		outer := func(m int) int {
			payload := 8 + 8 + 14 + m // UDP, VXLAN, Ethernet, inner packet
			padded := (payload + 2 + 3) / 4 * 4
			return ip + 8 + 8 + padded + ICVBits/8
		}
		if outer(got) > c.underlay || outer(got+4) <= c.underlay {
			t.Errorf("InnerMTU(%d) = %d: outer %d, next aligned %d", c.underlay, got, outer(got), outer(got+4))
		}
		if got+ESPOverhead+50 < c.underlay-3 && !c.v6 {
			t.Errorf("InnerMTU(%d) = %d wastes more than the worst-case overhead", c.underlay, got)
		}
	}
}

const (
	pinnedKey = "fa8c7a21da756d47d58f8e4f4df07a2045aebcce"
	pinnedSPI = 0xc076a071
)

// TestDerivationIsOneShotHKDF checks that deriving with the extraction done
// once per secret (deriver, and the Programmer's cache across a change of
// secret) gives exactly the one-shot HKDF of the specification (doc.go):
// hkdf.Key(SHA-256, secret, salt, info, length) for every SA, IPv4 and
// IPv6, so hosts running builds before and after the change agree.
func TestDerivationIsOneShotHKDF(t *testing.T) {
	other := []byte("fedcba9876543210fedcba9876543210")
	ref := func(secret []byte, label string, src, dst netip.Addr, epoch uint32, gen uint64, n int) []byte {
		t.Helper()
		b, err := hkdf.Key(sha256.New, secret, []byte(hkdfSalt), string(saInfo(label, src, dst, epoch, gen, 0)), n)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	var cache deriveCache
	for i := range 200 {
		secret := testSecret
		if i%3 == 2 {
			secret = other // the cache must follow a change of secret
		}
		src, dst := netip.AddrFrom4([4]byte{192, 0, 2, byte(i)}), netip.AddrFrom4([4]byte{198, 51, 100, byte(i * 7)})
		if i%2 == 1 {
			src = netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 14: byte(i >> 8), 15: byte(i)})
			dst = netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 1, 14: byte(i), 15: 1})
		}
		epoch, gen := uint32(i%5+1), uint64(i)*0x9e3779b97f4a7c15
		wantKey := ref(secret, infoKey, src, dst, epoch, gen, KeyLen)
		wantSPI := binary.BigEndian.Uint32(ref(secret, infoSPI, src, dst, epoch, gen, 4))
		if wantSPI < spiReserved {
			t.Fatalf("case %d: reference SPI %d in the reserved range: pick another case", i, wantSPI)
		}
		key, err := SAKey(secret, src, dst, epoch, gen)
		if err != nil || !bytes.Equal(key, wantKey) {
			t.Fatalf("case %d: SAKey = %x, %v; want %x", i, key, err, wantKey)
		}
		spi, err := SPI(secret, src, dst, epoch, gen)
		if err != nil || spi != wantSPI {
			t.Fatalf("case %d: SPI = %#x, %v; want %#x", i, spi, err, wantSPI)
		}
		for pass := range 2 { // derived, then from the cache
			spi, key, err := cache.derive(secret, src, dst, epoch, gen)
			if err != nil || spi != wantSPI || !bytes.Equal(key, wantKey) {
				t.Fatalf("case %d, cache pass %d: %#x %x %v; want %#x %x", i, pass, spi, key, err, wantSPI, wantKey)
			}
		}
	}
	if _, _, err := cache.derive([]byte("short"), hostA, hostB, 1, 1); err != ErrBadSecret {
		t.Fatalf("cache with a short secret: %v, want ErrBadSecret", err)
	}
}
