// Package wirecheck holds the fuzz property every wire codec of overlayd
// must keep: what decodes re-encodes, decodes to the same value, and
// encodes to the same bytes again.
package wirecheck

import (
	"bytes"
	"reflect"
	"testing"
)

// RoundTrip checks the property for input b. decode's error means b is
// refused (fine: nothing to check); a refusal is checked by the caller.
func RoundTrip[M any](t *testing.T, b []byte, decode func([]byte) (M, error), encode func(M) ([]byte, error)) {
	t.Helper()
	m, err := decode(b)
	if err != nil {
		return
	}
	enc, err := encode(m)
	if err != nil {
		t.Fatalf("a decoded message does not re-encode: %v\n%+v", err, m)
	}
	m2, err := decode(enc)
	if err != nil {
		t.Fatalf("a re-encoded message does not decode: %v", err)
	}
	if !reflect.DeepEqual(m, m2) {
		t.Fatalf("round trip differs:\n%+v\n%+v", m, m2)
	}
	enc2, err := encode(m2)
	if err != nil || !bytes.Equal(enc, enc2) {
		t.Fatalf("encoding not stable: %v", err)
	}
}
