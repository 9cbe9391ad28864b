//go:build testhooks

package stress

import (
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"testing"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/peerdb"
)

// Deterministic regression tests of driver bugs the harness found (fixed).

// TestEncryptedRecreateKeepsFailClosedRules: a network deleted while the
// same id is created again (encrypted both times) must leave the new
// network's VNIs in the nft set.
//
// The driver once keyed its encryption state by network id while a deleted
// network's syncEncLocked runs after the registry released the id: when
// the new instance's syncEncLocked took the encryption lock first, the old
// one's then deleted the new instance's VNIs (and remotes). Now every
// network instance has its own share (encryption.ShareID). The owner's
// lock is kept busy meanwhile (its loop poked, another share updated), so
// that the two instances' updates interleave with others.
func TestEncryptedRecreateKeepsFailClosedRules(t *testing.T) {
	e := newEnv(t, true, false, true)
	s := &netSpec{vnis: []uint32{700}, pools: []netip.Prefix{pfx("198.51.100.0/24")}, encrypted: true}
	if err := e.d.CreateNetwork(createRequest("x", s)); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var bg sync.WaitGroup
	for j := 0; j < 2; j++ {
		bg.Add(1)
		go func() {
			defer bg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if j == 0 {
					e.owner.Poke()
				} else if err := e.owner.Update(encryption.ShareID(1<<40), encryption.Share{VNIs: []uint32{900}}, false); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	defer func() { close(stop); bg.Wait() }()
	for i := 0; i < 300; i++ {
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			if err := e.d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: "x"}); err != nil {
				t.Error(err)
			}
		}()
		go func() {
			defer wg.Done()
			for e.d.CreateNetwork(createRequest("x", s)) != nil {
			}
		}()
		wg.Wait()
		got, err := dumpEncryption(e)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got.enc, []uint32{700}) {
			problems, err := e.d.Audit()
			t.Fatalf("iteration %d: encrypted network x exists (re-created while its previous instance was deleted), but %s holds VNIs %v: its VXLAN is not failed closed (driver Audit: %v %v)",
				i, encryption.SetName, got.enc, problems, err)
		}
	}
}

// TestEncryptedLeaveUncoversRemote: a Leave that is not the network's last
// uncovers a remote peer (its IP was claimed by the leaving endpoint): the
// remote's VTEP becomes needed, so it must get its outbound policy (on an
// ESP kernel: its SAs too) like every other remote's; a Join that shadows
// it again makes it unneeded.
//
// The driver once changed the active remote peers on Leave and Join
// without updating the encryption state.
func TestEncryptedLeaveUncoversRemote(t *testing.T) {
	e := newEnv(t, true, false, true)
	s := &netSpec{vnis: []uint32{700}, pools: []netip.Prefix{pfx("198.51.100.0/24")}, encrypted: true}
	if err := e.d.CreateNetwork(createRequest("x", s)); err != nil {
		t.Fatal(err)
	}
	for i, ep := range []string{"a", "b"} {
		if _, err := e.d.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: "x", EndpointID: ep,
			Interface: &api.EndpointInterface{Address: fmt.Sprintf("198.51.100.%d/24", 10+i)}}); err != nil {
			t.Fatal(err)
		}
		if _, err := e.d.Join(&api.JoinRequest{NetworkID: "x", EndpointID: ep, SandboxKey: "/x"}); err != nil {
			t.Fatal(err)
		}
	}
	vtep := netip.MustParseAddr("192.0.2.77")
	k := peerdb.Key{VNI: 700, Origin: originOf(vtep).name, EndpointID: "r"}
	e.src.mutate(func() {
		e.src.setLocked(k, peerdb.Peer{EndpointID: "r", IP: netip.MustParseAddr("198.51.100.10"), MAC: peerdb.MAC{2, 0, 0, 0, 0, 9}, VTEP: vtep})
	})
	e.d.PeersChanged(700, []peerdb.Key{k})
	wantPolicies := func(when string, want ...netip.Addr) {
		t.Helper()
		got, err := dumpEncryption(e)
		if err != nil {
			t.Fatal(err)
		}
		var pols []netip.Addr
		for _, p := range got.policies {
			pols = append(pols, p.remote)
		}
		if !slices.Equal(pols, want) {
			t.Fatalf("%s: outbound policies to %v, want %v", when, pols, want)
		}
	}
	wantPolicies("remote shadowed by a local endpoint")
	if err := e.d.Leave(&api.LeaveRequest{NetworkID: "x", EndpointID: "a"}); err != nil {
		t.Fatal(err)
	}
	wantPolicies("after the Leave that uncovered the remote", vtep)
	if st := e.owner.Status(); len(st.Pairs) != 1 || st.Pairs[0].Remote != vtep || st.Pairs[0].Shares != 1 || !st.Pairs[0].PolicyFound {
		t.Fatalf("owner's pairs after the Leave: %+v", st.Pairs)
	}
	if _, err := e.d.Join(&api.JoinRequest{NetworkID: "x", EndpointID: "a", SandboxKey: "/x"}); err != nil {
		t.Fatal(err)
	}
	wantPolicies("after the Join that shadowed the remote again")
}

