package ipam

import (
	"cmp"
	"fmt"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// maxNameLen bounds node names (memberlist's are short; this keeps
// messages bounded).
const maxNameLen = 255

// Identity is an owner of address space: a node name and the random host
// id made on that host's first start. A reinstalled host (empty state
// directory) has the same name and a new id, so it never inherits the
// ranges of its earlier installation; those are reclaimed explicitly.
type Identity struct {
	Name string
	ID   uint64
}

func (i Identity) String() string { return fmt.Sprintf("%s/%016x", i.Name, i.ID) }

// hexID renders the host id as status shows it.
func (i Identity) hexID() string { return fmt.Sprintf("%016x", i.ID) }

// compare orders identities (name, then id): the tie-break of the ring's
// merge, so it must be total.
func (i Identity) compare(o Identity) int {
	if c := strings.Compare(i.Name, o.Name); c != 0 {
		return c
	}
	return cmp.Compare(i.ID, o.ID)
}

// parseIdentity reads Identity.String's form.
func parseIdentity(s string) (Identity, error) {
	i := strings.LastIndexByte(s, '/')
	if i < 0 {
		return Identity{}, fmt.Errorf("identity %q: want NAME/HOSTID", s)
	}
	id, err := strconv.ParseUint(s[i+1:], 16, 64)
	if err != nil || len(s)-i-1 != 16 {
		return Identity{}, fmt.Errorf("identity %q: the host id is not 16 hex digits", s)
	}
	if err := checkName(s[:i]); err != nil {
		return Identity{}, fmt.Errorf("identity %q: %w", s, err)
	}
	return Identity{Name: s[:i], ID: id}, nil
}

// checkName validates a node name from the network or the state file.
func checkName(n string) error {
	switch {
	case n == "":
		return fmt.Errorf("the node name is empty")
	case len(n) > maxNameLen:
		return fmt.Errorf("the node name is %d bytes long, more than %d", len(n), maxNameLen)
	case !utf8.ValidString(n):
		return fmt.Errorf("the node name %q is not UTF-8", n)
	case strings.ContainsFunc(n, unicode.IsControl):
		return fmt.Errorf("the node name %q holds a control character", n)
	}
	return nil
}
