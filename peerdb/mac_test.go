package peerdb

import (
	"fmt"
	"testing"
)

// An endpoint's derived MAC is unicast and locally administered, the same
// for the same id every time (a restart derives what it persisted), and
// distinct for distinct ids: nothing of the address goes in, so two hosts
// that hand out one address still give their endpoints different MACs.
func TestMACFromEndpointID(t *testing.T) {
	seen := map[MAC]string{}
	for i := range 100000 {
		id := fmt.Sprintf("%064x", i) // the shape of dockerd's endpoint ids
		m := MACFromEndpointID(id)
		if !m.IsUnicast() || m[0]&0x02 == 0 {
			t.Fatalf("MAC %s of %s: want a unicast, locally administered address", m, id)
		}
		if other, dup := seen[m]; dup {
			t.Fatalf("ids %s and %s both give MAC %s", other, id, m)
		}
		seen[m] = id
		if again := MACFromEndpointID(id); again != m {
			t.Fatalf("MAC of %s is %s, then %s", id, m, again)
		}
	}
}
