package encryption

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
)

// Advert is what one host gossips about its encryption (never key bytes):
// its key epochs and its send generation.
type Advert struct {
	Keys NodeKeys
	// Gen is the host's send generation: a random 64-bit number, part of the
	// key and SPI of every outbound SA the host installs (see doc.go). It
	// changes whenever the host must re-create an outbound SA it installed
	// before (the kernel lost it), so the re-created SA never reuses a key
	// and the peer's inbound SA for it is new too.
	Gen uint64
}

// KeyGossip is how an Owner reads and publishes adverts through the control
// plane.
type KeyGossip interface {
	// Adverts returns what every other alive member advertises, by VTEP.
	Adverts() map[netip.Addr]Advert
	// Advertise gossips this host's advert. May block on the network: the
	// Owner never calls it with its lock held.
	Advertise(Advert) error
}

// Advert encoding: a fixed header then the accepted epochs.
//
//	"ovk2"           4 bytes, magic and format version
//	gen              8 bytes, big endian, never 0
//	send, target     4 bytes each, big endian
//	n                1 byte, number of accepted epochs (≤ MaxAdvertEpochs)
//	accept[n]        4 bytes each, big endian, strictly increasing, never 0
//
// Decoding is strict (exact length, canonical order): an advert that
// decodes re-encodes to the same bytes.
const (
	advertMagic     = "ovk2"
	advertHeaderLen = len(advertMagic) + 8 + 4 + 4 + 1
	// MaxAdvertEpochs bounds the accepted epochs an advert carries (a host
	// accepts one or two in steady state and during a rotation).
	MaxAdvertEpochs = 64
	// MaxAdvertLen is the longest encoded advert: it fits the control
	// plane's application state (cluster.MaxAppState, 400 bytes).
	MaxAdvertLen = advertHeaderLen + 4*MaxAdvertEpochs
)

// Encode returns the advert's wire form, at most MaxAdvertLen bytes. Accept
// is normalised (sorted, without duplicates or 0); if it holds more than
// MaxAdvertEpochs epochs only the newest are sent, which is safe: peers
// only switch to an epoch they see accepted by everyone, so under-reporting
// what we accept can delay a switch, never break traffic.
func (a Advert) Encode() []byte {
	acc := normAccept(a.Keys.Accept)
	if len(acc) > MaxAdvertEpochs {
		acc = acc[len(acc)-MaxAdvertEpochs:]
	}
	b := make([]byte, 0, advertHeaderLen+4*len(acc))
	b = append(b, advertMagic...)
	b = binary.BigEndian.AppendUint64(b, a.Gen)
	b = binary.BigEndian.AppendUint32(b, a.Keys.Send)
	b = binary.BigEndian.AppendUint32(b, a.Keys.Target)
	b = append(b, byte(len(acc)))
	for _, e := range acc {
		b = binary.BigEndian.AppendUint32(b, e)
	}
	return b
}

// ErrNotAdvert is wrapped by DecodeAdvert's error when b is not an advert
// of this format at all (another format, another application, empty).
var ErrNotAdvert = errors.New("not an overlayd key advert")

// DecodeAdvert parses an advert received from the network. It never
// panics; any malformed input is an error that says what is wrong.
func DecodeAdvert(b []byte) (Advert, error) {
	if len(b) < len(advertMagic) || string(b[:len(advertMagic)]) != advertMagic {
		return Advert{}, fmt.Errorf("%w (%d bytes)", ErrNotAdvert, len(b))
	}
	if len(b) > MaxAdvertLen {
		return Advert{}, fmt.Errorf("key advert of %d bytes, longer than the maximum %d", len(b), MaxAdvertLen)
	}
	if len(b) < advertHeaderLen {
		return Advert{}, fmt.Errorf("key advert truncated: %d bytes, header is %d", len(b), advertHeaderLen)
	}
	p := b[len(advertMagic):]
	var a Advert
	a.Gen = binary.BigEndian.Uint64(p)
	a.Keys.Send = binary.BigEndian.Uint32(p[8:])
	a.Keys.Target = binary.BigEndian.Uint32(p[12:])
	n := int(p[16])
	p = p[17:]
	if a.Gen == 0 {
		return Advert{}, errors.New("key advert with send generation 0")
	}
	if n > MaxAdvertEpochs {
		return Advert{}, fmt.Errorf("key advert with %d accepted epochs, more than %d", n, MaxAdvertEpochs)
	}
	if len(p) != 4*n {
		return Advert{}, fmt.Errorf("key advert with %d accepted epochs has %d bytes for them, want %d", n, len(p), 4*n)
	}
	if n > 0 {
		a.Keys.Accept = make([]uint32, n)
	}
	for i := range n {
		e := binary.BigEndian.Uint32(p[4*i:])
		if e == 0 || (i > 0 && e <= a.Keys.Accept[i-1]) {
			return Advert{}, fmt.Errorf("key advert: accepted epochs not strictly increasing and non-zero at %d (%d)", i, e)
		}
		a.Keys.Accept[i] = e
	}
	return a, nil
}

// String renders a as "accept=[1 2] send=1 target=2 gen=…".
func (a Advert) String() string { return fmt.Sprintf("%v gen=%016x", a.Keys, a.Gen) }

// Equal reports whether a and b advertise the same.
func (a Advert) Equal(b Advert) bool { return a.Gen == b.Gen && a.Keys.Equal(b.Keys) }