// TestESPTroubleStaysWithItsPair: on a kernel that cannot install ESP
// states, once an encrypted network needs a remote VTEP, that pair's
// traffic is dropped and the encryption owner says so in its status — and
// nothing else fails: a CreateNetwork of a plain network and a Join that
// builds a plain network's sandbox succeed. (The stress harness found the
// owner returning its ESP error from every share's update, which failed
// and undid operations of networks that are not encrypted at all; an SPI
// collision would have done the same on any kernel.)
func TestESPTroubleStaysWithItsPair(t *testing.T) {
	if espKernel() {
		t.Skip("this kernel can install ESP states; the defect needs one that cannot")
	}
	e := newEnv(t, true, false, true)
	enc := &netSpec{vnis: []uint32{700}, pools: []netip.Prefix{pfx("198.51.100.0/24")}, encrypted: true}
	plain := &netSpec{vnis: []uint32{701}, pools: []netip.Prefix{pfx("198.51.101.0/24")}}
	other := &netSpec{vnis: []uint32{702}, pools: []netip.Prefix{pfx("198.51.102.0/24")}}
	for _, n := range []struct {
		id, addr string
		s        *netSpec
		join     bool
	}{{"x", "198.51.100.10/24", enc, true}, {"y", "198.51.101.10/24", plain, false}} {
		if err := e.d.CreateNetwork(createRequest(n.id, n.s)); err != nil {
			t.Fatal(err)
		}
		if _, err := e.d.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: n.id, EndpointID: "a", Interface: &api.EndpointInterface{Address: n.addr}}); err != nil {
			t.Fatal(err)
		}
		if n.join {
			if _, err := e.d.Join(&api.JoinRequest{NetworkID: n.id, EndpointID: "a"}); err != nil {
				t.Fatal(err)
			}
		}
	}
	// A remote peer of the encrypted network: its VTEP needs an SA, which
	// this kernel cannot install (the policy is there: it drops).
	vtep := netip.MustParseAddr("192.0.2.77")
	k := peerdb.Key{VNI: 700, Origin: originOf(vtep).name, EndpointID: "r"}
	e.src.mutate(func() {
		e.src.setLocked(k, peerdb.Peer{EndpointID: "r", IP: netip.MustParseAddr("198.51.100.20"), MAC: peerdb.MAC{2, 0, 0, 0, 0, 9}, VTEP: vtep})
	})
	e.d.PeersChanged(700, []peerdb.Key{k})
	if st := e.owner.Status(); !st.ESPUnsupported {
		t.Fatalf("the owner does not report the missing ESP support: %+v", st)
	}
	errCreate := e.d.CreateNetwork(createRequest("z", other))
	_, errJoin := e.d.Join(&api.JoinRequest{NetworkID: "y", EndpointID: "a"})
	if errCreate != nil || errJoin != nil {
		t.Fatalf("operations of plain networks fail because another network's remote needs an SA this kernel cannot install:\n  CreateNetwork z (plain): %v\n  Join y/a (plain, builds its sandbox): %v", errCreate, errJoin)
	}
}
