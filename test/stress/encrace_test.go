package stress

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"testing"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/peerdb"
)

// TestEncryptedRecreateKeepsFailClosedRules: a network deleted while the
// same id is created again (encrypted both times) must leave the new
// network's VNIs in the nft set.
//
// The driver once keyed its encryption state by network id while a deleted
// network's syncEnc runs after the registry released the id: when the new
// instance's syncEnc took the encryption lock first, the old one's then
// deleted the new instance's VNIs (and remotes). Now keyed by network value.
func TestEncryptedRecreateKeepsFailClosedRules(t *testing.T) {
	e := newEnv(t, true, false)
	s := &netSpec{vnis: []uint32{700}, pools: []netip.Prefix{pfx("198.51.100.0/24")}, encrypted: true}
	if err := e.d.CreateNetwork(createRequest("x", s)); err != nil {
		t.Fatal(err)
	}
	// Keep the encryption lock busy (each SetKeys re-applies the state).
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
				_ = e.d.SetKeys(encryption.NodeKeys{})
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
		_, vnis, _, err := dumpEncryption(e)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(vnis, []uint32{700}) {
			problems, err := e.d.Audit()
			t.Fatalf("iteration %d: encrypted network x exists (re-created while its previous instance was deleted), but %s holds VNIs %v: its VXLAN is not failed closed (driver Audit: %v %v)",
				i, encryption.SetName, vnis, problems, err)
		}
	}
}

// TestEncryptedLeaveUncoversRemote: a Leave that is not the network's last
// uncovers a remote peer (its IP was claimed by the leaving endpoint): the
// remote's VTEP becomes desired, so failed keys must leave its fail-closed
// policy (on an ESP kernel: its SAs and policy) like every other remote's.
func TestEncryptedLeaveUncoversRemote(t *testing.T) {
	e := newEnv(t, true, false)
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
	p := peerdb.Peer{EndpointID: "r", IP: netip.MustParseAddr("198.51.100.10"), MAC: peerdb.MAC{2, 0, 0, 0, 0, 9}, VTEP: vtep}
	if err := e.d.ApplyPeerEvent(driver.PeerEvent{VNI: 700, Next: &p}); err != nil {
		t.Fatal(err)
	}
	if err := e.d.Leave(&api.LeaveRequest{NetworkID: "x", EndpointID: "a"}); err != nil {
		t.Fatal(err)
	}
	if err := e.d.SetKeys(encryption.NodeKeys{Accept: []uint32{1}, Send: 1, Target: 1}); !errors.Is(err, encryption.ErrKernelUnsupported) {
		t.Fatalf("SetKeys with remote %v desired: %v, want ErrKernelUnsupported", vtep, err)
	}
	if _, _, pols, err := dumpEncryption(e); err != nil || !slices.Equal(pols, []netip.Addr{vtep}) {
		t.Fatalf("policies %v (%v) after the remote became active by a Leave, want [%v]", pols, err, vtep)
	}
}
