package encryption

import (
	"bytes"
	"errors"
	"math"
	"strings"
	"testing"
)

func TestAdvertRoundTrip(t *testing.T) {
	many := make([]uint32, 100)
	for i := range many {
		many[i] = uint32(i + 1)
	}
	for _, c := range []struct {
		name string
		in   Advert
		want Advert // what decodes (Accept normalised, bounded)
	}{
		{"steady", Advert{Keys: NodeKeys{Accept: []uint32{1}, Send: 1, Target: 1}, Gen: 1}, Advert{}},
		{"rotating", Advert{Keys: NodeKeys{Accept: []uint32{5, 6}, Send: 5, Target: 6}, Gen: math.MaxUint64}, Advert{}},
		{"before keys", Advert{Gen: 0x0123456789abcdef}, Advert{}},
		{"unsorted with zero and duplicates", Advert{Keys: NodeKeys{Accept: []uint32{7, 0, 6, 7}, Send: 6, Target: 7}, Gen: 9},
			Advert{Keys: NodeKeys{Accept: []uint32{6, 7}, Send: 6, Target: 7}, Gen: 9}},
		{"too many epochs: the newest are sent", Advert{Keys: NodeKeys{Accept: many, Send: 100, Target: 100}, Gen: 3},
			Advert{Keys: NodeKeys{Accept: many[100-MaxAdvertEpochs:], Send: 100, Target: 100}, Gen: 3}},
	} {
		t.Run(c.name, func(t *testing.T) {
			want := c.want
			if want.Gen == 0 {
				want = c.in
			}
			b := c.in.Encode()
			if len(b) > MaxAdvertLen || MaxAdvertLen > 400 {
				t.Fatalf("%d bytes (max %d, the cluster carries 400)", len(b), MaxAdvertLen)
			}
			got, err := DecodeAdvert(b)
			if err != nil {
				t.Fatal(err)
			}
			if !got.Equal(want) || got.Gen != want.Gen {
				t.Fatalf("decoded %v, want %v", got, want)
			}
			if !bytes.Equal(got.Encode(), b) {
				t.Fatal("re-encoding differs")
			}
		})
	}
}

func TestDecodeAdvertRejects(t *testing.T) {
	good := Advert{Keys: NodeKeys{Accept: []uint32{1, 2}, Send: 1, Target: 2}, Gen: 5}.Encode()
	mut := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	for name, c := range map[string]struct {
		b    []byte
		want string
	}{
		"empty":                 {nil, "not an overlayd key advert"},
		"old json keys":         {[]byte(`keys1:{"a":[1],"s":1,"t":1}`), "not an overlayd key advert"},
		"truncated header":      {good[:10], "truncated"},
		"truncated epochs":      {good[:len(good)-1], "has 7 bytes for them, want 8"},
		"trailing garbage":      {append(bytes.Clone(good), 0), "has 9 bytes"},
		"generation 0":          {mut(func(b []byte) []byte { copy(b[4:12], make([]byte, 8)); return b }), "generation 0"},
		"too many epochs":       {mut(func(b []byte) []byte { b[20] = MaxAdvertEpochs + 1; return b }), "more than 64"},
		"epochs not increasing": {mut(func(b []byte) []byte { copy(b[21:25], b[25:29]); return b }), "not strictly increasing"},
		"epoch 0":               {mut(func(b []byte) []byte { copy(b[21:25], make([]byte, 4)); return b }), "not strictly increasing and non-zero"},
		"too long":              {append([]byte(advertMagic), make([]byte, MaxAdvertLen)...), "longer than the maximum"},
	} {
		_, err := DecodeAdvert(c.b)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error saying %q", name, err, c.want)
		}
	}
	if _, err := DecodeAdvert([]byte("keys1:{}")); !errors.Is(err, ErrNotAdvert) {
		t.Errorf("another format is not ErrNotAdvert: %v", err)
	}
}

// FuzzDecodeAdvert: nothing from the network makes DecodeAdvert panic; what
// decodes is bounded and re-encodes to the same bytes.
func FuzzDecodeAdvert(f *testing.F) {
	f.Add(Advert{Keys: NodeKeys{Accept: []uint32{1, 2}, Send: 1, Target: 2}, Gen: 5}.Encode())
	f.Add(Advert{Gen: 1}.Encode())
	f.Add([]byte("ovk2"))
	f.Add([]byte(`keys1:{"a":[1],"s":1,"t":1}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		a, err := DecodeAdvert(b)
		if err != nil {
			return
		}
		if len(b) > MaxAdvertLen || len(a.Keys.Accept) > MaxAdvertEpochs || a.Gen == 0 {
			t.Fatalf("accepted out of bounds: %d bytes, %d epochs, gen %d", len(b), len(a.Keys.Accept), a.Gen)
		}
		if e := a.Encode(); !bytes.Equal(e, b) {
			t.Fatalf("re-encoding %x differs from %x", e, b)
		}
	})
}
