// Package dnsname holds the rules for the names overlayd serves for
// containers across hosts: which names a DNS client can ask for, their
// canonical (lower-case) form, and the packed list an endpoint's record
// carries in the gossip. The gossip decoder, the driver and the DNS server
// all use these rules, so a name one accepts is a name the others accept.
package dnsname

import (
	"fmt"
	"slices"
	"strings"
)

const (
	// MaxLen is the longest name: 253 bytes, the longest a DNS name can be
	// written without its trailing dot.
	MaxLen = 253
	// MaxLabel is the longest label (between dots).
	MaxLabel = 63
	// MaxNames bounds the names of one endpoint (container name, its
	// aliases, compose's service and container names, ...).
	MaxNames = 16
	// MaxPacked bounds the bytes of one endpoint's packed names, so a
	// record with names still fits a gossip packet.
	MaxPacked = 512
	// sep separates the names of a packed list; no valid name holds it.
	sep = ","
)

// Canonical returns name in the form overlayd serves it: lower case,
// without a trailing dot. Docker allows container names of
// [a-zA-Z0-9][a-zA-Z0-9_.-]+ and aliases of nearly anything; a DNS client
// can ask for a name of labels of letters, digits, '-' and '_' (which
// resolvers pass on), 1..63 bytes each, 253 bytes in all. Anything else is
// refused with the reason, and is not served.
func Canonical(name string) (string, error) {
	name = strings.TrimSuffix(name, ".")
	switch {
	case name == "":
		return "", fmt.Errorf("name %q: empty", name)
	case len(name) > MaxLen:
		return "", fmt.Errorf("name %.20q...: %d bytes, at most %d allowed", name, len(name), MaxLen)
	}
	var b []byte // allocated only for a name with upper case
	start := 0
	for i := 0; i <= len(name); i++ {
		if i == len(name) || name[i] == '.' {
			switch n := i - start; {
			case n == 0:
				return "", fmt.Errorf("name %q: empty label at byte %d", name, i)
			case n > MaxLabel:
				return "", fmt.Errorf("name %q: label of %d bytes, at most %d allowed", name, n, MaxLabel)
			}
			start = i + 1
			continue
		}
		c := name[i]
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '-', c == '_':
		case c >= 'A' && c <= 'Z':
			if b == nil {
				b = []byte(name)
			}
			b[i] = c + 'a' - 'A'
		default:
			return "", fmt.Errorf("name %q: byte %d (%q) is not a letter, digit, '-', '_' or '.'", name, i, c)
		}
	}
	if b != nil {
		return string(b), nil
	}
	return name, nil
}

// Pack returns the canonical, sorted, duplicate-free list of names as one
// string (the form records carry and compare), the names refused (each
// with its reason) and an error when the list is over MaxNames or
// MaxPacked once the refused ones are left out; then the names past the
// bound are dropped (the first ones in sorted order are kept).
func Pack(names []string) (packed string, refused []error, err error) {
	out := make([]string, 0, len(names))
	for _, n := range names {
		c, cerr := Canonical(n)
		if cerr != nil {
			refused = append(refused, cerr)
			continue
		}
		out = append(out, c)
	}
	slices.Sort(out)
	out = slices.Compact(out)
	if len(out) > MaxNames {
		err = fmt.Errorf("%d names, at most %d served per endpoint: %v left out", len(out), MaxNames, out[MaxNames:])
		out = out[:MaxNames]
	}
	packed = strings.Join(out, sep)
	for len(packed) > MaxPacked {
		err = fmt.Errorf("names of %d bytes, at most %d served per endpoint: %q left out", len(packed), MaxPacked, out[len(out)-1])
		out = out[:len(out)-1]
		packed = strings.Join(out, sep)
	}
	return packed, refused, err
}

// Unpack returns the names of a packed list (nil for "").
func Unpack(packed string) []string {
	if packed == "" {
		return nil
	}
	return strings.Split(packed, sep)
}

// ValidPacked reports whether packed is a list Pack could have made: each
// name canonical, strictly ascending, within the bounds. The gossip
// decoder uses it on what other hosts send.
func ValidPacked(packed string) error {
	if packed == "" {
		return nil
	}
	if len(packed) > MaxPacked {
		return fmt.Errorf("names of %d bytes, at most %d allowed", len(packed), MaxPacked)
	}
	names := Unpack(packed)
	if len(names) > MaxNames {
		return fmt.Errorf("%d names, at most %d allowed", len(names), MaxNames)
	}
	for i, n := range names {
		if c, err := Canonical(n); err != nil {
			return err
		} else if c != n || strings.HasSuffix(n, ".") {
			return fmt.Errorf("name %q is not in canonical form", n)
		}
		if i > 0 && names[i-1] >= n {
			return fmt.Errorf("names %q and %q out of order or repeated", names[i-1], n)
		}
	}
	return nil
}
