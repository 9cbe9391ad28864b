package encryption

import (
	"bytes"
	"net/netip"
)

// deriveKey names one SA's derivation: its source and destination, epoch
// and the sender's send generation.
type deriveKey struct {
	src, dst netip.Addr
	epoch    uint32
	gen      uint64
}

type derivedSA struct {
	spi   uint32
	key   []byte // never modified: shared by every wantState of the SA
	round uint64 // the last round that used it
}

// deriveCache remembers the SPIs and keys derived for the current secret.
// Every Apply derives the SPI and key of every SA it wants (two HKDFs
// each); with 1,000 remote hosts that alone would cost more than the
// kernel changes of a remote coming or going. Entries unused for a round
// (an Apply) are dropped once they outnumber the used ones, so the cache
// holds about what the kernel holds.
//
// A deriveCache belongs to its Programmer and is used under the same
// serialisation (the Owner's lock).
type deriveCache struct {
	secret  []byte
	deriver *deriver // of secret: its HKDF extraction done once
	entries map[deriveKey]*derivedSA
	round   uint64
	used    int // entries used in this round
}

// derive returns the SPI and key of the SA from src to dst for epoch under
// the sender's generation gen. A nil cache derives every time.
func (c *deriveCache) derive(secret []byte, src, dst netip.Addr, epoch uint32, gen uint64) (uint32, []byte, error) {
	if c == nil {
		return deriveSA(secret, src, dst, epoch, gen)
	}
	if !bytes.Equal(c.secret, secret) || c.entries == nil {
		d, err := newDeriver(secret)
		if err != nil {
			return 0, nil, err
		}
		c.secret, c.deriver = bytes.Clone(secret), d
		c.entries = map[deriveKey]*derivedSA{}
		c.used = 0
	}
	k := deriveKey{src: src.Unmap(), dst: dst.Unmap(), epoch: epoch, gen: gen}
	if e, ok := c.entries[k]; ok {
		if e.round != c.round {
			e.round = c.round
			c.used++
		}
		return e.spi, e.key, nil
	}
	spi, key, err := c.deriver.sa(src, dst, epoch, gen)
	if err != nil {
		return 0, nil, err
	}
	c.entries[k] = &derivedSA{spi: spi, key: key, round: c.round}
	c.used++
	return spi, key, nil
}

// endRound closes a round (one Apply): entries it did not use go when they
// outnumber those it did.
func (c *deriveCache) endRound() {
	if c == nil {
		return
	}
	if len(c.entries) > 2*c.used+64 {
		for k, e := range c.entries {
			if e.round != c.round {
				delete(c.entries, k)
			}
		}
	}
	c.round++
	c.used = 0
}

func deriveSA(secret []byte, src, dst netip.Addr, epoch uint32, gen uint64) (uint32, []byte, error) {
	d, err := newDeriver(secret)
	if err != nil {
		return 0, nil, err
	}
	return d.sa(src, dst, epoch, gen)
}

// sa derives the SPI and key of one SA.
func (d *deriver) sa(src, dst netip.Addr, epoch uint32, gen uint64) (uint32, []byte, error) {
	spi, err := d.spi(src, dst, epoch, gen)
	if err != nil {
		return 0, nil, err
	}
	key, err := d.saKey(src, dst, epoch, gen)
	if err != nil {
		return 0, nil, err
	}
	return spi, key, nil
}
